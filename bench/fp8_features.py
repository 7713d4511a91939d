"""The target-FP8 switch (train.fp8_target) against bf16 on what the drafter reads: the target's captured features.
Shared by bench/h200.py's fp8 section (bench/sections/target.py: the random Qwen3-8B-shaped target) and
bench/quality.py's fp8_features part (the pipeline's pre-trained code target on its held-out conversations).

- `capture_both(model, ctx, measure)`: a training run's capture of `model` (dflash.train.features.run_capture on
  ctx.drafter_config's target layers, ctx.cfg.train's objective) with train.fp8_target off, then on. The second one
  quantizes the weights of the layers the capture runs, once and in place, exactly as a training run does (the model
  stays FP8 afterwards). `measure(name, capture) -> {label: features}` is called with each ("bf16", then "fp8"), and
  the capture's hooks are removed after it. Returns ({label: features as float32}, seconds the quantization took).
- `relative_error(got, ref)`: ||got - ref|| / ||ref|| over every element.
"""
from __future__ import annotations

from types import SimpleNamespace

from bench.common import Stopwatch


def capture_both(model, ctx, measure) -> tuple[dict, float]:
    import torch

    from dflash.train.features import run_capture
    feats, quantize_s = {}, 0.0
    device = next(model.parameters()).device
    for name, on in (("bf16", False), ("fp8", True)):
        train = ctx.cfg.train.model_copy(update={"fp8_target": on})
        quantize = Stopwatch()
        capture = run_capture(model, SimpleNamespace(drafter_config=ctx.drafter_config,
                                                     cfg=ctx.cfg.model_copy(update={"train": train})))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if on:
            quantize_s = quantize.s
        try:
            feats.update({label: f.float() for label, f in measure(name, capture).items()})
        finally:
            capture.remove()
    return feats, quantize_s


def relative_error(got, ref) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())
