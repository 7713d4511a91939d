"""The seed layout on several GPUs, through `snakemake` as a user runs it, in one bounded call (issue 18).

    python bench/multi_gpu.py --out OUT [--gpus N] [--budget 520] [--parts threads,dist,kill]
    python bench/multi_gpu.py --out OUT --cpu          # the same logic on the CPU: config/config.yaml, gloo

Parts, in --parts order (default threads,dist,kill), each timed and bounded by what is left of --budget (a failing
part cannot eat the others' time):
  threads  snakemake up to the run's summary (the first part also builds target, data and the warm-up) on
           config/seed-2gpu.yaml, train.runtime threads, --steps steps: replicas identical, no FX-tracing error,
           0 recompiles after warm-up
  dist     snakemake `all` (evaluate, export, the report over every run so far, the gate), runtime distributed (NCCL)
  kill     distributed, `kill -9` of the last drafter rank (its PID from results/runs/<run>/ranks/rank-N.json) once
           the first checkpoint is written; seconds until every rank is gone and the job exits, the rank named in
           the error; then the same snakemake command again, which resumes the run to its last step
  coloc    (optional) threads with a target and a drafter replica on every GPU, data parallel
  coloc_dist (optional) the same co-located placement in the distributed runtime: one rank per GPU running its
           target and its drafter replica, replicas in one DDP group (NCCL)
Placement on N GPUs: the seed's 5 targets : 3 drafters scaled, round(5N/8) target GPUs (at least one of each side):
2 GPUs 1 : 1, 4 GPUs 2 : 2, 8 GPUs 5 : 3.

Writes OUT/multi_gpu.json (bench/common.py's envelope: command, date, devices, versions, tree; every part's figures,
checks and full summary), OUT/report.md (the pipeline's report) and
OUT/runs.tar.gz (summaries, metrics, snakemake and stage logs, the report folder); prints one line per part.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.common import Budget, Record, Stopwatch, add_portable  # noqa: E402
from dflash.paths import RunFolder  # noqa: E402
ONE_GPU = REPO / "bench/results/2026-11-29-h200-r3/summary-1t1d-7bbc115.json"   # 1 target + 1 drafter, one H200
FX_ERROR = "symbolically trace a dynamo-optimized function"
CRITERION = ("Ktok/s per GPU against the one-GPU figure (1 target + 1 drafter on one H200, {k:.2f} Ktok/s): in a "
             "split layout every GPU serves the one pipeline that a single GPU runs alone there, so 'the one-GPU "
             "figure times the number of GPUs doing the same work' is {k:.2f} x N and the bar is 0.9 x {k:.2f} = "
             "{bar:.2f} Ktok/s per GPU. A split layout reaches it only when its T target GPUs and D drafter GPUs are "
             "equally busy (T/t = D/d for per-micro-batch times t, d); the run's placement line says how far from "
             "that it is.")
RANK_FAILED = re.compile(r"rank (\d+) = (\S+) \(([^)]*)\) failed with exit code (-?\d+)")


def split(n: int) -> tuple[int, int]:
    """The seed's 5 : 3 target : drafter split scaled to n GPUs."""
    t = min(max(round(5 * n / 8), 1), n - 1)
    return t, n - t


class Driver:
    def __init__(self, args):
        self.args, self.cpu = args, args.cpu
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.budget = Budget(args.budget, reserve=20.0)
        self.config = "config/config.yaml" if self.cpu else args.config
        if self.cpu:   # config.yaml's own placement: 1 target + 2 drafter replicas on the CPU, gloo
            self.targets, self.drafters, self.gpus = ["cpu"], ["cpu", "cpu"], 0
        else:
            t, d = split(args.gpus)
            self.targets = [f"cuda:{i}" for i in range(t)]
            self.drafters = [f"cuda:{i}" for i in range(t, t + d)]
            self.gpus = args.gpus
        self.results = Path(args.results_dir)
        self.prefix = "cpu" if self.cpu else f"seed-{self.gpus}gpu"

    # -- snakemake ---------------------------------------------------------------------------------------------
    def snakemake(self, run: str, train: dict, targets=(), extra=()) -> list[str]:
        flow = ", ".join(f"{k}: {json.dumps(v)}" for k, v in train.items())
        cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", "all", *extra]   # targets before --config
        if self.gpus:
            cmd += ["--resources", f"gpu={self.gpus}"]
        return cmd + ["--configfile", self.config, "--config", f"run_name={run}", f"results_dir={self.results}",
                      f"train={{{flow}}}"]

    def start(self, cmd, log: Path):
        f = open(log, "a")
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        proc.log_file = f
        return proc

    def finish(self, proc, timeout: float, run_dir: Path) -> tuple[int | None, bool]:
        """Wait up to `timeout` s; past it stop snakemake (SIGTERM, then SIGKILL) and every rank of the run."""
        try:
            code, timed_out = proc.wait(timeout=max(timeout, 1.0)), False
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
        proc.log_file.close()
        kill_ranks(run_dir)   # the elastic agent starts ranks in their own sessions: stop leftovers by PID
        if timed_out:
            subprocess.run([sys.executable, "-m", "snakemake", "--unlock", "--configfile", self.config, "--config",
                            f"results_dir={self.results}"], cwd=REPO, capture_output=True, timeout=60)
        return code, timed_out

    def run_dir(self, run: str) -> Path:
        return REPO / self.results / "runs" / run

    def train_keys(self, runtime: str, steps: int, **kw) -> dict:
        return {"runtime": runtime, "steps": steps, "targets": self.targets, "drafters": self.drafters, **kw}

    # -- parts --------------------------------------------------------------------------------------------------
    def pipeline(self, name: str, runtime: str, cap: float, **train) -> dict:
        """One run through snakemake: the part named by --full runs `all` (env, target, data, warm-up, train,
        evaluate, export, then the report over every run so far, and the gate), the others up to their summary."""
        run = f"{self.prefix}-{name}"
        targets = [] if name == self.args.full else [str(RunFolder(Path(self.results) / "runs" / run).summary)]
        cmd = self.snakemake(run, self.train_keys(runtime, self.args.steps, **train), targets, extra=["-R", "train"])
        log = self.logs / f"snakemake-{name}.log"
        wall = Stopwatch()
        code, timed_out = self.finish(self.start(cmd, log), self.budget.left(cap), self.run_dir(run))
        res = {"run": run, "command": shlex.join(cmd[1:]), "exit": code, "timed_out": timed_out,
               "wall_s": round(wall.s, 1)}
        return {**res, **self.read_run(run, [log])}

    def kill(self, cap: float) -> dict:
        """kill -9 of the last drafter rank during training, then the same command again resumes the run."""
        run, every = f"{self.prefix}-kill", self.args.kill_every
        victim = len(self.targets) + len(self.drafters) - 1
        rd = self.run_dir(run)
        target = str(RunFolder(Path(self.results) / "runs" / run).summary)
        keys = self.train_keys("distributed", self.args.kill_steps, checkpoint_every=every)
        log = self.logs / "snakemake-kill.log"
        res: dict = {"run": run, "victim_rank": victim, "checkpoint_every": every, "steps": self.args.kill_steps}
        shutil.rmtree(rd, ignore_errors=True)   # this part's own run: no earlier checkpoint or rank file to mistake
        t_begin = time.monotonic()
        first = self.snakemake(run, keys, [target], extra=["-R", "train"])
        res["command"] = shlex.join(first[1:])
        started = time.time()
        proc = self.start(first, log)
        deadline = time.monotonic() + self.budget.left(cap * 0.55)
        ckpt = f"checkpoints/*/step-{every:06d}/manifest.json"   # in the run's identity folder
        rank_file = rd / "ranks" / f"rank-{victim}.json"
        pid = None
        while time.monotonic() < deadline and proc.poll() is None:
            if any(rd.glob(ckpt)) and rank_file.exists() and rank_file.stat().st_mtime >= started - 1:
                pid = json.loads(rank_file.read_text())["pid"]
                break
            time.sleep(0.1)
        if pid is None:
            code, timed_out = self.finish(proc, 0 if proc.poll() is None else 5, rd)
            res.update(error=f"no checkpoint step {every} / rank file before the deadline (exit {code})",
                       log_tail=tail(log))
            return res
        res["seconds_to_kill"] = round(time.monotonic() - t_begin, 1)
        pids = [json.loads(f.read_text())["pid"] for f in (rd / "ranks").glob("rank-*.json")]
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ranks_gone = None
        while time.monotonic() - t_kill < 60 and proc.poll() is None:
            if ranks_gone is None and not any(alive(p) for p in pids):
                ranks_gone = time.monotonic() - t_kill
            time.sleep(0.05)
        if ranks_gone is None and not any(alive(p) for p in pids):
            ranks_gone = time.monotonic() - t_kill
        stopped = time.monotonic() - t_kill if proc.poll() is not None else None
        code, timed_out = self.finish(proc, 5, rd)
        text = log.read_text(errors="replace")
        named = [m.groups() for m in RANK_FAILED.finditer(text)]
        res.update(kill_exit=code, kill_timed_out=timed_out, seconds_until_ranks_gone=_r(ranks_gone),
                   seconds_until_job_exit=_r(stopped),
                   error_lines=sorted({m.group(0) for m in RANK_FAILED.finditer(text)}),
                   names_the_rank=any(int(r) == victim and c == "-9" for r, _, _, c in named))
        # resume: the same command, nothing forced: snakemake reruns the failed job, which resumes the checkpoint
        again = self.snakemake(run, keys, [target])
        t0 = time.monotonic()
        code, timed_out = self.finish(self.start(again, log), self.budget.left(cap), rd)
        res.update(resume_exit=code, resume_timed_out=timed_out, resume_wall_s=round(time.monotonic() - t0, 1))
        res.update(self.read_run(run, [log]))
        res["wall_s"] = round(time.monotonic() - t_begin, 1)
        return res

    # -- reading a run ------------------------------------------------------------------------------------------
    def read_run(self, run: str, logs) -> dict:
        rd = self.run_dir(run)
        texts = [p.read_text(errors="replace") for p in logs if p.exists()]
        stage_log = REPO / self.results / "logs" / "train" / f"{run}.log"
        if stage_log.exists():
            texts.append(stage_log.read_text(errors="replace"))
        out = {"fx_tracing_error": any(FX_ERROR in t for t in texts)}
        p = RunFolder(rd).summary
        if not p.exists():
            return {**out, "summary": None, "log_tail": "\n".join(t[-3000:] for t in texts)}
        s = json.loads(p.read_text())
        tp, comp = s.get("throughput") or {}, s.get("compile") or {}
        gpus = len({d["device"] for d in s.get("devices") or []   # several nodes: node1/cuda:0 (dflash/device_names.py)
                    if str(d.get("device", "")).split("/")[-1].startswith("cuda")})
        from dflash.report.placement import suggest
        out.update({
            "status": s.get("status"), "steps": s.get("steps"), "measured_steps": s.get("measured_steps"),
            "resumed_from_step": s.get("resumed_from_step"), "runtime": s.get("runtime"),
            "ktok_per_s": tp.get("ktok_per_s"), "gpus": gpus,
            "ktok_per_s_per_gpu": tp["ktok_per_s"] / gpus if tp.get("ktok_per_s") and gpus else None,
            "mfu": tp.get("mfu"), "time_split_s": s.get("time_split_s"),
            "replicas": len(s.get("replica_checksums") or []), "replicas_identical": s.get("replicas_identical"),
            "recompiles_after_warmup": comp.get("recompiles_after_warmup"),
            "eager_fallbacks": comp.get("eager_fallbacks"), "warmup_s": comp.get("warmup_s"),
            "seconds_to_first_step": s.get("seconds_to_first_step"), "loss": s.get("loss"),
            "devices": s.get("devices"), "placement": (suggest(s) or {}).get("sentence"), "summary": s})
        return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie (exited, not yet reaped by its parent) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def kill_ranks(run_dir: Path):
    for f in (run_dir / "ranks").glob("rank-*.json"):
        try:
            pid = json.loads(f.read_text())["pid"]
            if alive(pid) and "dflash" in Path(f"/proc/{pid}/cmdline").read_text():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass


def tail(p: Path, n: int = 3000) -> str:
    return p.read_text(errors="replace")[-n:] if p.exists() else ""


def _r(x):
    return round(x, 2) if x is not None else None


def one_gpu_figure() -> float | None:
    try:
        return json.loads(ONE_GPU.read_text())["throughput"]["ktok_per_s"]
    except (OSError, ValueError, KeyError):
        return None


def verdicts(parts: dict, base: float | None, steps: int) -> dict:
    """Issue 18's checks, each a bool (None: not measured)."""
    v: dict = {}
    d, k = parts.get("dist") or {}, parts.get("kill") or {}
    if d:
        v["dist_completed"] = d.get("status") == "completed" and d.get("steps") == steps
        v["dist_replicas_identical"] = d.get("replicas_identical")
        if base and d.get("ktok_per_s_per_gpu"):
            # every GPU of the split layout serves the one pipeline a single GPU runs alone in the 1t1d figure:
            # "the one-GPU figure times the number of GPUs doing the same work" is base x GPUs, i.e. base per GPU
            v["dist_per_gpu_vs_one_gpu"] = round(d["ktok_per_s_per_gpu"] / base, 4)
            v["dist_per_gpu_within_10pct"] = d["ktok_per_s_per_gpu"] >= 0.9 * base
    # threads: the split layout in one process; coloc: a target and a drafter replica on every GPU, every GPU
    # doing the one-GPU run's work, so its bar is the same 0.9 x base per GPU
    for name in ("threads", "coloc", "coloc_dist"):
        r = parts.get(name) or {}
        if base and r.get("ktok_per_s_per_gpu"):
            v[f"{name}_per_gpu_vs_one_gpu"] = round(r["ktok_per_s_per_gpu"] / base, 4)
            if name.startswith("coloc"):
                v[f"{name}_per_gpu_within_10pct"] = r["ktok_per_s_per_gpu"] >= 0.9 * base
        if r:
            v[f"{name}_completed"] = r.get("status") == "completed" and r.get("steps") == steps
            v[f"{name}_replicas_identical"] = r.get("replicas_identical")
            v[f"{name}_no_fx_error"] = not r.get("fx_tracing_error")
            v[f"{name}_zero_recompiles"] = r.get("recompiles_after_warmup") == 0 and r.get("eager_fallbacks") == 0
    if k:
        gone = k.get("seconds_until_job_exit")
        v["kill_stops_within_15s"] = gone is not None and gone <= 15
        v["kill_names_the_rank"] = k.get("names_the_rank")
        v["kill_resume_completed"] = k.get("status") == "completed" and k.get("steps") == k.get("steps_wanted")
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: every visible one)")
    p.add_argument("--cpu", action="store_true", help="rehearse on the CPU: config/config.yaml, gloo")
    p.add_argument("--config", default="config/seed-2gpu.yaml")
    p.add_argument("--results-dir", default="results")
    p.add_argument("--parts", default="threads,dist,kill",
                   help="in this order (threads, dist, kill, coloc, coloc_dist)")
    p.add_argument("--full", default="dist", help="the part whose run goes through the whole pipeline (`all`: "
                   "evaluate, export, report); the others stop at their summary and are in its report's history")
    p.add_argument("--steps", type=int, default=None, help="steps of the dist/threads runs (200; --cpu 16)")
    p.add_argument("--kill-steps", type=int, default=None, help="steps of the kill run (40; --cpu 24)")
    p.add_argument("--kill-every", type=int, default=None, help="its checkpoint interval (20; --cpu 4)")
    p.add_argument("--budget", type=float, default=520, help="seconds for every part together")
    args = p.parse_args(argv)
    args.steps = args.steps or (16 if args.cpu else 200)
    args.kill_steps = args.kill_steps or (24 if args.cpu else 40)
    args.kill_every = args.kill_every or (4 if args.cpu else 20)
    if args.gpus is None and not args.cpu:
        import torch
        args.gpus = torch.cuda.device_count()
    if not args.cpu and args.gpus < 2:
        p.error("--gpus: at least 2 (a target GPU and a drafter GPU)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    drv = Driver(args)
    total = Stopwatch()
    result = Record(drv.out / "multi_gpu.json", argv)
    result.update(layout={"targets": drv.targets, "drafters": drv.drafters},
                  one_gpu_ktok_per_s=one_gpu_figure(), one_gpu_source=str(ONE_GPU.relative_to(REPO)),
                  per_gpu_criterion=CRITERION.format(k=one_gpu_figure() or float("nan"),
                                                     bar=0.9 * (one_gpu_figure() or float("nan"))), parts={})
    caps = {"dist": 300, "threads": 300, "kill": 240, "coloc": 300, "coloc_dist": 300}   # the first part builds target, data, warm-up
    for part in args.parts.split(","):
        wall = Stopwatch()
        if part == "dist":
            r = drv.pipeline("dist", "distributed", caps[part])
        elif part == "threads":
            r = drv.pipeline("threads", "threads", caps[part])
        elif part in ("coloc", "coloc_dist"):
            devs = drv.targets + drv.drafters if not drv.cpu else ["cpu", "cpu"]
            r = drv.pipeline(part, "threads" if part == "coloc" else "distributed", caps[part], targets=devs,
                             drafters=devs)
        elif part == "kill":
            r = drv.kill(caps[part])
            r["steps_wanted"] = args.kill_steps
        else:
            p.error(f"--parts: unknown part {part!r} (dist, threads, kill, coloc, coloc_dist)")
        r["part_s"] = round(wall.s, 1)
        result["parts"][part] = r
        print(line(part, r), flush=True)
        result.save()
    result["verdicts"] = verdicts(result["parts"], result["one_gpu_ktok_per_s"], args.steps)
    result["total_s"] = round(total.s, 1)
    result.save()
    collect(drv)
    print("verdicts:", json.dumps(result["verdicts"]), f"total {result['total_s']} s", flush=True)
    return 0 if result["verdicts"] and all(v is not False for v in result["verdicts"].values()) else 1


def line(part: str, r: dict) -> str:
    f = lambda x, n=2: "n/a" if x is None else (f"{x:.{n}f}" if isinstance(x, float) else str(x))  # noqa: E731
    s = (f"[{part}] exit {f(r.get('exit', r.get('resume_exit')))} {r.get('status')} steps {f(r.get('steps'))} "
         f"Ktok/s {f(r.get('ktok_per_s'))} ({f(r.get('ktok_per_s_per_gpu'))}/GPU) identical "
         f"{f(r.get('replicas_identical'))} x{f(r.get('replicas'))} recompiles {f(r.get('recompiles_after_warmup'))} "
         f"fx-error {f(r.get('fx_tracing_error'))} {r.get('part_s')} s")
    if part == "kill":
        s += (f" | killed rank {r.get('victim_rank')} at {f(r.get('seconds_to_kill'), 1)} s: ranks gone "
              f"{f(r.get('seconds_until_ranks_gone'))} s, job exit {f(r.get('seconds_until_job_exit'))} s, named "
              f"{r.get('names_the_rank')}; resumed from {f(r.get('resumed_from_step'))}")
    if r.get("error"):
        s += f" | {r['error']}"
    if r.get("placement"):
        s += f"\n    placement: {r['placement']}"
    return s


def collect(drv: Driver):
    """OUT/report.md and OUT/runs.tar.gz: summaries, metrics, logs, the report folder (no checkpoints, no weights)."""
    res = REPO / drv.results
    report = res / "report" / "report.md"
    if report.exists():
        (drv.out / "report.md").write_text(report.read_text())
    with tarfile.open(drv.out / "runs.tar.gz", "w:gz") as tar:
        for f in sorted((res / "runs").glob(f"{drv.prefix}-*/*")):
            if f.is_file() and f.suffix in (".json", ".jsonl"):
                add_portable(tar, f, str(f.relative_to(res)))
        # compile/: the warm-up records only, not the Inductor cache beside them (compile/cache-<env hash>/)
        files = [f for sub in ("report", "logs", "benchmarks") for f in (res / sub).rglob("*")]
        files += list((res / "compile").glob("*.json")) + list((res / "env").glob("*.json"))
        for f in sorted(files):
            if f.is_file() and f.stat().st_size < 5_000_000:
                add_portable(tar, f, str(f.relative_to(res)))
        for f in sorted(drv.logs.glob("*.log")):
            tar.add(f, arcname=f"driver/{f.name}")
    for f in drv.logs.glob("*.log"):
        f.unlink()
    drv.logs.rmdir()


if __name__ == "__main__":
    sys.exit(main())
