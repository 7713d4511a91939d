"""The `threads` transport: one process, one thread per worker, race-free by construction (dflash/train/run.py runs
the lifecycle over it).

    feeder -> work queue -> TargetWorker x T -> inbox per replica (bounded) -> DrafterWorker x D (trainer.Replica)

Micro-batch i of the stream goes to replica i % D; optimizer step s consumes micro-batches [s*M, (s+1)*M) with
M = D * grad_accum, so the data order is a function of the step alone (exact resume). Compiled calls are safe from
several threads (dflash.compile_threads, on while the workers run), and every compile happens in the lifecycle's
warm-up, before any worker thread starts. The supervisor (main thread) starts workers, waits for them to be ready, and stops
everything within seconds when any worker fails, naming it; every stop signal (failures.STOP_SIGNALS: SIGINT,
SIGTERM, SIGUSR1, SIGHUP) makes every replica stop after its current step and write a checkpoint.

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

from dflash import compile_threads
from dflash.config_model import TrainSection
from dflash.device_names import device_name
from dflash.errors import UserError
from dflash.train import compile_guard, failures
from dflash.train.metrics import DeviceTimer
from dflash.train.run import Local
from dflash.train.step import frozen_head
from dflash.train.trainer import Micro

log = logging.getLogger("dflash.train")
POLL = 0.1  # seconds between checks of the stop flag in every blocking wait


class Stopped(Exception):
    """Raised inside a worker when the run is being stopped (not an error of that worker)."""


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

    def wait_take(self, q: queue.Queue):
        while not self.stop.is_set():
            try:
                return q.get(timeout=POLL)
            except queue.Empty:
                pass
        raise Stopped


class Worker(threading.Thread):
    def __init__(self, name: str, device: torch.device, shared: Shared):
        super().__init__(name=name, daemon=True)
        self.device, self.shared = device, shared
        self.ready = threading.Event()
        self.steps, self.ready_s, self.t0 = 0, None, time.perf_counter()

    def mark_ready(self):
        self.ready_s = round(time.perf_counter() - self.t0, 3)
        self.ready.set()

    def run(self):
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.body()
        except (Stopped, failures.StopRun):
            pass
        except BaseException as e:
            self.shared.errors.put((self.name, e, traceback.format_exc()))
            self.shared.stop.set()


class Feeder(Worker):
    """Reads batches in stream order from `start` and hands them to the target workers."""

    def __init__(self, reader, start: int, end: int, work: queue.Queue, shared: Shared, pin: bool):
        super().__init__("reader", torch.device("cpu"), shared)
        self.reader, self.start_index, self.end, self.work, self.pin = reader, start, end, work, pin

    def body(self):
        self.mark_ready()
        for i in range(self.start_index, self.end):
            b = self.reader.batch(i)
            self.shared.wait_put(self.work, b.pin() if self.pin else b)
            self.steps += 1

    def row(self) -> dict:
        return {"name": self.name, "role": "reader", "device": "cpu", "steps": self.steps, "ready_s": self.ready_s}


class TargetWorker(Worker):
    """Features of the batches it takes from the work queue, for the replica of each (a run.Target's capture)."""

    def __init__(self, target, ctx, work, inboxes, replica_devices, shared):
        super().__init__(target.name, target.device, shared)
        self.target, self.work, self.inboxes, self.replica_devices = target, work, inboxes, replica_devices
        self.ctx, self.fail = ctx, failures.injector(ctx.cfg.train, target.name)

    def body(self):
        self.fail(0)
        if self.target.capture.compiled:
            compile_guard.configure_thread(len(self.ctx.shapes), self.ctx.compiled_workers)
        cuda = self.device.type == "cuda"
        # high priority: the drafters wait on the features, so the target's kernels go first on a shared GPU
        stream = torch.cuda.Stream(self.device, priority=-1) if cuda else None
        self.mark_ready()
        timer = DeviceTimer(self.device)
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            while True:
                batch = self.shared.wait_take(self.work)
                self.fail(self.steps + 1)
                r = batch.index % len(self.inboxes)
                dst = self.replica_devices[r]
                with timer:
                    # every copy below runs on this stream (a cross-device copy runs on the source's current
                    # stream), so the event recorded after them covers the features on `dst` too
                    ids = batch.input_ids.to(self.device, non_blocking=True)
                    feats = self.target.features(ids)   # an inference tensor: autograd may not save it, so copy it
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
                self.target.steps = self.steps


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

    def hold(self, rank: int, work, timeout_s: float, what: str = ""):
        """Replica 0 runs `work()` while the others wait at the barrier (the supervisor's stall timeout bounds it; a
        failed run aborts the barrier) -> work's result on replica 0, None on the others."""
        out = work() if rank == 0 else None
        self._wait()
        return out

    def _wait(self):
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped from None


class DrafterWorker(Worker):
    def __init__(self, replica, inbox, shared):
        super().__init__(f"drafter-{replica.rank}", replica.device, shared)
        self.replica, self.inbox = replica, inbox
        self.pending: dict[int, Micro] = {}

    def take(self, index: int) -> Micro:
        """The micro-batch with this stream index (target workers may finish out of order)."""
        while index not in self.pending:
            item = self.shared.wait_take(self.inbox)
            self.pending[item.index] = item
        return self.pending.pop(index)

    def body(self):
        self.replica.fail(0)
        compile_guard.configure_thread(len(self.replica.ctx.shapes), self.replica.ctx.compiled_workers)
        self.mark_ready()
        self.replica.run(self.take, self.shared.interrupt.is_set, self.inbox.qsize)


class Threads:
    """The transport of one process holding every worker (run.Transport)."""

    reduce = "flat"

    def __init__(self):
        self.shared, self.workers, self.gradsync = Shared(), [], None

    def open(self, ctx) -> Local:
        pl = ctx.placement
        return Local([(f"target-{i}", d) for i, d in enumerate(pl.targets)], list(enumerate(pl.drafters)), True,
                     device_name, len(pl.drafters))

    def heads(self, ctx, targets, devices) -> dict:
        """Each drafter device's embedding and LM head: a target's own tensors on its device, a copy elsewhere."""
        return {d: frozen_head(next((t.model for t in targets if t.device == d), targets[0].model), d)
                for d in dict.fromkeys(devices)}

    def sync(self, ctx) -> "GradSync":
        self.gradsync = GradSync(len(ctx.placement.drafters))
        return self.gradsync

    def share(self, point):
        return point    # one process: the writer's point is everyone's

    def wrap(self, replicas):
        pass

    def serve(self, process) -> tuple[str, dict | None]:
        """Start the workers and supervise them, the stop signals handled, until the replicas end or one fails."""
        p, cfg, shared = process, process.ctx.cfg, self.shared
        work: queue.Queue = queue.Queue(maxsize=max(2, len(p.targets)) * 2)
        inboxes = [queue.Queue(maxsize=cfg.train.queue_size) for _ in p.replicas]
        feeder = Feeder(p.reader, p.data_index, p.end_index, work, shared,
                        pin=any(t.device.type == "cuda" for t in p.targets))
        targets = [TargetWorker(t, p.ctx, work, inboxes, [r.device for r in p.replicas], shared) for t in p.targets]
        drafters = [DrafterWorker(rep, inboxes[rep.rank], shared) for rep in p.replicas]
        self.workers = [feeder, *targets, *drafters]
        previous = {s: signal.signal(s, lambda signum, frame: _on_signal(shared, signum))
                    for s in failures.STOP_SIGNALS}
        with compile_threads.threaded():   # several threads call the compiled code (compiled in the warm-up)
            try:
                for w in self.workers:
                    w.start()
                status, failure = _supervise(self.workers, drafters, shared, self.gradsync, cfg.train, p.metrics)
            finally:
                for s, h in previous.items():
                    signal.signal(s, h)
            deadline = time.perf_counter() + 10
            for w in self.workers:  # every worker polls the stop flag: they end within a poll interval
                w.join(max(0.0, deadline - time.perf_counter()))
        p.extra_rows.append(feeder.row())
        p.ready.update({w.name: w.ready_s for w in [*targets, *drafters]})
        return status, failure

    def gather(self, rows: dict) -> list[dict]:
        return [rows]

    def close(self, status: str) -> int:
        code = 0 if status == "completed" else 128 + (self.shared.signum or signal.SIGINT) \
            if status == "interrupted" else 1
        stuck = [w.name for w in self.workers if w.is_alive()]
        if stuck:  # a thread inside a long native call: do not let interpreter shutdown abort or hang on it
            log.error("worker(s) still running after the stop: %s; exiting", ", ".join(stuck))
            logging.shutdown()
            os._exit(code)
        return code


def _on_signal(shared: Shared, signum: int):
    if shared.interrupt.is_set():
        return
    shared.signum = signum
    log.warning("%s: the replicas stop after the current step and write a checkpoint", signal.Signals(signum).name)
    shared.interrupt.set()


def _supervise(workers, replicas, shared: Shared, sync: "GradSync", tcfg: TrainSection,
               metrics) -> tuple[str, dict | None]:
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
        steps = replicas[0].replica.steps
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


def _failed(shared: Shared, sync: "GradSync") -> dict | None:
    if shared.errors.empty():
        return None
    _stop(shared, sync)
    records = []
    while not shared.errors.empty():
        name, exc, tb = shared.errors.get()
        records.append(failures.record(name, exc))
        if records[-1]["kind"] == "worker" and not isinstance(exc, UserError):   # the user's to fix: one line
            log.error("worker %s failed:\n%s", name, tb.rstrip())
        else:
            log.error("%s: %s", name, exc)
    return failures.first(records)


def _stop(shared: Shared, sync: "GradSync"):
    shared.stop.set()
    sync.barrier.abort()
