"""One data-parallel replica of the drafter, its whole life: build, resume, warm-up, the step loop, checkpoints,
the divergence guard and the fault-injection hooks. Both runtimes run this; they differ only in their transport:
how a micro-batch arrives (`take`) and how replicas reduce (`sync`, see runtime/threads.py and runtime/distributed.py).

Step s of replica `rank` (of n) consumes stream indices data_index + (s - start)*n*accum + a*n + rank, a < accum.
The step's loss is the weighted mean over every scored position of every micro-batch of every replica (normalised
by the global weight sum), so splitting a batch over replicas or accumulation never changes the gradient:
each micro-batch back-propagates its weighted *sum*, replicas sum gradients and weight sums, and every replica
divides by the same global weight sum before clipping and the optimizer step. That division and the clip are
one factor applied where the optimizer reads the gradients (in the fused AdamW's own kernel on GPUs), not extra
passes over them.

The training time (seconds after the warm-up, over resumes) is agreed the same way: each replica's clock is summed
with the step's statistics, and every replica takes the mean, so the LR of a time budget (train.time_budget_s) and
the step at which it ends the run are the same on all of them.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from dflash.config_model import ProfileSection
from dflash.train import checkpoint, compile_guard, optim, run_folder
from dflash.train.failures import Diverged, StopRun
from dflash.train import placement as P
from dflash.train.metrics import DeviceTimer, check_pending, log_due, loss_stats
from dflash.train.step import micro_step, warm_up

log = logging.getLogger("dflash.train")


@dataclass
class Micro:
    """One micro-batch as a replica receives it."""
    index: int
    tokens: int
    feats: torch.Tensor        # [b, S, k*H] target features on the replica's device
    input_ids: torch.Tensor    # [b, S]
    loss_mask: torch.Tensor    # [b, S]
    ready: object = None       # CUDA event the features are complete at (threads runtime), or None
    target_time: object = 0.0  # seconds or CUDA event pairs (resolved at logging time)


class Sync(Protocol):
    n: int
    reduces_in_backward: bool   # True: gradients are reduced during backward (DDP); reduce() then sums stats only

    def reduce(self, rank: int, tensors: list[torch.Tensor], want_stop: bool = False):
        """Sum each tensor over replicas (same order everywhere) -> (sums, any replica wants to stop)."""

    def gather(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every replica's `value` (a small tensor), in rank order."""

    def hold(self, rank: int, work: Callable[[], object], timeout_s: float, what: str):
        """Replica 0 runs `work()` (`what`, for a message) while the others wait (at most timeout_s) -> its result on
        replica 0, else None."""


def weight_checksum(module) -> torch.Tensor:
    """An exact fingerprint of the trainable weights' bits: int64 sums of their bit patterns, one per parameter.
    Equal across replicas iff (practically) every weight is bit-identical; no float rounding involved."""
    with torch.no_grad():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}
        return torch.stack([p.detach().contiguous().view(bits[p.element_size()]).long().sum()
                            for p in module.parameters() if p.requires_grad])


class StepProfiler:
    """train.profile: torch.profiler over steps [start_step, start_step + steps) of replica 0, the chrome trace
    written to the run folder when the window closes (or the loop ends). The loop's phases are record_function
    ranges (queue_wait, drafter_fwd_bwd, optimizer), free when no profiler runs."""

    def __init__(self, conf: ProfileSection, run_dir, rank: int):
        from dflash.config import inside
        self.conf: ProfileSection | None = conf if rank == 0 else None
        self.out = inside(run_dir / conf.out, run_dir) if self.conf else None
        self.prof = None

    def at(self, step: int) -> None:
        """Called before each step (0-based global step number)."""
        if self.conf is None:
            return
        if self.prof is None and step == self.conf.start_step:
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
            log.info("profiling steps %d..%d into %s", step + 1, step + self.conf.steps, self.out)
        elif self.prof is not None and step == self.conf.start_step + self.conf.steps:
            self.close()

    def close(self) -> None:
        if self.prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(self.out))
            self.prof, self.conf = None, None


class Replica:
    def __init__(self, ctx, rank: int, n: int, device: torch.device, drafter, sync: Sync, metrics=None,
                 fail: Callable[[int], None] = lambda step: None):
        self.ctx, self.rank, self.n, self.device = ctx, rank, n, device
        self.drafter = self.model = drafter         # `model` is what is called: the drafter or its DDP wrapper
        self.sync, self.metrics, self.fail = sync, metrics, fail
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizer, self.schedule = optim.build(drafter.named_parameters(), ctx.cfg.train, device,
                                                    compiled=ctx.compile and device.type == "cuda")
        self.start_step = self.data_index = self.steps = 0
        self.t0 = self.clock()
        self.base_s = self.elapsed = 0.0   # training seconds before this process (resume); at the last step, agreed
        self.finished_by = None         # "steps" | "time_budget" once the run reached its end
        self.live = None                # dflash.evaluate.live.LiveEval: tau measured every train.eval_every steps
        self.resumed = None             # the trainer state it resumed from (records.checkpoint.TrainerCore)

    # the clock of the training time (time.perf_counter); a class attribute so that tests can run on a fake one
    clock = staticmethod(time.perf_counter)

    # -- lifecycle ------------------------------------------------------------------------------------------
    def resume(self, path) -> None:
        state = checkpoint.load(path, self.drafter, self.optimizer, self.schedule)
        self.start_step = self.steps = state.step
        self.base_s = self.elapsed = self.schedule.elapsed_s
        self.data_index = state.data_index
        self.resumed = state

    def warm_up(self) -> dict:
        return warm_up(self.drafter, self.ctx, self.device, self.ctx.shapes, self.optimizer)

    def index(self, step: int, a: int) -> int:
        per_step = self.n * self.ctx.cfg.train.grad_accum
        return self.data_index + (step - self.start_step) * per_step + a * self.n + self.rank

    # -- one optimizer step ---------------------------------------------------------------------------------
    def accumulate(self, micros, want_stop: bool = False):
        """Forward+backward every micro-batch and reduce over replicas: afterwards every parameter's
        `.grad * self.grad_scale` is the gradient of the step's loss (the replicas' summed weighted sums over the
        global weight sum; `grad_scale` a 0-dim tensor, applied by optimizer_step). Returns (summed stats, stop)."""
        dtype = P.autocast_dtype(self.ctx.cfg.train, self.device)
        stats = None
        for i, m in enumerate(micros):
            last = i == len(micros) - 1
            no_sync = getattr(self.model, "no_sync", None)
            with (no_sync() if no_sync and not last else contextlib.nullcontext()), \
                    compile_guard.no_new_graphs(f"batch {tuple(m.input_ids.shape)} on {self.device}"):
                out = micro_step(self.model, m.feats, m.input_ids, m.loss_mask, m.index, self.ctx, dtype)
                (out.loss * out.weight_sum.detach()).backward()     # the weighted sum: normalised globally below
            s = loss_stats(out, m.tokens)
            stats = s if stats is None else stats + s
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        # the training time: each replica's clock rides with the stats and the replicas use the mean of the reduced
        # sum (the same on every replica), so all follow the same LR and stop at the same step (a time budget)
        clock = self.clock() - self.t0
        if self.n > 1:
            stats = torch.cat([stats, stats.new_full((1,), clock)])
        if self.sync.reduces_in_backward or self.n == 1:
            # gradients already summed (DDP averaged them over n replicas): no copies
            (stats,), stop = self.sync.reduce(self.rank, [stats], want_stop)
            self.grad_scale = self.n / stats[1].clamp(min=1e-12)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])     # one contiguous copy, reduced in place
            (flat, stats), stop = self.sync.reduce(self.rank, [flat, stats], want_stop)
            self.grad_scale = 1 / stats[1].clamp(min=1e-12)
            grads = [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in grads]), grads)]
        for p, g in zip(self.params, grads):
            p.grad = g
        if self.n > 1:   # (the reduce synchronised already: reading the sum costs no stall)
            stats, clock = stats[:-1], float(stats[-1]) / self.n
        self.elapsed = self.base_s + clock
        return stats, stop

    def optimizer_step(self):
        """Step `self.steps` (0-based): set the schedule's LR, clip to train.grad_clip and step on `.grad * grad_scale`
        (DrafterOptimizer.step). Returns the gradient's norm."""
        self.optimizer.set_lr(self.schedule.factor(self.steps, self.elapsed))
        gnorm = self.optimizer.step(self.params, self.grad_scale, self.ctx.cfg.train.grad_clip)
        self.optimizer.zero_grad(set_to_none=True)
        return gnorm

    # -- the loop ---------------------------------------------------------------------------------------------
    def run(self, take: Callable[[int], Micro], want_stop: Callable[[], bool], queue_depth: Callable[[], int]):
        """Train from self.start_step to train.steps (or the time budget): per step, its micro-batches (`take`,
        by stream index), forward+backward and the reduction, the optimizer step, then `after_step`. Raises StopRun
        when the replicas agreed to stop (`want_stop`: a signal), the failures of failures.py on a failed check."""
        cfg = self.ctx.cfg
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        t_fwd, t_opt = DeviceTimer(self.device), DeviceTimer(self.device)
        prof = StepProfiler(cfg.train.profile, self.ctx.run_dir, self.rank) if cfg.train.profile else None
        self.unchecked: list = []
        self.t0 = self.clock()   # training time counts from here (after the warm-up)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for step in range(self.start_step, cfg.train.steps):
                    if prof:
                        prof.at(step)
                    self.fail(step + 1)
                    micros, wait, target_t = self.take_step(step, take, stream)
                    with t_fwd, torch.profiler.record_function("drafter_fwd_bwd"):
                        stats, stop = self.accumulate(micros, want_stop())
                    del micros
                    with t_opt, torch.profiler.record_function("optimizer"):
                        gnorm = self.optimizer_step()
                    self.steps = step + 1
                    times = {"queue_wait": wait, "target": target_t, "drafter": t_fwd.pop(), "optimizer": t_opt.pop()}
                    if self.after_step(step + 1, stats, gnorm, times, queue_depth(), stop):
                        break
        finally:   # the trace is written however the loop ends (StopRun, a failure)
            if prof:
                prof.close()

    def take_step(self, step: int, take: Callable[[int], Micro], stream) -> tuple[list[Micro], float, list]:
        """The step's micro-batches of this replica, each ready on `stream` (features made on another stream are
        waited for and kept alive there); the seconds spent waiting for them and their target times."""
        wait, target_t, micros = 0.0, [], []
        for a in range(self.ctx.cfg.train.grad_accum):
            t = time.perf_counter()
            with torch.profiler.record_function("queue_wait"):
                m = take(self.index(step, a))
            wait += time.perf_counter() - t
            target_t.append(m.target_time)
            if m.ready is not None:
                stream.wait_event(m.ready)
                for x in (m.feats, m.input_ids, m.loss_mask):
                    x.record_stream(stream)
            micros.append(m)
        return micros, wait, target_t

    def after_step(self, step: int, stats, gnorm, times: dict, queue_depth: int, stop: bool) -> bool:
        """Everything after optimizer step `step` (1-based), the same in both runtimes and on every replica: the end
        test (train.steps or the agreed time budget), the divergence guard, metrics and checkpoints (replica 0), the
        finiteness check (the other distributed ranks). Returns True when this was the last step; StopRun on `stop`."""
        t = self.ctx.cfg.train
        self._inject_divergence(step)
        spent = self.schedule.spent(self.elapsed)   # the agreed time: every replica ends here
        final = step == t.steps or spent
        if final:
            self.finished_by = "time_budget" if spent else "steps"
        if t.check_every and (step % t.check_every == 0 or final or stop):
            self.check_replicas(step)
        if self.live is not None:   # tau by decoding (train.eval_every); the other replicas wait
            self.live.after_step(self, step, final)
        if self.rank == 0:   # the training time first: the step's metrics row carries it
            self.metrics.set_training(self.elapsed, self.finished_by)
            self.metrics.step_done(step, stats, gnorm, self.optimizer.lr, times, queue_depth)
        elif self.sync.reduces_in_backward:
            # distributed: the other ranks make replica 0's finiteness check at the same steps (the reduced stats
            # and the norm are the same on every rank), so all stop together, none waits in the next step's
            # all-reduce for a rank that stopped
            self.unchecked.append((step, stats, gnorm))
            if log_due(t, step, self.start_step) or final:
                check_pending(self.unchecked)
                self.unchecked.clear()
        if stop or final or (t.checkpoint_every and step % t.checkpoint_every == 0):
            self.checkpoint(step)
        if stop:
            raise StopRun
        return final

    @functools.cached_property
    def identity(self) -> dict:
        """What a checkpoint must match to be resumed (config and data hashes): read once per run."""
        return run_folder.identity(self.ctx)

    def checkpoint(self, step: int):
        """Checkpoint `step`: replica 0 writes it (`save`) while the others wait, and every replica takes the pause off
        its training clock, as an in-training evaluation's. The training time (train.time_budget_s and the schedule
        that follows it) counts training steps only, so a run cut at a checkpoint and resumed follows the uncut run's
        time exactly (it counted the uncut run's checkpoint writes, never a resumed one's)."""
        if self.device.type == "cuda":   # the step's kernels still in flight are training's time, not the pause's
            torch.cuda.synchronize(self.device)
        c0 = self.clock()
        self.sync.hold(self.rank, lambda: self.save(step), self.ctx.cfg.train.stall_timeout_s,
                       f"drafter-0's checkpoint of step {step}")
        self.t0 += self.clock() - c0

    def save(self, step: int):
        """Checkpoint `step` into this identity's folder; its trainer state says whether the run is finished
        (train.steps or the time budget reached: a rerun then restores it) and holds the training time (the
        schedule's state); the final one also holds the run's summary as it stands (what rebuilds the outputs from it
        alone)."""
        from dflash.train import summary
        self.metrics.flush()
        self.schedule.elapsed_s = self.elapsed
        with self.metrics.paused():   # writing a checkpoint is no training: out of Ktok/s and the utilisation
            kept = summary.build(self.ctx, self.metrics, [], "completed", []).model_dump() if self.finished_by else None
            checkpoint.save(run_folder.home(self.ctx.run_dir, self.identity), step, self.index(step, 0) - self.rank,
                            self.drafter, self.optimizer, self.schedule, self.identity, self.metrics.rows_upto(step),
                            self.finished_by, kept)

    def check_replicas(self, step: int):
        """The divergence guard: every replica compares exact weight checksums; any difference stops the run."""
        if self.n == 1:
            return
        sums = [s.cpu() for s in self.sync.gather(self.rank, weight_checksum(self.drafter))]
        groups: dict[tuple, list[int]] = {}
        for r, s in enumerate(sums):
            groups.setdefault(tuple(s.tolist()), []).append(r)
        if len(groups) > 1:
            parts = "; ".join(f"replicas {g}" for g in groups.values())
            raise Diverged(f"drafter replicas diverged at step {step}: weights differ between {parts}", step,
                           list(groups.values()))

    def _inject_divergence(self, step: int):
        hook = self.ctx.cfg.train.diverge_at_step
        if hook and hook.get("replica") == self.rank and hook.get("step") == step:
            with torch.no_grad():
                self.params[0].add_(1e-3)
            log.warning("drafter-%d: weights perturbed at step %d (train.diverge_at_step test hook)", self.rank, step)
