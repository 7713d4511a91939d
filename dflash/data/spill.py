"""Rows handed from one step of the data chain to the next through a JSONL file on disk (bounded memory between the
passes: the holdout is known only after every source is read).

Public:
- `Spill(path)`: `add(row)`, `close()`, `n` (rows added), iterating reads the rows back
- `spill_rows(path)`: the rows of a spill file, for `Dataset.from_generator`
"""
from __future__ import annotations

import json
from pathlib import Path


class Spill:
    """Rows streamed to a JSONL file and read back."""

    def __init__(self, path):
        self.path, self.n = Path(path), 0
        self.f = open(self.path, "w")

    def add(self, row: dict):
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.n += 1

    def close(self):
        self.f.close()

    def __iter__(self):
        return spill_rows(self.path)


def spill_rows(path):
    """Rows of a spill file, for Dataset.from_generator (streamed into Arrow, 1000 rows at a time)."""
    with open(path) as f:
        for line in f:
            yield json.loads(line)
