"""The warm-up stage's work on one device, single-threaded: the drafter's forward and backward (a device that runs a
replica, or nothing compiled) and, with train.compile_target, the target's captured layers (a device that runs a
target), compiled for every shape bucket as the train stage compiles them, into the compile cache; returned as
results/compile/<device>.json's record (`CompileRecord`, dflash/records/compile.py)."""
from __future__ import annotations

import gc
import logging

import torch

from dflash.records.compile import CompileRecord
from dflash.train import optim, placement as P
from dflash.train.context import RunContext

log = logging.getLogger("dflash.warmup")


def warm_up_device(ctx: RunContext, device: torch.device, cache) -> CompileRecord:
    """Every part this placement runs on `device`, in the train stage's order (the drafter, then the compiled
    target), warmed into the compile cache `cache`; the bucket shapes set on `ctx` (context.set_shapes)."""
    target = ctx.cfg.train.compile_target and device in ctx.placement.targets
    drafter = device in ctx.placement.drafters
    if not (drafter or target):
        log.warning("%s runs no drafter (nor a compiled target) in this placement; warming the drafter up anyway",
                    device)
    parts = []
    if drafter or not target:
        parts.append(_drafter(ctx, device))
    if target:
        gc.collect()   # the warmed drafter (compiled methods hold it in a cycle) goes before the target loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
        parts.append(_target(ctx, device))
    total = {k: sum(r[k] for r in parts) for k in ("graphs", "cache_hits", "cache_misses")}
    return CompileRecord(device=str(device), **total, seconds=round(sum(r["seconds"] for r in parts), 3),
                         per_role=parts, env_hash=ctx.env["hash"], cache_dir=str(cache))


def _drafter(ctx: RunContext, device) -> dict:
    from dflash.train.step import build_drafter, random_head, warm_up

    dtype = P.autocast_dtype(ctx.cfg.train, device) or torch.float32
    drafter = build_drafter(ctx, *random_head(ctx, device, dtype), device)
    optimizer, _ = optim.build(drafter.named_parameters(), ctx.cfg.train, device,
                               compiled=ctx.compile and device.type == "cuda")   # as train.trainer.Replica builds it
    return warm_up(drafter, ctx, device, ctx.shapes, optimizer)


def _target(ctx: RunContext, device) -> dict:
    """The target's captured layers compiled as the train stage compiles them (LayerCapture.compile / warm_up): the
    same graphs, so its first start finds them in the cache. The record has role 'target'."""
    from dflash.target import load_target
    from dflash.train.features import run_capture

    capture = run_capture(load_target(ctx.cfg.target, device=device, seed=ctx.cfg.seed), ctx)
    capture.compile()
    return capture.warm_up(device, ctx.shapes, ctx.drafter_config.vocab_size, ctx.compiled_workers)
