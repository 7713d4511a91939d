"""The data chain's steps over Arrow (a part's samples, on disk, `datasets`): tokenise, filter, weight. The per-row
rules they apply are `rows.tokenise_batch` and `rows.weight_batch`, so any split into shards gives the same rows.

Samples: {id, source, input_ids, loss_mask, length} (`shards.features()`); `tokenised` adds reject ('' when kept) and
truncated, which `filtered` takes away.

Public:
- `tokenised(cfg, spill, work, tokenizer, min_sup)` -> Dataset: tokenise, mask, truncate (datasets.map,
  data.num_proc processes)
- `filtered(ds, names, tally, work)` -> Dataset: the kept rows (counted: `kept`, `truncated`; rejects by reason)
- `weighted(ds, weights, seed, work)` -> Dataset: each source's weight as row copies
- `count(ds, tally)`: the samples per source (counted: `samples`)
"""
from __future__ import annotations

from collections import Counter

from dflash.config_model import DflashConfig
from dflash.data import shards
from dflash.data.rows import num_proc, tokenise_batch, weight_batch
from dflash.data.spill import Spill, spill_rows
from dflash.data.tally import Tally
from dflash.data.tokenise import end_of_turn_strings


def tokenised(cfg: DflashConfig, spill: Spill, work, tokenizer, min_sup: int):
    """Step `tokenise`: the spilled conversations {id, source, messages (JSON)} -> samples with `reject` ('' when kept)
    and `truncated`: datasets.map over Arrow on disk, data.num_proc processes."""
    from datasets import Dataset, Features, Value
    d = cfg.data
    feats = Features({"id": Value("string"), "source": Value("string"), "messages": Value("string")})
    out_feats = Features({**shards.features(), "reject": Value("string"), "truncated": Value("bool")})
    if not spill.n:     # nothing left to tokenise (every conversation rejected above): the gather names the rejects
        return Dataset.from_dict({k: [] for k in out_feats}, features=out_feats)
    ds = Dataset.from_generator(spill_rows, features=feats, gen_kwargs={"path": str(spill.path)},
                                cache_dir=str(work / "hf"), writer_batch_size=1000)
    nproc = min(num_proc(d), max(1, spill.n // 256))
    return ds.map(tokenise_batch, batched=True, batch_size=256, num_proc=nproc if nproc > 1 else None,
                  remove_columns=["messages"], features=out_feats, desc="tokenise",
                  cache_file_name=str(work / "tokenised.arrow"),
                  fn_kwargs={"tokenizer": tokenizer, "stop_strings": end_of_turn_strings(tokenizer),
                             "max_length": d.max_length, "truncation": d.truncation, "min_sup": min_sup})


def filtered(ds, names, tally: Tally, work):
    """Step `filter`: count the rejects (template_mismatch, too_long, too_few_supervised) and the kept and truncated
    rows of each source (`names`); the kept rows without the `reject`, `truncated` columns."""
    kept_per = Counter()
    for b in ds.select_columns(["source", "reject", "truncated"]).iter(batch_size=8192):
        for src, rj, tr in zip(b["source"], b["reject"], b["truncated"]):
            if rj:
                tally.reject(src, rj)
            else:
                kept_per[src] += 1
                tally.counts[src]["truncated"] += int(tr)
    for name in names:
        tally.counts[name]["kept"] = kept_per[name]
    ds = ds.filter(lambda rj: [not x for x in rj], input_columns="reject", batched=True, batch_size=8192,
                   cache_file_name=str(work / "kept.arrow"))
    return ds.remove_columns(["reject", "truncated"])


def weighted(ds, weights: dict[str, float], seed, work):
    """Step `weight`: a source's weight as row copies (`rows.weighted`: a per-row rule); unchanged when every weight
    is 1."""
    if any(w != 1.0 for w in weights.values()) and len(ds):
        ds = ds.map(weight_batch, batched=True, batch_size=1024, fn_kwargs={"weights": weights, "seed": seed},
                    features=shards.features(), cache_file_name=str(work / "weighted.arrow"))
    return ds


def count(ds, tally: Tally):
    """The samples of each source (after weighting)."""
    for src in ds.select_columns(["source"]).iter(batch_size=8192):
        for name, n in Counter(src["source"]).items():
            tally.counts[name]["samples"] += n
