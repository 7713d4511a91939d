"""H200 benchmark: ceilings, micro-benchmarks and the real `train` stage on config/h200.yaml.

    python bench/h200.py --out bench/out [--sections ceilings,mask,attention,loss,drafter,target,e2e,threads]

Every section writes into one JSON (`<out>/bench.json`): the command, device, torch version and date are recorded
with the numbers, so a result under bench/results/ can be rerun. Shapes are the issue's: 3072-token context,
512 anchors x 16, Qwen3-8B target (36 layers, hidden 4096, 32/8 heads, head dim 128, vocab 151936), 5-layer drafter.
"""
from __future__ import annotations

import argparse
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
S, A, BK, H, V = 3072, 512, 16, 4096, 151936
DEV = torch.device("cuda")


def bench(fn, warmup=3, reps=10):
    """Median milliseconds of fn() with CUDA events."""
    for _ in range(warmup):
        fn()
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
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


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


def loss():
    import torch.nn.functional as F

    from dflash.model import dflash_loss
    Q = A * BK
    hidden = torch.randn(1, Q, H, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device=DEV, dtype=torch.bfloat16) * 0.02)
    labels = torch.randint(0, V, (1, Q), device=DEV)
    labels.view(1, A, BK)[:, :, 0] = -100
    weights = torch.ones(1, Q, device=DEV)
    out = {}
    for chunk in (2048, 4096, 8192):
        def chunked():
            dflash_loss(hidden, w, labels, weights, BK, chunk).loss.backward()
        out[f"chunked_{chunk}_ms"] = round(bench(chunked), 2)
        out[f"chunked_{chunk}_peak_gb"] = peak_gb(chunked)

    def naive():
        h = hidden.view(1, A, BK, H)[:, :, 1:].reshape(-1, H)
        lab = labels.view(1, A, BK)[:, :, 1:].reshape(-1)
        F.cross_entropy((h @ w.t()).float(), lab).backward()
    out["naive_ms"] = round(bench(naive), 2)
    out["naive_peak_gb"] = peak_gb(naive)
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss()

        def fused():
            h = hidden.view(1, A, BK, H)[:, :, 1:].reshape(-1, H)
            lab = labels.view(1, A, BK)[:, :, 1:].reshape(-1)
            liger(w, h, lab).backward()
        out["liger_fused_ms"] = round(bench(fused), 2)
        out["liger_fused_peak_gb"] = peak_gb(fused)
    except Exception as e:  # not installed or failed: say so
        out["liger_fused"] = f"unavailable: {type(e).__name__}: {e}"[:300]
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
    from types import SimpleNamespace

    from dflash import config as C
    from dflash.fingerprint import collect, compile_cache_dir
    from dflash.model import DrafterConfig
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
    tconf = SimpleNamespace(hidden_size=H, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            intermediate_size=12288, num_hidden_layers=36, vocab_size=V, rms_norm_eps=1e-6,
                            rope_theta=1e6, max_position_embeddings=40960)
    dcfg = DrafterConfig.from_target(tconf, loaded.cfg.drafter, 151669)
    feats = torch.randn(1, s, 5 * H, device=DEV, dtype=torch.bfloat16)
    ids = torch.randint(0, V, (1, s), device=DEV)
    mask = torch.ones(1, s, dtype=torch.bool, device=DEV)
    backend, compiled = name.split("+")[0], name.endswith("+compile")
    setup = RunContext(loaded, None, backend, Path("/tmp"), Path("/tmp"), tconf, dcfg, 7.0, {}, compiled)
    embed, head = random_head(setup, DEV, torch.bfloat16)
    model = build_drafter(setup, embed, head, DEV)
    opt, sched = optim.build([p for p in model.parameters() if p.requires_grad], loaded.cfg.train, DEV)
    counter = [0]

    def step():
        counter[0] += 1
        res = micro_step(model, feats, ids, mask, counter[0], setup, torch.bfloat16)
        res.loss.backward()
        opt.step()
        sched.step()
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
    model = cap = None
    torch.cuda.empty_cache()
    return {"capture_ms": round(ms, 2), "capture_ktok_s": round(S / ms, 2), "full_forward_ms": round(full, 2),
            "full_forward_ktok_s": round(S / full, 2), "build_s": round(build_s, 1)}


def dflash_stage(*args, timeout=900):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dflash", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    return r, time.perf_counter() - t0


def e2e(out_dir: Path, steps: int, extra=()):
    res = {}
    for stage in ("target", "data"):
        r, s = dflash_stage(stage, "--config", "config/h200.yaml", "--no-progress", *extra)
        res[f"{stage}_s"] = round(s, 1)
        if r.returncode:
            res[f"{stage}_error"] = r.stderr[-3000:]
            return res
    runs = {"1t1d": ["--set", 'train.drafters=["cuda:0"]'],
            "restart": None,
            "1t3d": ["--set", 'train.drafters=["cuda:0","cuda:0","cuda:0"]'],
            # two GPUs: the split layout (target on one, drafter on the other) in both runtimes, and data-parallel
            # drafter replicas on both GPUs (threads)
            "x2-split-dist": ["--set", 'train.drafters=["cuda:1"]', "--set", "train.runtime=distributed"],
            "x2-split-threads": ["--set", 'train.drafters=["cuda:1"]', "--set", "train.runtime=threads"],
            "x2-dp-threads": ["--set", 'train.drafters=["cuda:0","cuda:1"]', "--set", "train.runtime=threads"]}
    wanted = os.environ.get("BENCH_E2E_RUNS", ",".join(runs)).split(",")
    for name, sets in runs.items():
        if name not in wanted:
            continue
        (out_dir / "e2e_partial.json").write_text(json.dumps(res, indent=1))
        if sets is None:
            res["warm_restart"] = warm_restart(extra)
            continue
        r, s = dflash_stage("train", "--config", "config/h200.yaml", "--no-progress", "--set", f"run_name=h200-{name}",
                            "--set", f"train.steps={steps}", "--set", "train.resume=false", *sets, *extra)
        (out_dir / f"train-{name}.log").write_text(r.stderr[-200000:])
        summ = REPO / "results" / "runs" / f"h200-{name}" / "summary.json"
        res[name] = {"exit": r.returncode, "wall_s": round(s, 1)}
        if summ.exists():
            sm = json.loads(summ.read_text())
            (out_dir / f"summary-{name}.json").write_text(json.dumps(sm, indent=1))
            res[name].update({k: sm.get(k) for k in ("steps", "measured_steps", "throughput", "time_split_s",
                                                      "seconds_to_first_step", "loss",
                                                      "devices", "compile", "replicas_identical", "replica_checksums",
                                                      "status", "failure")})
            res[name]["compile"].pop("per_device", None)
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


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--sections", default="ceilings,mask,attention,loss,drafter_variants,target,e2e")
    p.add_argument("--steps", type=int, default=120)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([Path(sys.executable).name] + sys.argv), "date": datetime.now(timezone.utc).isoformat(),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except Exception:
        pass
    path = out / "bench.json"
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name == "e2e":
                result[name] = e2e(out, args.steps)
            else:
                result[name] = globals()[name]()
        except Exception:
            result[name] = {"error": traceback.format_exc()[-3000:]}
        result[name + "_section_s"] = round(time.perf_counter() - t0, 1)
        torch.cuda.empty_cache()
        path.write_text(json.dumps(result, indent=1))
        print(name, json.dumps(result[name])[:1500], flush=True)


if __name__ == "__main__":
    main()
