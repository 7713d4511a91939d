"""H200 benchmark: ceilings, micro-benchmarks and the real `train` stage on config/h200.yaml.

    python bench/h200.py --out bench/out [--sections ceilings,mask,attention,flex_tune,loss,drafter_variants,specforge,
                                                     fp8,target,step_parts,profile,e2e] [--steps N]

flex_tune: the drafter's attention with each flex kernel option set (block sizes, warps, stages, flags), fwd and bwd ms.
specforge: the drafter step at 3072/512, 8192/1024, 16384/2048 (context/anchors), this project's (per precision
variant: BENCH_SF_VARIANTS, e.g. bf16,fp8,fp8head,fp8-rowwise) and SpecForge's (`OnlineDFlashModel`, flex; its wheel
carried) in one process. fp8: the LM head's two GEMMs and the fused loss with the FP8 head copies against bf16, and
the target's captured forward with FP8 weights against bf16 (ms, relative error of the features). loss: training's fused loss beside torch's and Liger's,
with agreement checks. step_parts: the bf16 drafter step's memory-bound parts alone (AdamW fused, foreach and compiled,
the clip's norm, the weight and gradient casts, the loss kernel) against the HBM copy bandwidth.
profile: the train stage under torch.profiler (train.profile), reduced to where GPU time goes.
e2e: train runs (BENCH_E2E_RUNS: 1t1d, restart, 1t3d, x2-*, long = config/h200-long.yaml, 1t1d-eager = 1t1d with
     the target eager, train.compile_target false; 1t1d-fp8 = FP8 drafter layers, 1t1d-fp8head = + the FP8 LM head,
     1t1d-fp8all = + the FP8 target; long, 1t1d-eager and the fp8 runs only when named).

Every section writes into one JSON (`<out>/bench.json`): the command, device, torch version and date are recorded
with the numbers, so a result under bench/results/ can be rerun. Shapes are the issue's: 3072-token context,
512 anchors x 16, Qwen3-8B target (36 layers, hidden 4096, 32/8 heads, head dim 128, vocab 151936), 5-layer drafter.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
from transformers import Qwen3Config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.traces import KEEP_MB, reduce_trace  # noqa: E402  (the profile section's, shared with bench/regen.py)

S, A, BK, H, V = 3072, 512, 16, 4096, 151936
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def bench(fn, warmup=3, reps=10):
    """Median milliseconds of fn() with CUDA events (wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    if DEV.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def peak_gb(fn):
    """Peak GB allocated by fn() above what was allocated before it (None on the CPU)."""
    if DEV.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def configs_8b(loaded, h=H, v=V, inter=12288, mask_id=151669):
    """The Qwen3-8B-shaped target's config (36 layers, 32 / 8 heads of dim h / 32) and the drafter's of `loaded`
    (config/h200.yaml and its overrides) over it; a smaller h, v and inter for the CPU tests."""
    from dflash.model import DrafterConfig
    tconf = Qwen3Config(hidden_size=h, num_attention_heads=32, num_key_value_heads=8, head_dim=h // 32,
                        intermediate_size=inter, num_hidden_layers=36, vocab_size=v, rms_norm_eps=1e-6,
                        rope_theta=1e6, max_position_embeddings=40960)
    return tconf, DrafterConfig.from_target(tconf, loaded.cfg.drafter, mask_id)


def random_anchors(b=1, s=S, a=A, bk=BK, seed=0):
    from dflash.model import Anchors
    g = torch.Generator(device="cpu").manual_seed(seed)
    pos = torch.stack([torch.randperm(s - 1, generator=g)[:a].sort().values for _ in range(b)])
    return Anchors(pos.to(DEV), torch.ones(b, a, dtype=torch.bool, device=DEV), bk)


# ---- sections ---------------------------------------------------------------------------------------------
def ceilings():
    n = 8192
    x, y = torch.randn(n, n, device=DEV, dtype=torch.bfloat16), torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = bench(lambda: x @ y, reps=20)
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    ms_copy = bench(lambda: dst.copy_(src), reps=20)
    return {"bf16_matmul_tflops": round(2 * n**3 / ms / 1e9, 1), "copy_gbps": round(2 * 2**30 / ms_copy / 1e6, 1)}


def mask():
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.model import block_mask
    anchors = random_anchors()
    ours = bench(lambda: block_mask(anchors, S), warmup=5, reps=50)
    pos = anchors.pos[0]

    def mod(b, h, q, kv):
        j = q // BK
        a = pos[j]
        return torch.where(kv < S, kv < a, (kv - S) // BK == j)

    ref = bench(lambda: create_block_mask(mod, 1, None, A * BK, S + A * BK, device=DEV), warmup=2, reps=10)
    # agreement on the tile structure
    bm = block_mask(anchors, S)
    cb = create_block_mask(mod, 1, None, A * BK, S + A * BK, device=DEV)
    same = bool(torch.equal(bm.to_dense().bool(), cb.to_dense().bool()))
    return {"ours_ms": round(ours, 4), "create_block_mask_ms": round(ref, 3), "speedup": round(ref / ours, 1),
            "same_tiles": same}


def attention():
    import torch.nn.functional as F

    from dflash.model import compiled_flex, dense_mask
    from dflash.model.masks import block_mask
    anchors = random_anchors()
    Q = A * BK
    q = torch.randn(1, 32, Q, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 8, S + Q, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 8, S + Q, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    bm = block_mask(anchors, S)
    flex = compiled_flex()
    dm = dense_mask(anchors, S)

    def run_flex():
        out = flex(q, k, v, block_mask=bm, enable_gqa=True)
        out.sum().backward()

    def run_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dm, enable_gqa=True)
        out.sum().backward()

    t0 = time.perf_counter()
    run_flex()
    compile_s = time.perf_counter() - t0
    return {"flex_fwd_bwd_ms": round(bench(run_flex), 3), "sdpa_dense_fwd_bwd_ms": round(bench(run_sdpa), 3),
            "flex_first_call_s": round(compile_s, 1)}


def loss_problem(q=A * BK, s=S, h=H, v=V, bk=BK, seed=0):
    """The loss's inputs as training makes them: drafter output [1, Q, H] bf16, the frozen head [V, H] bf16,
    labels and weights exp(-(k-1)/gamma) of random anchors over a random sequence (block_labels, the train path)."""
    from dflash.model import block_labels
    g = torch.Generator(device="cpu").manual_seed(seed)
    anchors = random_anchors(1, s, q // bk, bk, seed)
    ids = torch.randint(0, v, (1, s), generator=g).to(DEV)
    labels, weights = block_labels(ids, torch.ones(1, s, dtype=torch.bool, device=DEV), anchors)
    hidden = torch.randn(1, q, h, generator=g).to(DEV, torch.bfloat16)
    head = (torch.randn(v, h, generator=g) * 0.02).to(DEV, torch.bfloat16)
    return hidden, head, labels, weights


def loss_variants(head, labels, weights, bk=BK, chunk=4096, compiled=None):
    """name -> f(hidden [1, Q, H]) -> the step's loss (weighted mean over scored positions), differentiable in hidden.
    The first is what training runs (train.loss_kernel fused, its kernel compiled on GPU); the others compute the
    same quantity with torch's own ops or Liger's fused linear cross-entropy."""
    import torch.nn.functional as F

    from dflash.model import IGNORE, dflash_loss
    from dflash.train.step import loss_kernel
    compiled = DEV.type == "cuda" if compiled is None else compiled

    def rows(x):  # [1, Q, ...] -> [N, ...]: block positions 1.. (position 0 is never scored)
        return x.reshape(-1, bk, *x.shape[2:])[:, 1:].reshape(-1, *x.shape[2:])
    lab = rows(labels)
    wk = rows(torch.where(labels != IGNORE, weights.float(), torch.zeros((), device=weights.device)))
    wsum = wk.sum()

    def torch_full(h):  # unchunked: [N, V] logits in float32 at once
        logits = (rows(h) @ head.t()).float()
        return (F.cross_entropy(logits, lab.clamp(min=0), reduction="none") * wk).sum() / wsum
    out = {
        "fused": lambda h: dflash_loss(h, head, labels, weights, bk, chunk, fused=True,
                                       kernel=loss_kernel(compiled)).loss,
        "torch_chunked_checkpointed": lambda h: dflash_loss(h, head, labels, weights, bk, chunk).loss,
        "torch_full": torch_full,
    }
    if compiled:
        out["torch_compile_full"] = torch.compile(torch_full, dynamic=False)
        out["fused_eager_kernel"] = lambda h: dflash_loss(h, head, labels, weights, bk, chunk, fused=True).loss
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        # per-position weights need reduction="none" (Liger then recomputes the logits in the backward)
        per_row = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="none")
        out["liger_flce_weighted"] = lambda h: (per_row(head, rows(h), lab) * wk).sum() / wsum
        # reference only: unweighted mean, the gradient made in the forward (Liger's fast path); a different loss
        mean = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="mean")
        out["liger_flce_unweighted_ref"] = lambda h: mean(head, rows(h), lab)
    except Exception as e:  # not carried, or no triton (CPU)
        out["liger"] = f"unavailable: {type(e).__name__}: {e}"[:300]
    return out


def loss_compare(hidden, head, labels, weights, bk=BK, chunk=4096, reps=10, compiled=None):
    """Every loss variant's value and gradient w.r.t. hidden against training's (fused), then its speed and peak
    memory (forward + backward). `agrees`: loss within 2e-3 relative, gradient within 2% of its largest entry."""
    variants = loss_variants(head, labels, weights, bk, chunk, compiled)
    res, ref = {}, None
    for name, fn in variants.items():
        if isinstance(fn, str):
            res[name] = {"error": fn}
            continue
        try:
            h = hidden.detach().requires_grad_(True)
            value = fn(h)
            value.backward()
            grad = h.grad.float()
            r = {"loss": round(value.item(), 6)}
            if ref is None:
                ref = (value.item(), grad)
            else:
                dl = abs(value.item() - ref[0])
                dg = (grad - ref[1]).abs().max().item()
                scale = ref[1].abs().max().item()
                r.update(loss_abs_diff=dl, grad_max_abs_diff=dg, grad_max_abs=scale,
                         agrees=bool(dl <= 2e-3 * max(1.0, abs(ref[0])) and dg <= 2e-2 * scale))
            if name == "fused":
                r["agrees"] = True

            def run():
                h.grad = None
                fn(h).backward()
            r["fwd_bwd_ms"] = round(bench(run, warmup=2, reps=reps), 2)
            r["peak_gb"] = peak_gb(run)
            res[name] = r
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        h = value = grad = None
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
    ok = {k: v["fwd_bwd_ms"] for k, v in res.items() if v.get("agrees") and "fwd_bwd_ms" in v}
    res["fastest_agreeing"] = min(ok, key=ok.get) if ok else None
    res["training_uses"] = "fused"
    return res


def loss():
    """The loss training runs (train.loss_kernel fused, loss_chunk 4096 as config/h200.yaml) beside torch's own and
    Liger's fused linear cross-entropy: 512 anchors x 16 = 8192 block positions (7680 scored), hidden 4096,
    vocab 151936, bf16."""
    hidden, head, labels, weights = loss_problem()
    out = loss_compare(hidden, head, labels, weights, reps=int(os.environ.get("BENCH_LOSS_REPS", 10)))
    out["shape"] = {"positions": hidden.shape[1], "scored": int((labels != -100).sum()), "hidden": H, "vocab": V,
                    "chunk": 4096}
    return out


def drafter_variants():
    """The production drafter step (build_drafter + micro_step + AdamW), as train runs it, per variant and shape,
    each in a fresh process (so each peak is its own). Environment:
      BENCH_VARIANTS  comma list of [base:]BACKEND[+compile][:chunk=N][:casts=recompute] (default
                      flex+compile,flex,sdpa); `base:` runs the tree at BENCH_BASE (another commit's whole tree,
                      e.g. from `git archive`, for before/after in one run); `:chunk=N` sets train.loss_chunk
                      (config/h200.yaml: 4096), `:casts=recompute` train.recompute_weight_casts
      BENCH_SHAPES    comma list of CONTEXTxANCHORS (default 3072x512); keys of other shapes end in @CONTEXTxANCHORS
      BENCH_PROFILE   a file for a CUDA profile of the first variant at the first shape
    Per variant: step_ms (median of 10), peak_gb (max allocated, GiB, weights and AdamW state included),
    peak_reserved_gb, first_step_s, drafter_only_ktok_s."""
    variants = os.environ.get("BENCH_VARIANTS", "flex+compile,flex,sdpa").split(",")
    shapes = os.environ.get("BENCH_SHAPES", f"{S}x{A}").split(",")
    out = {}
    for i, shape in enumerate(shapes):
        for j, name in enumerate(variants):
            tree, spec = (os.environ.get("BENCH_BASE"), name[5:]) if name.startswith("base:") else (str(REPO), name)
            key = name if shape == f"{S}x{A}" else f"{name}@{shape}"
            if tree is None:
                out[key] = {"error": "base: variant without BENCH_BASE"}
                continue
            profile = os.environ.get("BENCH_PROFILE", "") if i == j == 0 else ""
            code = (f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); import h200; "
                    f"h200._drafter_step({str(Path(tree).resolve())!r}, {spec!r}, {shape!r}, {profile!r})")
            try:
                r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)
            except subprocess.TimeoutExpired:
                out[key] = {"error": "timed out after 900 s"}
                continue
            if r.returncode:
                out[key] = {"error": r.stderr[-3000:]}
                print("drafter_variants", key, "failed:", r.stderr[-500:], flush=True)
                continue
            res = json.loads(r.stdout.strip().splitlines()[-1])
            print("drafter_variants", key, json.dumps(res), flush=True)   # seen even if a later variant times out
            out.update({f"{key}_{k}": v for k, v in res.items()})
    return out


def _drafter_step(tree: str, spec: str, shape: str, profile: str = ""):
    """One drafter_variants measurement in this process, with the dflash package of `tree`; prints one JSON line."""
    sys.path.insert(0, tree)
    
    from dflash import config as C
    from dflash.fingerprint import collect, compile_cache_dir
    from dflash.train import optim
    from dflash.train.compile_guard import use_compile_cache
    from dflash.train.context import RunContext
    from dflash.train.step import build_drafter, micro_step, random_head
    use_compile_cache(compile_cache_dir(REPO / "results", collect()["hash"]))  # share the train stage's cache
    name, *opts = spec.split(":")
    s, a = (int(x) for x in shape.split("x"))
    sets = {"train.num_anchors": a}
    for o in opts:
        k, v = o.split("=")
        sets[{"chunk": "train.loss_chunk", "casts": "train.recompute_weight_casts"}[k]] = (
            v == "recompute" if k == "casts" else int(v))
    loaded = C.load(REPO / "config" / "h200.yaml", sets)
    tconf, dcfg = configs_8b(loaded)
    feats = torch.randn(1, s, 5 * H, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (1, s), device=DEV)
    mask = torch.ones(1, s, dtype=torch.bool, device=DEV)
    backend, compiled = name.split("+")[0], name.endswith("+compile")
    setup = RunContext(loaded, None, backend, Path("/tmp"), Path("/tmp"), tconf, dcfg, 7.0, {}, compiled)
    embed, head = random_head(setup, DEV, torch.bfloat16)
    model = build_drafter(setup, embed, head, DEV)
    opt, sched = optim.build(model.named_parameters(), loaded.cfg.train, DEV)
    counter = [0]

    def step():
        counter[0] += 1
        res = micro_step(model, feats, ids, mask, counter[0], setup, torch.bfloat16)
        res.loss.backward()
        opt.set_lr(sched.factor(counter[0], 0.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    out = {"first_step_s": round(time.perf_counter() - t0, 1)}
    out["step_ms"] = round(bench(step, warmup=3, reps=10), 2)
    out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    out["drafter_only_ktok_s"] = round(s / out["step_ms"], 2)
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof_
        with prof_(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90)
        Path(profile).write_text(table)
    print(json.dumps(out), flush=True)


# ---- the drafter step against SpecForge's (same process, same shapes) ------------------------------------------
SF_SHAPES = ((3072, 512), (8192, 1024), (16384, 2048))   # (context tokens, anchors): the three shapes


@functools.cache
def load_specforge():
    """SpecForge's DFlash modelling modules, imported file by file: its package __init__s pull sglang, the
    trainer and the data stack. Needs only torch and transformers (its wheel installed with --no-deps)."""
    import importlib
    import importlib.util
    import types
    from importlib.metadata import version
    spec = importlib.util.find_spec("specforge")
    if spec is None:
        raise ModuleNotFoundError("specforge: carry .whl/specforge-0.2.0-py3-none-any.whl")
    root = Path(list(spec.submodule_search_locations)[0])
    for pkg in ("specforge", "specforge.core", "specforge.modeling", "specforge.modeling.draft",
                "specforge.algorithms", "specforge.algorithms.common"):
        if pkg not in sys.modules:   # empty packages: submodules import, __init__ bodies do not run
            mod = types.ModuleType(pkg)
            mod.__path__ = [str(root.joinpath(*pkg.split(".")[1:]))]
            sys.modules[pkg] = mod
    return (importlib.import_module("specforge.algorithms.common.dflash_family_model"),
            importlib.import_module("specforge.modeling.draft.dflash"),
            importlib.import_module("specforge.optimizer"), version("specforge"))


def specforge_step(num_anchors, feats, ids, loss_mask, vocab=V, layers=5, heads=(32, 8, 128), inter=12288,
                   target_layers=36, mask_id=151669, attention="flex_attention", lr=6e-4):
    """SpecForge's DFlash training step as its trainer runs it: OnlineDFlashModel (bf16 weights, its own anchor
    sampling, block mask and chunked loss) + BF16Optimizer (fp32 master weights, AdamW, clip, cosine).
    feats [1, S, 5*hidden] (their dtype is the model's), ids [1, S], loss_mask [1, S]."""

    fam, draft, optmod, _ = load_specforge()
    h = feats.shape[-1] // 5
    cfg = Qwen3Config(hidden_size=h, num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2],
                      intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab, rms_norm_eps=1e-6,
                      rope_theta=1e6, max_position_embeddings=40960)
    cfg.block_size, cfg.num_target_layers = BK, target_layers
    cfg.dflash_config = {"target_layer_ids": draft.build_target_layer_ids(target_layers, 5), "mask_token_id": mask_id}
    cfg._attn_implementation = attention
    dev, dt = feats.device, feats.dtype
    torch.manual_seed(0)
    with torch.device(dev):
        model = draft.DFlashDraftModel(cfg)
        embed = torch.nn.Embedding(cfg.vocab_size, h)
        head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
    for m in (embed, head):
        m.weight.data.normal_(0, 0.02)
        m.requires_grad_(False)
    model = model.to(dev, dt)
    wrapped = fam.OnlineDFlashModel(model, head, embed, mask_token_id=mask_id, block_size=BK,
                                    attention_backend=attention, num_anchors=num_anchors,
                                    loss_decay_gamma=7.0).to(dev, dt)
    opt = optmod.BF16Optimizer(model, lr=lr, max_grad_norm=1.0, total_steps=1000, warmup_ratio=0.04)
    lm = loss_mask.to(dt)

    def step():
        loss, _, _ = wrapped(input_ids=ids, hidden_states=feats, loss_mask=lm)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def our_step(num_anchors, feats, ids, loss_mask, sets=None):
    """This project's drafter step as train runs it: build_drafter (compiled flex layers, warmed up for this shape)
    and the trainer's Replica: micro_step (fused loss), then optimizer_step (the global-weight-sum scale and the
    clip folded into the fused AdamW's grad_scale) with its schedule; config/h200.yaml with train.num_anchors =
    num_anchors and the config keys `sets` (e.g. FP8_VARIANTS[name])."""
    
    from dflash import config as C
    from dflash.train.context import RunContext
    from dflash.train.runtime.threads import GradSync
    from dflash.train.step import build_drafter, random_head
    from dflash.train.trainer import Micro, Replica
    loaded = C.load(REPO / "config" / "h200.yaml", {"train.num_anchors": num_anchors, **(sets or {})})
    tconf, dcfg = configs_8b(loaded)
    setup = RunContext(loaded, None, "flex", Path("/tmp"), Path("/tmp"), tconf, dcfg, 7.0, {}, True)
    setup.shapes = [tuple(ids.shape)]
    embed, head = random_head(setup, feats.device, torch.bfloat16)
    rep = Replica(setup, 0, 1, feats.device, build_drafter(setup, embed, head, feats.device), GradSync(1))
    rep.warm_up()
    counter = [0]

    def step():
        counter[0] += 1
        stats, _ = rep.accumulate([Micro(counter[0], ids.numel(), feats, ids, loss_mask)])
        rep.optimizer_step()
        return stats[0] / stats[1]
    return step


def measure_step(make, reps):
    """Build a step (make()), time its first call (compiles), its median over reps, and the peak GB allocated from
    before the build (weights, optimizer state, activations; the shared inputs excluded). Frees everything."""
    import gc
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = {"allocated_before_gb": round(base / 2**30, 2)}
    try:
        t0 = time.perf_counter()
        step = make()
        out["build_s"] = round(time.perf_counter() - t0, 1)
        torch.cuda.reset_peak_memory_stats()   # a build's transients (fp32 init before a bf16 cast) not counted
        t0 = time.perf_counter()
        out["first_loss"] = round(float(step()), 4)
        torch.cuda.synchronize()
        out["first_step_s"] = round(time.perf_counter() - t0, 1)
        out["step_ms"] = round(bench(step, warmup=1, reps=reps), 2)
        out["peak_gb"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    except Exception as e:   # OOM or an incompatibility: recorded, the next one runs
        out["error"] = f"{type(e).__name__}: {e}"[:1500]
        out["traceback"] = traceback.format_exc()[-1500:]
    step = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


# the drafter step's precision variants (BENCH_SF_VARIANTS): config keys over config/h200.yaml
FP8_VARIANTS = {"bf16": {},
                "fp8": {"train.precision": "fp8"},                                    # layers, tensorwise
                "fp8-rowwise": {"train.precision": "fp8", "train.fp8_recipe": "rowwise"},
                "fp8-gw-hp": {"train.precision": "fp8", "train.fp8_recipe": "rowwise_with_gw_hp"},
                "head": {"train.fp8_lm_head": True},                                  # the LM head alone
                "fp8head": {"train.precision": "fp8", "train.fp8_lm_head": True}}     # layers + head


def specforge():
    """The drafter step (forward + backward + optimizer step) at the issue's three shapes, this project's (per
    BENCH_SF_VARIANTS, default bf16: names of FP8_VARIANTS, keyed `ours` for bf16 and `ours-<name>` for the others,
    with `vs_bf16`: bf16 ms / its ms and `loss_vs_bf16`: its first loss / bf16's, same weights, batch and anchors)
    and SpecForge's OnlineDFlashModel (flex attention; BENCH_SF_SKIP=1 leaves it out) one after the other in this
    process: median ms and peak GB."""
    from dflash.fingerprint import collect, compile_cache_dir
    from dflash.train import compile_guard
    compile_guard.use_compile_cache(compile_cache_dir(REPO / "results", collect()["hash"]))
    variants = os.environ.get("BENCH_SF_VARIANTS", "bf16").split(",")
    unknown = [v for v in variants if v not in FP8_VARIANTS]
    if unknown:
        return {"error": f"unknown BENCH_SF_VARIANTS {unknown}; known: {', '.join(FP8_VARIANTS)}"}
    compile_guard.configure_thread(8, len(variants) + 1)   # recompile limit for every variant's and SpecForge's shapes
    out = {}
    try:
        out["specforge_version"] = load_specforge()[3]
    except Exception as e:
        out["specforge_version"] = f"unavailable: {type(e).__name__}: {e}"[:300]
    reps = int(os.environ.get("BENCH_SF_REPS", 5))
    shapes = [tuple(map(int, x.split("/"))) for x in os.environ["BENCH_SF_SHAPES"].split(",")] \
        if os.environ.get("BENCH_SF_SHAPES") else SF_SHAPES
    for s, a in shapes:
        g = torch.Generator(device="cpu").manual_seed(s)
        feats = torch.randn(1, s, 5 * H, generator=g).to(DEV, torch.bfloat16)
        ids = torch.randint(0, V, (1, s), generator=g).to(DEV)
        mask = torch.ones(1, s, dtype=torch.bool, device=DEV)
        row = {}
        for v in variants:
            row["ours" if v == "bf16" else f"ours-{v}"] = measure_step(
                lambda: our_step(a, feats, ids, mask, FP8_VARIANTS[v]), reps)
            print("specforge", s, a, v, json.dumps(row["ours" if v == "bf16" else f"ours-{v}"])[:400], flush=True)
        if not os.environ.get("BENCH_SF_SKIP"):
            row["specforge"] = measure_step(lambda: specforge_step(a, feats, ids, mask), reps)
        o, f = row.get("ours", {}), row.get("specforge", {})
        if "step_ms" in o and "step_ms" in f:
            row["speedup"] = round(f["step_ms"] / o["step_ms"], 3)
            row["memory_ratio"] = round(o["peak_gb"] / f["peak_gb"], 3)
        for v in variants:
            r = row.get(f"ours-{v}", {})
            if "step_ms" in o and "step_ms" in r:
                row.setdefault("vs_bf16", {})[v] = round(o["step_ms"] / r["step_ms"], 3)
                row.setdefault("loss_vs_bf16", {})[v] = round(r["first_loss"] / o["first_loss"], 5)
        out[f"{s}/{a}"] = row
        feats = ids = mask = None
        print("specforge", s, a, json.dumps(row)[:600], flush=True)
    return out



def _hbm(fn, gb: float, reps: int = 10) -> dict:
    """fn's median ms and its bandwidth: `gb` GB read + written per call."""
    ms = bench(fn, warmup=2, reps=reps)
    return {"ms": round(ms, 3), "gb": round(gb, 3), "tb_per_s": round(gb / ms, 3)}


def step_parts(h=H, v=V, inter=12288, copy_gib=4, rows=4096, compiled=True):
    """The bf16 drafter step's memory-bound parts (config/h200.yaml's 5-layer drafter, fp32 trainable weights under
    bf16 autocast, as train runs it), each alone at its real size against the HBM copy bandwidth: how much of the
    step's non-GEMM time a faster kernel could still take off. `copy`: one 4 GiB fp32 copy (the practical
    bandwidth). `adamw_fused`: the optimizer step train runs (fused AdamW, the clip folded into grad_scale);
    `adamw_foreach`, `adamw_foreach_compiled` (torch.compile of the step) for comparison; `grad_norm`: the clip's
    norm (get_total_norm, foreach). `casts_fwd`: autocast's fp32 -> bf16 copy of every weight; `casts_grad`: the
    bf16 gradients back to fp32. `loss_kernel`: training's compiled per-chunk loss kernel on [4096, V] bf16 logits
    (logsumexp, argmax, the gradient written over the logits) and `loss_reduction` its reductions alone; the floor
    of both is one read of the logits plus one read and one write. `floor_ms`: GB / copy bandwidth. The arguments
    shrink it for the CPU test (`compiled` False: the eager loss kernel, no compiled AdamW)."""
    from dflash import config as C
    from dflash.model import DFlashDrafter
    from dflash.train.step import loss_kernel
    loaded = C.load(REPO / "config" / "h200.yaml")
    _, dcfg = configs_8b(loaded, h, v, inter, mask_id=min(151669, v - 1))
    embed = head = torch.zeros(1, h, device=DEV, dtype=torch.bfloat16)   # frozen, not stepped: stand-ins
    with torch.device(DEV):
        drafter = DFlashDrafter(dcfg, embed, head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    out = {"trainable_params": n}
    x = torch.empty(int(copy_gib * 2**28), device=DEV)
    y = torch.empty_like(x)
    out["copy"] = _hbm(lambda: y.copy_(x), 2 * x.numel() * 4 / 1e9)
    x = y = None
    bw = out["copy"]["tb_per_s"]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    grad_scale = torch.tensor(1.0, device=DEV)
    t = loaded.cfg.train
    kw = dict(lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay)
    opts = {"adamw_fused": torch.optim.AdamW(params, fused=True, **kw),
            "adamw_foreach": torch.optim.AdamW(params, foreach=True, **kw)}
    opts["adamw_fused"].grad_scale = grad_scale
    adam_gb = n * 4 * 7 / 1e9   # read p, g, m, v; write p, m, v (fp32)
    for name, opt in opts.items():
        out[name] = _hbm(opt.step, adam_gb)
        opt.state.clear()
    if compiled:
        comp = torch.optim.AdamW(params, foreach=True, **kw)
        try:
            out["adamw_foreach_compiled"] = _hbm(torch.compile(comp.step), adam_gb)
        except Exception as e:
            out["adamw_foreach_compiled"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        comp = None
    opts = None
    grads = [p.grad for p in params]
    out["grad_norm"] = _hbm(lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True), n * 4 / 1e9)
    out["casts_fwd"] = _hbm(lambda: [p.to(torch.bfloat16) for p in params], n * 6 / 1e9)
    g16 = [g.to(torch.bfloat16) for g in grads]
    out["casts_grad"] = _hbm(lambda: [g.to(torch.float32) for g in g16], n * 6 / 1e9)
    for p in params:
        p.grad = None
    g16 = grads = None
    if DEV.type == "cuda":
        torch.cuda.empty_cache()
    gen = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(rows, v, device=DEV, dtype=torch.bfloat16, generator=gen) * 3
    labels = torch.randint(0, v, (rows,), device=DEV, generator=gen)
    one = rows * v * 2 / 1e9
    kernel = loss_kernel(compiled, "ce")
    out["loss_kernel"] = _hbm(lambda: kernel(logits, labels), 3 * one)
    def reduction(lg):
        return torch.logsumexp(lg.float(), -1), lg.argmax(-1)
    out["loss_reduction"] = _hbm(functools.partial(torch.compile(reduction, fullgraph=True) if compiled else
                                                   reduction, logits), one)
    for part in out.values():
        if isinstance(part, dict) and "gb" in part:
            part["floor_ms"] = round(part["gb"] / bw, 3)
    return out

# flex kernel options tried by flex_tune: forward (BLOCK_M, BLOCK_N, num_warps, num_stages) and backward
# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages); {} = torch's own choice for the device
FLEX_FWD = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
FLEX_BWD = [(64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3), (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 4, 3),
            (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 8, 2), (128, 128, 128, 128, 8, 2), (32, 128, 128, 32, 8, 3)]
FLEX_FLAGS = [{"PRESCALE_QK": True}, {"USE_TMA": True}, {"ROWS_GUARANTEED_SAFE": True}]


def flex_tune():
    """The drafter's attention (our BlockMask, GQA 32/8, head dim 128, bf16) with each kernel option set of FLEX_FWD,
    FLEX_BWD and FLEX_FLAGS, one at a time on top of torch's defaults: forward ms and forward+backward ms (median),
    bwd_ms their difference (an estimate: the forward alone is timed without autograd, a graph of its own),
    and the largest difference of the output and of dq/dk/dv from the default's. BENCH_FLEX_SHAPES: comma list of
    CONTEXTxANCHORS (default 3072x512)."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.model.masks import block_mask
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    sets = [("default", {})]
    sets += [(f"fwd{c}", {"fwd_BLOCK_M": c[0], "fwd_BLOCK_N": c[1], "fwd_num_warps": c[2], "fwd_num_stages": c[3]})
             for c in FLEX_FWD]
    sets += [(f"bwd{c}", {"bwd_BLOCK_M1": c[0], "bwd_BLOCK_N1": c[1], "bwd_BLOCK_M2": c[2], "bwd_BLOCK_N2": c[3],
                          "bwd_num_warps": c[4], "bwd_num_stages": c[5]}) for c in FLEX_BWD]
    sets += [(",".join(f), f) for f in FLEX_FLAGS]
    out = {}
    for shape in os.environ.get("BENCH_FLEX_SHAPES", f"{S}x{A}").split(","):
        s, a = (int(x) for x in shape.split("x"))
        anchors = random_anchors(s=s, a=a)
        Q = a * BK
        g = torch.Generator(device="cpu").manual_seed(1)
        q0 = torch.randn(1, 32, Q, 128, generator=g).to(DEV, torch.bfloat16)
        k0 = torch.randn(1, 8, s + Q, 128, generator=g).to(DEV, torch.bfloat16)
        v0 = torch.randn(1, 8, s + Q, 128, generator=g).to(DEV, torch.bfloat16)
        go = torch.randn(1, 32, Q, 128, generator=g).to(DEV, torch.bfloat16)
        bm = block_mask(anchors, s)
        ref = None
        rows = {}
        for name, opts in sets:
            q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))

            def fwd():
                return fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(opts) or None)

            def fwd_bwd():
                fwd().backward(go)
            row = {}
            try:
                t0 = time.perf_counter()
                fwd_bwd()
                torch.cuda.synchronize()
                row["compile_s"] = round(time.perf_counter() - t0, 1)
                with torch.no_grad():
                    row["fwd_ms"] = round(bench(fwd, warmup=3, reps=20), 3)
                row["fwd_bwd_ms"] = round(bench(fwd_bwd, warmup=3, reps=20), 3)
                row["bwd_ms"] = round(row["fwd_bwd_ms"] - row["fwd_ms"], 3)
                q.grad = k.grad = v.grad = None
                o = fwd()
                o.backward(go)
                got = [o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
                if ref is None:
                    ref = got
                else:
                    row["max_abs_diff"] = [round((x - y).abs().max().item(), 5) for x, y in zip(got, ref)]
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:400]
            rows[name] = row
            print("flex_tune", shape, name, json.dumps(row), flush=True)
        ref = None
        ok = {n: r for n, r in rows.items() if "fwd_bwd_ms" in r}
        best_f = min((n for n in ok if n.startswith("fwd") or n == "default"), key=lambda n: ok[n]["fwd_ms"], default=None)
        best_b = min((n for n in ok if n.startswith("bwd") or n == "default"), key=lambda n: ok[n]["bwd_ms"], default=None)
        out[shape] = {"rows": rows, "best_fwd": best_f, "best_bwd": best_b}
    return out


def target():
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash.train.features import LayerCapture
    conf = AutoConfig.for_model("qwen3", hidden_size=H, num_hidden_layers=36, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=V,
                                max_position_embeddings=40960)
    t0 = time.perf_counter()
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, V, (1, S), device=DEV)
    with torch.inference_mode():
        full = bench(lambda: model(ids), warmup=2, reps=5)
    cap = LayerCapture(model, [1, 9, 17, 25, 33])
    ms = bench(lambda: cap(ids), warmup=2, reps=10)
    want = cap(ids)
    cap.compile()                                    # train.compile_target: layers 0..33 compiled in place
    warm = cap.warm_up(DEV, [(1, S)], V)
    cms = bench(lambda: cap(ids), warmup=2, reps=10)
    diff = (cap(ids).float() - want.float()).abs().max().item()
    model = cap = want = None
    torch.cuda.empty_cache()
    return {"capture_ms": round(ms, 2), "capture_ktok_s": round(S / ms, 2), "full_forward_ms": round(full, 2),
            "full_forward_ktok_s": round(S / full, 2), "build_s": round(build_s, 1),
            "capture_compiled_ms": round(cms, 2), "capture_compiled_ktok_s": round(S / cms, 2),
            "compiled_vs_eager_max_abs_diff": diff, "compile_warmup_s": warm["seconds"], "compile_graphs": warm["graphs"]}


def fp8():
    """The FP8 parts besides the drafter's layers (those: the specforge section's variants), each against bf16:
    - head: the frozen LM head [V, H] at the step's 7680 rows (512 anchors x 15): making its FP8 copies (once per
      run), the logits (h @ W.T) and the input gradient (g @ W) of one 4096-row chunk (inputs quantized by the
      compiled quantize_rows, as train.compile runs it), and training's fused loss
      (compiled kernel) forward + backward with each head: ms, the loss's and the gradient's relative difference.
    - target: the Qwen3-8B-shaped target's captured forward (layers 0..33, config/h200.yaml's capture) at 3072
      tokens with bf16 weights and with FP8 copies (train.fp8_target), eager and compiled (BENCH_FP8_TARGET_COMPILE=0:
      eager only): ms and the features' relative error (norm of the difference / norm) against bf16.
    BENCH_FP8_PARTS: comma list of head, target (default both)."""
    parts = os.environ.get("BENCH_FP8_PARTS", "head,target").split(",")
    out = {"head": {}, "target": {}}
    if "head" in parts:
        _fp8_head(out["head"])
    if "target" in parts:
        _fp8_target(out["target"])
    return out


def _fp8_head(hd: dict):
    from dflash.model import dflash_loss, fp8 as F8
    from dflash.train import precision
    from dflash.train.step import loss_kernel
    hidden, head, labels, weights = loss_problem()
    F8.FrozenHead(head[:64])    # torchao's first call (imports, kernels) not counted below
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fhead = F8.FrozenHead(head, precision.quantizer(True))    # as train.compile makes it
    torch.cuda.synchronize()
    hd["make_copies_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    n = 4096
    h = hidden[0, :n].contiguous()
    g = torch.softmax((h @ head.t()).float(), -1).to(torch.bfloat16)
    hd["logits_bf16_ms"] = round(bench(lambda: h @ head.t()), 3)
    hd["logits_fp8_ms"] = round(bench(lambda: fhead.logits(h)), 3)
    hd["input_grad_bf16_ms"] = round(bench(lambda: g @ head), 3)
    hd["input_grad_fp8_ms"] = round(bench(lambda: fhead.input_grad(g)), 3)
    ref_l, ref_g = (h @ head.t()).float(), (g @ head).float()
    hd["logits_rel_err"] = round(float((fhead.logits(h).float() - ref_l).norm() / ref_l.norm()), 5)
    hd["input_grad_rel_err"] = round(float((fhead.input_grad(g).float() - ref_g).norm() / ref_g.norm()), 5)
    g = ref_l = ref_g = None
    kernel = loss_kernel(True)
    res = {}
    for name, w in (("bf16", head), ("fp8", fhead)):
        x = hidden.detach().clone().requires_grad_(True)

        def fwd_bwd():
            x.grad = None
            loss = dflash_loss(x, w, labels, weights, BK, 4096, fused=True, kernel=kernel).loss
            loss.backward()
            return loss
        loss = fwd_bwd()
        res[name] = (float(loss.detach()), x.grad.float().clone())
        hd[f"fused_loss_{name}_ms"] = round(bench(fwd_bwd, warmup=2, reps=10), 2)
    (a, ga), (b, gb) = res["bf16"], res["fp8"]
    hd["fused_loss_rel_diff"] = round(abs(a - b) / a, 6)
    hd["fused_grad_rel_err"] = round(float((gb - ga).norm() / ga.norm()), 5)
    res = hidden = head = fhead = None
    torch.cuda.empty_cache()


def _fp8_target(tg: dict):
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoModelForCausalLM

    from bench import fp8_features
    from dflash import config as C
    from dflash.model import DrafterConfig
    conf = AutoConfig.for_model("qwen3", hidden_size=H, num_hidden_layers=36, num_attention_heads=32,
                                num_key_value_heads=8, head_dim=128, intermediate_size=12288, vocab_size=V,
                                max_position_embeddings=40960)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(conf, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    loaded = C.load(REPO / "config" / "h200.yaml")   # its capture: layers 1, 9, 17, 25, 33 of 36
    ctx = SimpleNamespace(drafter_config=DrafterConfig.from_target(conf, loaded.cfg.drafter, V - 1), cfg=loaded.cfg)
    ids = torch.randint(0, V, (1, S), device=DEV)
    compiled = os.environ.get("BENCH_FP8_TARGET_COMPILE", "1") == "1"

    def measure(name, cap):
        tg[f"capture_{name}_ms"] = round(bench(lambda: cap(ids), warmup=2, reps=5), 2)
        feats = {name: cap(ids)}
        if compiled:
            cap.compile()
            warm = cap.warm_up(DEV, [(1, S)], V)
            tg[f"capture_{name}_compiled_ms"] = round(bench(lambda: cap(ids), warmup=2, reps=10), 2)
            tg[f"compile_{name}_s"] = warm["seconds"]
            feats[name + "_compiled"] = cap(ids)
            for m in cap.modules:       # back to eager for the next variant (the compiled forward is an attribute)
                del m.forward
        return feats
    feats, quantize_s = fp8_features.capture_both(model, ctx, measure)
    tg["quantize_s"] = round(quantize_s, 2)
    for k, v in feats.items():
        if k != "bf16":
            tg[f"{k}_rel_err"] = round(fp8_features.relative_error(v, feats["bf16"]), 5)
    model = feats = None
    torch.cuda.empty_cache()


def dflash_stage(*args, timeout=900):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dflash", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.perf_counter() - t0


H200, LONG = "config/h200.yaml", "config/h200-long.yaml"


OPT_IN = ("long", "1t1d-eager", "1t1d-fp8", "1t1d-fp8head", "1t1d-fp8all", "1t1d-fp8target")   # only when BENCH_E2E_RUNS names them


def e2e_runs() -> dict:
    """name -> (config, --set arguments; None for the warm restart)."""
    one = ["--set", 'train.drafters=["cuda:0"]']
    fp8 = ["--set", "train.precision=fp8"]
    return {"1t1d": (H200, one),
            "restart": (H200, None),
            "1t3d": (H200, ["--set", 'train.drafters=["cuda:0","cuda:0","cuda:0"]']),
            # two GPUs: the split layout (target on one, drafter on the other) in both runtimes, and data-parallel
            # drafter replicas on both GPUs (threads)
            "x2-split-dist": (H200, ["--set", 'train.drafters=["cuda:1"]', "--set", "train.runtime=distributed"]),
            "x2-split-threads": (H200, ["--set", 'train.drafters=["cuda:1"]', "--set", "train.runtime=threads"]),
            "x2-dp-threads": (H200, ["--set", 'train.drafters=["cuda:0","cuda:1"]', "--set", "train.runtime=threads"]),
            # long context: 4K/8K/16K buckets, 512/1024/2048 anchors (config/h200-long.yaml), 1 target + 1 drafter
            "long": (LONG, one),
            # 1t1d with the target eager (config/h200.yaml compiles it: train.compile_target)
            "1t1d-eager": (H200, [*one, "--set", "train.compile_target=false"]),
            # FP8 (issue 28): the drafter's layers; + the frozen LM head; + the target's forward
            "1t1d-fp8": (H200, [*one, *fp8]),
            "1t1d-fp8head": (H200, [*one, *fp8, "--set", "train.fp8_lm_head=true"]),
            "1t1d-fp8all": (H200, [*one, *fp8, "--set", "train.fp8_lm_head=true", "--set", "train.fp8_target=true",
                                   "--set", "train.eval_every=0"]),   # tau under an FP8 target is refused
            # the target's FP8 forward on its own, the drafter in bf16
            "1t1d-fp8target": (H200, [*one, "--set", "train.fp8_target=true", "--set", "train.eval_every=0"])}


def e2e(out_dir: Path, steps: int, extra=()):
    """The train stage end to end, one run per BENCH_E2E_RUNS entry (default: every entry but those in OPT_IN); each
    config's target and data stages run once, before its first run."""
    runs = e2e_runs()
    wanted = os.environ.get("BENCH_E2E_RUNS", ",".join(k for k in runs if k not in OPT_IN)).split(",")
    res, ready = {}, {}
    for name, (config, sets) in runs.items():
        if name not in wanted:
            continue
        if config not in ready:   # BENCH_SKIP_STAGES=1: target and data already built (another bench process)
            st = {} if os.environ.get("BENCH_SKIP_STAGES") else stages(config, extra)
            prefix = "" if config == H200 else Path(config).stem + "_"
            res.update({prefix + k: v for k, v in st.items()})
            ready[config] = not any(k.endswith("_error") for k in st)
        if not ready[config]:
            continue
        (out_dir / "e2e_partial.json").write_text(json.dumps(res, indent=1))
        if sets is None:
            res["warm_restart"] = warm_restart(extra)
            continue
        r, s = dflash_stage("train", "--config", config, "--no-progress", "--set", f"run_name=h200-{name}",
                            "--set", f"train.steps={steps}", "--set", "train.resume=false", *sets, *extra)
        (out_dir / f"train-{name}.log").write_text(r.stderr[-200000:])
        summ = REPO / "results" / "runs" / f"h200-{name}" / "summary.json"
        res[name] = {"exit": r.returncode, "wall_s": round(s, 1)}
        if summ.exists():
            sm = json.loads(summ.read_text())
            (out_dir / f"summary-{name}.json").write_text(json.dumps(sm, indent=1))
            res[name].update({k: sm.get(k) for k in ("steps", "measured_steps", "throughput", "time_split_s",
                                                      "seconds_to_first_step", "loss", "eval",
                                                      "devices", "compile", "replicas_identical", "replica_checksums",
                                                      "status", "failure")})
            (res[name]["compile"] or {}).pop("per_device", None)
    return res


def warm_restart(extra=()):
    """A restart with a warm cache: seconds from process start to the first training step."""
    r, s = dflash_stage("train", "--config", "config/h200.yaml", "--no-progress", "--set", "run_name=h200-restart",
                        "--set", "train.steps=12", "--set", "train.log_every=1", "--set",
                        "train.warmup_steps_excluded=1", "--set", "train.resume=false", *extra)
    m = REPO / "results" / "runs" / "h200-restart" / "metrics.jsonl"
    if m.exists():
        rows = [json.loads(x) for x in m.read_text().splitlines()]
        res = {"wall_s": round(s, 1), "first_logged_step_elapsed_s": rows[0]["elapsed_s"], "exit": r.returncode}
        sm = REPO / "results" / "runs" / "h200-restart" / "summary.json"
        if sm.exists():
            sm = json.loads(sm.read_text())
            c = sm["compile"]
            res.update(seconds_to_first_step=sm.get("seconds_to_first_step"),
                                       warmup_s=c["warmup_s"], cache_hits=c["cache_hits"], graphs=c["graphs"])
    else:
        res = {"exit": r.returncode, "stderr": r.stderr[-3000:]}
    return res


def stages(config, extra=()):
    """The target and data stages of `config` (both quick: a random target's config and tokenizer, synthetic data)."""
    res = {}
    for stage in ("target", "data"):
        r, s = dflash_stage(stage, "--config", config, "--no-progress", *extra)
        res[f"{stage}_s"] = round(s, 1)
        if r.returncode:
            res[f"{stage}_error"] = r.stderr[-3000:]
    return res


def profile(out_dir: Path, extra=()):
    """The real train stage of one e2e run (BENCH_PROFILE_RUN, a name of e2e_runs(), default 1t1d: 1 target + 1
    drafter on cuda:0; e.g. 1t1d-fp8all for the fastest) with train.profile over BENCH_PROFILE_WINDOW
    (start_step,steps; default 10,5: every graph is compiled before step 0, by the warm-up), reduced by reduce_trace.
    The run goes 12 steps past the window: the target, which runs ahead by up to train.queue_size batches, is then
    still working in the window (with 2 steps past it, a compiled target had finished its batches before the window).
    The gzipped chrome trace is copied to the output only under traces.KEEP_MB (15 MiB: the device returns files of up
    to 16). Recording the drafter thread's CPU ops slows its host side a little: compare busy_fraction with the run's
    own GPU utilisation (summary.devices)."""
    import shutil
    start, n = (int(x) for x in os.environ.get("BENCH_PROFILE_WINDOW", "10,5").split(","))
    run_name = os.environ.get("BENCH_PROFILE_RUN", "1t1d")
    runs = {k: v for k, v in e2e_runs().items() if v[1] is not None}
    if run_name not in runs:
        return {"error": f"unknown BENCH_PROFILE_RUN {run_name}; known: {', '.join(runs)}"}
    config, sets = runs[run_name]
    res = {} if os.environ.get("BENCH_SKIP_STAGES") else stages(config, extra)
    if any(k.endswith("_error") for k in res):
        return res
    name = "h200-profile"
    r, s = dflash_stage("train", "--config", config, "--no-progress", "--set", f"run_name={name}",
                        "--set", f"train.steps={start + n + 12}", "--set", "train.resume=false", *sets,
                        "--set", "train.check_every=0", "--set", "train.eval_every=0",
                        "--set", "train.profile=" + json.dumps({"start_step": start, "steps": n}), *extra)
    res.update(run=run_name, exit=r.returncode, wall_s=round(s, 1), window={"start_step": start, "steps": n})
    run = REPO / "results" / "runs" / name
    trace = run / "profile.json.gz"
    if r.returncode or not trace.exists():
        res["stderr"] = r.stderr[-3000:]
        return res
    if (run / "summary.json").exists():
        sm = json.loads((run / "summary.json").read_text())
        res["summary"] = {k: sm.get(k) for k in ("throughput", "time_split_s", "devices")}
    res["trace_mb"] = round(trace.stat().st_size / 2**20, 2)
    t0 = time.perf_counter()
    res["trace"] = reduce_trace(trace)
    res["reduce_s"] = round(time.perf_counter() - t0, 1)
    if trace.stat().st_size < KEEP_MB * 2**20:
        shutil.copy(trace, out_dir / "profile-trace.json.gz")
        res["trace_file"] = "profile-trace.json.gz"
    return res


SECTIONS = ("ceilings", "mask", "attention", "flex_tune", "loss", "drafter_variants", "specforge", "fp8", "target",
            "step_parts", "profile", "e2e")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sections", default="ceilings,mask,attention,loss,drafter_variants,target,e2e",
                   help=f"comma-separated, run in this order: {', '.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=120, help="optimizer steps of each e2e run")
    args = p.parse_args(argv)
    args.sections = [x for x in args.sections.split(",") if x]
    unknown = [x for x in args.sections if x not in SECTIONS]
    if unknown:
        p.error(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "date": datetime.now(timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "torch": torch.__version__,
              "cuda": torch.version.cuda}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except Exception:
        pass
    path = out / "bench.json"
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            if name == "e2e":
                result[name] = e2e(out, args.steps)
            elif name == "profile":
                result[name] = profile(out)
            else:
                result[name] = globals()[name]()
        except Exception:
            result[name] = {"error": traceback.format_exc()[-3000:]}
        result[name + "_section_s"] = round(time.perf_counter() - t0, 1)
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        path.write_text(json.dumps(result, indent=1))
        print(name, json.dumps(result[name])[:1500], flush=True)


if __name__ == "__main__":
    main()
