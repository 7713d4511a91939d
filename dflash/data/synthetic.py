"""The chain's short way for data.synthetic (throughput benchmarks): random-token samples of fixed lengths, made
tokenised, so they skip read .. weight; held out, filtered (too_long, too_few_supervised) and counted like any
source's, under the source name `synthetic`. Shard 0 makes them all (other shards' parts are empty).

Public: `synthetic_part(cfg, tokenizer, vocab_size, first, tally)` -> (holdout rows, samples Dataset)
"""
from __future__ import annotations

from dflash.config_model import DflashConfig
from dflash.data import shards
from dflash.data.rows import min_supervised_tokens
from dflash.data.tally import Tally
from dflash.errors import UserError


def _samples(cfg: DflashConfig, tokenizer, vocab_size: int, tally: Tally):
    """(samples, holdout): data.synthetic.num_samples rows of ids drawn from the non-special tokens (seeded), the
    last `supervised_fraction` of each supervised; the first data.holdout become prompts with references."""
    import numpy as np
    d = cfg.data
    syn = d.synthetic
    special = set(tokenizer.all_special_ids)
    limit = min(len(tokenizer), vocab_size)
    allowed = np.array([t for t in range(limit) if t not in special], dtype=np.int64)
    rng = np.random.default_rng(cfg.seed)
    min_sup = min_supervised_tokens(cfg)
    samples, holdout = [], []
    st = tally.counts["synthetic"]
    for i in range(syn.num_samples):
        st["rows"] += 1
        n = int(syn.lengths[i % len(syn.lengths)])
        ids = rng.choice(allowed, size=n).astype(np.int32).tolist()
        sup = int(round(syn.supervised_fraction * n))
        mask = [0] * (n - sup) + [1] * sup
        sid = f"synthetic-{i}"
        if len(holdout) < d.holdout and n - sup > 0 and sup > 0:
            holdout.append({"id": sid, "source": "synthetic", "prompt_ids": ids[:n - sup], "reference_ids": ids[n - sup:]})
            st["holdout"] += 1
            continue
        if n > d.max_length:
            if d.truncation == "drop":
                tally.reject("synthetic", "too_long")
                continue
            ids, mask = ids[:d.max_length], mask[:d.max_length]
            st["truncated"] += 1
        if sum(mask) < min_sup:
            tally.reject("synthetic", "too_few_supervised")
            continue
        samples.append({"id": sid, "source": "synthetic", "input_ids": ids, "loss_mask": mask, "length": len(ids)})
    return samples, holdout


def synthetic_part(cfg: DflashConfig, tokenizer, vocab_size: int, first: bool, tally: Tally):
    """(holdout rows, samples Dataset) of a part: everything in shard 0 (`first`), nothing in the others."""
    from datasets import Dataset
    tally.counts["synthetic"]
    samples, holdout = _samples(cfg, tokenizer, vocab_size, tally) if first else ([], [])
    if first and not samples:
        raise UserError(f"source 'synthetic': all {tally.counts['synthetic']['rows']} samples rejected "
                        f"({dict(tally.rejects['synthetic'])})")
    tally.counts["synthetic"]["kept"] = len(samples)
    return holdout, Dataset.from_dict({c: [r[c] for r in samples] for c in shards.COLUMNS}, features=shards.features())
