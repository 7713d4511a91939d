"""Sections that run the real `train` stage (`python -m dflash train`): e2e, one run per entry of e2e_runs() on
config/h200.yaml (or h200-long.yaml), with a warm restart; and profile, one of those runs under train.profile, its
trace reduced to where GPU time goes (bench/traces.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import traces
from bench.common import REPO, Option, Section, Stopwatch, portable
from bench.shapes import H200, LONG, LONG32K

OPT_IN = ("long", "long32k", "1t1d-eager", "1t1d-fp8", "1t1d-fp8head", "1t1d-fp8all", "1t1d-fp8target")   # only when named
SUMMARY_KEYS = ("steps", "measured_steps", "throughput", "time_split_s", "seconds_to_first_step", "loss", "eval",
                "devices", "compile", "replicas_identical", "replica_checksums", "status", "failure")


def dflash_stage(*args, timeout=900):
    """`python -m dflash ARGS` in the repository: (the completed process, wall seconds)."""
    wall = Stopwatch()
    r = subprocess.run([sys.executable, "-m", "dflash", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    return r, wall.s


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
            # long context: config/h200-long.yaml's buckets and anchors, 1 target + 1 drafter
            "long": (LONG, one),
            # 32K-token contexts: config/h200-32k.yaml (h200-long.yaml with a 32K bucket), 1 target + 1 drafter
            "long32k": (LONG32K, one),
            # 1t1d with the target eager (config/h200.yaml compiles it: train.compile_target)
            "1t1d-eager": (H200, [*one, "--set", "train.compile_target=false"]),
            # FP8 (issue 28): the drafter's layers; + the frozen LM head; + the target's forward
            "1t1d-fp8": (H200, [*one, *fp8]),
            "1t1d-fp8head": (H200, [*one, *fp8, "--set", "train.fp8_lm_head=true"]),
            "1t1d-fp8all": (H200, [*one, *fp8, "--set", "train.fp8_lm_head=true", "--set", "train.fp8_target=true",
                                   "--set", "train.eval_every=0"]),   # tau under an FP8 target is refused
            # the target's FP8 forward on its own, the drafter in bf16
            "1t1d-fp8target": (H200, [*one, "--set", "train.fp8_target=true", "--set", "train.eval_every=0"])}


def stages(config, extra=()) -> dict:
    """The target and data stages of `config` (both quick: a random target's config and tokenizer, synthetic data)."""
    res = {}
    for stage in ("target", "data"):
        r, s = dflash_stage(stage, "--config", config, "--no-progress", *extra)
        res[f"{stage}_s"] = round(s, 1)
        if r.returncode:
            res[f"{stage}_error"] = r.stderr[-3000:]
    return res


def train_run(job, name: str, config: str, sets: list[str], extra=()) -> dict:
    """One e2e run: its log, and its summary.json beside the bench's JSON (with the tree the bench ran: `bench`)."""
    r, s = dflash_stage("train", "--config", config, "--no-progress", "--set", f"run_name=h200-{name}",
                        "--set", f"train.steps={job.steps}", "--set", "train.resume=false", *sets, *extra)
    (job.out / f"train-{name}.log").write_text(portable(r.stderr[-200000:]))
    summ = REPO / "results" / "runs" / f"h200-{name}" / "summary.json"
    res = {"exit": r.returncode, "wall_s": round(s, 1)}
    if summ.exists():
        sm = json.loads(summ.read_text())
        sm["bench"] = {"command": job.record.get("command"), "tree": job.record.get("tree")}
        (job.out / f"summary-{name}.json").write_text(json.dumps(portable(sm), indent=1))
        res.update({k: sm.get(k) for k in SUMMARY_KEYS})
        (res["compile"] or {}).pop("per_device", None)
    return res


def e2e(job, extra=()) -> dict:
    """The train stage end to end, one run per name of option `runs` (default: every entry of e2e_runs() but those in
    OPT_IN; a name not in e2e_runs() is refused before anything runs), in the table's order; each config's target and
    data stages run once, before its first run (option skip_stages: already built, by another bench process)."""
    runs = e2e_runs()
    wanted = (job.opts["runs"] or ",".join(k for k in runs if k not in OPT_IN)).split(",")
    unknown = [w for w in wanted if w not in runs]
    if unknown:   # a misspelt name would run nothing for it, silently
        return {"error": f"unknown BENCH_E2E_RUNS / e2e.runs {', '.join(unknown)}; known: {', '.join(runs)}"}
    res, ready = {}, {}
    for name, (config, sets) in runs.items():
        if name not in wanted:
            continue
        if config not in ready:
            st = {} if job.opts["skip_stages"] else stages(config, extra)
            prefix = "" if config == H200 else Path(config).stem + "_"
            res.update({prefix + k: v for k, v in st.items()})
            ready[config] = not any(k.endswith("_error") for k in st)
        if not ready[config]:
            continue
        (job.out / "e2e_partial.json").write_text(json.dumps(portable(res), indent=1))
        if sets is None:
            res["warm_restart"] = warm_restart(extra)
        else:
            res[name] = train_run(job, name, config, sets, extra)
    return res


def warm_restart(extra=()) -> dict:
    """A restart with a warm cache: seconds from process start to the first training step."""
    r, s = dflash_stage("train", "--config", H200, "--no-progress", "--set", "run_name=h200-restart",
                        "--set", "train.steps=12", "--set", "train.log_every=1", "--set",
                        "train.warmup_steps_excluded=1", "--set", "train.resume=false", *extra)
    run = REPO / "results" / "runs" / "h200-restart"
    if not (run / "metrics.jsonl").exists():
        return {"exit": r.returncode, "stderr": r.stderr[-3000:]}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    res = {"wall_s": round(s, 1), "first_logged_step_elapsed_s": rows[0]["elapsed_s"], "exit": r.returncode}
    if (run / "summary.json").exists():
        sm = json.loads((run / "summary.json").read_text())
        c = sm["compile"]
        res.update(seconds_to_first_step=sm.get("seconds_to_first_step"), warmup_s=c["warmup_s"],
                   cache_hits=c["cache_hits"], graphs=c["graphs"])
    return res


def profile(job, extra=()) -> dict:
    """The real train stage of one e2e run (option `run`, a name of e2e_runs(), default 1t1d: 1 target + 1 drafter on
    cuda:0; e.g. 1t1d-fp8all for the fastest) with train.profile over option `window` (start_step,steps; default 10,5:
    every graph is compiled before step 0, by the warm-up), reduced by traces.reduce_trace. The run goes 12 steps past
    the window: the target, which runs ahead by up to train.queue_size batches, is then still working in the window
    (with 2 steps past it, a compiled target had finished its batches before the window). The gzipped chrome trace is
    copied beside the JSON (profile.trace.json.gz: git-ignored) only under traces.KEEP_MB. Recording the drafter
    thread's CPU ops slows its host side a little: compare busy_fraction with the run's own GPU utilisation
    (summary.devices)."""
    start, n = (int(x) for x in job.opts["window"].split(","))
    run_name = job.opts["run"]
    runs = {k: v for k, v in e2e_runs().items() if v[1] is not None}
    if run_name not in runs:
        return {"error": f"unknown BENCH_PROFILE_RUN {run_name}; known: {', '.join(runs)}"}
    config, sets = runs[run_name]
    res = {} if job.opts["skip_stages"] else stages(config, extra)
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
    reduce = Stopwatch()
    res["trace"] = traces.reduce_trace(trace)
    res["reduce_s"] = round(reduce.s, 1)
    res.update(traces.keep(trace, job.out / f"profile{traces.TRACE_SUFFIX}"))
    return res


SKIP = Option("skip_stages", "", "non-empty: the target and data stages are built already", "BENCH_SKIP_STAGES")
SECTIONS = [
    Section("profile", profile, "one e2e run under train.profile, its trace reduced to where GPU time goes", options=(
        Option("run", "1t1d", "the e2e run profiled", "BENCH_PROFILE_RUN"),
        Option("window", "10,5", "START_STEP,STEPS of the profiler's window", "BENCH_PROFILE_WINDOW"), SKIP)),
    Section("e2e", e2e, "the train stage end to end, one run per e2e_runs() name", default=True, options=(
        Option("runs", "", f"names of e2e_runs() (default: all but {', '.join(OPT_IN)})", "BENCH_E2E_RUNS"), SKIP)),
]
