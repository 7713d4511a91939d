"""torch.profiler chrome traces (.json or .json.gz) reduced to where the time goes.

- `reduce_trace(path)`: the train stage's profile window (bench/h200.py `profile`): per GPU its busy fraction, busy
  time per stream and its kernels' time per step in groups (`group`), with how much of it overlapped another
  stream's kernels, top kernels, idle gaps with what the CPU was
  doing, host syncs and the trainer's phases.
- `step_table(path, annotation)`: a window of annotated steps (bench/regen.py `--profile`: decode steps): the work
  launched inside the annotated ranges, per step, and the rest, each in groups (`group`: gemm, attention,
  fp8 scale+cast, elementwise+copies, sampling, other) and top names.
- `keep(trace, dest)`: a gzipped trace copied beside the results (named `*.trace.json.gz`, git-ignored) when small
  enough for the device to bring back.
Times in ms. CPU ops are those of the profiling thread only (torch.profiler records the thread that opens it).
"""
from __future__ import annotations

import gzip
import json
import re
import shutil
from bisect import bisect_right
from collections import defaultdict
from pathlib import Path

KEEP_MB = 15   # a gzipped trace is kept beside the results below this: the device returns files of at most 16 MiB
TRACE_SUFFIX = ".trace.json.gz"   # a kept trace's name ends so: git-ignored (.gitignore), traces stay out of git
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
PHASES = ("queue_wait", "drafter_fwd_bwd", "optimizer")   # record_function ranges of the trainer loop
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "aten::item",
         "aten::_local_scalar_dense")
# kernel (GPU) or aten op (CPU) name -> group; the first pattern that matches wins (the memory-efficient attention
# kernel is a cutlass kernel: attention is tried before gemm)
GROUPS = (("attention", r"attention|attn|fmha|flash|sdpa|flex|decoding"),
          ("gemm", r"gemm|nvjet|xmma|cublas|cutlass|splitk|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
          # torchao float8's scales and casts: Inductor kernels taking an abs-max or scaling for _scaled_mm (often
          # fused with a norm or an activation, whose time they then hold too)
          ("fp8 scale+cast", r"^triton_.*(amax|_abs_|_abs$|abs_max|_scaled_mm|reciprocal)"),
          ("sampling", r"(^|[_:.])(argmax|argmin|softmax|multinomial|topk|sort|isin)"),
          ("elementwise+copies", r"^triton_|elementwise|vectorized|copy|memcpy|memset|fill|index|cat|gather|scatter"
                                 r"|reduce|^aten::"))


def keep(trace, dest) -> dict:
    """{trace_mb} of a gzipped trace, and a copy at `dest` ({trace_file: its name}) when under KEEP_MB."""
    mb = Path(trace).stat().st_size / 2**20
    if mb >= KEEP_MB:
        return {"trace_mb": round(mb, 2)}
    shutil.copy(trace, dest)
    return {"trace_mb": round(mb, 2), "trace_file": Path(dest).name}


def group(name: str) -> str:
    return next((g for g, pat in GROUPS if re.search(pat, name, re.IGNORECASE)), "other")


def load_events(path) -> list[dict]:
    """The complete ("X") events of a chrome trace."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    out = []
    for a, e in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([a, e])
    return out


def _covered(union, a, e) -> float:
    """How much of [a, e) the merged intervals `union` cover."""
    i, t = max(bisect_right(union, [a, float("inf")]) - 1, 0), 0.0
    while i < len(union) and union[i][0] < e:
        t += max(0.0, min(e, union[i][1]) - max(a, union[i][0]))
        i += 1
    return t


def _totals(events) -> dict:
    """name (first 140 characters) -> [count, microseconds]."""
    names = defaultdict(lambda: [0, 0.0])
    for e in events:
        names[e["name"][:140]][0] += 1
        names[e["name"][:140]][1] += e["dur"]
    return names


def reduce_trace(path, top=15, gap_ms=1.0, gaps_listed=15) -> dict:
    """A torch.profiler chrome trace -> where the GPU time goes, per GPU: busy fraction of the
    window (first to last GPU activity), busy time per stream (the stream holding the drafter's annotations is the
    drafter's; the target runs on its own), the top kernels, idle gaps longer than gap_ms with what the profiled
    (drafter) thread was doing on the CPU then, and host syncs and annotated phases (queue_wait, drafter_fwd_bwd, optimizer)."""
    ev = load_events(path)
    gpu = [e for e in ev if e.get("cat") in DEVICE_CATS]
    host = sorted((e for e in ev if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")),
                  key=lambda e: e["ts"])
    out = {"events": len(ev), "steps": sum(1 for e in ev if e.get("cat") == "user_annotation" and e["name"] == "optimizer")}
    phases = defaultdict(lambda: defaultdict(float))
    for e in ev:
        if e["name"] in PHASES and e.get("cat") in ("user_annotation", "gpu_user_annotation"):
            key = "cpu_ms" if e["cat"] == "user_annotation" else "gpu_ms"
            phases[e["name"]][key] += e["dur"] / 1e3
            phases[e["name"]]["count_" + key[:3]] += 1
    out["phases"] = {k: {m: round(x, 2) for m, x in v.items()} for k, v in phases.items()}
    syncs = defaultdict(lambda: [0, 0.0])
    for e in host:
        if e["name"] in SYNCS:
            syncs[e["name"]][0] += 1
            syncs[e["name"]][1] += e["dur"] / 1e3
    out["host_syncs"] = {k: {"count": c, "ms": round(t, 2)} for k, (c, t) in syncs.items()}
    drafter_streams = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "gpu_user_annotation"}
    main = {e["tid"] for e in ev if e.get("cat") == "user_annotation"}   # the profiled (drafter) thread
    out["gpus"] = {}
    for dev in sorted({e["pid"] for e in gpu}, key=str):
        g = [e for e in gpu if e["pid"] == dev]
        busy = _union((e["ts"], e["ts"] + e["dur"]) for e in g)
        t0, t1 = busy[0][0], busy[-1][1]
        busy_us = sum(e - a for a, e in busy)
        streams = {}
        per_step = max(out["steps"], 1) * 1e3
        for tid in {e["tid"] for e in g}:
            u = _union((e["ts"], e["ts"] + e["dur"]) for e in g if e["tid"] == tid)
            others = _union((e["ts"], e["ts"] + e["dur"]) for e in g if e["tid"] != tid)
            mine = [e for e in g if e["tid"] == tid]
            per_group, shared = defaultdict(float), defaultdict(float)
            for e in mine:
                k = group(e["name"])
                per_group[k] += e["dur"]
                shared[k] += _covered(others, e["ts"], e["ts"] + e["dur"])
            order = sorted(per_group, key=lambda k: -per_group[k])
            streams[str(tid)] = {"busy_ms": round(sum(e - a for a, e in u) / 1e3, 2),
                                 "kernels": len(mine),
                                 "group_ms_per_step": {k: round(per_group[k] / per_step, 2) for k in order},
                                 # of that, the time another stream of this GPU ran kernels too
                                 "group_overlapped_ms_per_step": {k: round(shared[k] / per_step, 2) for k in order},
                                 "role": "drafter" if (dev, tid) in drafter_streams else "other (target)"}
        names = _totals(g)
        total = sum(t for _, t in names.values()) or 1.0
        kernels = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
        gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:]) if b_start - a_end > gap_ms * 1e3]
        listed = []
        for a, e in sorted(gaps, key=lambda x: x[0] - x[1])[:gaps_listed]:
            # what the CPU was doing: host events covering most of the gap, outermost first, then the innermost two
            at = [h for h in host if min(e, h["ts"] + h["dur"]) - max(a, h["ts"]) > (e - a) / 2]
            listed.append({"at_ms": round((a - t0) / 1e3, 2), "ms": round((e - a) / 1e3, 2),
                           "cpu": [h["name"][:100] + ("" if h["tid"] in main else f" (thread {h['tid']})")
                                   for h in (at if len(at) <= 3 else at[:1] + at[-2:])]})
        out["gpus"][str(dev)] = {
            "window_ms": round((t1 - t0) / 1e3, 2), "busy_ms": round(busy_us / 1e3, 2),
            "busy_fraction": round(busy_us / max(t1 - t0, 1e-9), 4),
            "window_ms_per_step": round((t1 - t0) / 1e3 / out["steps"], 2) if out["steps"] else None,
            "streams": streams,
            "idle_gaps_over_ms": {"threshold_ms": gap_ms, "count": len(gaps),
                                  "total_ms": round(sum(e - a for a, e in gaps) / 1e3, 2), "longest": listed},
            "top_kernels": [{"name": k, "count": c, "ms": round(t / 1e3, 2), "share": round(t / total, 4)}
                            for k, (c, t) in kernels]}
    return out


def _self_time_ops(ev) -> list[dict]:
    """The CPU ops, each with its self time as `dur` (its time less that of the CPU ops directly inside it, on its
    thread): they add up without double counting, and a wrapper (aten::linear) leaves its time to what it calls."""
    ops = sorted(({**e} for e in ev if e.get("cat") == "cpu_op"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    stack = []
    for e in ops:
        end = e["ts"] + e["dur"]
        while stack and (stack[-1][0]["tid"] != e["tid"] or stack[-1][1] <= e["ts"]):
            stack.pop()
        if stack:
            stack[-1][0]["dur"] -= e["dur"]
        stack.append((e, end))
    return ops


def _part(events, per: int, top: int) -> dict:
    """ms (divided by `per`), ms and share per group, the top names with their group."""
    names = _totals(events)
    total = sum(t for _, t in names.values())
    groups = defaultdict(float)
    for name, (_, t) in names.items():
        groups[group(name)] += t
    return {"ms": round(total / 1e3 / per, 3),
            "groups": {g: {"ms": round(groups[g] / 1e3 / per, 3), "share": round(groups[g] / (total or 1.0), 4)}
                       for g in sorted(groups, key=lambda g: -groups[g])},
            "top": [{"name": k, "group": group(k), "count": round(c / per, 2), "ms": round(t / 1e3 / per, 3),
                     "share": round(t / (total or 1.0), 4)}
                    for k, (c, t) in sorted(names.items(), key=lambda kv: -kv[1][1])[:top]]}


def step_table(path, annotation: str, top=15) -> dict:
    """A profiled window holding `annotation` ranges (one per step) -> {device, steps, step: the work launched inside
    the ranges, per step, outside: the rest, in total (for a decode window: the prefill, the cache and mask set-up and
    the loop's bookkeeping)}, each part as `_part`. The work is the GPU's kernels, memcpys and memsets when the trace
    has any: a kernel is a step's when the runtime call that launched it (matched by correlation id; a CUDA graph's
    kernels carry its launch's) lies in a range of its thread. Without GPU work (a CPU run) it is the CPU ops' self
    times, a step's when the op lies in a range of its thread. `steps_with_work`: the ranges that got any work; the
    per-step figures are over those (the profiler can drop a session's first kernel records: torch 2.10's kineto
    discards records stamped before its window starts, pytorch#192021), so a step whose kernels were lost does not
    halve the others' time."""
    ev = load_events(path)
    ranges = defaultdict(list)                             # thread -> sorted (start, end) of the annotated ranges
    for e in sorted(ev, key=lambda e: e["ts"]):
        if e.get("cat") == "user_annotation" and e["name"] == annotation:
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))

    def inside(tid, ts):
        """The range (thread, index) holding ts, or None."""
        r = ranges.get(tid, [])
        i = bisect_right(r, (ts, float("inf"))) - 1
        return (tid, i) if i >= 0 and r[i][0] <= ts < r[i][1] else None
    gpu = [e for e in ev if e.get("cat") in DEVICE_CATS]
    if gpu:
        launch = {e["args"]["correlation"]: (e["tid"], e["ts"]) for e in ev
                  if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        work = [(e, inside(*launch[c]) if (c := e.get("args", {}).get("correlation")) in launch else None)
                for e in gpu]
    else:
        work = [(e, inside(e["tid"], e["ts"])) for e in _self_time_ops(ev)]
    steps = sum(len(r) for r in ranges.values())
    seen = len({s for _, s in work if s is not None})
    return {"device": "gpu" if gpu else "cpu", "steps": steps, "steps_with_work": seen,
            "step": _part([e for e, s in work if s is not None], max(seen, 1), top),
            "outside": _part([e for e, s in work if s is None], 1, top)}


if __name__ == "__main__":   # python bench/traces.py TRACE.json.gz: a train profile's trace reduced again, as JSON
    import sys
    print(json.dumps(reduce_trace(sys.argv[1]), indent=1))
