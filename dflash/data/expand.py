"""Dataset expansion: sources -> normalised, deduplicated conversations -> (regenerated) -> tokenised with a loss
mask -> filtered -> weighted -> holdout + length-bucketed shards + manifest.

Public:
- `conversation_ids(tokenizer, messages, stop_strings=None)` -> (input_ids, loss_mask) or reject reason (str)
- `prompt_ids(tokenizer, messages)` -> ids of the chat template up to and including the assistant generation prompt
- `regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=32, seed=0, progress=True)`
  -> (responses: list[list[int]] without the stop token, stats dict)
- `expand(loaded, out_dir, progress=True)` -> manifest dict; writes shards, holdout.jsonl and manifest.json
"""
from __future__ import annotations

import datetime as dt
import hashlib
import heapq
import json
import logging
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

from dflash.data import shards
from dflash.data.sources import Row, SourceSpec, normalise, read_rows
from dflash.errors import UserError

log = logging.getLogger("dflash.data")


# ---- tokenisation and loss mask ---------------------------------------------------------------------------------

def _render(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _stop_strings(tokenizer) -> list[str]:
    from dflash.target import END_OF_TURN_TOKENS
    vocab = tokenizer.get_vocab()
    out = [t for t in END_OF_TURN_TOKENS if t in vocab]
    if tokenizer.eos_token and tokenizer.eos_token not in out:
        out.append(tokenizer.eos_token)
    return out


def prompt_ids(tokenizer, messages) -> list[int]:
    """The chat template of `messages` followed by the assistant generation prompt, as token ids."""
    text = _render(tokenizer, messages, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation_ids(tokenizer, messages, stop_strings=None):
    """(input_ids, loss_mask) of a conversation; the mask covers each assistant turn's content and its end-of-turn
    token (and nothing of the template around it). Returns a reject reason (str) when the template does not render
    each turn as a prefix of the next (a template that rewrites history)."""
    stop_strings = _stop_strings(tokenizer) if stop_strings is None else stop_strings
    full = _render(tokenizer, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[:i + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            return "template_mismatch"
        seg = upto[len(prefix):]
        content = m["content"].strip()
        j = seg.find(content)
        if j < 0:
            return "template_mismatch"
        end = j + len(content)
        for s in stop_strings:
            if seg.startswith(s, end):
                end += len(s)
                break
        spans.append((len(prefix) + j, len(prefix) + end))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    mask = [0] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
            mask[t] = 1
    return ids, mask


# ---- regeneration ------------------------------------------------------------------------------------------------

def auto_batch_size(model, width: int, max_new_tokens: int, memory_fraction: float = 0.6, cap: int = 1024) -> int:
    """Sequences per generate call that fit `memory_fraction` of the free GPU memory: the KV cache of
    width + max_new_tokens positions (every layer's K and V) plus the last-position logits; 32 on CPU."""
    import torch
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 32
    c = model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    elem = next(model.parameters()).element_size()
    per_seq = 2 * c.num_hidden_layers * heads * head_dim * elem * (width + max_new_tokens) + 8 * c.vocab_size
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(cap, memory_fraction * free // per_seq)))


def regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=32, seed=0, progress=True,
               stop_ids=None, cache_implementation=None, compile=True, pad_multiple=None, ignore_eos=False):
    """Batched generation with a KV cache and left padding, prompts sorted by length (longest first). Returns
    responses (token ids up to, excluding, the first stop token) in the order of `prompts`, and {tokens, seconds,
    tokens_per_s, batch_size}.

    batch_size 0 sizes batches from free GPU memory (`auto_batch_size`). cache_implementation "static" keeps every
    shape fixed: prompt widths are rounded up to `pad_multiple` (default 64) and the last batch is filled, so on GPU
    transformers compiles the decode step once per width (CUDA graphs) instead of running it eagerly; `compile`
    False keeps it eager. `ignore_eos` generates exactly max_new_tokens (benchmarks)."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    from dflash.target import stop_token_ids

    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else list(stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    static = cache_implementation == "static"
    pad_multiple = pad_multiple or (64 if static else 1)
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                               temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                               eos_token_id=None if ignore_eos else stop_ids, pad_token_id=pad, use_cache=True,
                               cache_implementation=cache_implementation, disable_compile=not compile)
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    if not batch_size:
        batch_size = auto_batch_size(model, -(-len(prompts[order[0]]) // pad_multiple) * pad_multiple, max_new_tokens)
        log.info("regeneration batch size %d (from free GPU memory)", batch_size)
    out: list[list[int] | None] = [None] * len(prompts)
    tokens = 0
    torch.manual_seed(seed)
    t0 = time.time()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    bar = tqdm(batches, desc="regenerate", unit="batch", disable=not progress, mininterval=2.0)
    stop = set() if ignore_eos else set(stop_ids)
    with torch.inference_mode():
        for batch in bar:
            rows = batch + [batch[-1]] * (batch_size - len(batch)) if static else batch   # fixed batch shape
            width = -(-max(len(prompts[i]) for i in rows) // pad_multiple) * pad_multiple
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            att = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                p = prompts[i]
                ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
                att[r, width - len(p):] = 1
            gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), generation_config=gen_cfg)
            for r, i in enumerate(batch):
                seq = gen[r, width:].tolist()
                cut = next((k for k, t in enumerate(seq) if t in stop), None)
                out[i] = seq[:cut] if cut is not None else seq
                tokens += (cut + 1) if cut is not None else len(seq)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
    seconds = time.time() - t0
    return out, {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                 "batch_size": batch_size}


# ---- the stage ---------------------------------------------------------------------------------------------------

def _conv_hash(messages) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def shard_of(conv_hash: str, shards: int) -> int:
    """The shard a conversation belongs to: a function of its content only (the same for any run)."""
    return int(conv_hash[:8], 16) % shards


def _rank(seed, sid: str) -> str:
    """A sample's place in the shards: a seeded hash of its id (the same for any number of data shards)."""
    return hashlib.sha256(f"{seed}:{sid}".encode()).hexdigest()


def _neg(hexdigest: str) -> int:
    """For a max-heap of hex ranks (heapq is a min-heap)."""
    return -int(hexdigest[:16], 16)


def _first_assistant(messages) -> int:
    return next(i for i, m in enumerate(messages) if m["role"] == "assistant")


def _source_specs(dcfg) -> list[SourceSpec]:
    specs = [SourceSpec.of(s) for s in dcfg.sources]
    names = [s.name for s in specs]
    if dcfg.builtin_corpus.enabled:
        if "stdlib" in names:
            raise UserError("data.sources: the name 'stdlib' is taken by the built-in corpus (data.builtin_corpus)")
        specs.append(SourceSpec(name="stdlib", path="<builtin>", kind="builtin", format="openai"))
        names.append("stdlib")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"data.sources: duplicate source name(s) {', '.join(dup)}")
    return specs


def _read_source(spec: SourceSpec, dcfg, seed):
    if spec.kind == "builtin":
        from dflash.data import corpus
        convs = corpus.conversations(dcfg.builtin_corpus.max_conversations, seed=0)
        return (Row("stdlib", i, c) for i, c in enumerate(convs))
    return read_rows(spec)


def _weighted(rows: list[dict], weight: float, seed) -> list[dict]:
    """Each row floor(weight) times, plus once more with probability frac(weight) (a seeded hash of its id decides):
    a per-row rule, so the result is the same however the rows are split into shards. Copies get `#rK` ids."""
    whole, frac = int(weight), weight - int(weight)
    out = []
    for r in rows:
        u = int(_rank(f"w{seed}", r["id"])[:8], 16) / 0x100000000
        k = whole + (1 if u < frac else 0)
        for j in range(k):
            out.append(r if j == 0 else {**r, "id": f"{r['id']}#r{j}"})
    return out


def _check_config(cfg):
    d = cfg.data
    if not d.bucket_edges:
        raise UserError("data.bucket_edges is empty: give at least one length bucket")
    if d.max_length > max(d.bucket_edges):
        raise UserError(f"data.max_length ({d.max_length}) exceeds the largest data.bucket_edges entry "
                        f"({max(d.bucket_edges)}): every kept sample must fit a bucket")


def min_supervised_tokens(cfg) -> int:
    return max(1, int(-(-cfg.data.min_supervised_blocks * cfg.drafter.block_size // 1)))


def _synthetic(cfg, tokenizer, vocab_size, stats, rejects):
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


def default_cache_dir(loaded) -> Path:
    """Where finished regeneration chunks are kept across runs: <results_dir>/data/<dataset>.regen/<key>."""
    from dflash.config import results_path
    from dflash.data.regen import cache_key
    return Path(results_path(loaded, "data", f"{loaded.cfg.dataset_name}.regen")) / cache_key(loaded.cfg)


def expand(loaded, out_dir, progress: bool = True, threads: int | None = None, cache_dir=None) -> dict:
    """Run the whole expansion for a loaded config and write it into `out_dir` (the caller makes it atomic).
    `threads`: torch CPU threads while it runs (restored after; None leaves torch's). `cache_dir`: finished
    regeneration chunks (default `default_cache_dir`)."""
    from dflash.data.tiny_target import cpu_threads
    with cpu_threads(threads):
        part = expand_part(loaded, 0, 1, cache_dir=cache_dir, progress=progress)
        return finish(loaded, [part], out_dir)


def expand_part(loaded, shard: int, shards: int, cache_dir=None, progress: bool = True) -> dict:
    """One shard of the expansion: every shard reads and deduplicates all sources (cheap; the same result in each),
    then regenerates and tokenises only its conversations (`shard_of`). Returns the part: {"samples", "holdout",
    "stats", "rejects", "weights", "regeneration", "sources", "seconds"}; read-level counts (rows, read rejects,
    duplicates, holdout) are recorded by shard 0 only, so parts add up."""
    from transformers import AutoConfig

    from dflash.target import load_tokenizer

    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    _check_config(cfg)
    if not 0 <= shard < shards:
        raise UserError(f"data shard {shard} of {shards}: expected 0 <= shard < shards")
    tokenizer = load_tokenizer(cfg.target)
    tconf = AutoConfig.from_pretrained(str(cfg.target.path), trust_remote_code=cfg.target.trust_remote_code)
    vocab_size = int(getattr(tconf, "vocab_size", len(tokenizer)))
    min_sup = min_supervised_tokens(cfg)
    stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "kept": 0, "samples": 0, "holdout": 0, "truncated": 0})
    rejects: dict[str, Counter] = defaultdict(Counter)
    regen = {"enabled": False, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    weights = {}
    first = shard == 0

    if d.synthetic.enabled:
        stats["synthetic"]
        samples, holdout = _synthetic(cfg, tokenizer, vocab_size, stats, rejects) if first else ([], [])
        weights["synthetic"] = 1.0
        if first and not samples:
            raise UserError(f"source 'synthetic': all {stats['synthetic']['rows']} samples rejected "
                            f"({dict(rejects['synthetic'])})")
        specs = []
    else:
        specs = _source_specs(d)
        if not specs:
            raise UserError("data: no sources (data.sources is empty and data.builtin_corpus.enabled is false)")
        # 1. read + normalise + deduplicate (streamed: of the other shards' conversations only a 16-byte hash stays)
        mine = []                    # {"id", "source", "messages", "hash"} of this shard
        hold: list = []              # heap of (-rank, conversation): the `holdout` lowest seeded ranks, any shard
        seen: set[bytes] = set()
        read_rejects: dict[str, Counter] = defaultdict(Counter)
        read_stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "valid": 0})
        for spec in specs:
            weights[spec.name] = spec.weight
            st = read_stats[spec.name]
            for row in _read_source(spec, d, cfg.seed):
                st["rows"] += 1
                if row.reject:
                    read_rejects[spec.name][row.reject] += 1
                    continue
                msgs = normalise(row.value, spec.format)
                if isinstance(msgs, str):
                    read_rejects[spec.name][msgs] += 1
                    continue
                h = _conv_hash(msgs)
                hb = bytes.fromhex(h[:32])
                if hb in seen:
                    read_rejects[spec.name]["duplicate"] += 1
                    continue
                seen.add(hb)
                st["valid"] += 1
                rid = row.value.get("id") if spec.kind == "builtin" else None
                c = {"id": rid or f"{spec.name}-{row.index}", "source": spec.name, "messages": msgs, "hash": h}
                if d.holdout:
                    item = (_neg(_rank(f"h{cfg.seed}", h)), h, c)
                    (heapq.heappush if len(hold) < d.holdout else heapq.heappushpop)(hold, item)
                if shard_of(h, shards) == shard:
                    mine.append(c)
            if not st["rows"]:
                raise UserError(f"source '{spec.name}': {spec.path} has no rows")
            if not st["valid"]:
                raise UserError(f"source '{spec.name}' ({spec.path}): all {st['rows']} rows rejected "
                                f"({', '.join(f'{k}: {v}' for k, v in read_rejects[spec.name].most_common())})")
        valid = len(seen)
        del seen
        # 2. holdout: the conversations of lowest seeded rank (the same in every shard), written by shard 0
        if d.holdout >= valid:
            raise UserError(f"data.holdout ({d.holdout}) leaves no training conversations (only {valid} valid)")
        held = {h for _, h, _ in hold}
        holdout = []
        if first:
            for _, _, c in sorted(hold, key=lambda x: x[1]):
                a = _first_assistant(c["messages"])
                holdout.append({"id": c["id"], "source": c["source"],
                                "prompt_ids": prompt_ids(tokenizer, c["messages"][:a]),
                                "reference_ids": tokenizer(c["messages"][a]["content"],
                                                           add_special_tokens=False)["input_ids"]})
                stats[c["source"]]["holdout"] += 1
        train_convs = [c for c in mine if c["hash"] not in held]
        del mine, hold
        if first:
            for name, st in read_stats.items():
                stats[name]["rows"] = st["rows"]
                rejects[name].update(read_rejects[name])
        for spec in specs:
            stats[spec.name]
        # 3. regeneration (resumable: finished chunks are kept in the cache folder, keyed by conversation)
        if d.regenerate.enabled and train_convs:
            from dflash.data.regen import regenerate_conversations
            cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(loaded)
            new_msgs, regen = regenerate_conversations(train_convs, tokenizer, cfg, cache_dir, progress=progress,
                                                       shard=shard)
            kept = []
            for c in train_convs:
                r = new_msgs[c["hash"]]
                if isinstance(r, str):
                    rejects[c["source"]][r] += 1
                else:
                    kept.append({**c, "messages": r})
            train_convs = kept
        elif d.regenerate.enabled:
            regen.update(enabled=True, engine=d.regenerate.engine)
        # 4. tokenise, mask, truncate, filter
        stop_strings = _stop_strings(tokenizer)
        per_source: dict[str, list] = defaultdict(list)
        for c in train_convs:
            r = conversation_ids(tokenizer, c["messages"], stop_strings)
            if isinstance(r, str):
                rejects[c["source"]][r] += 1
                continue
            ids, mask = r
            if len(ids) > d.max_length:
                if d.truncation == "drop":
                    rejects[c["source"]]["too_long"] += 1
                    continue
                ids, mask = ids[:d.max_length], mask[:d.max_length]
                stats[c["source"]]["truncated"] += 1
            if sum(mask) < min_sup:
                rejects[c["source"]]["too_few_supervised"] += 1
                continue
            per_source[c["source"]].append({"id": c["id"], "source": c["source"], "input_ids": ids,
                                            "loss_mask": mask, "length": len(ids)})
        # 5. weights
        samples = []
        for spec in specs:
            kept = per_source.get(spec.name, [])
            stats[spec.name]["kept"] = len(kept)
            samples.extend(_weighted(kept, spec.weight, cfg.seed))
    if d.synthetic.enabled:
        stats["synthetic"]["kept"] = len(samples)
    for s in samples:
        stats[s["source"]]["samples"] += 1
    return {"shard": shard, "shards": shards, "samples": samples, "holdout": holdout,
            "stats": {k: dict(v) for k, v in stats.items()}, "rejects": {k: dict(v) for k, v in rejects.items()},
            "weights": weights, "regeneration": regen, "sources": [s.name for s in specs] or ["synthetic"],
            "paths": {s.name: s.path for s in specs}, "seconds": round(time.time() - t_start, 3)}


def write_part(part: dict, out_dir) -> None:
    """A part on disk (the scatter job's output): samples as a datasets folder, everything else in part.json."""
    from datasets import Dataset
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = part["samples"]
    Dataset.from_dict({c: [r[c] for r in rows] for c in shards.COLUMNS}, features=shards.features()) \
        .save_to_disk(str(out_dir / "samples"))
    shards.write_holdout(out_dir / "holdout.jsonl", part["holdout"])
    from dflash.atomic import atomic_write_json
    atomic_write_json(out_dir / "part.json", {k: v for k, v in part.items() if k not in ("samples", "holdout")})


def read_part(folder) -> dict:
    from datasets import load_from_disk
    folder = Path(folder)
    if not (folder / "part.json").is_file():
        raise UserError(f"{folder}: not a data part (no part.json): run `python -m dflash data --shard I/N` first")
    part = json.loads((folder / "part.json").read_text())
    part["samples"] = load_from_disk(str(folder / "samples")).to_list()
    part["holdout"] = shards.read_holdout(folder)
    return part


def finish(loaded, parts: list[dict], out_dir) -> dict:
    """The gather: merge the parts' counts, write the length buckets, holdout.jsonl and the manifest into `out_dir`.
    The content (and its hash) is the same for any number of parts: samples are ordered by a seeded hash of their
    id and every per-row decision is a function of the row."""
    from transformers import AutoConfig

    from dflash.target import load_tokenizer, mask_token_id

    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
                stats[n][k] += v
        for n, rj in p["rejects"].items():
            rejects[n].update(rj)
    regens = [p["regeneration"] for p in parts]
    regen = dict(regens[0])
    if regen.get("enabled"):
        for k in ("tokens", "conversations", "cached"):
            regen[k] = sum(r.get(k, 0) for r in regens)
        regen["seconds"] = round(max(r.get("seconds", 0.0) for r in regens), 3)    # shards run side by side
        regen["tokens_per_s"] = round(regen["tokens"] / max(regen["seconds"], 1e-9), 1)
    paths = parts[0].get("paths", {})
    for n in names:
        if not stats[n]["kept"] and not stats[n]["holdout"]:
            raise UserError(f"source '{n}' ({paths.get(n, n)}): all {stats[n]['rows']} rows rejected "
                            f"({', '.join(f'{k}: {v}' for k, v in rejects[n].most_common())})")
    samples = [s for p in parts for s in p["samples"]]
    holdout = [h for p in parts for h in p["holdout"]]
    if not samples:
        raise UserError("data: no training samples left after filtering and weighting")
    samples.sort(key=lambda s: _rank(cfg.seed, s["id"]))
    holdout.sort(key=lambda s: s["id"])
    min_sup = min_supervised_tokens(cfg)
    few = sum(r.get("too_few_supervised", 0) for r in rejects.values())
    rows = sum(st["rows"] for st in stats.values())
    if few:
        log.warning("%d of %d rows rejected as too_few_supervised: fewer than %d supervised (assistant) tokens = "
                    "data.min_supervised_blocks %s x drafter.block_size %d; lower data.min_supervised_blocks to keep "
                    "them (a row needs supervised tokens past its anchors to train a block)%s", few, rows, min_sup,
                    d.min_supervised_blocks, cfg.drafter.block_size,
                    f"; regenerated responses are cut at data.regenerate.max_new_tokens "
                    f"{d.regenerate.max_new_tokens}" if regen.get("enabled") else "")

    tokenizer = load_tokenizer(cfg.target)
    tconf = AutoConfig.from_pretrained(str(cfg.target.path), trust_remote_code=cfg.target.trust_remote_code)
    vocab_size = int(getattr(tconf, "vocab_size", len(tokenizer)))
    buckets = shards.write_buckets(samples, out_dir, d.bucket_edges, d.shard_rows)
    shards.write_holdout(out_dir / "holdout.jsonl", holdout)
    lengths = [s["length"] for s in samples]
    manifest = {
        "dataset": cfg.dataset_name,
        "content_hash": shards.content_hash(samples, holdout),
        "num_samples": len(samples),
        "total_tokens": int(sum(lengths)),
        "supervised_tokens": int(sum(sum(s["loss_mask"]) for s in samples)),
        "bucket_edges": sorted(int(e) for e in d.bucket_edges),
        "buckets": {str(e): n for e, n in sorted(buckets.items())},
        "length_histogram": shards.length_histogram(lengths, d.max_length),
        "sources": {name: {"rows": st["rows"], "kept": st["kept"], "samples": st["samples"], "holdout": st["holdout"],
                           "truncated": st["truncated"], "weight": parts[0]["weights"].get(name, 1.0),
                           "rejected": dict(sorted(rejects[name].items()))}
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
        "files": shards.file_hashes(out_dir),
        "tokenizer": {"size": len(tokenizer), "vocab_size": vocab_size, "pad_token_id": tokenizer.pad_token_id,
                      "eos_token_id": tokenizer.eos_token_id, "mask_token_id": mask_token_id(tokenizer, vocab_size)},
        "target_path": str(cfg.target.path),
        "seed": cfg.seed,
        "seconds": round(max(p["seconds"] for p in parts) + time.time() - t_start, 3),
        "created_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    from dflash.atomic import atomic_write_json
    atomic_write_json(out_dir / "manifest.json", manifest)
    return manifest
