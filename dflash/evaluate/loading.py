"""Finding and loading the trained drafter and the evaluation prompts (clear errors naming the file/row)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash.errors import UserError

log = logging.getLogger("dflash.evaluate")


def _prompt_rows(path, parse, what: str, expected: str = "", limit: int | None = None) -> list[dict]:
    """Rows of a JSONL prompt file as {"id", "prompt_ids"}; `parse(row) -> ids` raising on a bad row, which is
    reported naming the file and line."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ids = parse(row)
            except (ValueError, KeyError, TypeError) as e:
                raise UserError(f"{path} line {n}: bad {what} row ({type(e).__name__}: {e}){expected}") from None
            rows.append({"id": str(row.get("id", n)), "prompt_ids": ids})
            if limit is not None and len(rows) >= limit:
                break
    return rows


def read_holdout(path, limit: int) -> list[dict]:
    """The first `limit` rows of holdout.jsonl: {"id", "prompt_ids": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: held-out prompts not found (run the data stage with data.holdout > 0)")

    def parse(row):
        ids = row["prompt_ids"]
        if not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_ids must be a non-empty list of integers")
        return ids

    rows = _prompt_rows(path, parse, "held-out", limit=limit)
    if not rows:
        raise UserError(f"{path}: no held-out prompts (set data.holdout > 0)")
    if len(rows) < limit:
        log.warning("%s holds %d prompts, fewer than evaluate.num_prompts=%d", path, len(rows), limit)
    return rows


def read_prompt_file(path, tokenizer, vocab_size: int) -> list[dict]:
    """A JSONL prompt set: each row has `prompt` (text, wrapped in the chat template as a user turn), `messages`
    (a chat), or `prompt_ids` (token ids as they are)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"evaluate.prompt_files: {path} not found")

    def parse(row):
        if "prompt_ids" in row:
            ids = [int(t) for t in row["prompt_ids"]]
        else:
            msgs = row.get("messages") or [{"role": "user", "content": str(row["prompt"])}]
            ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = [int(t) for t in ids]
        if not ids or max(ids) >= vocab_size or min(ids) < 0:
            raise ValueError(f"empty prompt or token id outside the vocabulary (0..{vocab_size - 1})")
        return ids

    rows = _prompt_rows(path, parse, "prompt", "; expected a `prompt` string, `messages` or `prompt_ids`")
    if not rows:
        raise UserError(f"{path}: no prompts")
    return rows
