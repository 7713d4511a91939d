"""Regeneration throughput of the `hf` engine (dflash.data.generate.regenerate): generated tokens per second.

    python bench/regen.py --out bench/results/regen.json                      # H200: Qwen3-8B-shaped, 512 x 256
    python bench/regen.py --out /tmp/regen.json --variants generate-128,static-256,cb
    python bench/regen.py --out /tmp/regen.json --tiny                        # CPU: tiny target, small numbers

A random Qwen3-8B-shaped target (config/h200.yaml's `target.arch`, `build: random`, bf16), prompts of random
tokens with lengths cycling --prompt-lengths, greedy, exactly --new-tokens per prompt (stop tokens ignored, so
every variant generates the same count). Each variant runs once on all prompts with 16 new tokens (warm-up: compiles,
CUDA graph capture and allocator growth happen there), then on all prompts with --new-tokens, timed. Variants:
  generate-N | generate-auto   transformers generate, dynamic KV cache, batch N (auto: from free GPU memory)
  static-N | static-auto       dflash.data.decode.StaticDecoder: static KV cache, one fixed batch shape, the decode
                               step compiled and replayed as a CUDA graph (the `hf` engine's default on GPU)
  static-N-eager               the same decode loop without compiling
  static-N[-eager][-prefillR][-flex|-sdpa][-fit][-cprefill|-eprefill][-noprologue]
                               with the decoder's options (issue 28): -prefillR: the prefill in chunks of R prompts of
                               similar length, each only as wide as its longest prompt (the default since r7: R 64;
                               -prefill0: the whole batch at once, the decoder before r7); -flex | -sdpa: decode
                               attention `grouped_flex` (flex_attention over only the 128-slot KV blocks holding
                               slots a row sees: no block of left padding, none not yet written; the default under
                               CUDA graphs since 2026-12-02, when it ran at 1.24x -sdpa) | `grouped_sdpa` (one cuDNN
                               kernel over the whole static cache; the default before, and on the CPU); flex's block
                               lists are built inside the step (any/all/sum/argsort kernels: the profile groups them
                               as elementwise, sampling or other, not attention: compare step totals);
                               -fit: the cache sized to each batch (`fit_cache`), not to the first (longest) one:
                               shows only with several batches of different widths, e.g. --prompts 2048 at batch 512
                               (the warm-up then generates all --new-tokens, so every batch's length is compiled);
                               -cprefill: the row-chunk prefill compiled (`compile_prefill`: one dynamic-shape
                               graph for every chunk; the warm-up compiles it, so the timed pass does not; refused
                               with -eager or -prefill0, where there is no compiled row-chunk prefill; the default
                               on GPU since 2026-12-03, when it ran at 1.105x the eager one) | -eprefill: eager (the
                               default before);
                               -noprologue: compiled with Inductor's prologue fusion off (`prologue_fusion=False`:
                               r7's flex failure was in a template with the step's RoPE and norm fused into it;
                               the flex decode compiled with it on the H200 on 2026-12-02)
  cb                           transformers continuous batching (`generate_batch`, paged attention; GPU only:
                               on CPU it did not finish 16 x 8 tokens in 8 minutes)
  hfstatic-N[-forward|-eager][-gqa]
                               transformers' own static-cache generate (`cache_implementation="static"`), batch N,
                               greedy, the same sorted, left-padded, filled batches and the same cache length as
                               static-N. Plain: generate compiles its decode step itself (transformers 5.17 does so for
                               a static cache on GPU: `compile_config=CompileConfig(fullgraph=True,
                               mode="reduce-overhead")`, prefill eager). -forward: the documented recipe,
                               `model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`
                               (prefill compiled too), generate's own compile off. -eager: no compile (CPU).
                               -gqa: with our grouped decode attention instead of transformers' sdpa
A static-N variant's decoder is made before the warm-up for the timed pass's length, so the warm-up compiles and
records what the timed pass replays.
The JSON (written after every variant, so a timeout keeps what finished) holds bench/common.py's envelope (the
command, date, device, versions, the tree), the config, and per variant: tokens, seconds, tokens/s, ms per decode step (the
wall time over batches x new tokens: the prefill included), peak GPU memory, or the error. Every variant but the
reference (the first static-* listed, else the first listed) also gets `greedy_vs`: the count of its sequences
identical token for token to the reference's (`identical_sequences` of `sequences`) and the mean length of their
common prefix (on the random bf16 target any change of kernel changes some argmax: a prefix of tens of tokens is
rounding, a prefix near 0 a broken decoder). Static variants also get `phases` (the timed pass, CUDA events):
prefill_ms per batch, decode_step_ms (the CUDA graph replay), between_steps_ms (the loop's bookkeeping and its stop
check's sync), prefill_share of the pass, decode_tokens_per_s. `--profile V1,V2` (static variants) adds `profile`:
torch.profiler over one batch with --profile-steps decode steps after the timed pass, reduced by
`bench.traces.step_table` (per decode step: ms per group gemm / attention / elementwise+copies / sampling / other
and the top kernels, over the steps whose kernels the trace holds: steps_with_work of steps; outside the steps: the
prefill and the loop's bookkeeping), the chrome trace kept gzipped beside the JSON
(`<out>-profile-<variant>.trace.json.gz`, git-ignored) when under 15 MiB (the device returns files up to 16).

Where a static-512 pass goes on the H200 (r7, `bench/results/2026-12-01-h200-r7/`): with the whole-batch prefill
(`-prefill0`) 7,413 tok/s, the prefill 8.5 s of the 17.7 s pass, 255 decode steps of 35.9 ms; a decode step is 22.6 ms
of attention (one cuDNN flash kernel per layer reading the whole static cache) and 10.7 ms of GEMMs (near the bf16
ceiling); the default 64-row prefill: 9,206 tok/s, prefill 5.2 s. The -flex variant's kernel failed to compile there.

On 2026-12-02 (`bench/results/2026-12-02-h200-quality-regen/`), two batches of 512 (1024 prompts cycling 128-512
tokens, sorted by `regenerate`: widths 512 and 256), 256 new tokens each: static-512 with grouped sdpa 9,275 tok/s
(decode step 34.9 ms, prefill 5.18 s per batch), with flex 11,472 tok/s (decode step 24.3 ms, the same prefill, now
46% of the pass).

On 2026-12-03 (`bench/results/2026-12-03-h200-r8/`), the same 2 x 512 prompts, the command:

    bash bench/device_wheels.sh   # here, once: .whl/ for the device's carry
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \\
      timeout 500 python3 bench/regen.py --out $OUT/regen.json --prompts 1024 \\
        --variants static-512,static-512-cprefill,static-512-prefill128 --profile static-512 > $OUT/regen.log 2>&1

static-512 (flex, the eager prefill then: now `-eprefill`) 11,156 tok/s (prefill 5.29 s per batch, decode step
25.1 ms); -cprefill **12,332** (prefill 4.17 s; warm-up 180 s against 77 s), now the default on GPU; -prefill128
11,179 (no gain over 64 rows). The decode step (profile): 23.0 ms = GEMMs 11.2 + attention 9.9 + elementwise 1.7.

Each generate call of an hfstatic variant allocates a fresh StaticCache (transformers' behaviour without a passed
`past_key_values`), so the timed pass may re-record the CUDA graph once; the warm-up pass uses the same cache length,
so it does not recompile.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import Record, Stopwatch  # noqa: E402
from bench.traces import TRACE_SUFFIX  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "vocab_size": 384, "max_position_embeddings": 1024,
        "rope_theta": 10000.0}


def h200_arch() -> dict:
    """config/h200.yaml's `target.arch` (the Qwen3-8B shape)."""
    from bench import shapes
    return shapes.load(shapes.H200).arch.model_dump()


def build(arch: dict, device: str, dtype: str, folder: Path):
    """The random target: config + the tiny tokenizer written by the `target` stage's code, weights made on device."""
    from dflash.config import from_dict
    from dflash.data.tiny_target import build_target
    from dflash.target import load_target, load_tokenizer
    loaded = from_dict({"target": {"path": str(folder), "build": "random", "dtype": dtype, "arch": arch}})
    build_target(loaded.cfg.target, folder, corpus_size=200, progress=False)
    return load_target(loaded.cfg.target, device=device, seed=0), load_tokenizer(loaded.cfg.target)


def make_prompts(tokenizer, vocab: int, n: int, lengths: list[int], seed=0) -> list[list[int]]:
    import torch
    special = set(tokenizer.all_special_ids)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        out.append([t if t not in special else t + 1 for t in ids])
    return out


def parse_variant(v: str) -> dict:
    if v == "cb":
        return {"name": v, "kind": "cb"}
    parts = v.split("-")
    if parts[0] == "hfstatic":
        flags = parts[2:]
        if len(parts) < 2 or not parts[1].isdigit() or len(set(flags)) != len(flags) \
                or not set(flags) <= {"forward", "eager", "gqa"} or {"forward", "eager"} <= set(flags):
            raise SystemExit(f"--variants: {v!r} is not hfstatic-N[-forward|-eager][-gqa]")
        return {"name": v, "kind": "hfstatic", "batch": int(parts[1]), "gqa": "gqa" in flags,
                "compile": "forward" if "forward" in flags else "eager" if "eager" in flags else "generate"}
    from dflash.data.decode import FLEX, GQA
    flags, options = parts[2:], {}
    for f in flags if parts[0] == "static" else ():
        if f in ("flex", "sdpa") and "attention" not in options:
            options["attention"] = FLEX if f == "flex" else GQA
        elif f.startswith("prefill") and f[len("prefill"):].isdigit():
            options["prefill_rows"] = int(f[len("prefill"):])
        elif f == "fit":
            options["fit_cache"] = True
        elif f in ("cprefill", "eprefill") and "compile_prefill" not in options:
            options["compile_prefill"] = f == "cprefill"
    if options.get("compile_prefill") and ("eager" in flags or options.get("prefill_rows") == 0):
        raise SystemExit(f"--variants: {v!r}: -cprefill compiles the row-chunk prefill, which -eager and -prefill0 "
                         "do not run")
    inductor = {"prologue_fusion": False} if "noprologue" in flags and parts[0] == "static" else {}
    if parts[0] not in ("generate", "static") or len(parts) < 2 or not (parts[1].isdigit() or parts[1] == "auto") \
            or len(set(flags)) != len(flags) or len(flags) != ("eager" in flags) + len(options) + len(inductor):
        raise SystemExit(f"--variants: {v!r} is not generate-N, generate-auto, static-N|auto[-eager][-prefillR]"
                         "[-flex|-sdpa][-fit][-cprefill|-eprefill][-noprologue], hfstatic-N[-forward|-eager][-gqa]"
                         " or cb")
    return {"name": v, "kind": "generate", "decoder": parts[0], "batch": 0 if parts[1] == "auto" else int(parts[1]),
            "compile": "eager" not in flags, "options": options, "inductor": inductor}


def hf_static(model, prompts, new_tokens, batch, pad, compile, cache_len, compile_config=None):
    """transformers' static-cache generate over the prompts as `regenerate` batches them for the static decoder
    (sorted longest first, left-padded, the last batch filled to the fixed shape), greedy, exactly new_tokens each
    (no EOS), the static cache `cache_len` long in every call. compile "generate": generate compiles its decode
    step with `compile_config` (default: fullgraph, reduce-overhead); else it compiles nothing itself.
    Returns (tokens, sequences in prompt order)."""
    import torch
    from transformers import CompileConfig

    from dflash.data.generate import _left_padded
    device = next(model.parameters()).device
    kw = dict(max_new_tokens=new_tokens, do_sample=False, temperature=None, top_k=None, top_p=None,
              eos_token_id=None, pad_token_id=pad, use_cache=True, cache_implementation="static",
              max_cache_len=cache_len, disable_compile=compile != "generate")
    if compile == "generate":
        kw["compile_config"] = compile_config or CompileConfig(fullgraph=True, mode="reduce-overhead")
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    out, tokens = [None] * len(prompts), 0
    with torch.inference_mode():
        for k in range(0, len(order), batch):
            rows = order[k:k + batch]
            ids, att = _left_padded(prompts, rows + [rows[-1]] * (batch - len(rows)), pad)
            gen = model.generate(input_ids=ids.to(device), attention_mask=att.to(device), **kw)[:, ids.shape[1]:]
            gen = gen.cpu()
            for r, i in enumerate(rows):
                out[i] = gen[r].tolist()
                tokens += len(out[i])
    return tokens, out


def greedy_vs(seqs, ref) -> dict:
    """How many sequences are identical token for token, and the mean common prefix length."""
    def prefix(a, b):
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"identical_sequences": sum(a == b for a, b in zip(seqs, ref)), "sequences": len(ref),
            "mean_common_prefix": round(sum(prefix(a, b) for a, b in zip(seqs, ref)) / max(1, len(ref)), 2)}


class PhaseClock:
    """The static decoders' time, split: per generate call the prefill (from the call to its first decode step: the
    mask and cache set-up and the prompt's forward), each decode step (the compiled step: a CUDA graph replay) and
    each gap between steps (the loop's bookkeeping, the stop check's host sync every check_every steps). CUDA events
    on a GPU (no sync until `summary`), the wall clock on the CPU. Each step is also a `decode_step` profiler range
    (for `bench.traces.step_table`). It hooks StaticDecoder.generate, so every decoder of the pass is timed (-fit
    makes one per cache length), until `close`."""

    def __init__(self, cuda: bool, batch: int):
        import torch

        from dflash.data.decode import StaticDecoder
        self.cuda, self.calls, self.B, self.wrapped = cuda, [], batch, {}   # wrapped: decoder -> its own step
        real = StaticDecoder.generate

        def timed_generate(dec, *a, **kw):
            if dec not in self.wrapped:
                step = self.wrapped[dec] = dec._greedy

                def timed_step(*sa, **skw):
                    self.calls[-1].append(self._mark())
                    with torch.profiler.record_function("decode_step"):
                        out = step(*sa, **skw)
                    self.calls[-1].append(self._mark())
                    return out
                dec._greedy = timed_step
            self.calls.append([self._mark()])
            return real(dec, *a, **kw)
        StaticDecoder.generate = timed_generate
        self._real = real

    def close(self) -> None:
        """StaticDecoder.generate and every timed decoder's step as they were."""
        from dflash.data.decode import StaticDecoder
        StaticDecoder.generate = self._real
        for dec, step in self.wrapped.items():
            if dec._greedy is not None:      # not closed meanwhile
                dec._greedy = step
        self.wrapped.clear()

    def _mark(self):
        import torch
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def summary(self) -> dict:
        """ms: prefill per call, decode step and gap between steps (mean and median), decode-only tokens/s."""
        import statistics

        import torch
        if self.cuda:
            torch.cuda.synchronize()
        prefill, steps, gaps = [], [], []
        for marks in (m for m in self.calls if len(m) > 1):
            t = [marks[0].elapsed_time(x) if self.cuda else 1e3 * (x - marks[0]) for x in marks]   # ms from the call
            prefill.append(t[1])
            steps += [b - a for a, b in zip(t[1::2], t[2::2])]
            gaps += [b - a for a, b in zip(t[2::2], t[3::2])]
        if not steps:
            return {"calls": len(self.calls), "decode_steps": 0}
        step, gap = statistics.fmean(steps), statistics.fmean(gaps) if gaps else 0.0
        total = sum(prefill) + sum(steps) + sum(gaps)
        return {"calls": len(prefill), "decode_steps": len(steps), "prefill_ms": round(statistics.fmean(prefill), 2),
                "decode_step_ms": round(step, 3), "decode_step_ms_median": round(statistics.median(steps), 3),
                "between_steps_ms": round(gap, 3), "prefill_share": round(sum(prefill) / total, 4),
                "decode_tokens_per_s": round(1e3 * self.B / (step + gap), 1)}


def profile_decode(go, prompts, batch, steps, trace_out: Path) -> dict:
    """torch.profiler (CPU, and CUDA on a GPU) over one generate call of `batch` prompts with `steps` decode steps,
    after the variant's timed pass (compiled, graphs recorded), reduced by `bench.traces.step_table`; the chrome
    trace is kept gzipped at `trace_out` when under `bench.traces.KEEP_MB` (bench.traces.keep)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench import traces
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        with profile(activities=acts) as prof:
            go(prompts[:batch], steps + 1)                          # the prefill's token, then `steps` decode steps
        prof.export_chrome_trace(str(raw))
        res = {"steps_asked": steps, "table": traces.step_table(raw, "decode_step")}
        with open(raw, "rb") as f, gzip.open(Path(tmp) / "trace.json.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        res.update(traces.keep(Path(tmp) / "trace.json.gz", trace_out))
    return res


def run_variant(model, tokenizer, prompts, new_tokens, var, device, profile_steps=0, trace_out=None):
    """The variant's warm-up, timed pass and profile, under its Inductor settings (-noprologue)."""
    import torch._inductor.config
    with torch._inductor.config.patch(var.get("inductor") or {}):
        return _run_variant(model, tokenizer, prompts, new_tokens, var, device, profile_steps, trace_out)


def _run_variant(model, tokenizer, prompts, new_tokens, var, device, profile_steps=0, trace_out=None):
    import torch

    from dflash.data.decode import decoder_for, kept, release
    from dflash.data.generate import regenerate
    cuda = device.startswith("cuda")
    release(model)                              # the previous variant's decoder: each variant sizes its own
    torch._dynamo.reset()                       # and compiles its own: no graph (static or, after a second cache
    #                                             length, dynamic) nor Inductor setting carried over from another
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    attn = [model.config._attn_implementation]
    if var["kind"] == "cb":
        from transformers import GenerationConfig
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=tokenizer.pad_token_id)

        def go(ps, new):
            gen.max_new_tokens = new
            t = time.time()
            res = model.generate_batch(inputs=ps, generation_config=gen, progress_bar=False)
            if cuda:
                torch.cuda.synchronize()
            return sum(len(r.generated_tokens) for r in res.values()), time.time() - t, None, None
    elif var["kind"] == "hfstatic":
        from dflash.data.decode import GQA, _register, cache_len
        for a in ("_compiled_call", "_last_compile_config", "_previous_max_cache_length"):
            model.__dict__.pop(a, None)        # a previous variant's compiled call or cache length: start afresh
        prev = model.config._attn_implementation
        if var["gqa"]:
            _register()
        attn[0] = GQA if var["gqa"] else prev
        length = cache_len(max(len(q) for q in prompts) + new_tokens)    # the static decoder's length for these
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) \
            if var["compile"] == "forward" else None

        def go(ps, new):
            t = time.time()
            if attn[0] != prev:
                model.set_attn_implementation(attn[0])
            if compiled is not None:
                model.forward = compiled
            try:
                tokens, seqs = hf_static(model, ps, new, var["batch"], tokenizer.pad_token_id, var["compile"], length)
            finally:
                if attn[0] != prev:
                    model.set_attn_implementation(prev)
                model.__dict__.pop("forward", None)      # the class's forward again (the compiled one is cached)
            if cuda:
                torch.cuda.synchronize()
            return tokens, time.time() - t, var["batch"], seqs
    else:
        def go(ps, new):
            t = time.time()
            seqs, st = regenerate(model, tokenizer, ps, new, 0.0, var["batch"], progress=False,
                                  decoder=var["decoder"], compile=var["compile"], ignore_eos=True,
                                  static_options=var["options"])
            if cuda:
                torch.cuda.synchronize()
            attn[0] = st["attn_implementation"]
            return st["tokens"], time.time() - t, st["batch_size"], seqs
    static = var.get("decoder") == "static"
    fit = static and var["options"].get("fit_cache", False)
    need = max(len(q) for q in prompts) + new_tokens
    if static and var["batch"] and not fit:     # the timed pass's length: the warm-up compiles what it runs
        decoder_for(model, var["batch"], need, var["compile"], **var["options"])
    # warm-up: the same batches, fewer tokens (-fit: all of them, so each batch's cache length is compiled; the timed
    # pass still records each length's CUDA graph again, on a new cache: in its mean step, not its median)
    _, warm_s, _, _ = go(prompts, new_tokens if fit else min(16, new_tokens))
    dec = kept(model) if static else None        # the warm-up's decoder (-fit: its last one): the batch size
    clock = PhaseClock(cuda, dec.B) if dec is not None else None
    try:
        return _timed(go, prompts, new_tokens, var, attn, clock, cuda, warm_s, profile_steps, trace_out)
    finally:
        if clock is not None:
            clock.close()


def _timed(go, prompts, new_tokens, var, attn, clock, cuda, warm_s, profile_steps, trace_out):
    """The variant's timed pass, then its phases and profile (after: their failure does not cost it its result)."""
    import torch
    tokens, seconds, bs, seqs = go(prompts, new_tokens)
    batches = -(-len(prompts) // bs) if bs else None
    res = {"variant": var["name"], "batch_size": bs, "tokens": tokens, "seconds": round(seconds, 3),
           "attn_implementation": attn[0], **({"options": var["options"]} if var.get("options") else {}),
           "tokens_per_s": round(tokens / seconds, 1), "warmup_s": round(warm_s, 3),
           "ms_per_decode_step": round(1000 * seconds / (batches * new_tokens), 2) if batches else None,
           "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}
    if clock is not None:
        res["phases"] = _guarded(clock.summary)
    if profile_steps:
        if clock is None:
            res["profile"] = {"error": "--profile: only a static-N variant's decode steps are profiled"}
        else:
            res["profile"] = _guarded(profile_decode, go, prompts, bs, profile_steps, trace_out)
    return res, seqs


def _guarded(fn, *args):
    """fn(*args), or {"error": ...}: what comes after a variant's timed pass does not cost it its result."""
    try:
        return fn(*args)
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:500]}"}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny random target, 16 prompts x 8 tokens")
    p.add_argument("--prompts", type=int, default=None, help="prompts (default 512; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 256; tiny 8)")
    p.add_argument("--prompt-lengths", default=None, help="comma list cycled over prompts (default 128,256,384,512)")
    p.add_argument("--variants", default=None,
                   help="comma list (default static-128,static-256,static-auto,generate-128; tiny generate-4,static-4-eager)")
    p.add_argument("--device", default=None, help="default cuda (tiny: cpu)")
    p.add_argument("--profile", default="", help="comma list of static-N variants (of --variants) to profile: "
                   "torch.profiler over one batch with --profile-steps decode steps after the timed pass")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps in a profile (default 8)")
    args = p.parse_args(argv)
    tiny = args.tiny
    device = args.device or ("cpu" if tiny else "cuda")
    n = args.prompts or (16 if tiny else 512)
    new = args.new_tokens or (8 if tiny else 256)
    lengths = [int(x) for x in (args.prompt_lengths or ("8,12,16" if tiny else "128,256,384,512")).split(",")]
    variants = [parse_variant(v) for v in (args.variants or ("generate-4,static-4-eager" if tiny else
                                                             "static-128,static-256,static-auto,generate-128")).split(",")]
    profiled = set(filter(None, args.profile.split(",")))
    if profiled - {v["name"] for v in variants}:
        raise SystemExit(f"--profile: {sorted(profiled - {v['name'] for v in variants})} not in --variants")
    arch = TINY if tiny else h200_arch()
    dtype = "float32" if device == "cpu" else "bfloat16"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = Record(out, argv)
    if not device.startswith("cuda"):
        report["device"] = "cpu"   # the device generating, not the first GPU of the machine
    report.update(config={"arch": arch, "dtype": dtype, "prompts": n, "new_tokens": new, "prompt_lengths": lengths,
                          "greedy": True, "stop_tokens": "ignored (exactly new_tokens per prompt)"}, results=[])
    wall = Stopwatch()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build(arch, device, dtype, Path(tmp) / "target")
        report["build_s"] = round(wall.s, 1)
        prompts = make_prompts(tokenizer, arch["vocab_size"], n, lengths)
        ref = next((v["name"] for v in variants if v.get("decoder") == "static"), variants[0]["name"])
        seqs = {}                                      # variant -> greedy sequences, held to the reference's
        for var in variants:
            try:
                r, seqs[var["name"]] = run_variant(
                    model, tokenizer, prompts, new, var, device, args.profile_steps if var["name"] in profiled else 0,
                    out.with_name(f"{out.stem}-profile-{var['name']}{TRACE_SUFFIX}"))
            except Exception as e:                     # OOM, an unsupported variant: recorded, the others still run
                r = {"variant": var["name"], "error": f"{type(e).__name__}: {str(e)[:500]}",
                     "traceback": traceback.format_exc()[-2000:]}
            report["results"].append(r)
            for x in report["results"]:
                if x["variant"] != ref and seqs.get(x["variant"]) is not None and seqs.get(ref) is not None:
                    x["greedy_vs"] = {"variant": ref, **greedy_vs(seqs[x["variant"]], seqs[ref])}
            print(json.dumps({k: v for k, v in r.items() if k not in ("traceback", "profile")}), flush=True)
            if "table" in r.get("profile", {}):                 # the profile's headline: ms per decode step by group
                t = r["profile"]["table"]
                print(json.dumps({"profile": r["variant"], "steps": t["steps"],
                                  "steps_with_work": t.get("steps_with_work"), "step_ms": t["step"]["ms"],
                                  "step_groups_ms": {g: v["ms"] for g, v in t["step"]["groups"].items()},
                                  "outside_ms": t["outside"]["ms"]}), flush=True)
            elif "error" in r.get("profile", {}):
                print(json.dumps({"profile": r["variant"], "error": r["profile"]["error"]}), flush=True)
            report.save()
    ok = [r for r in report["results"] if "tokens_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        report["best"] = {"variant": best["variant"], "tokens_per_s": best["tokens_per_s"]}
    report.save()
    print(f"best: {report.get('best')} -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
