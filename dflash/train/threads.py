"""The `threads` runtime: one process, one thread per worker, race-free by construction.

    feeder -> work queue -> TargetWorker x T -> inbox per replica (bounded) -> DrafterWorker x D (data parallel)

Micro-batch i of the stream goes to replica i % D; optimizer step s consumes micro-batches
[s*M, (s+1)*M) with M = D * grad_accum, so the data order is a function of the step alone (exact resume).
The supervisor (main thread) starts workers, waits for them to be ready, and stops everything within seconds
when any worker fails, naming it. Compiles happen before any worker thread starts (setup.warm_up).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from dflash.train import checkpoint, compile_guard, optim
from dflash.train.loop import DrafterLoop, Micro, StopRun, _Null
from dflash.train.features import LayerCapture
from dflash.train.metrics import DeviceTimer, RunMetrics, weight_checksum
from dflash.train.setup import Setup, build_drafter, frozen_head, warm_up

log = logging.getLogger("dflash.train")
POLL = 0.1  # seconds between checks of the stop flag in every blocking wait


class Stopped(Exception):
    """Raised inside a worker when the run is being stopped (not an error of that worker)."""


class InjectedFailure(RuntimeError):
    """The `train.fail_at_step` test hook."""


@dataclass
class Shared:
    stop: threading.Event = field(default_factory=threading.Event)
    interrupt: threading.Event = field(default_factory=threading.Event)  # Ctrl-C: checkpoint, then stop
    errors: "queue.Queue[tuple[str, str]]" = field(default_factory=queue.Queue)

    def wait_put(self, q: queue.Queue, item):
        while not self.stop.is_set():
            try:
                return q.put(item, timeout=POLL)
            except queue.Full:
                pass
        raise Stopped

    def wait_get(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=POLL)
            except queue.Empty:
                pass
        raise Stopped


class Worker(threading.Thread):
    def __init__(self, name: str, role: str, device: torch.device, shared: Shared, fail_at=None):
        super().__init__(name=name, daemon=True)
        self.role, self.device, self.shared = role, device, shared
        self.ready = threading.Event()
        self.steps, self.ready_s, self.t0 = 0, None, time.perf_counter()
        self.fail_at = fail_at.get("step") if fail_at and fail_at.get("worker") == name else None

    def maybe_fail(self, step: int):
        if self.fail_at == step:
            raise InjectedFailure(f"{self.name}: injected failure at {'init' if step == 0 else f'step {step}'}")

    def mark_ready(self):
        self.ready_s = round(time.perf_counter() - self.t0, 3)
        self.ready.set()

    def run(self):
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.body()
        except (Stopped, StopRun):
            pass
        except BaseException:
            self.shared.errors.put((self.name, traceback.format_exc()))
            self.shared.stop.set()

    def describe(self) -> dict:
        return {"name": self.name, "role": self.role, "device": str(self.device), "steps": self.steps,
                "ready_s": self.ready_s}


class Feeder(Worker):
    """Reads batches in stream order from `start` and hands them to the target workers."""

    def __init__(self, reader, start: int, end: int, work: queue.Queue, shared: Shared, pin: bool):
        super().__init__("reader", "reader", torch.device("cpu"), shared)
        self.reader, self.start_index, self.end, self.work, self.pin = reader, start, end, work, pin

    def body(self):
        self.mark_ready()
        for i in range(self.start_index, self.end):
            b = self.reader.batch(i)
            self.shared.wait_put(self.work, b.pin() if self.pin else b)
            self.steps += 1


class TargetWorker(Worker):
    def __init__(self, name, device, setup: Setup, work, inboxes, replica_devices, shared):
        super().__init__(name, "target", device, shared, setup.cfg.train.fail_at_step)
        self.setup, self.work, self.inboxes, self.replica_devices = setup, work, inboxes, replica_devices
        self.model = None

    def load(self):
        from dflash.target import load_target
        self.model = load_target(self.setup.cfg.target, device=self.device, seed=self.setup.cfg.seed)
        self.capture = LayerCapture(self.model, self.setup.drafter_config.target_layer_ids)

    def body(self):
        self.maybe_fail(0)
        if self.model is None:
            self.load()
        cuda = self.device.type == "cuda"
        # high priority: the drafters wait on the features, so the target's kernels go first on a shared GPU
        stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.mark_ready()
        timer = DeviceTimer(self.device)
        with torch.cuda.stream(stream) if cuda else _Null():
            while True:
                batch = self.shared.wait_get(self.work)
                self.maybe_fail(self.steps + 1)
                r = batch.index % len(self.inboxes)
                dst = self.replica_devices[r]
                with timer:
                    ids = batch.input_ids.to(self.device, non_blocking=True)
                    feats = self.capture(ids)  # an inference tensor: autograd may not save it, so copy it out
                    feats = feats.to(dst, non_blocking=True) if dst != self.device else feats.clone()
                    ids_dst = ids.to(dst, non_blocking=True)
                    mask = batch.loss_mask.to(dst, non_blocking=True)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record(stream)
                self.shared.wait_put(self.inboxes[r], Micro(batch.index, batch.tokens, feats, ids_dst, mask, ready,
                                                            timer.pop()))
                self.steps += 1


class GradSync:
    """Averages gradients (and sums step statistics) across replicas in threads: every replica adds the same
    tensors in the same order, so all replicas end every step with identical weights."""

    def __init__(self, n: int):
        self.n = n
        self.slots: list = [None] * n
        self.barrier = threading.Barrier(n)
        self.stop_after = False

    def reduce(self, rank: int, tensors: list[torch.Tensor], want_stop: bool = False):
        self.slots[rank] = tensors
        if rank == 0:
            self.stop_after = want_stop
        self._wait()
        dev = tensors[0].device
        out = [sum(self.slots[j][k].to(dev, non_blocking=True) for j in range(self.n)) for k in range(len(tensors))]
        stop = self.stop_after
        self._wait()
        return out, stop

    def _wait(self):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped from None


class DrafterWorker(Worker):
    def __init__(self, rank, device, setup: Setup, inbox, sync: GradSync, shared, metrics: RunMetrics, drafter,
                 start_step, data_index):
        super().__init__(f"drafter-{rank}", "drafter", device, shared, setup.cfg.train.fail_at_step)
        self.rank, self.setup, self.inbox, self.sync, self.metrics = rank, setup, inbox, sync, metrics
        self.drafter, self.start_step, self.data_index = drafter, start_step, data_index
        self.pending: dict[int, tuple] = {}
        self.optimizer = self.scheduler = None

    def take(self, index: int) -> Micro:
        """The micro-batch with this stream index (target workers may finish out of order)."""
        while index not in self.pending:
            item = self.shared.wait_get(self.inbox)
            self.pending[item.index] = item
        return self.pending.pop(index)

    def body(self):
        self.maybe_fail(0)
        compile_guard.configure_thread(len(self.setup.extra.get("shapes", [])))
        self.loop = DrafterLoop(self.rank, self.sync.n, self.device, self.setup, self.drafter, self.optimizer,
                                self.scheduler, self.sync, self.metrics, self.start_step, self.data_index,
                                fail=self.maybe_fail)
        self.mark_ready()
        try:
            self.loop.run(self.take, self.shared.interrupt.is_set, self.inbox.qsize)
        finally:
            self.steps = self.loop.steps


def run(setup: Setup, reader, metrics: RunMetrics) -> int:
    """Build, warm up, start and supervise the workers. Returns the process exit code."""
    cfg = setup.cfg
    pl = setup.placement
    compile_guard.install_fx_guard()
    shared = Shared()
    D = len(pl.drafters)
    per_step = D * cfg.train.grad_accum

    # 1. targets first (the drafters borrow their embedding and LM head), on the main thread
    work: queue.Queue = queue.Queue(maxsize=max(2, len(pl.targets)) * 2)
    inboxes = [queue.Queue(maxsize=cfg.train.queue_size) for _ in range(D)]
    targets = [TargetWorker(f"target-{i}", d, setup, work, inboxes, pl.drafters, shared)
               for i, d in enumerate(pl.targets)]
    t0 = time.perf_counter()
    for tw in targets:
        if tw.fail_at != 0:
            tw.load()
    heads = {}
    for d in pl.drafters:
        if d not in heads:
            owner = next((tw.model for tw in targets if tw.device == d and tw.model is not None), None)
            heads[d] = frozen_head(owner or next(tw.model for tw in targets if tw.model is not None), d)

    # 2. replicas: identical weights, optimizer state restored from the newest checkpoint if resuming
    drafters = [build_drafter(setup, *heads[d], d) for d in pl.drafters]
    for dr in drafters[1:]:
        dr.load_state_dict(drafters[0].state_dict())
    start_step, data_index = 0, 0
    latest = checkpoint.resumable(setup)
    optims = [optim.build([p for p in dr.parameters() if p.requires_grad], cfg.train, d)
              for dr, d in zip(drafters, pl.drafters)]
    if latest is not None:
        for dr, (o, s) in zip(drafters, optims):
            state = checkpoint.load(latest, dr, o, s)
        start_step, data_index = state["step"], state["data_index"]
        log.info("resuming from %s: step %d, data index %d", latest, start_step, data_index)
    if start_step >= cfg.train.steps:
        log.info("run already complete at step %d (checkpoint %s); nothing to train", start_step, latest)
        return 0

    # 3. warm-up: every compile, single-threaded, before any worker thread starts
    shapes = reader.shapes()
    setup.extra["shapes"] = shapes
    warm = {}
    for r, (d, dr) in enumerate(zip(pl.drafters, drafters)):  # every replica: a graph may be per module
        warm[r] = warm_up(dr, setup, d, shapes)
        log.info("warm-up of drafter-%d on %s: %d graph(s), %d cache hit(s), %.1f s", r, d, warm[r]["graphs"],
                 warm[r]["cache_hits"], warm[r]["seconds"])
    if setup.compile:
        compile_guard.forbid_recompiles()
    metrics.set_warmup(list(warm.values()), time.perf_counter() - t0)

    # 4. workers
    end_index = data_index + (cfg.train.steps - start_step) * per_step
    feeder = Feeder(reader, data_index, end_index, work, shared, pin=any(d.type == "cuda" for d in pl.targets))
    sync = GradSync(D)
    replicas = [DrafterWorker(r, d, setup, inboxes[r], sync, shared, metrics, drafters[r], start_step, data_index)
                for r, d in enumerate(pl.drafters)]
    for w, (o, s) in zip(replicas, optims):
        w.optimizer, w.scheduler = o, s
    workers = [feeder, *targets, *replicas]
    metrics.start(start_step, workers)
    for w in workers:
        w.start()
    status = _supervise(workers, replicas, shared, sync, cfg.train, metrics)
    deadline = time.perf_counter() + 10
    for w in workers:  # every worker polls the stop flag: they end within a poll interval
        w.join(max(0.0, deadline - time.perf_counter()))
    compile_guard.allow_compiles()
    metrics.finish(setup, [w.describe() for w in workers], status=status, resumed_from=start_step or None,
                   checksums=[weight_checksum(dr) for dr in drafters])
    code = {"completed": 0, "interrupted": 130}.get(status, 1)
    stuck = [w.name for w in workers if w.is_alive()]
    if stuck:  # a thread inside a long native call: do not let interpreter shutdown abort or hang on it
        log.error("worker(s) still running after the stop: %s; exiting", ", ".join(stuck))
        logging.shutdown()
        os._exit(code)
    return code


def _supervise(workers, replicas, shared: Shared, sync: GradSync, tcfg, metrics) -> str:
    """Wait for readiness, then for the end; any error or stall stops the run within seconds, named."""
    deadline = time.perf_counter() + tcfg.ready_timeout_s
    try:
        while not all(w.ready.is_set() for w in workers):
            if _failed(shared, sync):
                return "failed"
            if time.perf_counter() > deadline:
                late = ", ".join(f"{w.name} ({w.device})" for w in workers if not w.ready.is_set())
                log.error("worker(s) not ready after %.0f s: %s", tcfg.ready_timeout_s, late)
                _stop(shared, sync)
                return "failed"
            time.sleep(POLL)
        last_progress, last_steps = time.perf_counter(), -1
        while any(r.is_alive() for r in replicas):
            if _failed(shared, sync):
                return "failed"
            steps = replicas[0].steps
            if steps != last_steps:
                last_steps, last_progress = steps, time.perf_counter()
            elif time.perf_counter() - last_progress > tcfg.stall_timeout_s:
                log.error("no training step for %.0f s (last step %d); stopping", tcfg.stall_timeout_s, steps)
                _stop(shared, sync)
                return "failed"
            metrics.refresh()
            time.sleep(POLL)
        if _failed(shared, sync):
            return "failed"
        if shared.interrupt.is_set():
            _stop(shared, sync)
            return "interrupted"
        _stop(shared, sync)
        return "completed"
    except KeyboardInterrupt:
        log.warning("interrupted: the replicas stop after the current step and write a checkpoint")
        shared.interrupt.set()
        t = time.perf_counter()
        while any(r.is_alive() for r in replicas) and time.perf_counter() - t < 120:
            if _failed(shared, sync):
                return "failed"
            time.sleep(POLL)
        _stop(shared, sync)
        return "interrupted"


def _failed(shared: Shared, sync: GradSync) -> bool:
    if shared.errors.empty():
        return False
    _stop(shared, sync)
    while not shared.errors.empty():
        name, tb = shared.errors.get()
        log.error("worker %s failed:\n%s", name, tb.rstrip())
    return True


def _stop(shared: Shared, sync: GradSync):
    shared.stop.set()
    sync.barrier.abort()
