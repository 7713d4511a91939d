"""Sections on the drafter step alone: drafter_variants (the production step per backend, loss chunk and shape,
each in a fresh process, optionally with another tree's dflash: `base:`) and specforge (this project's step per
precision variant against SpecForge's OnlineDFlashModel, in one process, at the issue's three shapes).

No dflash import at module level: drafter_variants' processes import this module, then put the `base:` tree's
dflash first on sys.path (drafter_step)."""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch

from bench import shapes as SH
from bench.common import REPO, Option, Section, Stopwatch, median_ms
from bench.sections.kernels import device


def use_compile_cache():
    """The train stage's Inductor cache of this environment (results/compile/cache-<env hash>)."""
    from dflash.fingerprint import collect, compile_cache_dir
    from dflash.train.compile_guard import use_compile_cache as use
    use(compile_cache_dir(REPO / "results", collect()["hash"]))


def context_inputs(sh, s: int, g: torch.Generator | None = None):
    """The drafter's inputs for one sequence of s tokens: features [1, s, k*hidden] bf16, ids [1, s], mask [1, s]."""
    k = sh.drafter_config().num_context_layers
    feats = torch.randn(1, s, k * sh.hidden, generator=g).to(device(), torch.bfloat16)
    ids = torch.randint(0, sh.vocab, (1, s), generator=g).to(device())
    return feats, ids, torch.ones(1, s, dtype=torch.bool, device=device())


# ---- drafter_variants ------------------------------------------------------------------------------------------
def drafter_variants(job) -> dict:
    """The production drafter step (build_drafter + micro_step + AdamW), as train runs it, per variant and shape,
    each in a fresh process (so each peak is its own). Options: `variants`, comma list of
    [base:]BACKEND[+compile][:chunk=N][:casts=recompute][:SECTION.KEY=VALUE...] (`base:` runs the tree at option
    `base`, another commit's whole tree, e.g. from `git archive`, for before/after in one run; `:chunk=N` sets
    train.loss_chunk, `:casts=recompute` train.recompute_weight_casts, `:train.precision=fp8` any config key);
    `shapes`, comma list of CONTEXTxANCHORS (keys of a shape other
    than the config's end in @CONTEXTxANCHORS); `profile`, a file for a CUDA profile of the first variant at the first
    shape. Per variant: step_ms (median of 10), peak_gb (max allocated, GiB, weights and AdamW state included),
    peak_reserved_gb, first_step_s, drafter_only_ktok_s."""
    own = f"{job.shapes.context}x{job.shapes.anchors}"
    out = {}
    for i, shape in enumerate(job.opts["shapes"].split(",") if job.opts["shapes"] else [own]):
        for j, name in enumerate(job.opts["variants"].split(",")):
            base = name.startswith("base:")
            tree, spec = (job.opts["base"] or None, name[5:]) if base else (str(REPO), name)
            key = name if shape == own else f"{name}@{shape}"
            if tree is None:
                out[key] = {"error": "base: variant without the base option (BENCH_BASE)"}
                continue
            profile = job.opts["profile"] if i == j == 0 else ""
            code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from bench.sections import drafter; "
                    f"drafter.drafter_step({str(Path(tree).resolve())!r}, {spec!r}, {shape!r}, {profile!r})")
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


def variant_sets(spec: str, anchors: int) -> tuple[str, bool, dict]:
    """BACKEND[+compile][:chunk=N][:casts=recompute][:SECTION.KEY=VALUE...] -> (backend, compiled, config keys); a
    dotted KEY is any config key, its VALUE read as YAML (`:train.precision=fp8:train.fp8_recipe=rowwise`)."""
    import yaml
    name, *opts = spec.split(":")
    sets = {"train.num_anchors": anchors}
    for o in opts:
        k, v = o.split("=", 1)
        if "." in k:
            sets[k] = yaml.safe_load(v)
        else:
            sets[{"chunk": "train.loss_chunk", "casts": "train.recompute_weight_casts"}[k]] = (
                v == "recompute" if k == "casts" else int(v))
    return name.split("+")[0], name.endswith("+compile"), sets


def drafter_step(tree: str, spec: str, shape: str, profile: str = ""):
    """One drafter_variants measurement in this process, with the dflash package of `tree`; prints one JSON line.
    The step is the trainer's (our_step: warm-up, micro_step, the clip and the optimizer as Replica runs them), so a
    `base:` tree's step is the one that tree trains with."""
    sys.path.insert(0, tree)
    use_compile_cache()   # share the train stage's cache
    s, a = (int(x) for x in shape.split("x"))
    backend, compiled, sets = variant_sets(spec, a)
    feats, ids, mask = context_inputs(SH.load(SH.H200, sets), s)
    torch.cuda.reset_peak_memory_stats()
    first = Stopwatch()
    step = our_step(a, feats, ids, mask, sets, backend, compiled)
    step()
    torch.cuda.synchronize()
    out = {"first_step_s": round(first.s, 1)}
    out["step_ms"] = round(median_ms(step, warmup=3, reps=10), 2)
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


def specforge_shape(sh) -> dict:
    """specforge_step's model arguments for the bench config's drafter and target."""
    d = sh.drafter_config()
    return {"vocab": sh.vocab, "layers": d.num_layers, "heads": (d.num_attention_heads, d.num_key_value_heads,
            d.head_dim), "inter": d.intermediate_size, "target_layers": sh.arch.num_hidden_layers,
            "context_layers": d.num_context_layers, "rope_theta": d.rope_theta, "rms_norm_eps": d.rms_norm_eps,
            "max_positions": d.max_position_embeddings, "mask_id": sh.mask_id,
            "block": sh.block, "gamma": sh.gamma, "lr": sh.cfg.train.lr}


def specforge_step(num_anchors, feats, ids, loss_mask, *, vocab, layers, heads, inter, target_layers, context_layers,
                   rope_theta, rms_norm_eps, max_positions, mask_id, block, gamma, lr, attention="flex_attention"):
    """SpecForge's DFlash training step as its trainer runs it: OnlineDFlashModel (bf16 weights, its own anchor
    sampling, block mask and chunked loss) + BF16Optimizer (fp32 master weights, AdamW, clip, cosine).
    feats [1, S, context_layers*hidden] (their dtype is the model's), ids [1, S], loss_mask [1, S]."""
    from transformers import Qwen3Config
    fam, draft, optmod, _ = load_specforge()
    h = feats.shape[-1] // context_layers
    cfg = Qwen3Config(hidden_size=h, num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=heads[2],
                      intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab, rms_norm_eps=rms_norm_eps,
                      rope_theta=rope_theta, max_position_embeddings=max_positions)
    cfg.block_size, cfg.num_target_layers = block, target_layers
    cfg.dflash_config = {"target_layer_ids": draft.build_target_layer_ids(target_layers, context_layers),
                         "mask_token_id": mask_id}
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
    wrapped = fam.OnlineDFlashModel(model, head, embed, mask_token_id=mask_id, block_size=block,
                                    attention_backend=attention, num_anchors=num_anchors,
                                    loss_decay_gamma=gamma).to(dev, dt)
    opt = optmod.BF16Optimizer(model, lr=lr, max_grad_norm=1.0, total_steps=1000, warmup_ratio=0.04)
    lm = loss_mask.to(dt)

    def step():
        loss, _, _ = wrapped(input_ids=ids, hidden_states=feats, loss_mask=lm)
        loss.backward()
        opt.step()
        return loss.detach()
    return step


def our_step(num_anchors, feats, ids, loss_mask, sets=None, backend: str = "flex", compiled: bool = True):
    """This project's drafter step as train runs it: build_drafter (compiled flex layers by default, warmed up for
    this shape, with the optimizer's compiled step where train compiles it) and the trainer's Replica: micro_step
    (fused loss), then optimizer_step (the global-weight-sum scale and the clip applied where the optimizer reads the
    gradients) with its schedule; config/h200.yaml with train.num_anchors = num_anchors and the config keys `sets`
    (e.g. FP8_VARIANTS[name])."""
    from dflash.train.runtime.threads import GradSync
    from dflash.train.step import build_drafter, random_head
    from dflash.train.trainer import Micro, Replica
    sh = SH.load(SH.H200, {"train.num_anchors": num_anchors, **(sets or {})})
    setup = sh.run_context(backend, compiled, shapes=[tuple(ids.shape)])
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
        build = Stopwatch()
        step = make()
        out["build_s"] = round(build.s, 1)
        torch.cuda.reset_peak_memory_stats()   # a build's transients (fp32 init before a bf16 cast) not counted
        first = Stopwatch()
        out["first_loss"] = round(float(step()), 4)
        torch.cuda.synchronize()
        out["first_step_s"] = round(first.s, 1)
        out["step_ms"] = round(median_ms(step, warmup=1, reps=reps), 2)
        out["peak_gb"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
        out["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    except Exception as e:   # OOM or an incompatibility: recorded, the next one runs
        out["error"] = f"{type(e).__name__}: {e}"[:1500]
        out["traceback"] = traceback.format_exc()[-1500:]
    step = None
    gc.collect()
    torch.cuda.empty_cache()
    return out


# the drafter step's precision variants (option specforge.variants): config keys over config/h200.yaml
FP8_VARIANTS = {"bf16": {},
                "fp8": {"train.precision": "fp8"},                                    # layers, tensorwise
                "fp8-rowwise": {"train.precision": "fp8", "train.fp8_recipe": "rowwise"},
                "fp8-gw-hp": {"train.precision": "fp8", "train.fp8_recipe": "rowwise_with_gw_hp"},
                "head": {"train.fp8_lm_head": True},                                  # the LM head alone
                "fp8head": {"train.precision": "fp8", "train.fp8_lm_head": True}}     # layers + head


def compare_row(row: dict, variants: list[str]) -> None:
    """SpecForge / ours (speedup, memory_ratio) and each variant against bf16 (vs_bf16, loss_vs_bf16), in place."""
    o, f = row.get("ours", {}), row.get("specforge", {})
    if "step_ms" in o and "step_ms" in f:
        row["speedup"] = round(f["step_ms"] / o["step_ms"], 3)
        row["memory_ratio"] = round(o["peak_gb"] / f["peak_gb"], 3)
    for v in variants:
        r = row.get(f"ours-{v}", {})
        if "step_ms" in o and "step_ms" in r:
            row.setdefault("vs_bf16", {})[v] = round(o["step_ms"] / r["step_ms"], 3)
            row.setdefault("loss_vs_bf16", {})[v] = round(r["first_loss"] / o["first_loss"], 5)


def specforge(job) -> dict:
    """The drafter step (forward + backward + optimizer step) at the issue's three shapes (bench.shapes.issue_shapes),
    this project's per option `variants` (names of FP8_VARIANTS, keyed `ours` for bf16 and `ours-<name>` for the
    others, with `vs_bf16`: bf16 ms / its ms and `loss_vs_bf16`: its first loss / bf16's, same weights, batch and
    anchors) and SpecForge's OnlineDFlashModel (flex attention; option `skip` leaves it out) one after the other in
    this process: median ms and peak GB."""
    from dflash.train import compile_guard
    use_compile_cache()
    variants = job.opts["variants"].split(",")
    unknown = [v for v in variants if v not in FP8_VARIANTS]
    if unknown:
        return {"error": f"unknown BENCH_SF_VARIANTS {unknown}; known: {', '.join(FP8_VARIANTS)}"}
    compile_guard.configure_thread(8, len(variants) + 1)   # recompile limit for every variant's and SpecForge's shapes
    out = {}
    try:
        out["specforge_version"] = load_specforge()[3]
    except Exception as e:
        out["specforge_version"] = f"unavailable: {type(e).__name__}: {e}"[:300]
    reps = int(job.opts["reps"])
    shapes = [tuple(map(int, x.split("/"))) for x in job.opts["shapes"].split(",")] if job.opts["shapes"] \
        else SH.issue_shapes()
    theirs = specforge_shape(job.shapes)
    for s, a in shapes:
        feats, ids, mask = context_inputs(job.shapes, s, torch.Generator(device="cpu").manual_seed(s))
        row = {}
        for v in variants:
            key = "ours" if v == "bf16" else f"ours-{v}"
            row[key] = measure_step(lambda: our_step(a, feats, ids, mask, FP8_VARIANTS[v]), reps)
            print("specforge", s, a, v, json.dumps(row[key])[:400], flush=True)
        if not job.opts["skip"]:
            row["specforge"] = measure_step(lambda: specforge_step(a, feats, ids, mask, **theirs), reps)
        compare_row(row, variants)
        out[f"{s}/{a}"] = row
        feats = ids = mask = None
        print("specforge", s, a, json.dumps(row)[:600], flush=True)
    return out


SECTIONS = [
    Section("drafter_variants", drafter_variants, "the production drafter step per variant and shape, one process each",
            default=True, options=(
                Option("variants", "flex+compile,flex,sdpa",
                       "[base:]BACKEND[+compile][:chunk=N][:casts=recompute][:KEY=VALUE],...",
                       "BENCH_VARIANTS"),
                Option("shapes", "", "CONTEXTxANCHORS,... (default: the config's)", "BENCH_SHAPES"),
                Option("profile", "", "a file for a CUDA profile table of the first variant", "BENCH_PROFILE"),
                Option("base", "", "the tree `base:` variants import dflash from (bench/base_tree.sh)", "BENCH_BASE"))),
    Section("specforge", specforge, "our drafter step per precision variant against SpecForge's, same process",
            options=(
                Option("variants", "bf16", f"names of FP8_VARIANTS: {', '.join(FP8_VARIANTS)}", "BENCH_SF_VARIANTS"),
                Option("skip", "", "non-empty: leave SpecForge's step out", "BENCH_SF_SKIP"),
                Option("reps", "5", "timed steps of each", "BENCH_SF_REPS"),
                Option("shapes", "", "CONTEXT/ANCHORS,... (default: bench.shapes.issue_shapes)", "BENCH_SF_SHAPES"))),
]
