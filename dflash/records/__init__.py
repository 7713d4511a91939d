"""Every file that crosses a stage, typed: one module per record (summary.json: `summary`; acceptance.json and the
draft-policy vocabulary: `acceptance`; results/compile/<device>.json: `compile`; manifest.json: `manifest`; a
checkpoint's trainer.json and checkpoints/<identity>/finished.json: `checkpoint`; regressions.json: `regressions`;
sweep.json: `sweep`), each with its docs table (`key_table`, checked against docs/architecture.md by a test).

Here: the two views every record has, the writer's exact model (`WRITTEN`: strict types, no key it does not describe)
and the reader's (`Read`: strict types, other keys kept, so a record of another age still reads); the one door in and
out (`write(path, model)`, `read(path, View, remedy)`); `problem`, what a view refused, in a reader's words.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash.atomic import atomic_write_json
from dflash.errors import UserError


class Read(BaseModel):
    """The reader's view: strict types (no "12" for 12), other keys kept."""
    model_config = ConfigDict(strict=True, extra="allow")


# The writer's record: exactly these keys.
WRITTEN = ConfigDict(strict=True, extra="forbid")


def like(model: type[BaseModel], name: str, *default):
    """A field with the meaning of `model`'s field `name` (`default`: where a file lacks it): a reader's view of a
    writer's key, or a record that lays out another's keys in its own order."""
    return Field(*default, description=model.model_fields[name].description)


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


M = TypeVar("M", bound=BaseModel)


def write(path: str | Path, model: BaseModel) -> Path:
    """`model` as its file, atomically: JSON, indented 2, the keys it was given in the model's order (a key it was
    not given, with a default, is left out: e.g. a warm-up part's `modules`, the target's alone)."""
    return atomic_write_json(path, model.model_dump(exclude_unset=True))


def read(path: str | Path, view: type[M], remedy: str) -> M:
    """The record at `path` through `view`, else a UserError `<path>: <what is wrong>; <remedy>`, naming the key at
    fault as pydantic words it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: cannot read it ({e}); {remedy}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object; {remedy}")
    try:
        return view.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise UserError(f"{path}: key '{'.'.join(map(str, err['loc']))}': {err['msg']}; {remedy}") from None
