"""Dataset expansion, the driver of the data stage: sources -> normalised, deduplicated conversations ->
(regenerated) -> tokenised with a loss mask -> filtered -> weighted -> holdout + length-bucketed shards + manifest.
Streamed (spill files, Arrow on disk): memory does not grow with the number of conversations beyond a 16-byte hash
each (deduplication). The jobs it drives live beside it: `tokenise` (chat templates, loss mask), `rows` (per-row
rules), `regen` (resumable regeneration; `generate` its in-process driver), `gather` (buckets and manifest).

Public:
- `expand(loaded, out_dir, progress=True, threads=None, cache_dir=None)` -> manifest dict; writes shards,
  holdout.jsonl and manifest.json (= `expand_part` of shard 0/1 + `gather.finish`)
- `expand_part(loaded, shard, nshards, part_dir, cache_dir=None, progress=True)` -> part (the scatter job)
- `default_cache_dir(loaded)`: where finished regeneration chunks are kept
"""
from __future__ import annotations

import contextlib
import heapq
import json
import logging
import time
from collections import Counter, defaultdict
from pathlib import Path

from dflash.config import Loaded
from dflash.config_model import DataSection, DflashConfig
from dflash.data import shards
from dflash.data.gather import finish, read_part
from dflash.data.regen import cache_key, regenerate_stream
from dflash.data.rows import conv_hash, min_supervised_tokens, rank, shard_of, tokenise_batch, weight_batch
from dflash.data.sources import Row, SourceSpec, normalise, read_rows
from dflash.data.tokenise import end_of_turn_strings, prompt_ids
from dflash.errors import UserError

log = logging.getLogger("dflash.data")


def _neg(hexdigest: str) -> int:
    """For a max-heap of hex ranks (heapq is a min-heap)."""
    return -int(hexdigest[:16], 16)


def _first_assistant(messages) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant")


BUILTIN_SOURCES = {"stdlib": "builtin_corpus", "code": "code_completion"}   # source name: the data section enabling it


def _source_specs(dcfg: DataSection) -> list[SourceSpec]:
    specs = [SourceSpec.of(s) for s in dcfg.sources]
    names = [s.name for s in specs]
    for name, section in BUILTIN_SOURCES.items():
        if getattr(dcfg, section).enabled:
            if name in names:
                raise UserError(f"data.sources: the name '{name}' is taken by the built-in source data.{section}")
            specs.append(SourceSpec(name=name, path="<builtin>", kind="builtin", format="openai"))
            names.append(name)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"data.sources: duplicate source name(s) {', '.join(dup)}")
    return specs


def _read_source(spec: SourceSpec, cfg: DflashConfig):
    if spec.kind == "builtin" and spec.name == "code":
        from dflash.data import code_corpus
        convs = code_corpus.completion_source(cfg.target.pretrain, cfg.data.code_completion,
                                              processes=_num_proc(cfg.data))
        return (Row("code", i, c, file=c["file"], evaluable=c["heldout"]) for i, c in enumerate(convs))
    if spec.kind == "builtin":
        from dflash.data import corpus
        convs = corpus.conversations(cfg.data.builtin_corpus.max_conversations, seed=0)
        return (Row("stdlib", i, c) for i, c in enumerate(convs))
    return read_rows(spec)


def _synthetic(cfg: DflashConfig, tokenizer, vocab_size, stats, rejects):
    import numpy as np
    d = cfg.data
    syn = d.synthetic
    special = set(tokenizer.all_special_ids)
    limit = min(len(tokenizer), vocab_size)
    allowed = np.array([t for t in range(limit) if t not in special], dtype=np.int64)
    rng = np.random.default_rng(cfg.seed)
    min_sup = min_supervised_tokens(cfg)
    samples, holdout = [], []
    st = stats["synthetic"]
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
                rejects["synthetic"]["too_long"] += 1
                continue
            ids, mask = ids[:d.max_length], mask[:d.max_length]
            st["truncated"] += 1
        if sum(mask) < min_sup:
            rejects["synthetic"]["too_few_supervised"] += 1
            continue
        samples.append({"id": sid, "source": "synthetic", "input_ids": ids, "loss_mask": mask, "length": len(ids)})
    return samples, holdout


def default_cache_dir(loaded: Loaded) -> Path:
    """Where finished regeneration chunks are kept across runs: <results_dir>/data/<dataset>.regen/<key>. A cache made
    under the key of before (the target by its files' mtimes) is taken over, renamed: its responses are kept."""
    from dflash import paths
    root = Path(f"{paths.dataset(loaded.cfg.results_dir, loaded.cfg.dataset_name)}.regen")
    folder, legacy = root / cache_key(loaded.cfg), root / cache_key(loaded.cfg, legacy=True)
    if not folder.exists() and legacy.is_dir():
        with contextlib.suppress(OSError):   # another shard's job took it over first
            legacy.rename(folder)
    return folder


def expand(loaded: Loaded, out_dir, progress: bool = True, threads: int | None = None, cache_dir=None) -> dict:
    """Run the whole expansion for a loaded config and write it into `out_dir` (the caller makes it atomic):
    one part (shard 0 of 1) made in `out_dir/.part`, then gathered. `threads`: torch CPU threads while it runs
    (restored after; None leaves torch's). `cache_dir`: finished regeneration chunks (default `default_cache_dir`)."""
    import shutil

    from dflash.data.tiny_target import cpu_threads
    with cpu_threads(threads):
        work = Path(out_dir) / ".part"
        try:
            part = expand_part(loaded, 0, 1, work, cache_dir=cache_dir, progress=progress)
            return finish(loaded, [part], out_dir)
        finally:
            shutil.rmtree(work, ignore_errors=True)


class _Spill:
    """Conversations streamed to a JSONL file and read back (bounded memory between the passes)."""

    def __init__(self, path):
        self.path, self.n = Path(path), 0
        self.f = open(self.path, "w")

    def add(self, row: dict):
        self.f.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.n += 1

    def close(self):
        self.f.close()

    def __iter__(self):
        with open(self.path) as f:
            for line in f:
                yield json.loads(line)


def _spill_rows(path):
    """Rows of a spill file, for Dataset.from_generator (streamed into Arrow, 1000 rows at a time)."""
    with open(path) as f:
        for line in f:
            yield json.loads(line)


def _num_proc(d: DataSection) -> int:
    import os
    return d.num_proc or os.cpu_count() or 1


def expand_part(loaded: Loaded, shard: int, nshards: int, part_dir, cache_dir=None, progress: bool = True) -> dict:
    """One shard of the expansion, written into `part_dir` (samples/ datasets folder, holdout.jsonl, part.json).

    Every shard reads and deduplicates all sources (cheap; the same result in each), then regenerates and tokenises
    only its conversations (`shard_of`). Streamed: the shard's conversations go to a spill file, regeneration works
    chunk by chunk, tokenising is a `datasets.map` over Arrow on disk (data.num_proc processes); what stays in memory
    is a 16-byte hash per conversation (deduplication) and the holdout. Read-level counts (rows, read rejects,
    duplicates, holdout) are recorded by shard 0 only, so parts add up. The holdout (evaluation prompts) is the
    data.holdout evaluable conversations of lowest seeded rank (the code source's: those of held-out files), the same
    in every shard; no conversation of a file that gives one is trained on (reject `holdout_file`), so every shard
    excludes the same files. Returns `read_part(part_dir)`."""
    import datasets
    from datasets import Dataset
    from transformers import AutoConfig

    from dflash.target import load_tokenizer

    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    if not 0 <= shard < nshards:
        raise UserError(f"data shard {shard} of {nshards}: expected 0 <= shard < shards")
    part_dir = Path(part_dir)
    work = part_dir / ".work"
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.target)
    tconf = AutoConfig.from_pretrained(str(cfg.target.path), trust_remote_code=cfg.target.trust_remote_code)
    vocab_size = int(getattr(tconf, "vocab_size", len(tokenizer)))
    min_sup = min_supervised_tokens(cfg)
    stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "kept": 0, "samples": 0, "holdout": 0, "truncated": 0})
    rejects: dict[str, Counter] = defaultdict(Counter)
    regen = {"enabled": False, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    weights = {}
    first = shard == 0
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if d.synthetic.enabled:
            stats["synthetic"]
            samples, holdout = _synthetic(cfg, tokenizer, vocab_size, stats, rejects) if first else ([], [])
            weights["synthetic"] = 1.0
            if first and not samples:
                raise UserError(f"source 'synthetic': all {stats['synthetic']['rows']} samples rejected "
                                f"({dict(rejects['synthetic'])})")
            specs = []
            stats["synthetic"]["kept"] = len(samples)
            ds = Dataset.from_dict({c: [r[c] for r in samples] for c in shards.COLUMNS}, features=shards.features())
        else:
            specs = _source_specs(d)
            if not specs:
                raise UserError("data: no sources (data.sources is empty and data.builtin_corpus and "
                                "data.code_completion are not enabled)")
            holdout, ds = _expand_sources(loaded, specs, shard, nshards, work, cache_dir, tokenizer, min_sup, stats,
                                          rejects, weights, regen, progress)
        for src in ds.select_columns(["source"]).iter(batch_size=8192):
            for name, n in Counter(src["source"]).items():
                stats[name]["samples"] += n
        ds.save_to_disk(str(part_dir / "samples"), num_shards=1 if not len(ds) else None)   # an empty part too
    finally:
        if bars:
            datasets.enable_progress_bars()
    shards.write_holdout(part_dir / "holdout.jsonl", holdout)
    meta = {"shard": shard, "shards": nshards, "stats": {k: dict(v) for k, v in stats.items()},
            "rejects": {k: dict(v) for k, v in rejects.items()}, "weights": weights, "regeneration": regen,
            "sources": [s.name for s in specs] or ["synthetic"], "paths": {s.name: s.path for s in specs},
            "seconds": round(time.time() - t_start, 3)}
    from dflash.atomic import atomic_write_json
    atomic_write_json(part_dir / "part.json", meta)
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    return read_part(part_dir)


def _read_sources(cfg: DflashConfig, specs, shard, nshards, spill, weights):
    """Read, normalise and deduplicate every source; this shard's conversations ({id, source, hash, file, messages})
    go to `spill`. Returns (holdout heap of (-rank, hash, conversation): the data.holdout lowest seeded ranks among the
    evaluable conversations (`Row.evaluable`) of every shard, the same in each; valid conversations; read rejects;
    read stats: rows, valid, and for a source whose rows have files, valid conversations `from_pretrain_files` and
    `from_heldout_files`)."""
    d = cfg.data
    hold: list = []
    seen: set[bytes] = set()
    read_rejects: dict[str, Counter] = defaultdict(Counter)
    read_stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "valid": 0})
    for spec in specs:
        weights[spec.name] = spec.weight
        st = read_stats[spec.name]
        from_files = Counter()
        for row in _read_source(spec, cfg):
            st["rows"] += 1
            if row.reject:
                read_rejects[spec.name][row.reject] += 1
                continue
            msgs = normalise(row.value, spec.format)
            if isinstance(msgs, str):
                read_rejects[spec.name][msgs] += 1
                continue
            h = conv_hash(msgs)
            hb = bytes.fromhex(h[:32])
            if hb in seen:
                read_rejects[spec.name]["duplicate"] += 1
                continue
            seen.add(hb)
            st["valid"] += 1
            rid = row.value.get("id") if spec.kind == "builtin" else None
            c = {"id": rid or f"{spec.name}-{row.index}", "source": spec.name, "hash": h, "file": row.file,
                 "messages": msgs}
            if row.file is not None:
                from_files[row.evaluable] += 1
            if d.holdout and row.evaluable:
                item = (_neg(rank(f"h{cfg.seed}", h)), h, c)
                (heapq.heappush if len(hold) < d.holdout else heapq.heappushpop)(hold, item)
            if shard_of(h, nshards) == shard:
                spill.add(c)
        if from_files:
            st.update(from_pretrain_files=from_files[False], from_heldout_files=from_files[True])
        if not st["rows"]:
            raise UserError(f"source '{spec.name}': {spec.path} has no rows")
        if not st["valid"]:
            raise UserError(f"source '{spec.name}' ({spec.path}): all {st['rows']} rows rejected "
                            f"({', '.join(f'{k}: {v}' for k, v in read_rejects[spec.name].most_common())})")
    spill.close()
    return hold, len(seen), read_rejects, read_stats


def _holdout_rows(hold, tokenizer, stats) -> list[dict]:
    """The held-out conversations as {id, source, prompt_ids (up to the first assistant turn), reference_ids}."""
    holdout = []
    for _, _, c in sorted(hold, key=lambda x: x[1]):
        a = _first_assistant(c["messages"])
        holdout.append({"id": c["id"], "source": c["source"], "prompt_ids": prompt_ids(tokenizer, c["messages"][:a]),
                        "reference_ids": tokenizer(c["messages"][a]["content"], add_special_tokens=False)["input_ids"]})
        stats[c["source"]]["holdout"] += 1
    return holdout


def _training(spill, held: set, held_files: set, rejects):
    """The spilled conversations to train on: not held out, and not of a file that gives an evaluation prompt (file-
    level separation; counted as the reject `holdout_file`)."""
    for c in spill:
        if c["hash"] in held:
            continue
        if c["file"] in held_files:
            rejects[c["source"]]["holdout_file"] += 1
            continue
        yield c


def _regenerated(loaded: Loaded, convs, n, tokenizer, work, cache_dir, rejects, regen, progress, shard) -> _Spill:
    """The training conversations (regenerated by the target when data.regenerate.enabled: resumable, finished
    chunks kept in the cache folder, keyed by conversation) in a spill file of {id, source, messages (JSON)}."""
    cfg = loaded.cfg
    train = _Spill(work / "train.jsonl")
    if cfg.data.regenerate.enabled:
        cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(loaded)
        for c, r in regenerate_stream(convs, n, tokenizer, cfg, cache_dir, regen, progress=progress, shard=shard):
            if isinstance(r, str):
                rejects[c["source"]][r] += 1
            else:
                train.add({"id": c["id"], "source": c["source"], "messages": json.dumps(r, ensure_ascii=False)})
    else:
        for c in convs:
            train.add({"id": c["id"], "source": c["source"], "messages": json.dumps(c["messages"], ensure_ascii=False)})
    train.close()
    return train


def _tokenised(cfg: DflashConfig, train: _Spill, work, tokenizer, min_sup):
    """tokenise, mask, truncate, filter: datasets.map over Arrow on disk, data.num_proc processes. Returns a
    Dataset with `reject` ('' when kept) and `truncated` columns."""
    from datasets import Dataset, Features, Value
    d = cfg.data
    feats = Features({"id": Value("string"), "source": Value("string"), "messages": Value("string")})
    out_feats = Features({**shards.features(), "reject": Value("string"), "truncated": Value("bool")})
    if not train.n:     # nothing left to tokenise (every conversation rejected above): the gather names the rejects
        return Dataset.from_dict({k: [] for k in out_feats}, features=out_feats)
    ds = Dataset.from_generator(_spill_rows, features=feats, gen_kwargs={"path": str(train.path)},
                                cache_dir=str(work / "hf"), writer_batch_size=1000)
    nproc = min(_num_proc(d), max(1, train.n // 256))
    return ds.map(tokenise_batch, batched=True, batch_size=256, num_proc=nproc if nproc > 1 else None,
                  remove_columns=["messages"], features=out_feats, desc="tokenise",
                  cache_file_name=str(work / "tokenised.arrow"),
                  fn_kwargs={"tokenizer": tokenizer, "stop_strings": end_of_turn_strings(tokenizer),
                             "max_length": d.max_length, "truncation": d.truncation, "min_sup": min_sup})


def _kept(ds, specs, stats, rejects, work):
    """Count the rejects and the kept rows per source; the kept rows without the `reject`, `truncated` columns."""
    kept_per = Counter()
    for b in ds.select_columns(["source", "reject", "truncated"]).iter(batch_size=8192):
        for src, rj, tr in zip(b["source"], b["reject"], b["truncated"]):
            if rj:
                rejects[src][rj] += 1
            else:
                kept_per[src] += 1
                stats[src]["truncated"] += int(tr)
    for spec in specs:
        stats[spec.name]["kept"] = kept_per[spec.name]
    ds = ds.filter(lambda rj: [not x for x in rj], input_columns="reject", batched=True, batch_size=8192,
                   cache_file_name=str(work / "kept.arrow"))
    return ds.remove_columns(["reject", "truncated"])


def _expand_sources(loaded: Loaded, specs, shard, nshards, work, cache_dir, tokenizer, min_sup, stats, rejects, weights,
                    regen, progress):
    """The conversation path of `expand_part`: returns (holdout rows, samples Dataset)."""
    cfg = loaded.cfg
    d = cfg.data
    # 1. read + normalise + deduplicate; this shard's conversations go to a spill file
    spill = _Spill(work / "convs.jsonl")
    hold, valid, read_rejects, read_stats = _read_sources(cfg, specs, shard, nshards, spill, weights)
    # 2. holdout: the evaluable conversations of lowest seeded rank (the same in every shard), written by shard 0;
    # no conversation of their files is trained on
    if d.holdout >= valid:
        raise UserError(f"data.holdout ({d.holdout}) leaves no training conversations (only {valid} valid)")
    if len(hold) < d.holdout:
        raise UserError(f"data.holdout ({d.holdout}) exceeds the {len(hold)} conversations that may be evaluation "
                        f"prompts (the code source's are those of held-out files): lower data.holdout")
    held = {h for _, h, _ in hold}
    held_files = {c["file"] for _, _, c in hold} - {None}
    holdout = []
    if shard == 0:
        holdout = _holdout_rows(hold, tokenizer, stats)
        for name, st in read_stats.items():
            stats[name].update((k, v) for k, v in st.items() if k != "valid")
            rejects[name].update(read_rejects[name])
    for spec in specs:
        stats[spec.name]
    del hold
    # 3. regeneration, 4. tokenise, mask, truncate, filter
    train = _regenerated(loaded, _training(spill, held, held_files, rejects), spill.n, tokenizer, work, cache_dir,
                         rejects, regen, progress, shard)
    ds = _kept(_tokenised(cfg, train, work, tokenizer, min_sup), specs, stats, rejects, work)
    # 5. weights: a per-row rule (`rows.weighted`), so any split into shards gives the same rows
    if any(w != 1.0 for w in weights.values()) and len(ds):
        ds = ds.map(weight_batch, batched=True, batch_size=1024, fn_kwargs={"weights": weights, "seed": cfg.seed},
                    features=shards.features(), cache_file_name=str(work / "weighted.arrow"))
    return holdout, ds
