"""The two views every typed record file has (summary.json, manifest.json, acceptance.json): the writer's exact model
(`WRITTEN`: strict types, no key it does not describe) and the reader's (`Read`: strict types, other keys kept, so a
record of another age still reads)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Read(BaseModel):
    """The reader's view: strict types (no "12" for 12), other keys kept."""
    model_config = ConfigDict(strict=True, extra="allow")


# The writer's record: exactly these keys.
WRITTEN = ConfigDict(strict=True, extra="forbid")
