"""AdamW with linear warm-up and cosine decay (the DFlash recipe: lr 6e-4, warm-up 4%, clip 1.0)."""
from __future__ import annotations

import math

import torch


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    warm = max(1, int(round(total * warmup_ratio)))
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build(params, train_cfg, device: torch.device):
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(params, lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                            weight_decay=train_cfg.weight_decay, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_lambda(s, train_cfg.steps, train_cfg.warmup_ratio, train_cfg.min_lr_ratio))
    return opt, sched
