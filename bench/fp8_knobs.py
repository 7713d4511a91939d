"""The FP8 drafter step (FP8 layers + FP8 head, config/h200.yaml's shapes: the production step of bench/sections/
drafter.py's our_step) under Inductor config knobs, each in a fresh process: step ms (median of 10) and GPU ms a step
per bench/traces.py group over 3 profiled steps, with the largest FP8 scale-and-cast kernels. It asks whether
Inductor's tiling or tuning shortens the casts that write each activation again (issue 51).

    python3 bench/fp8_knobs.py OUT.json [KNOB ...]       # KNOB: names of KNOBS (default: all); on a lent GPU
    SPEC=...  other drafter_variants spec;  KNOB_TIMEOUT=s  per knob (default 200)
Used for bench/results/2026-12-07-h100-r11 (only `base` finished inside that call)."""
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KNOBS = {"base": {},
         "cdt": {"coordinate_descent_tuning": True},
         "nd": {"triton.prefer_nd_tiling": True},
         "nd3": {"triton.prefer_nd_tiling": True, "triton.max_tiles": 3},
         "apw": {"max_autotune_pointwise": True},
         "nd-cdt": {"triton.prefer_nd_tiling": True, "coordinate_descent_tuning": True}}
SPEC = os.environ.get("SPEC", "flex+compile:train.precision=fp8:train.fp8_lm_head=true")


def set_knobs(knobs: dict) -> None:
    import torch._inductor.config as ic
    for key, value in knobs.items():
        *path, last = key.split(".")
        obj = ic
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, value)


def measure(name: str) -> dict:
    """One knob set in this process: build and warm the step, time it, profile 3 steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    set_knobs(KNOBS[name])
    sys.path.insert(0, str(REPO))
    from bench import shapes as SH, traces
    from bench.common import median_ms
    from bench.sections import drafter as D
    backend, compiled, sets = D.variant_sets(SPEC, 0)
    sets.pop("train.num_anchors")
    shapes = SH.load(SH.H200, sets)
    sets["train.num_anchors"] = shapes.anchors
    feats, ids, mask = D.context_inputs(shapes, shapes.context)
    t = time.time()
    step = D.our_step(shapes.anchors, feats, ids, mask, sets, backend, compiled)
    step()
    torch.cuda.synchronize()
    out = {"knobs": KNOBS[name], "first_step_s": round(time.time() - t, 1),
           "step_ms": round(median_ms(step, warmup=3, reps=10), 2)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    groups, casts = collections.Counter(), collections.Counter()
    for e in prof.key_averages():
        ms = getattr(e, "device_time_total", 0) / 1e3 / 3
        if ms > 0 and not e.key.startswith("ProfilerStep"):
            groups[traces.group(e.key)] += ms
            if traces.group(e.key) == "fp8 scale+cast":
                casts[e.key[:120]] += ms
    out["group_ms"] = {k: round(v, 2) for k, v in groups.most_common()}
    out["top_casts_ms"] = {k: round(v, 2) for k, v in casts.most_common(12)}
    return out


def main(out_path: str, names: list[str]) -> None:
    res = {"spec": SPEC}
    for name in names or list(KNOBS):
        t = time.time()
        try:
            r = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True,
                               timeout=int(os.environ.get("KNOB_TIMEOUT", 200)))
            lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            res[name] = json.loads(lines[-1][7:]) if lines else {"error": r.stderr[-2000:]}
        except subprocess.TimeoutExpired:
            res[name] = {"error": "timed out"}
        res[name]["wall_s"] = round(time.time() - t, 1)
        print(name, json.dumps(res[name])[:600], flush=True)
        Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print("RESULT " + json.dumps(measure(sys.argv[2])), flush=True)
    else:
        main(sys.argv[1], sys.argv[2:])
