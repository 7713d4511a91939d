"""The two views every typed record file has (summary.json, manifest.json, acceptance.json, a checkpoint's
trainer.json, checkpoints/<identity>/finished.json): the writer's exact model (`WRITTEN`: strict types, no key it does
not describe) and the reader's (`Read`: strict types, other keys kept, so a record of another age still reads);
`problem` names what a view refused."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError


class Read(BaseModel):
    """The reader's view: strict types (no "12" for 12), other keys kept."""
    model_config = ConfigDict(strict=True, extra="allow")


# The writer's record: exactly these keys.
WRITTEN = ConfigDict(strict=True, extra="forbid")


def problem(e: ValidationError) -> str:
    """The first fault a view found, as a reader names it: "missing key 'a.b'", "key 'a.b': <what>, got <value>", or
    pydantic's words where no key is at fault (not JSON, not an object)."""
    err = e.errors()[0]
    key = ".".join(map(str, err["loc"]))
    if not key:
        return err["msg"]
    if err["type"] == "missing":
        return f"missing key '{key}'"
    got = repr(err["input"])
    return f"key '{key}': {err['msg']}, got {got if len(got) <= 80 else got[:77] + '...'}"


def key_table(parts: tuple[tuple[str, type[BaseModel]], ...]) -> str:
    """A record's docs table (docs/architecture.md, between its markers): one row per key of each (prefix, model)
    part, in order, with the field's description."""
    rows = ["| key | meaning |", "| --- | --- |"]
    for prefix, model in parts:
        rows += [f"| `{prefix}{key}` | {field.description} |" for key, field in model.model_fields.items()]
    return "\n".join(rows) + "\n"
