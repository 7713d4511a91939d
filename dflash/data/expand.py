"""Dataset expansion: sources -> normalised, deduplicated conversations -> (regenerated) -> tokenised with a loss
mask -> filtered -> weighted -> holdout + length-bucketed shards + manifest. Streamed (spill files, Arrow on disk):
memory does not grow with the number of conversations beyond a 16-byte hash each (deduplication).

Public:
- `conversation_ids(tokenizer, messages, stop_strings=None)` -> (input_ids, loss_mask) or reject reason (str)
- `prompt_ids(tokenizer, messages)` -> ids of the chat template up to and including the assistant generation prompt
- `regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=32, seed=0, progress=True,
  stop_ids=None, decoder="auto", compile=True, ignore_eos=False)` -> (responses: list[list[int]] without the stop
  token, stats dict); batch_size 0: `auto_batch_size`; decoder static|generate|auto (`dflash.data.decode`)
- `expand(loaded, out_dir, progress=True, threads=None, cache_dir=None)` -> manifest dict; writes shards,
  holdout.jsonl and manifest.json (= `expand_part` of shard 0/1 + `finish`)
- `expand_part(loaded, shard, nshards, part_dir, cache_dir=None, progress=True)` -> part (the scatter job)
- `read_part(part_dir)` -> part; `finish(loaded, parts, out_dir)` -> manifest (the gather job)
- `shard_of(conv_hash, nshards)`, `default_cache_dir(loaded)`, `min_supervised_tokens(cfg)`
"""
from __future__ import annotations

import datetime as dt
import hashlib
import heapq
import json
import logging
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
               stop_ids=None, decoder="auto", compile=True, ignore_eos=False):
    """Batched generation with a KV cache and left padding, prompts sorted by length (longest first). Returns
    responses (token ids up to, excluding, the first stop token) in the order of `prompts`, and {tokens, seconds,
    tokens_per_s, batch_size, decoder}.

    decoder "generate": transformers `generate` with its dynamic cache. "static": `dflash.data.decode.StaticDecoder`
    (one fixed batch shape, the last batch filled; on GPU with `compile` the decode step is a CUDA graph). "auto":
    static on GPU, generate on CPU. batch_size 0 sizes batches from free GPU memory (`auto_batch_size`).
    `ignore_eos` generates exactly max_new_tokens (benchmarks)."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    from dflash.target import stop_token_ids

    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else list(stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    device = next(model.parameters()).device
    static = decoder == "static" or (decoder == "auto" and device.type == "cuda")
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    longest = len(prompts[order[0]]) if prompts else 1
    need = longest + max_new_tokens
    dec = None
    if static:       # the model's kept decoder if it fits (batch_size 0: whatever its batch), else one of batch_size
        from dflash.data.decode import cache_len, decoder_for
        dec = decoder_for(model, batch_size or None, need, compile)
    if not batch_size and dec is None:
        width = cache_len(need) - max_new_tokens if static else longest
        batch_size = auto_batch_size(model, width, max_new_tokens, memory_fraction=0.6)
        if static and prompts:                          # equal batches (the last one is filled to the fixed shape)
            batch_size = -(-len(prompts) // -(-len(prompts) // max(1, batch_size)))
        log.info("regeneration batch size %d (from free GPU memory)", batch_size)
        if static:
            dec = decoder_for(model, batch_size, need, compile)
    if static:
        batch_size = dec.B
        gen_g = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    else:
        gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                   temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                                   eos_token_id=None if ignore_eos else stop_ids, pad_token_id=pad, use_cache=True)
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
            width = max(len(prompts[i]) for i in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            att = torch.zeros((len(rows), width), dtype=torch.long)
            for r, i in enumerate(rows):
                p = prompts[i]
                ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
                att[r, width - len(p):] = 1
            if static:
                gen = dec.generate(ids, att, max_new_tokens, stop, temperature, gen_g).cpu()
            else:
                gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device),
                                     generation_config=gen_cfg)[:, width:].cpu()
            for r, i in enumerate(batch):
                seq = gen[r].tolist()
                cut = next((k for k, t in enumerate(seq) if t in stop), None)
                out[i] = seq[:cut] if cut is not None else seq
                tokens += (cut + 1) if cut is not None else len(seq)
            bar.set_postfix(tok_s=f"{tokens / max(time.time() - t0, 1e-9):.0f}")
    seconds = time.time() - t0
    return out, {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
                 "batch_size": batch_size, "decoder": "static" if static else "generate",
                 "attn_implementation": dec.attn if static else model.config._attn_implementation}


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


BUILTIN_SOURCES = {"stdlib": "builtin_corpus", "code": "code_completion"}   # source name: the data section enabling it


def _source_specs(dcfg) -> list[SourceSpec]:
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


def _read_source(spec: SourceSpec, cfg):
    if spec.kind == "builtin" and spec.name == "code":
        from dflash.data import code_corpus
        convs = code_corpus.heldout_conversations(cfg.target.pretrain, cfg.data.code_completion.max_conversations,
                                                  processes=_num_proc(cfg.data))
        return (Row("code", i, c) for i, c in enumerate(convs))
    if spec.kind == "builtin":
        from dflash.data import corpus
        convs = corpus.conversations(cfg.data.builtin_corpus.max_conversations, seed=0)
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
    from dflash import paths
    from dflash.data.regen import cache_key
    return Path(f"{paths.dataset(loaded.cfg.results_dir, loaded.cfg.dataset_name)}.regen") / cache_key(loaded.cfg)


def expand(loaded, out_dir, progress: bool = True, threads: int | None = None, cache_dir=None) -> dict:
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


def _num_proc(d) -> int:
    import os
    return d.num_proc or os.cpu_count() or 1


def _tokenise_batch(batch, tokenizer, stop_strings, max_length, truncation, min_sup):
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


def _weight_batch(batch, weights, seed):
    """datasets.map function: each row repeated as `_weighted` says (the row count changes)."""
    rows = [dict(zip(batch, vals)) for vals in zip(*batch.values())]
    out = []
    for r in rows:
        out.extend(_weighted([r], weights[r["source"]], seed))
    return {k: [r[k] for r in out] for k in batch}


def expand_part(loaded, shard: int, nshards: int, part_dir, cache_dir=None, progress: bool = True) -> dict:
    """One shard of the expansion, written into `part_dir` (samples/ datasets folder, holdout.jsonl, part.json).

    Every shard reads and deduplicates all sources (cheap; the same result in each), then regenerates and tokenises
    only its conversations (`shard_of`). Streamed: the shard's conversations go to a spill file, regeneration works
    chunk by chunk, tokenising is a `datasets.map` over Arrow on disk (data.num_proc processes); what stays in memory
    is a 16-byte hash per conversation (deduplication) and the holdout. Read-level counts (rows, read rejects,
    duplicates, holdout) are recorded by shard 0 only, so parts add up. Returns `read_part(part_dir)`."""
    import datasets
    from datasets import Dataset
    from transformers import AutoConfig

    from dflash.target import load_tokenizer

    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    _check_config(cfg)
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


def _expand_sources(loaded, specs, shard, nshards, work, cache_dir, tokenizer, min_sup, stats, rejects, weights,
                    regen, progress):
    """The conversation path of `expand_part`: returns (holdout rows, samples Dataset)."""
    from datasets import Dataset, Features, Value

    cfg = loaded.cfg
    d = cfg.data
    first = shard == 0
    # 1. read + normalise + deduplicate; this shard's conversations go to a spill file
    spill = _Spill(work / "convs.jsonl")
    hold: list = []              # heap of (-rank, hash, conversation): the `holdout` lowest seeded ranks, any shard
    seen: set[bytes] = set()
    read_rejects: dict[str, Counter] = defaultdict(Counter)
    read_stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "valid": 0})
    for spec in specs:
        weights[spec.name] = spec.weight
        st = read_stats[spec.name]
        for row in _read_source(spec, cfg):
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
            c = {"id": rid or f"{spec.name}-{row.index}", "source": spec.name, "hash": h, "messages": msgs}
            if d.holdout:
                item = (_neg(_rank(f"h{cfg.seed}", h)), h, c)
                (heapq.heappush if len(hold) < d.holdout else heapq.heappushpop)(hold, item)
            if shard_of(h, nshards) == shard:
                spill.add(c)
        if not st["rows"]:
            raise UserError(f"source '{spec.name}': {spec.path} has no rows")
        if not st["valid"]:
            raise UserError(f"source '{spec.name}' ({spec.path}): all {st['rows']} rows rejected "
                            f"({', '.join(f'{k}: {v}' for k, v in read_rejects[spec.name].most_common())})")
    spill.close()
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
            holdout.append({"id": c["id"], "source": c["source"], "prompt_ids": prompt_ids(tokenizer, c["messages"][:a]),
                            "reference_ids": tokenizer(c["messages"][a]["content"], add_special_tokens=False)["input_ids"]})
            stats[c["source"]]["holdout"] += 1
        for name, st in read_stats.items():
            stats[name]["rows"] = st["rows"]
            rejects[name].update(read_rejects[name])
    for spec in specs:
        stats[spec.name]
    del hold
    # 3. regeneration (resumable: finished chunks are kept in the cache folder, keyed by conversation)
    train = _Spill(work / "train.jsonl")
    convs = (c for c in spill if c["hash"] not in held)
    if d.regenerate.enabled:
        from dflash.data.regen import regenerate_stream
        cache_dir = Path(cache_dir) if cache_dir else default_cache_dir(loaded)
        for c, r in regenerate_stream(convs, spill.n, tokenizer, cfg, cache_dir, regen,
                                      progress=progress, shard=shard):
            if isinstance(r, str):
                rejects[c["source"]][r] += 1
            else:
                train.add({"id": c["id"], "source": c["source"], "messages": json.dumps(r, ensure_ascii=False)})
    else:
        for c in convs:
            train.add({"id": c["id"], "source": c["source"], "messages": json.dumps(c["messages"], ensure_ascii=False)})
    train.close()
    # 4. tokenise, mask, truncate, filter: datasets.map over Arrow on disk, data.num_proc processes
    feats = Features({"id": Value("string"), "source": Value("string"), "messages": Value("string")})
    out_feats = Features({**shards.features(), "reject": Value("string"), "truncated": Value("bool")})
    if train.n:
        ds = Dataset.from_generator(_spill_rows, features=feats, gen_kwargs={"path": str(train.path)},
                                    cache_dir=str(work / "hf"), writer_batch_size=1000)
        nproc = min(_num_proc(d), max(1, train.n // 256))
        ds = ds.map(_tokenise_batch, batched=True, batch_size=256, num_proc=nproc if nproc > 1 else None,
                    remove_columns=["messages"], features=out_feats, desc="tokenise",
                    cache_file_name=str(work / "tokenised.arrow"),
                    fn_kwargs={"tokenizer": tokenizer, "stop_strings": _stop_strings(tokenizer),
                               "max_length": d.max_length, "truncation": d.truncation, "min_sup": min_sup})
    else:   # nothing left to tokenise (every conversation rejected above): the gather names the rejects
        ds = Dataset.from_dict({k: [] for k in out_feats}, features=out_feats)
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
    ds = ds.remove_columns(["reject", "truncated"])
    # 5. weights: a per-row rule (`_weighted`), so any split into shards gives the same rows
    if any(w != 1.0 for w in weights.values()) and len(ds):
        ds = ds.map(_weight_batch, batched=True, batch_size=1024, fn_kwargs={"weights": weights, "seed": cfg.seed},
                    features=shards.features(), cache_file_name=str(work / "weighted.arrow"))
    return holdout, ds


# what to change when every row is rejected for a reason (the data stage's one-line error says it)
REMEDY = {"empty_response": "the target regenerated empty answers: is it trained? (data.regenerate.enabled: false "
                            "keeps the sources' answers)",
          "too_few_supervised": "lower data.min_supervised_blocks",
          "too_long": "raise data.max_length or set data.truncation: truncate",
          "prompt_too_long": "raise data.max_length"}


def _reasons(counts: Counter) -> str:
    """"empty_response: 268: <remedy>, duplicate: 3": each reject reason with its count and what to change."""
    return ", ".join(f"{k}: {v}" + (f": {REMEDY[k]}" if k in REMEDY else "") for k, v in counts.most_common())


def read_part(folder) -> dict:
    """A part folder: part.json's fields, "samples" (a memory-mapped datasets.Dataset) and "holdout" (rows)."""
    from datasets import load_from_disk
    folder = Path(folder)
    if not (folder / "part.json").is_file():
        raise UserError(f"{folder}: not a data part (no part.json): run `python -m dflash data --shard I/N` first")
    part = json.loads((folder / "part.json").read_text())
    part["samples"] = load_from_disk(str(folder / "samples"))
    part["holdout"] = shards.read_holdout(folder)
    return part


def _rank_batch(ids, seed):
    return {"rank": [int(_rank(seed, i)[:15], 16) for i in ids]}


def finish(loaded, parts: list[dict], out_dir) -> dict:
    """The gather: merge the parts' counts, write the length buckets, holdout.jsonl and the manifest into `out_dir`.
    The content (and its hash) is the same for any number of parts: samples are ordered by a seeded hash of their
    id and every per-row decision is a function of the row. Streamed: Arrow on disk, sorted through an index."""
    import shutil

    import datasets
    import pyarrow.compute as pc
    from datasets import concatenate_datasets
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
                            f"({_reasons(rejects[n])})")
    if not any(stats[n]["kept"] for n in names):
        raise UserError("data: no row left to train on: " + "; ".join(
            f"source '{n}' ({paths.get(n, n)}): {stats[n]['rows']} rows, {stats[n]['holdout']} held out, all others "
            f"rejected ({_reasons(rejects[n])})" for n in names))
    holdout = sorted((h for p in parts for h in p["holdout"]), key=lambda s: s["id"])
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
        buckets = shards.write_buckets_ds(ordered, out_dir, d.bucket_edges, d.shard_rows, work)
        lengths, total, supervised = [], 0, 0
        for b in ds.select_columns(["length", "loss_mask"]).iter(batch_size=4096):
            lengths.extend(b["length"])
            total += sum(b["length"])
            supervised += sum(sum(m) for m in b["loss_mask"])
        chash = shards.content_hash_ds(ds.select(by_id, indices_cache_file_name=str(work / "by-id.arrow")), holdout)
        num_samples = len(ds)
        del ds, ordered
    finally:
        if bars:
            datasets.enable_progress_bars()
        shutil.rmtree(work, ignore_errors=True)
    shards.write_holdout(out_dir / shards.HOLDOUT, holdout)
    manifest = {
        "dataset": cfg.dataset_name,
        "content_hash": chash,
        "num_samples": num_samples,
        "total_tokens": int(total),
        "supervised_tokens": int(supervised),
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
        "tokenizer": {"size": len(tokenizer), "vocab_size": vocab_size, "pad_token_id": tokenizer.pad_token_id,
                      "eos_token_id": tokenizer.eos_token_id, "mask_token_id": mask_token_id(tokenizer, vocab_size)},
        "target_path": str(cfg.target.path),
        "seed": cfg.seed,
        "seconds": round(max(p["seconds"] for p in parts) + time.time() - t_start, 3),
        "created_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    return shards.write_manifest(out_dir, manifest)   # + the file hashes and its own hash
