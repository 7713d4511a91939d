"""The drafter replica's training loop, shared by both runtimes (threads and distributed).

Step s of replica `rank` (of n) consumes stream indices data_index + (s - start)*n*accum + a*n + rank, a < accum;
gradients and step statistics are summed across replicas by `sync` (threads: barrier; distributed: all-reduce),
so every replica applies the same averaged gradient and the weights stay identical.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from dflash.train import checkpoint, compile_guard
from dflash.train import placement as P
from dflash.train.metrics import DeviceTimer, loss_stats
from dflash.train.setup import micro_step


@dataclass
class Micro:
    """One micro-batch as the drafter receives it."""
    index: int
    tokens: int
    feats: torch.Tensor        # [b, S, k*H] target features on the drafter's device
    input_ids: torch.Tensor    # [b, S]
    loss_mask: torch.Tensor    # [b, S]
    ready: object = None       # CUDA event the features are complete at (threads runtime), or None
    target_time: object = 0.0  # seconds or CUDA event pairs (resolved at logging time)


class StopRun(Exception):
    """All replicas agreed to stop after this step (Ctrl-C); the checkpoint is written."""


class DrafterLoop:
    def __init__(self, rank, n, device, setup, drafter, optimizer, scheduler, sync, metrics, start_step, data_index,
                 fail: Callable[[int], None] = lambda step: None):
        self.rank, self.n, self.device, self.setup = rank, n, device, setup
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self.sync, self.metrics, self.fail = sync, metrics, fail
        self.start_step, self.data_index = start_step, data_index
        self.steps = start_step

    def index(self, step: int, a: int) -> int:
        per_step = self.n * self.setup.cfg.train.grad_accum
        return self.data_index + (step - self.start_step) * per_step + a * self.n + self.rank

    def run(self, take: Callable[[int], Micro], want_stop: Callable[[], bool], queue_depth: Callable[[], int]):
        cfg, setup = self.setup.cfg, self.setup
        accum = cfg.train.grad_accum
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        dtype = P.autocast_dtype(cfg.train, self.device)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        t_fwd, t_opt = DeviceTimer(self.device), DeviceTimer(self.device)
        with torch.cuda.stream(stream) if cuda else _Null():
            for step in range(self.start_step, cfg.train.steps):
                self.fail(step + 1)
                stats, wait, target_t = None, 0.0, []
                for a in range(accum):
                    t = time.perf_counter()
                    m = take(self.index(step, a))
                    wait += time.perf_counter() - t
                    target_t.append(m.target_time)
                    if m.ready is not None:
                        stream.wait_event(m.ready)
                        for x in (m.feats, m.input_ids, m.loss_mask):
                            x.record_stream(stream)
                    with t_fwd, compile_guard.FX_GUARD.shared(), \
                            compile_guard.no_new_graphs(f"batch {tuple(m.input_ids.shape)} on {self.device}"):
                        out = micro_step(self.drafter, m.feats, m.input_ids, m.loss_mask, m.index, setup, dtype)
                        (out.loss / accum).backward()
                    s = loss_stats(out, m.tokens)
                    stats = s if stats is None else stats + s
                with t_opt:
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                    flat = torch._utils._flatten_dense_tensors(grads)
                    (flat, stats), stop = self.sync.reduce(self.rank, [flat, stats], want_stop=want_stop())
                    for g, avg in zip(grads, torch._utils._unflatten_dense_tensors(flat / self.n, grads)):
                        g.copy_(avg)
                    for p, g in zip(params, grads):
                        p.grad = g
                    gnorm = (torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip) if cfg.train.grad_clip
                             else torch.zeros(()))
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                self.steps = step + 1
                if self.rank == 0:
                    self.metrics.step_done(step + 1, stats, gnorm, self.scheduler.get_last_lr()[0],
                                           {"queue_wait": wait, "target": target_t, "drafter": t_fwd.pop(),
                                            "optimizer": t_opt.pop()}, queue_depth())
                    every = cfg.train.checkpoint_every
                    if stop or step + 1 == cfg.train.steps or (every and (step + 1) % every == 0):
                        checkpoint.save(setup.run_dir, step + 1, self.index(step + 1, 0) - self.rank, self.drafter,
                                        self.optimizer, self.scheduler, checkpoint.identity(setup))
                if stop:
                    raise StopRun


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
