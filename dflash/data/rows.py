"""Per-row rules of the data stage: each decision is a function of the row alone (its content, its id, the seed),
so the dataset is the same however the rows are split into shards.

Public:
- `conv_hash(messages)`: a conversation's identity; `shard_of(conv_hash, nshards)`: the shard it belongs to
- `rank(seed, sid)`: a sample's seeded place (holdout choice, weighting, shard order)
- `min_supervised_tokens(cfg)`: the fewest supervised tokens a row may have; `num_proc(data_cfg)`: processes that
  tokenise
- `tokenise_batch(batch, ...)`: datasets.map function: tokenise, truncate or drop, reject too few supervised tokens
- `weighted(rows, weight, seed)`, `weight_batch(batch, weights, seed)`: a source's weight as row copies
- `REMEDY`, `reasons(counts)`: reject reasons with their counts and what to change
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter

from dflash.config_model import DataSection, DflashConfig
from dflash.data.tokenise import conversation_ids


def conv_hash(messages) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def shard_of(conv_hash: str, shards: int) -> int:
    """The shard a conversation belongs to: a function of its content only (the same for any run)."""
    return int(conv_hash[:8], 16) % shards


def rank(seed, sid: str) -> str:
    """A sample's place in the shards: a seeded hash of its id (the same for any number of data shards)."""
    return hashlib.sha256(f"{seed}:{sid}".encode()).hexdigest()


def min_supervised_tokens(cfg: DflashConfig) -> int:
    return max(1, int(-(-cfg.data.min_supervised_blocks * cfg.drafter.block_size // 1)))


def num_proc(d: DataSection) -> int:
    """data.num_proc, 0 being every core."""
    import os
    return d.num_proc or os.cpu_count() or 1


def tokenise_batch(batch, tokenizer, stop_strings, max_length, truncation, min_sup):
    """datasets.map function: conversations -> input_ids, loss_mask, length, reject ('' when kept), truncated."""
    out = {k: [] for k in ("id", "source", "input_ids", "loss_mask", "length", "reject", "truncated")}
    for sid, src, msgs in zip(batch["id"], batch["source"], batch["messages"]):
        r = conversation_ids(tokenizer, json.loads(msgs), stop_strings)
        reject, trunc, ids, mask = "", False, [], []
        if isinstance(r, str):
            reject = r
        else:
            ids, mask = r
            if len(ids) > max_length:
                if truncation == "drop":
                    reject = "too_long"
                else:
                    ids, mask, trunc = ids[:max_length], mask[:max_length], True
            if not reject and sum(mask) < min_sup:
                reject = "too_few_supervised"
        if reject:
            ids, mask = [], []
        for k, v in (("id", sid), ("source", src), ("input_ids", ids), ("loss_mask", mask), ("length", len(ids)),
                     ("reject", reject), ("truncated", trunc)):
            out[k].append(v)
    return out


def weighted(rows: list[dict], weight: float, seed) -> list[dict]:
    """Each row floor(weight) times, plus once more with probability frac(weight) (a seeded hash of its id decides):
    a per-row rule, so the result is the same however the rows are split into shards. Copies get `#rK` ids."""
    whole, frac = int(weight), weight - int(weight)
    out = []
    for r in rows:
        u = int(rank(f"w{seed}", r["id"])[:8], 16) / 0x100000000
        k = whole + (1 if u < frac else 0)
        for j in range(k):
            out.append(r if j == 0 else {**r, "id": f"{r['id']}#r{j}"})
    return out


def weight_batch(batch, weights, seed):
    """datasets.map function: each row repeated as `weighted` says (the row count changes)."""
    rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
    out = []
    for r in rows:
        out.extend(weighted([r], weights[r["source"]], seed))
    return {k: [r[k] for r in out] for k in batch}


# what to change when every row is rejected for a reason (the data stage's one-line error says it)
REMEDY = {"empty_response": "the target regenerated empty answers: is it trained? (data.regenerate.enabled: false "
                            "keeps the sources' answers)",
          "too_few_supervised": "lower data.min_supervised_blocks",
          "too_long": "raise data.max_length or set data.truncation: truncate",
          "prompt_too_long": "raise data.max_length",
          "holdout_file": "kept out of training: a sibling of an evaluation prompt from the same file (expected; "
                          "data.holdout sets how many files give evaluation prompts)"}


def reasons(counts: Counter) -> str:
    """"empty_response: 268: <remedy>, duplicate: 3": each reject reason with its count and what to change."""
    return ", ".join(f"{k}: {v}" + (f": {REMEDY[k]}" if k in REMEDY else "") for k, v in counts.most_common())
