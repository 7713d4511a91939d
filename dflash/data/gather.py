"""The gather of the data stage, where the parallel parts of the chain meet: parts (one per data shard) -> step
`shard` (length buckets in a seeded order), holdout.jsonl and the manifest.

Public:
- `read_part(part_dir)` -> part: part.json's fields, "samples" (a memory-mapped datasets.Dataset), "holdout" (rows)
- `gathered(loaded, parts, out_dir)` -> manifest (unsealed): merge the parts' counts, write the buckets and the holdout
  into `out_dir`; `write_manifest(out_dir, manifest)` seals and writes it; `finish` is both. The content (and its
  hash) is the same for any number of parts.
"""
from __future__ import annotations

import datetime as dt
import json
import logging
import time
from collections import Counter
from pathlib import Path

from dflash.config import Loaded
from dflash.config_model import DflashConfig
from dflash import records
from dflash.data import shards
from dflash.records.manifest import Manifest
from dflash.data.rows import min_supervised_tokens, rank, reasons
from dflash.data.tokenise import target_tokenizer
from dflash.errors import UserError

log = logging.getLogger("dflash.data")
PART = "part.json"      # a part's record, beside its samples/ and holdout.jsonl


def read_part(folder) -> dict:
    """A part folder: part.json's fields, "samples" (a memory-mapped datasets.Dataset) and "holdout" (rows)."""
    from datasets import load_from_disk
    folder = Path(folder)
    if not (folder / PART).is_file():
        raise UserError(f"{folder}: not a data part (no part.json): run `python -m dflash data --shard I/N` first")
    part = json.loads((folder / PART).read_text())
    part["samples"] = load_from_disk(str(folder / "samples"))
    part["holdout"] = shards.read_holdout(folder)
    return part


def _merge(parts: list[dict]):
    """(source names, stats, rejects, regeneration) summed over the parts, which must be one complete set."""
    shards_n = {p["shards"] for p in parts}
    if len(shards_n) != 1 or sorted(p["shard"] for p in parts) != list(range(shards_n.pop())):
        raise UserError(f"data gather: parts {sorted((p['shard'], p['shards']) for p in parts)} are not one complete "
                        f"set of shards (same data.shards, every shard once)")
    names = parts[0]["sources"]
    stats = {n: {"rows": 0, "kept": 0, "samples": 0, "holdout": 0, "truncated": 0} for n in names}
    rejects: dict[str, Counter] = {n: Counter() for n in names}
    for p in parts:
        for n, st in p["stats"].items():
            for k, v in st.items():
                stats[n][k] = stats[n].get(k, 0) + v
        for n, rj in p["rejects"].items():
            rejects[n].update(rj)
    regens = [p["regeneration"] for p in parts]
    regen = dict(regens[0])
    if regen.get("enabled"):
        for k in ("tokens", "conversations", "cached"):
            regen[k] = sum(r.get(k, 0) for r in regens)
        regen["seconds"] = round(max(r.get("seconds", 0.0) for r in regens), 3)    # shards run side by side
        regen["tokens_per_s"] = round(regen["tokens"] / max(regen["seconds"], 1e-9), 1)
    return names, stats, rejects, regen


def _check_left(names, stats, rejects, paths: dict):
    """One line naming each source's rows and rejects (with what to change) when a source, or all, kept nothing."""
    for n in names:
        if not stats[n]["kept"] and not stats[n]["holdout"]:
            raise UserError(f"source '{n}' ({paths.get(n, n)}): all {stats[n]['rows']} rows rejected "
                            f"({reasons(rejects[n])})")
    if not any(stats[n]["kept"] for n in names):
        raise UserError("data: no row left to train on: " + "; ".join(
            f"source '{n}' ({paths.get(n, n)}): {stats[n]['rows']} rows, {stats[n]['holdout']} held out, all others "
            f"rejected ({reasons(rejects[n])})" for n in names))


def _warn_too_few(cfg: DflashConfig, few: int, rows: int, min_sup: int, regenerated: bool):
    if few:
        d = cfg.data
        log.warning("%d of %d rows rejected as too_few_supervised: fewer than %d supervised (assistant) tokens = "
                    "data.min_supervised_blocks %s x drafter.block_size %d; lower data.min_supervised_blocks to keep "
                    "them (a row needs supervised tokens past its anchors to train a block)%s", few, rows, min_sup,
                    d.min_supervised_blocks, cfg.drafter.block_size,
                    f"; regenerated responses are cut at data.regenerate.max_new_tokens "
                    f"{d.regenerate.max_new_tokens}" if regenerated else "")


def _rank_batch(ids, seed):
    return {"rank": [int(rank(seed, i)[:15], 16) for i in ids]}


def _write_samples(cfg: DflashConfig, parts, holdout, out_dir: Path) -> dict:
    """Write the parts' samples into length buckets, ordered by a seeded hash of their id; returns {buckets, lengths,
    total, supervised, content_hash, num_samples}. Streamed: Arrow on disk, sorted through an index."""
    import shutil

    import datasets
    import pyarrow.compute as pc
    from datasets import concatenate_datasets

    d = cfg.data
    work = out_dir / ".gather"
    work.mkdir(exist_ok=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        ds = concatenate_datasets([p["samples"] for p in parts])
        if not len(ds):
            raise UserError("data: no training samples left after filtering and weighting")
        ds = ds.map(_rank_batch, batched=True, batch_size=8192, input_columns="id", fn_kwargs={"seed": cfg.seed},
                    cache_file_name=str(work / "ranked.arrow"))
        # orders from the small key columns only (Dataset.sort on an indexed dataset would load every column)
        keys = ds.data.table.select(["rank", "id"])
        order = lambda *cols: pc.sort_indices(keys, sort_keys=[(c, "ascending") for c in cols]).to_numpy() \
            .astype("int64")     # noqa: E731 (datasets' select wants signed indices)
        by_rank, by_id = order("rank", "id"), order("id")
        del keys
        ds = ds.remove_columns(["rank"])
        ordered = ds.select(by_rank, indices_cache_file_name=str(work / "order.arrow"))
        out = {"buckets": shards.write_buckets_ds(ordered, out_dir, d.bucket_edges, d.shard_rows, work),
               "lengths": [], "total": 0, "supervised": 0}
        for b in ds.select_columns(["length", "loss_mask"]).iter(batch_size=4096):
            out["lengths"].extend(b["length"])
            out["total"] += sum(b["length"])
            out["supervised"] += sum(sum(m) for m in b["loss_mask"])
        out["content_hash"] = shards.content_hash_ds(
            ds.select(by_id, indices_cache_file_name=str(work / "by-id.arrow")), holdout)
        out["num_samples"] = len(ds)
        del ds, ordered
        return out
    finally:
        if bars:
            datasets.enable_progress_bars()
        shutil.rmtree(work, ignore_errors=True)


def _tokenizer_facts(cfg: DflashConfig) -> dict:
    from dflash.target import mask_token_id
    tokenizer, vocab_size = target_tokenizer(cfg)
    return {"size": len(tokenizer), "vocab_size": vocab_size, "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id, "mask_token_id": mask_token_id(tokenizer, vocab_size)}


def finish(loaded: Loaded, parts: list[dict], out_dir) -> Manifest:
    """`gathered`, then the manifest written (`write_manifest`); returns what was written."""
    return write_manifest(out_dir, gathered(loaded, parts, out_dir))


def write_manifest(out_dir, manifest: dict) -> Manifest:
    """manifest.json into `out_dir`: `manifest` sealed (the file hashes and its own hash, `shards.sealed`) made the
    `Manifest` record (strict: a key it lacks, does not describe or types otherwise is refused before anything is
    written) and written through `records.write`; returns the record."""
    record = Manifest.model_validate(shards.sealed(out_dir, manifest))
    record.manifest_hash = shards.seal(record.model_dump(exclude_unset=True))     # of what is written, whatever the
    records.write(Path(out_dir) / shards.MANIFEST, record)                        # model made of a value
    return record


def gathered(loaded: Loaded, parts: list[dict], out_dir) -> dict:
    """The gather: merge the parts' counts, write the length buckets and holdout.jsonl into `out_dir`; returns the
    manifest (not written). The content (and its hash) is the same for any number of parts: samples are ordered by a
    seeded hash of their id and every per-row decision is a function of the row."""
    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names, stats, rejects, regen = _merge(parts)
    _check_left(names, stats, rejects, parts[0].get("paths", {}))
    holdout = sorted((h for p in parts for h in p["holdout"]), key=lambda s: s["id"])
    min_sup = min_supervised_tokens(cfg)
    few = sum(r.get("too_few_supervised", 0) for r in rejects.values())
    _warn_too_few(cfg, few, sum(st["rows"] for st in stats.values()), min_sup, bool(regen.get("enabled")))
    tokenizer = _tokenizer_facts(cfg)
    w = _write_samples(cfg, parts, holdout, out_dir)
    shards.write_holdout(out_dir / shards.HOLDOUT, holdout)
    manifest = {
        "dataset": cfg.dataset_name,
        "content_hash": w["content_hash"],
        "num_samples": w["num_samples"],
        "total_tokens": int(w["total"]),
        "supervised_tokens": int(w["supervised"]),
        "bucket_edges": sorted(int(e) for e in d.bucket_edges),
        "buckets": {str(e): n for e, n in sorted(w["buckets"].items())},
        "length_histogram": shards.length_histogram(w["lengths"], d.max_length),
        "sources": {name: {**st, "weight": parts[0]["weights"].get(name, 1.0),    # st: rows, kept, samples, holdout,
                           "rejected": dict(sorted(rejects[name].items()))}      # truncated (+ from_*_files)
                    for name, st in stats.items()},
        "holdout": len(holdout),
        "regeneration": regen,
        "max_length": d.max_length,
        "truncation": d.truncation,
        "min_supervised_tokens": min_sup,
        "filters": {"too_few_supervised": {"rejected": few, "min_supervised_tokens": min_sup,
                                           "keys": {"data.min_supervised_blocks": d.min_supervised_blocks,
                                                    "drafter.block_size": cfg.drafter.block_size}},
                    "too_long": {"rejected": sum(r.get("too_long", 0) for r in rejects.values()),
                                 "keys": {"data.max_length": d.max_length, "data.truncation": d.truncation}}},
        "block_size": cfg.drafter.block_size,
        "synthetic": bool(d.synthetic.enabled),
        "data_shards": len(parts),
        "tokenizer": tokenizer,
        "target_path": str(cfg.target.path),
        "seed": cfg.seed,
        "seconds": round(max(p["seconds"] for p in parts) + time.time() - t_start, 3),
        "created_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return manifest
