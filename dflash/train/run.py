"""The one lifecycle of a training process, for either runtime, over a transport (runtime/threads.py: one process,
a thread per worker; runtime/distributed.py: a process per device under torch's elastic launch).

    open -> load targets and capture -> heads to drafter devices -> refuse what cannot fit -> build replicas
    -> resume -> warm up, forbid recompiles -> start metrics and the sampler -> serve (the loop, supervised)
    -> gather per-process rows -> summary.json (the writer) -> close (exit code)

Each process runs the workers `Transport.open` gives it (`Local`): the threads runtime every target and replica, a
distributed rank one target, one replica, or both (co-located). The process holding replica 0 is the writer: it
picks the checkpoint to resume from, writes metrics.jsonl, the checkpoints and summary.json. What differs between the
runtimes is the transport's, nothing else:
  heads(targets, devices)   how the target's embedding and LM head reach the drafter devices
  sync(ctx)                 how the replicas sum gradients and step statistics (trainer.Sync)
  share(point)              where resume starts, told by the writer to every process
  wrap(replicas)            what wraps a warmed replica for the loop (DDP), if anything
  serve(process)            how micro-batches are made and taken, how the workers run and are supervised:
                            (status, failure)
  gather(rows)              every process's rows, on the writer (None elsewhere)
  close(status)             the exit code, after the summary
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from dflash.evaluate import live
from dflash.fingerprint import compile_cache_dir
from dflash.train import compile_guard, memory, run_folder, summary
from dflash.train import failures
from dflash.train.context import RunContext, set_shapes
from dflash.train.features import run_capture
from dflash.train.metrics import DeviceTimer, RunMetrics, seconds
from dflash.train.step import build_drafter
from dflash.train.telemetry import GpuSampler, device_rows
from dflash.train.trainer import Replica, Sync, weight_checksum

log = logging.getLogger("dflash.train")


@dataclass
class Local:
    """The workers of this process, as the transport opened it."""
    targets: list[tuple[str, torch.device]]    # (worker name, device) of every target here
    replicas: list[tuple[int, torch.device]]   # (replica rank, device) of every drafter replica here
    writer: bool                               # holds replica 0
    device_name: Callable[[torch.device], str]   # a device as summaries name it (cuda:0, node1/cuda:0)
    replica_count: int = 1                     # drafter replicas of the whole run


class Transport(Protocol):
    reduce: str        # memory.estimate's gradient reduction with several replicas: "flat" | "ddp"

    def open(self, ctx) -> Local: ...
    def heads(self, ctx, targets: list["Target"], devices: list[torch.device]) -> dict: ...
    def sync(self, ctx) -> Sync: ...
    def share(self, point: tuple | None) -> tuple: ...
    def wrap(self, replicas: list[Replica]) -> None: ...
    def serve(self, process: "Process") -> tuple[str, dict | None]: ...
    def gather(self, rows: dict) -> list[dict] | None: ...
    def close(self, status: str) -> int: ...


class ForwardClock(DeviceTimer):
    """`with clock:` times a target forward; CUDA event pairs are resolved in batches, behind the newest ones (so the
    host never waits for a forward still in flight), and only their running sum is kept."""

    KEEP = 16

    def __init__(self, device):
        super().__init__(device)
        self.total, self.n, self.since = 0.0, 0, None

    def __enter__(self):
        self.since = self.since or time.perf_counter()   # the first measured forward: utilisation counts from it
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if len(self.items) >= 4 * self.KEEP:
            self._settle(self.KEEP)
        return False

    def _settle(self, keep: int):
        done, self.items = self.items[:len(self.items) - keep], self.items[len(self.items) - keep:]
        self.total += seconds(done)
        self.n += len(done)

    def mean(self) -> float | None:
        self._settle(0)
        return self.total / self.n if self.n else None


class Target:
    """One frozen target of this process: the model, the capture of the layers the drafter reads (compiled with
    train.compile_target), and the clock of its measured forwards (the summary's time split)."""

    def __init__(self, ctx, name: str, device: torch.device):
        from dflash.target import load_target
        self.name, self.device, self.steps = name, device, 0
        self.model = load_target(ctx.cfg.target, device=device, seed=ctx.cfg.seed, devices=ctx.placement.group(device))
        self.capture = run_capture(self.model, ctx)
        if ctx.cfg.train.compile_target:
            self.capture.compile()
        self.clock = ForwardClock(device)

    def warm_up(self, ctx) -> dict:
        """train.compile_target: the capture compiled for every bucket shape (before any micro-batch)."""
        return self.capture.warm_up(self.device, ctx.shapes, ctx.drafter_config.vocab_size, ctx.compiled_workers)

    def features(self, ids: torch.Tensor, measured: bool = False) -> torch.Tensor:
        """[b, S, width] features of `ids` (on this target's device): an inference tensor; `measured` forwards are
        timed."""
        with torch.inference_mode(), self.clock if measured else contextlib.nullcontext():
            return self.capture.guarded(ids)

    def row(self, where: str) -> dict:
        return {"name": self.name, "role": "target", "device": where, "steps": self.steps,
                "forward_s": self.clock.mean(), "forward_batches": self.clock.n}


@dataclass
class Process:
    """A training process as its transport serves it: the workers, where the stream starts and ends."""
    ctx: RunContext
    local: Local
    reader: object
    targets: list[Target]
    replicas: list[Replica]
    metrics: RunMetrics | None
    sampler: GpuSampler
    start_step: int
    data_index: int
    extra_rows: list[dict] = field(default_factory=list)   # the transport's own workers (the threads' reader)
    ready: dict[str, float] = field(default_factory=dict)   # worker name -> seconds to ready, where measured

    @property
    def end_index(self) -> int:
        """One past the last micro-batch of the run's last step."""
        return self.data_index + max(0, self.ctx.cfg.train.steps - self.start_step) * self.ctx.batches_per_step

    def measured(self, index: int) -> bool:
        """Whether micro-batch `index` belongs to a step past train.warmup_steps_excluded (timed for the summary)."""
        return index >= self.data_index + self.ctx.cfg.train.warmup_steps_excluded * self.ctx.batches_per_step


def train(ctx, transport: Transport, progress: bool = True) -> int:
    """The lifecycle of one training process. Returns its exit code."""
    cfg = ctx.cfg
    local = transport.open(ctx)
    compile_guard.use_compile_cache(compile_cache_dir(cfg.results_dir, ctx.env["hash"]))
    reader = ctx.open_reader()
    set_shapes(ctx, reader.shapes())
    if local.writer:
        log.info("buckets %s", reader.edges)
    t0 = time.perf_counter()
    targets = [Target(ctx, name, d) for name, d in local.targets]    # first: the drafters borrow their heads
    heads = transport.heads(ctx, targets, [d for _, d in local.replicas])
    refuse_what_cannot_fit(ctx, local, targets, transport.reduce)
    metrics = RunMetrics(ctx, progress=progress) if local.writer else None
    replicas = build_replicas(ctx, local, heads, transport.sync(ctx), metrics)
    start_step, data_index = resume(ctx, local, replicas, transport)
    if start_step >= cfg.train.steps:
        log.info("run already complete at step %d; nothing to train", start_step)
        return transport.close("completed")
    warm = warm_up(ctx, local, replicas, targets)
    transport.wrap(replicas)
    sampler = GpuSampler(list(dict.fromkeys(d for _, d in local.targets + local.replicas)))
    live.attach(ctx, replicas, eval_target(targets, replicas), sampler)
    if metrics is not None:
        metrics.sampler = sampler   # started with the first training step, not during the warm-up
        metrics.set_warmup(warm, time.perf_counter() - t0)
        metrics.start(start_step, replicas[0].resumed.metrics if replicas[0].resumed else None)
    else:
        sampler.start()
    process = Process(ctx, local, reader, targets, replicas, metrics, sampler, start_step, data_index)
    try:
        status, failure = transport.serve(process)
    finally:
        sampler.stop()
    compile_guard.allow_compiles()
    everyone = transport.gather(rows(process, warm))
    if everyone is not None:
        write_summary(process, everyone, status, failure)
    return transport.close(status)


def refuse_what_cannot_fit(ctx, local: Local, targets: list[Target], reduce: str) -> None:
    """The memory estimate of every drafter device of this process (its replicas plus the targets' weights already
    there): one line naming the keys to change, before anything big is allocated."""
    longest = max(s for _, s in ctx.shapes)
    devices = [d for _, d in local.replicas]
    for dev in dict.fromkeys(devices):
        resident = sum(memory.target_bytes(t.model).get(dev, 0) for t in targets) if dev.type == "cuda" else 0
        memory.check(ctx.drafter_config, ctx.cfg.train, longest, dev, ctx.backend, replicas=devices.count(dev),
                     resident=resident, num_anchors=ctx.anchors_for(longest), compiled=ctx.compile,
                     reduce=reduce if local.replica_count > 1 else "none")


def build_replicas(ctx, local: Local, heads: dict, sync: Sync, metrics) -> list[Replica]:
    """This process's drafter replicas, each with the same initial weights (built from the same seed or
    drafter.init_from; several in one process copy the first's)."""
    out = []
    for r, d in local.replicas:
        dr = build_drafter(ctx, *heads[d], d)
        if out:
            dr.load_state_dict(out[0].drafter.state_dict())
        out.append(Replica(ctx, r, local.replica_count, d, dr, sync, metrics if r == 0 else None,
                           fail=failures.injector(ctx.cfg.train, f"drafter-{r}")))
    return out


def eval_target(targets: list[Target], replicas: list[Replica]):
    """The target model replica 0 decodes with while training (train.eval_every): the one on its device, else any of
    this process's; None where this process has no target (the split distributed layout, refused by train.context)."""
    on = [t for t in targets if replicas and t.device == replicas[0].device] + targets
    return on[0].model if on else None


def resume(ctx, local: Local, replicas: list[Replica], transport: Transport) -> tuple[int, int]:
    """The writer picks the newest verified checkpoint of an interrupted run (run_folder.resumable) and resumes
    replica 0 from it; the transport tells every process the path, the step and the data index; every other replica
    loads the same checkpoint. Returns (start step, data index)."""
    point = None
    if local.writer:
        latest = run_folder.resumable(ctx)
        if latest:
            replicas[0].resume(latest)
            log.info("resuming from %s: step %d, data index %d", latest, replicas[0].start_step,
                     replicas[0].data_index)
        point = (str(latest or ""), replicas[0].start_step, replicas[0].data_index)
    latest, start_step, data_index = transport.share(point)
    for rep in replicas:
        if latest and rep.rank != 0:
            rep.resume(latest)
    return start_step, data_index


def warm_up(ctx, local: Local, replicas: list[Replica], targets: list[Target]) -> list[dict]:
    """Every compile, single-threaded, before any micro-batch: every replica (a compiled graph may belong to one
    module), then every target with train.compile_target; afterwards a compile is an error. The warm-up records
    (summary.json's compile.per_device)."""
    records = []
    for rep in replicas:
        records.append({**rep.warm_up(), "device": local.device_name(rep.device)})
        log.info("warm-up of drafter-%d on %s: %d graph(s), %d cache hit(s), %.1f s", rep.rank, rep.device,
                 records[-1]["graphs"], records[-1]["cache_hits"], records[-1]["seconds"])
    if ctx.cfg.train.compile_target:
        for t in targets:
            records.append({**t.warm_up(ctx), "device": local.device_name(t.device)})
            log.info("warm-up of %s on %s (compiled target): %d graph(s), %d cache hit(s), %.1f s", t.name,
                     t.device, records[-1]["graphs"], records[-1]["cache_hits"], records[-1]["seconds"])
    if (ctx.compile and replicas) or (ctx.cfg.train.compile_target and targets):
        compile_guard.forbid_recompiles()
    compile_guard.configure_thread(len(ctx.shapes), ctx.compiled_workers)   # this thread's (dynamo's is per thread)
    return records


def rows(process: Process, warm: list[dict]) -> dict:
    """What this process tells the writer: its workers (a target and a replica of one name, co-located, in one
    row), its devices, its replicas' exact weight checksums and its warm-up records."""
    p, where = process, process.local.device_name
    workers: dict[str, dict] = {}
    for t in p.targets:
        workers[t.name] = t.row(where(t.device))
    for rep in p.replicas:
        name = f"drafter-{rep.rank}"
        workers[name] = {**workers.get(name, {}), "name": name, "role": "drafter", "device": where(rep.device),
                         "steps": rep.steps}
    for name, seconds_ in p.ready.items():   # the threads runtime: each worker's seconds to ready
        workers[name]["ready_s"] = seconds_
    roles: dict[torch.device, list[str]] = {}
    for role, d in [("target", t.device) for t in p.targets] + [("drafter", r.device) for r in p.replicas]:
        if role not in roles.setdefault(d, []):
            roles[d].append(role)
    since = min((t.clock.since for t in p.targets if t.clock.since), default=None)
    window = p.metrics.measured_window() if p.metrics else (since if not p.replicas else None, None)
    return {"workers": p.extra_rows + list(workers.values()),
            "devices": device_rows(roles, where, p.sampler, window),
            "checksums": [(rep.rank, weight_checksum(rep.drafter).tolist()) for rep in p.replicas],
            "warmup": warm}


def write_summary(process: Process, everyone: list[dict], status: str, failure: dict | None) -> None:
    """summary.json from every process's rows (the writer's metrics hold the steps, losses and throughput)."""
    metrics, cfg = process.metrics, process.ctx.cfg
    metrics.set_warmup([w for e in everyone for w in e["warmup"]], metrics.warmup_s)
    workers = [w for e in everyone for w in e["workers"]]
    timed = [(w["forward_s"], w["forward_batches"]) for w in workers if w.get("forward_batches")]
    if timed:   # the mean target forward per micro-batch, times the micro-batches of one replica's step
        mean = sum(s * n for s, n in timed) / sum(n for _, n in timed)
        metrics.set_split("target", mean * cfg.train.grad_accum)
    checksums = [c for _, c in sorted(c for e in everyone for c in e["checksums"])]
    summary.write(process.ctx, metrics, workers, status, [d for e in everyone for d in e["devices"]],
                  checksums=checksums, failure=failure)
