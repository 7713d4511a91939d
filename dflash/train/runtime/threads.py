"""The `threads` runtime: one process, one thread per worker, race-free by construction.

    feeder -> work queue -> TargetWorker x T -> inbox per replica (bounded) -> DrafterWorker x D (trainer.Replica)

Micro-batch i of the stream goes to replica i % D; optimizer step s consumes micro-batches [s*M, (s+1)*M) with
M = D * grad_accum, so the data order is a function of the step alone (exact resume). Compiles happen before any
worker thread starts (the warm-up). The supervisor (main thread) starts workers, waits for them to be ready, and
stops everything within seconds when any worker fails, naming it; SIGINT, SIGTERM and SIGUSR1 make every replica
stop after its current step and write a checkpoint.

GPU streams: a tensor crosses from one worker to another only after its producer's kernels are complete (the
features: a CUDA event the reader's stream waits on, then record_stream; gradients: GradSync below).
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch

from dflash.evaluate import live
from dflash.train import checkpoint, compile_guard
from dflash.train.features import run_capture
from dflash.train.metrics import DeviceTimer
from dflash.train.step import build_drafter, frozen_head
from dflash.train.telemetry import device_report
from dflash.train.trainer import Diverged, Micro, NonFinite, Replica, StopRun, weight_checksum
from dflash.train import summary

log = logging.getLogger("dflash.train")
POLL = 0.1  # seconds between checks of the stop flag in every blocking wait
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Stopped(Exception):
    """Raised inside a worker when the run is being stopped (not an error of that worker)."""


class InjectedFailure(RuntimeError):
    """The `train.fail_at_step` test hook."""


@dataclass
class Shared:
    stop: threading.Event = field(default_factory=threading.Event)
    interrupt: threading.Event = field(default_factory=threading.Event)  # a stop signal: checkpoint, then stop
    errors: "queue.Queue[tuple[str, BaseException, str]]" = field(default_factory=queue.Queue)
    signum: int | None = None

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
        except BaseException as e:
            self.shared.errors.put((self.name, e, traceback.format_exc()))
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
    def __init__(self, name, device, ctx, work, inboxes, replica_devices, shared):
        super().__init__(name, "target", device, shared, ctx.cfg.train.fail_at_step)
        self.ctx, self.work, self.inboxes, self.replica_devices = ctx, work, inboxes, replica_devices
        self.model = None

    def load(self):
        from dflash.target import load_target
        self.model = load_target(self.ctx.cfg.target, device=self.device, seed=self.ctx.cfg.seed)
        self.capture = run_capture(self.model, self.ctx)
        if self.ctx.cfg.train.compile_target:
            self.capture.compile()

    def warm_up(self) -> dict:
        """train.compile_target: compile the capture for every bucket shape (on the main thread, before any worker
        starts, like the drafter replicas' warm-up)."""
        return self.capture.warm_up(self.device, self.ctx.shapes, self.ctx.drafter_config.vocab_size,
                                    self.ctx.compiled_workers)

    def body(self):
        self.maybe_fail(0)
        if self.model is None:
            self.load()
        if self.capture.compiled:
            compile_guard.configure_thread(len(self.ctx.shapes), self.ctx.compiled_workers)
        cuda = self.device.type == "cuda"
        # high priority: the drafters wait on the features, so the target's kernels go first on a shared GPU
        stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.mark_ready()
        timer = DeviceTimer(self.device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            while True:
                batch = self.shared.wait_get(self.work)
                self.maybe_fail(self.steps + 1)
                r = batch.index % len(self.inboxes)
                dst = self.replica_devices[r]
                with timer:
                    # every copy below runs on this stream (a cross-device copy runs on the source's current
                    # stream), so the event recorded after them covers the features on `dst` too
                    ids = batch.input_ids.to(self.device, non_blocking=True)
                    feats = self.capture.guarded(ids)  # an inference tensor: autograd may not save it, so copy it out
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
    """Sums tensors across the replica threads in place, correct on CUDA streams and across devices by construction:
    1. each replica waits until its own stream has finished the tensors it offers (no reader sees a tensor whose
       kernels are still queued), then a barrier;
    2. reduce-scatter: replica r sums shard r (1/n of every tensor) over all replicas in rank order on its own stream
       (a cross-device read is a copy ordered after the producer's completed work), waits for its stream, barrier;
    3. all-gather: each replica copies every shard's sum into its own tensors, waits for its stream, barrier, so no
       replica frees or overwrites a tensor another one still reads.
    Each element is summed once, in rank order, and copied: the sums are bit-identical on every replica. A replica
    reads 2(n-1)/n of the gradients from its peers whatever n is (a ring's traffic), not n-1 whole copies."""

    reduces_in_backward = False

    def __init__(self, n: int):
        self.n = n
        self.slots: list = [None] * n
        self.shards: list = [None] * n
        self.barrier = threading.Barrier(n)
        self.stop_after = False

    def _bounds(self, numel: int, j: int) -> tuple[int, int]:
        step = -(-numel // self.n)
        return min(j * step, numel), min((j + 1) * step, numel)

    def reduce(self, rank: int, tensors: list[torch.Tensor], want_stop: bool = False):
        """Every replica's `tensors` (contiguous, the same shapes on each) summed over the replicas, in place."""
        if self.n == 1:
            return tensors, want_stop
        dev = tensors[0].device
        self._publish(rank, tensors, dev)
        if rank == 0:
            self.stop_after = want_stop
        self._wait()
        mine = []
        for k, t in enumerate(tensors):                                    # 2. my shard, summed in rank order
            lo, hi = self._bounds(t.numel(), rank)
            acc = self.slots[0][k].view(-1)[lo:hi].to(dev, copy=True)
            for j in range(1, self.n):
                acc += self.slots[j][k].view(-1)[lo:hi].to(dev)
            mine.append(acc)
        stop = self.stop_after
        self._publish_shard(rank, mine, dev)
        for k, t in enumerate(tensors):                                    # 3. every shard's sum, into mine
            flat = t.view(-1)
            for j in range(self.n):
                lo, hi = self._bounds(t.numel(), j)
                flat[lo:hi].copy_(self.shards[j][k])
        self._consumed(dev)
        self.slots[rank] = self.shards[rank] = None    # nobody reads them now: freed before the next step's forward
        return tensors, stop

    def gather(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        dev = value.device
        self._publish(rank, [value], dev)
        self._wait()
        out = [self.slots[j][0].to("cpu") for j in range(self.n)]
        self._consumed(dev)
        self.slots[rank] = None
        return out

    def hold(self, rank: int, work, timeout_s: float):
        """Replica 0 runs `work()` while the others wait at the barrier (the supervisor's stall timeout bounds it; a
        failed run aborts the barrier) -> work's result on replica 0, None on the others."""
        out = work() if rank == 0 else None
        self._wait()
        return out

    def _publish(self, rank, tensors, dev):
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        self.slots[rank] = tensors

    def _publish_shard(self, rank, shards, dev):
        """My shards' sums are complete on my stream and every replica has finished reading the slots."""
        self.shards[rank] = shards
        self._consumed(dev)

    def _consumed(self, dev):
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        self._wait()

    def _wait(self):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped from None


class DrafterWorker(Worker):
    def __init__(self, replica: Replica, inbox, shared):
        super().__init__(f"drafter-{replica.rank}", "drafter", replica.device, shared,
                         replica.ctx.cfg.train.fail_at_step)
        self.replica, self.inbox = replica, inbox
        replica.fail = self.maybe_fail
        self.pending: dict[int, Micro] = {}

    def take(self, index: int) -> Micro:
        """The micro-batch with this stream index (target workers may finish out of order)."""
        while index not in self.pending:
            item = self.shared.wait_get(self.inbox)
            self.pending[item.index] = item
        return self.pending.pop(index)

    def body(self):
        self.maybe_fail(0)
        compile_guard.configure_thread(len(self.replica.ctx.shapes), self.replica.ctx.compiled_workers)
        self.steps = self.replica.steps
        self.mark_ready()
        try:
            self.replica.run(self.take, self.shared.interrupt.is_set, self.inbox.qsize)
        finally:
            self.steps = self.replica.steps


def run(ctx, reader, metrics) -> int:
    """Build, warm up, start and supervise the workers; write the summary. Returns the process exit code."""
    cfg, pl = ctx.cfg, ctx.placement
    compile_guard.install_fx_guard()
    shared = Shared()
    D = len(pl.drafters)

    # 1. targets first (the drafters borrow their embedding and LM head), on the main thread
    work: queue.Queue = queue.Queue(maxsize=max(2, len(pl.targets)) * 2)
    inboxes = [queue.Queue(maxsize=cfg.train.queue_size) for _ in range(D)]
    targets = [TargetWorker(f"target-{i}", d, ctx, work, inboxes, pl.drafters, shared)
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

    # 2. will it fit? one line naming the keys to change, before anything big is allocated
    check_memory(ctx, targets)

    # 3. replicas: identical weights; optimizer state restored from the newest good checkpoint if resuming
    sync = GradSync(D)
    replicas = []
    for r, d in enumerate(pl.drafters):
        dr = build_drafter(ctx, *heads[d], d)
        if replicas:
            dr.load_state_dict(replicas[0].drafter.state_dict())
        replicas.append(Replica(ctx, r, D, d, dr, sync, metrics))
    live.attach(ctx, replicas, next((tw.model for tw in targets if tw.device == pl.drafters[0] and tw.model),
                                    next((tw.model for tw in targets if tw.model is not None), None)))
    latest = checkpoint.resumable(ctx)
    if latest is not None:
        for rep in replicas:
            rep.resume(latest)
        log.info("resuming from %s: step %d, data index %d", latest, replicas[0].start_step, replicas[0].data_index)
    start_step, data_index = replicas[0].start_step, replicas[0].data_index
    if start_step >= cfg.train.steps:
        log.info("run already complete at step %d (checkpoint %s); nothing to train", start_step, latest)
        return 0

    # 4. warm-up: every compile, single-threaded, before any worker thread starts; every replica (a compiled
    #    graph may belong to one module), then every target when train.compile_target is on
    warm = []
    for rep in replicas:
        warm.append(rep.warm_up())
        log.info("warm-up of drafter-%d on %s: %d graph(s), %d cache hit(s), %.1f s", rep.rank, rep.device,
                 warm[-1]["graphs"], warm[-1]["cache_hits"], warm[-1]["seconds"])
    if cfg.train.compile_target:
        for tw in targets:
            if tw.model is not None:
                warm.append(tw.warm_up())
                log.info("warm-up of %s on %s (compiled target): %d graph(s), %d cache hit(s), %.1f s", tw.name,
                         tw.device, warm[-1]["graphs"], warm[-1]["cache_hits"], warm[-1]["seconds"])
    if ctx.compile or cfg.train.compile_target:
        compile_guard.forbid_recompiles()
    metrics.set_warmup(warm, time.perf_counter() - t0)

    # 5. workers
    end_index = data_index + (cfg.train.steps - start_step) * ctx.batches_per_step
    feeder = Feeder(reader, data_index, end_index, work, shared, pin=any(d.type == "cuda" for d in pl.targets))
    drafters = [DrafterWorker(rep, inboxes[rep.rank], shared) for rep in replicas]
    workers = [feeder, *targets, *drafters]
    metrics.start(start_step, getattr(replicas[0], "resumed", {}).get("metrics"))
    previous = {s: signal.signal(s, lambda signum, frame: _on_signal(shared, signum)) for s in STOP_SIGNALS}
    try:
        for w in workers:
            w.start()
        status, failure = _supervise(workers, drafters, shared, sync, cfg.train, metrics)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    deadline = time.perf_counter() + 10
    for w in workers:  # every worker polls the stop flag: they end within a poll interval
        w.join(max(0.0, deadline - time.perf_counter()))
    compile_guard.allow_compiles()
    summary.write(ctx, metrics, [w.describe() for w in workers], status, device_report(pl, metrics.sampler, metrics.measured_window()),
                  checksums=[weight_checksum(rep.drafter).tolist() for rep in replicas], failure=failure)
    code = 0 if status == "completed" else 128 + (shared.signum or signal.SIGINT) if status == "interrupted" else 1
    stuck = [w.name for w in workers if w.is_alive()]
    if stuck:  # a thread inside a long native call: do not let interpreter shutdown abort or hang on it
        log.error("worker(s) still running after the stop: %s; exiting", ", ".join(stuck))
        logging.shutdown()
        os._exit(code)
    return code


def check_memory(ctx, targets):
    """The memory estimate of every drafter device (its replicas plus the targets' weights already there)."""
    from dflash.train import memory
    longest = max(s for _, s in ctx.shapes)
    for dev in dict.fromkeys(ctx.placement.drafters):
        resident = 0
        if dev.type == "cuda":
            resident = sum(p.numel() * p.element_size() for tw in targets if tw.device == dev and tw.model
                           for p in tw.model.parameters())
        memory.check(ctx.drafter_config, ctx.cfg.train, longest, dev, ctx.backend,
                     replicas=ctx.placement.drafters.count(dev), resident=resident,
                     num_anchors=ctx.anchors_for(longest), compiled=ctx.compile,
                     reduce="flat" if len(ctx.placement.drafters) > 1 else "none")


def _on_signal(shared: Shared, signum: int):
    if shared.interrupt.is_set():
        return
    shared.signum = signum
    log.warning("%s: the replicas stop after the current step and write a checkpoint", signal.Signals(signum).name)
    shared.interrupt.set()


def _supervise(workers, replicas, shared: Shared, sync: GradSync, tcfg, metrics) -> tuple[str, dict | None]:
    """Wait for readiness, then for the end; any error or stall stops the run within seconds, named."""
    deadline = time.perf_counter() + tcfg.ready_timeout_s
    while not all(w.ready.is_set() for w in workers):
        if (failure := _failed(shared, sync)):
            return "failed", failure
        if time.perf_counter() > deadline:
            late = ", ".join(f"{w.name} ({w.device})" for w in workers if not w.ready.is_set())
            log.error("worker(s) not ready after %.0f s: %s", tcfg.ready_timeout_s, late)
            _stop(shared, sync)
            return "failed", {"kind": "not_ready", "message": f"not ready: {late}"}
        time.sleep(POLL)
    last_progress, last_steps, t_signal = time.perf_counter(), -1, None
    while any(r.is_alive() for r in replicas):
        if (failure := _failed(shared, sync)):
            return "failed", failure
        if shared.interrupt.is_set():
            t_signal = t_signal or time.perf_counter()
            if time.perf_counter() - t_signal > tcfg.stop_timeout_s:
                log.error("replicas did not stop within %.0f s of the signal; exiting without a checkpoint",
                          tcfg.stop_timeout_s)
                _stop(shared, sync)
                return "interrupted", None
        steps = replicas[0].steps
        if steps != last_steps:
            last_steps, last_progress = steps, time.perf_counter()
        elif time.perf_counter() - last_progress > tcfg.stall_timeout_s:
            log.error("no training step for %.0f s (last step %d); stopping", tcfg.stall_timeout_s, steps)
            _stop(shared, sync)
            return "failed", {"kind": "stall", "message": f"no step for {tcfg.stall_timeout_s} s after step {steps}"}
        metrics.refresh()
        time.sleep(POLL)
    if (failure := _failed(shared, sync)):
        return "failed", failure
    _stop(shared, sync)
    return ("interrupted" if shared.interrupt.is_set() else "completed"), None


def _failed(shared: Shared, sync: GradSync) -> dict | None:
    if shared.errors.empty():
        return None
    _stop(shared, sync)
    first = None
    while not shared.errors.empty():
        name, exc, tb = shared.errors.get()
        kind = "diverged" if isinstance(exc, Diverged) else "non_finite" if isinstance(exc, NonFinite) else "worker"
        if kind == "worker":
            log.error("worker %s failed:\n%s", name, tb.rstrip())
        else:
            log.error("%s: %s", name, exc)
        if first is None or (first["kind"] == "worker" and kind != "worker"):
            first = {"kind": kind, "worker": name, "message": str(exc), **getattr(exc, "info", {})}
    return first


def _stop(shared: Shared, sync: GradSync):
    shared.stop.set()
    sync.barrier.abort()
