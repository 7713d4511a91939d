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

def regenerate(model, tokenizer, prompts, max_new_tokens, temperature=0.0, batch_size=32, seed=0, progress=True,
               stop_ids=None):
    """Batched generation with a KV cache and left padding. Returns responses (token ids up to, excluding, the first
    stop token) in the order of `prompts`, and {tokens, seconds, tokens_per_s}."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig

    from dflash.target import stop_token_ids

    stop_ids = stop_token_ids(tokenizer, model) if stop_ids is None else list(stop_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                               temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                               eos_token_id=stop_ids, pad_token_id=pad, use_cache=True)
    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    out: list[list[int] | None] = [None] * len(prompts)
    tokens = 0
    torch.manual_seed(seed)
    t0 = time.time()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    bar = tqdm(batches, desc="regenerate", unit="batch", disable=not progress, mininterval=2.0)
    stop = set(stop_ids)
    with torch.inference_mode():
        for batch in bar:
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            att = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
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
    return out, {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1)}


# ---- the stage ---------------------------------------------------------------------------------------------------

def _conv_hash(messages) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


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


def _read_source(spec: SourceSpec, dcfg, seed) -> list[Row]:
    if spec.kind == "builtin":
        from dflash.data import corpus
        convs = corpus.conversations(dcfg.builtin_corpus.max_conversations, seed=0)
        return [Row("stdlib", i, c) for i, c in enumerate(convs)]
    return list(read_rows(spec))


def _weighted(rows: list[dict], weight: float, rng: random.Random) -> list[dict]:
    n = len(rows)
    m = int(round(weight * n))
    if m == n:
        return list(rows)
    if m < n:
        keep = sorted(rng.sample(range(n), m))
        return [rows[i] for i in keep]
    extra = [dict(rows[rng.randrange(n)]) for _ in range(m - n)]
    seen = Counter()
    for e in extra:
        seen[e["id"]] += 1
        e["id"] = f"{e['id']}#r{seen[e['id']]}"
    return list(rows) + extra


def _check_config(cfg):
    d = cfg.data
    if not d.bucket_edges:
        raise UserError("data.bucket_edges is empty: give at least one length bucket")
    if d.max_length > max(d.bucket_edges):
        raise UserError(f"data.max_length ({d.max_length}) exceeds the largest data.bucket_edges entry "
                        f"({max(d.bucket_edges)}): every kept sample must fit a bucket")


def _synthetic(cfg, tokenizer, vocab_size, stats, rejects):
    import numpy as np
    d = cfg.data
    syn = d.synthetic
    special = set(tokenizer.all_special_ids)
    limit = min(len(tokenizer), vocab_size)
    allowed = np.array([t for t in range(limit) if t not in special], dtype=np.int64)
    rng = np.random.default_rng(cfg.seed)
    min_sup = int(np.ceil(d.min_supervised_blocks * cfg.drafter.block_size))
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


def expand(loaded, out_dir, progress: bool = True, threads: int | None = None) -> dict:
    """Run the whole expansion for a loaded config and write it into `out_dir` (the caller makes it atomic).
    `threads`: torch CPU threads while it runs (restored after; None leaves torch's)."""
    from dflash.data.tiny_target import cpu_threads
    with cpu_threads(threads):
        return _expand(loaded, out_dir, progress)


def _expand(loaded, out_dir, progress):
    from transformers import AutoConfig

    from dflash.target import load_target, load_tokenizer, mask_token_id, resolve_device

    t_start = time.time()
    cfg = loaded.cfg
    d = cfg.data
    _check_config(cfg)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(cfg.target)
    tconf = AutoConfig.from_pretrained(str(cfg.target.path), trust_remote_code=cfg.target.trust_remote_code)
    vocab_size = int(getattr(tconf, "vocab_size", len(tokenizer)))
    block = cfg.drafter.block_size
    min_sup = int(-(-d.min_supervised_blocks * block // 1))
    stats: dict[str, dict] = defaultdict(lambda: {"rows": 0, "kept": 0, "samples": 0, "holdout": 0, "truncated": 0})
    rejects: dict[str, Counter] = defaultdict(Counter)
    regen = {"enabled": False, "tokens": 0, "seconds": 0.0, "tokens_per_s": 0.0}
    weights = {}

    if d.synthetic.enabled:
        stats["synthetic"]
        samples, holdout = _synthetic(cfg, tokenizer, vocab_size, stats, rejects)
        weights["synthetic"] = 1.0
        if not samples:
            raise UserError(f"source 'synthetic': all {stats['synthetic']['rows']} samples rejected "
                            f"({dict(rejects['synthetic'])})")
    else:
        specs = _source_specs(d)
        if not specs:
            raise UserError("data: no sources (data.sources is empty and data.builtin_corpus.enabled is false)")
        # 1. read + normalise + deduplicate
        convs = []                   # {"id", "source", "messages"}
        seen: dict[str, str] = {}
        for spec in specs:
            weights[spec.name] = spec.weight
            st = stats[spec.name]
            rows = _read_source(spec, d, cfg.seed)
            if not rows:
                raise UserError(f"source '{spec.name}': {spec.path} has no rows")
            for row in rows:
                st["rows"] += 1
                if row.reject:
                    rejects[spec.name][row.reject] += 1
                    continue
                msgs = normalise(row.value, spec.format)
                if isinstance(msgs, str):
                    rejects[spec.name][msgs] += 1
                    continue
                h = _conv_hash(msgs)
                if h in seen:
                    rejects[spec.name]["duplicate"] += 1
                    continue
                seen[h] = spec.name
                rid = row.value.get("id") if spec.kind == "builtin" else None
                convs.append({"id": rid or f"{spec.name}-{row.index}", "source": spec.name, "messages": msgs})
            if not any(c["source"] == spec.name for c in convs):
                raise UserError(f"source '{spec.name}' ({spec.path}): all {st['rows']} rows rejected "
                                f"({', '.join(f'{k}: {v}' for k, v in rejects[spec.name].most_common())})")
        # 2. holdout
        if d.holdout >= len(convs):
            raise UserError(f"data.holdout ({d.holdout}) leaves no training conversations (only {len(convs)} valid)")
        hold_idx = set(random.Random(cfg.seed).sample(range(len(convs)), d.holdout))
        holdout = []
        train_convs = []
        for i, c in enumerate(convs):
            if i in hold_idx:
                a = _first_assistant(c["messages"])
                holdout.append({"id": c["id"], "source": c["source"],
                                "prompt_ids": prompt_ids(tokenizer, c["messages"][:a]),
                                "reference_ids": tokenizer(c["messages"][a]["content"], add_special_tokens=False)["input_ids"]})
                stats[c["source"]]["holdout"] += 1
            else:
                train_convs.append(c)
        # 3. regeneration, one round per assistant turn (later turns see the regenerated earlier ones)
        if d.regenerate.enabled:
            device = resolve_device(d.regenerate.device)
            model = load_target(cfg.target, device=device, seed=cfg.seed)
            regen.update(enabled=True, device=device, max_new_tokens=d.regenerate.max_new_tokens,
                         temperature=d.regenerate.temperature)
            pending = {i: [m for m in c["messages"]] for i, c in enumerate(train_convs)}
            done: dict[int, list] = {i: [] for i in pending}
            failed: dict[int, str] = {}
            rnd = 0
            while pending:
                rnd += 1
                todo, prompts = [], []
                for i, msgs in list(pending.items()):
                    a = next((k for k, m in enumerate(msgs) if m["role"] == "assistant"), None)
                    if a is None:
                        del pending[i]
                        continue
                    p = prompt_ids(tokenizer, done[i] + msgs[:a])
                    if len(p) >= d.max_length:
                        if not any(m["role"] == "assistant" for m in done[i]):
                            failed[i] = "prompt_too_long"
                        del pending[i]
                        continue
                    done[i].extend(msgs[:a])
                    pending[i] = msgs[a:]
                    todo.append(i)
                    prompts.append(p)
                if not todo:
                    break
                log.info("regeneration round %d: %d prompts", rnd, len(todo))
                resp, st = regenerate(model, tokenizer, prompts, d.regenerate.max_new_tokens, d.regenerate.temperature,
                                      d.regenerate.batch_size, seed=cfg.seed + rnd, progress=progress)
                regen["tokens"] += st["tokens"]
                regen["seconds"] += st["seconds"]
                for i, r in zip(todo, resp):
                    text = tokenizer.decode(r, skip_special_tokens=True)
                    pending[i] = pending[i][1:]            # drop the original assistant turn
                    if not text.strip():
                        if not any(m["role"] == "assistant" for m in done[i]):
                            failed[i] = "empty_response"
                        del pending[i]
                        continue
                    done[i].append({"role": "assistant", "content": text})
            regen["seconds"] = round(regen["seconds"], 3)
            regen["tokens_per_s"] = round(regen["tokens"] / max(regen["seconds"], 1e-9), 1)
            new = []
            for i, c in enumerate(train_convs):
                if i in failed:
                    rejects[c["source"]][failed[i]] += 1
                    continue
                msgs = done[i]
                while msgs and msgs[-1]["role"] != "assistant":
                    msgs = msgs[:-1]
                new.append({**c, "messages": msgs})
            train_convs = new
            del model
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
            if sum(mask) < max(1, min_sup):
                rejects[c["source"]]["too_few_supervised"] += 1
                continue
            per_source[c["source"]].append({"id": c["id"], "source": c["source"], "input_ids": ids,
                                            "loss_mask": mask, "length": len(ids)})
        # 5. per-source checks and weights
        samples = []
        wrng = random.Random(cfg.seed + 1)
        for spec in specs:
            kept = per_source.get(spec.name, [])
            stats[spec.name]["kept"] = len(kept)
            if not kept and not stats[spec.name]["holdout"]:
                raise UserError(f"source '{spec.name}' ({spec.path}): all {stats[spec.name]['rows']} rows rejected "
                                f"({', '.join(f'{k}: {v}' for k, v in rejects[spec.name].most_common())})")
            samples.extend(_weighted(kept, spec.weight, wrng))
    if d.synthetic.enabled:
        stats["synthetic"]["kept"] = len(samples)
    for s in samples:
        stats[s["source"]]["samples"] += 1
    if not samples:
        raise UserError("data: no training samples left after filtering and weighting")

    # 6. deterministic order, shards, holdout, manifest
    random.Random(cfg.seed + 2).shuffle(samples)
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
                           "truncated": st["truncated"], "weight": weights.get(name, 1.0),
                           "rejected": dict(sorted(rejects[name].items()))}
                    for name, st in stats.items()},
        "holdout": len(holdout),
        "regeneration": regen,
        "max_length": d.max_length,
        "truncation": d.truncation,
        "min_supervised_tokens": min_sup,
        "block_size": block,
        "synthetic": bool(d.synthetic.enabled),
        "tokenizer": {"size": len(tokenizer), "vocab_size": vocab_size, "pad_token_id": tokenizer.pad_token_id,
                      "eos_token_id": tokenizer.eos_token_id, "mask_token_id": mask_token_id(tokenizer, vocab_size)},
        "target_path": str(cfg.target.path),
        "seed": cfg.seed,
        "seconds": round(time.time() - t_start, 3),
        "created_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    from dflash.atomic import atomic_write_json
    atomic_write_json(out_dir / "manifest.json", manifest)
    return manifest
