"""Finding and loading the trained drafter and the evaluation prompts (clear errors naming the file/row)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash.errors import UserError

log = logging.getLogger("dflash.evaluate")


def newest_checkpoint(run_dir) -> Path:
    """The newest `checkpoints/step-N/` of a run that holds model.safetensors (the trained drafter)."""
    root = Path(run_dir, "checkpoints")
    dirs = sorted(d for d in root.glob("step-*") if (d / "model.safetensors").is_file()) if root.is_dir() else []
    if not dirs:
        raise UserError(f"{root}: no checkpoint with model.safetensors (train the run first, or pass --drafter DIR)")
    return dirs[-1]


def checkpoint_step(path) -> int | None:
    try:
        return int(Path(path).name.split("-", 1)[1])
    except (IndexError, ValueError):
        return None


def drafter_config(loaded, target_config, tokenizer=None):
    """The drafter's shape from the config's `drafter` section and the target (as train builds it)."""
    from dflash.model import DrafterConfig
    from dflash.target import mask_token_id
    cfg = loaded.cfg
    mask_id = cfg.drafter.mask_token_id
    if mask_id is None:
        if tokenizer is None:
            raise UserError("drafter.mask_token_id is null and no tokenizer was given")
        mask_id = mask_token_id(tokenizer, int(target_config.vocab_size))
    try:
        return DrafterConfig.from_target(target_config, cfg.drafter, mask_id)
    except ValueError as e:
        raise UserError(f"drafter section: {e}") from None


def drafter_from_checkpoint(ckpt_dir, dcfg, embed_weight, lm_head_weight, device=None, dtype=None):
    """A DFlashDrafter with the weights of `ckpt_dir/model.safetensors` (reference tensor names, strict)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from dflash.model import DFlashDrafter
    w = Path(ckpt_dir, "model.safetensors")
    try:
        sd = load_file(str(w), device="cpu")
    except (SafetensorError, OSError) as e:
        raise UserError(f"{w}: cannot read safetensors: {e}") from None
    drafter = DFlashDrafter(dcfg, embed_weight, lm_head_weight)
    missing, unexpected = drafter.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise UserError(f"{w}: weights do not match the drafter built from the config ({dcfg.num_layers} layers): "
                        f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    if device is not None or dtype is not None:
        drafter.to(device=device, dtype=dtype)
    return drafter.eval().requires_grad_(False)


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
