"""The data stage as one chain, composed here (README.md beside this file draws it: the steps, the module that owns
each, what each records, where the scatter/gather cuts it):

  read -> normalise -> dedupe -> hold out -> scatter | regenerate -> tokenise -> filter -> weight | gather -> shard
  (every part: all sources)                 (part I of N: its conversations)                        (once)

Streamed (spill files, Arrow on disk): memory does not grow with the number of conversations beyond a 16-byte hash
each (dedupe). Each step records its statistics in the part's `Tally` (per source: counts, reject reasons).

Public:
- `build(loaded, out_dir, shard=None, parts=None, cache_dir=None, progress=True)` -> the stage's record, unwritten:
  shard (I, N): the part record (the scatter job); parts: the gather of those part folders; neither: the whole
  chain in one process (the manifest)
- `expand(loaded, out_dir, progress=True, threads=None, cache_dir=None)` -> manifest dict; writes shards,
  holdout.jsonl and manifest.json (= `expand_part` of shard 0/1 + `gather.finish`)
- `expand_part(loaded, shard, nshards, part_dir, cache_dir=None, progress=True)` -> part (the scatter job, written)
- `write_part(part_dir, record)`: part.json
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from dflash.atomic import atomic_write_json
from dflash.config import Loaded
from dflash.data import gather, samples, select, shards, sources
from dflash.data.regen import regenerated
from dflash.data.rows import min_supervised_tokens
from dflash.data.spill import Spill
from dflash.data.synthetic import synthetic_part
from dflash.data.tally import READ, Tally
from dflash.data.tokenise import target_tokenizer
from dflash.errors import UserError


def build(loaded: Loaded, out_dir, shard: tuple[int, int] | None = None, parts=None, cache_dir=None,
          progress: bool = True) -> dict:
    """The data stage's work into `out_dir`; its record returned, for the caller to write (`write_part` for a part,
    `gather.write_manifest` else)."""
    if shard:
        return build_part(loaded, *shard, out_dir, cache_dir=cache_dir, progress=progress)
    if parts:
        return gather.gathered(loaded, [gather.read_part(p) for p in parts], out_dir)
    work = Path(out_dir) / ".part"
    try:
        return gather.gathered(loaded, [expand_part(loaded, 0, 1, work, cache_dir=cache_dir, progress=progress)],
                               out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def expand(loaded: Loaded, out_dir, progress: bool = True, threads: int | None = None, cache_dir=None) -> dict:
    """The whole chain in one process into `out_dir` (the caller makes it atomic): one part (shard 0 of 1) made in
    `out_dir/.part`, then gathered, the manifest written. `threads`: torch CPU threads while it runs (restored after;
    None leaves torch's). `cache_dir`: finished regeneration chunks (default `regen.default_cache_dir`)."""
    from dflash.data.tiny_target import cpu_threads
    with cpu_threads(threads):
        record = gather.write_manifest(out_dir, build(loaded, out_dir, progress=progress, cache_dir=cache_dir))
    return record.model_dump(exclude_unset=True)


def expand_part(loaded: Loaded, shard: int, nshards: int, part_dir, cache_dir=None, progress: bool = True) -> dict:
    """`build_part`, written; returns `gather.read_part(part_dir)`."""
    write_part(part_dir, build_part(loaded, shard, nshards, part_dir, cache_dir=cache_dir, progress=progress))
    return gather.read_part(part_dir)


def write_part(part_dir, record: dict) -> dict:
    atomic_write_json(Path(part_dir) / gather.PART, record)
    return record


def build_part(loaded: Loaded, shard: int, nshards: int, part_dir, cache_dir=None, progress: bool = True) -> dict:
    """Part `shard` of `nshards`: its samples (a datasets folder `samples/`) and holdout.jsonl written into `part_dir`;
    returns its record (part.json's content: the tally of every step, weights, regeneration figures).

    Every part reads, normalises, dedupes and holds out all sources (cheap; the same result in each), then
    regenerates, tokenises, filters and weights only its own conversations (`select.scatter`). The read steps'
    counts (rows, their rejects, duplicates) and the holdout rows are kept by part 0 only, so parts add up."""
    import datasets
    t_start = time.time()
    cfg = loaded.cfg
    if not 0 <= shard < nshards:
        raise UserError(f"data shard {shard} of {nshards}: expected 0 <= shard < shards")
    part_dir = Path(part_dir)
    work = part_dir / ".work"
    work.mkdir(parents=True, exist_ok=True)
    tally, regen, weights = Tally(), {"enabled": False, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}, {}
    tokenizer, vocab_size = target_tokenizer(cfg)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if cfg.data.synthetic.enabled:
            specs, weights["synthetic"] = [], 1.0
            holdout, ds = synthetic_part(cfg, tokenizer, vocab_size, shard == 0, tally)
        else:
            specs = sources.source_specs(cfg.data)
            if not specs:
                raise UserError("data: no sources (data.sources is empty and data.builtin_corpus and "
                                "data.code_completion are not enabled)")
            weights.update((s.name, s.weight) for s in specs)
            holdout, ds = _chain(cfg, specs, shard, nshards, work, tokenizer, tally, regen, cache_dir, progress)
        samples.count(ds, tally)
        ds.save_to_disk(str(part_dir / "samples"), num_shards=1 if not len(ds) else None)   # an empty part too
    finally:
        if bars:
            datasets.enable_progress_bars()
    shards.write_holdout(part_dir / shards.HOLDOUT, holdout)
    shutil.rmtree(work, ignore_errors=True)
    stats, rejects = tally.record()
    return {"shard": shard, "shards": nshards, "stats": stats, "rejects": rejects, "weights": weights,
            "regeneration": regen, "sources": [s.name for s in specs] or ["synthetic"],
            "paths": {s.name: s.path for s in specs}, "seconds": round(time.time() - t_start, 3)}


def _chain(cfg, specs, shard, nshards, work, tokenizer, tally, regen, cache_dir, progress):
    """The chain from the sources to this part's samples: returns (holdout rows, samples Dataset)."""
    # read -> normalise -> dedupe -> hold out -> scatter, source by source, into a spill file (the holdout is known
    # only once every source is read); the read steps record into their own tally
    read, seen, hold = Tally(READ), set(), select.HoldOut(cfg.data.holdout, cfg.seed)
    mine = Spill(work / "convs.jsonl")
    for spec in specs:
        convs = select.dedupe(sources.normalised(sources.read(spec, cfg, read), spec, read), seen, read)
        for c in select.scatter(hold.watch(convs), shard, nshards):
            mine.add(c)
        read.close_source(spec.name, spec.path)
    mine.close()
    hold.check(len(seen))
    holdout = []
    if shard == 0:
        holdout = hold.rows(tokenizer, tally)
        tally.take(read)
    for spec in specs:
        tally.counts[spec.name]         # every source has its counts, zero or not
    # (this part) -> regenerate -> tokenise -> filter -> weight
    train = regenerated(cfg, hold.exclude(mine, tally), mine.n, tokenizer, Spill(work / "train.jsonl"), cache_dir,
                        tally, regen, progress=progress, shard=shard)
    ds = samples.tokenised(cfg, train, work, tokenizer, min_supervised_tokens(cfg))
    ds = samples.filtered(ds, [s.name for s in specs], tally, work)
    return holdout, samples.weighted(ds, {s.name: s.weight for s in specs}, cfg.seed, work)

