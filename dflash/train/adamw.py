"""The AdamW step as one compiled function: the clip's gradient norm, the clip, AdamW's update, every parameter at once.

torch's fused AdamW reads and writes each parameter's four float32 tensors in one kernel per tensor list chunk at
2.8 TB/s on an H200; the same update traced by torch.compile runs at 4.0 (7.4 against 10.4 ms for the 1.05B-weight
drafter of config/h200.yaml, bench/results/2026-12-04-h200-r9), and the norm and the clip coefficient, three more
passes and a dozen small kernels before it, join the same graph. `update` is that function; `CompiledAdamW` runs it
over a torch.optim.AdamW's own parameters and state, so state_dict, load_state_dict, checkpoints and resume are
torch's exactly, and either path can resume the other's run.

Every scalar the step reads lives in one float32 tensor on the parameters' device, `hyper` (filled by small
kernels, never copied from the host), so a new learning rate neither recompiles nor stalls the host:
    [lr, beta1, beta2, 1 - beta1**t, sqrt(1 - beta2**t), eps, weight_decay, clip]
The math is torch.optim.AdamW's (decoupled weight decay, bias correction) on `grad * scale * clip_coef`, where
clip_coef = min(1, clip / (norm + 1e-6)) of norm = ||grad|| * scale (clip 0: 1), clip_grad_norm_'s rule.

`warm_up` compiles the graph on the run's own tensors with a step that changes nothing, bit for bit (zero gradients,
lr 0, beta1 = beta2 = 1, no bias correction): m' = m + 0*(0 - m), v' = 1*v + 0, p' = p*(1 - 0) - 0*finite.
"""
from __future__ import annotations

import math

import torch

from dflash import compile_threads

LR, BETA1, BETA2, BIAS1, BIAS2_SQRT, EPS, WD, CLIP = range(8)


def update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], scale: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """One clipped AdamW step in place (see the module docstring); returns ||grads|| * scale (float32, 0-dim)."""
    lr, b1, b2, bias1, bias2_sqrt, eps, wd, clip = hyper.unbind()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
    norm = norm * scale
    coef = torch.where(clip > 0, torch.clamp(clip / (norm + 1e-6), max=1.0), torch.ones_like(norm))
    factor = scale * coef
    step_size = lr / bias1
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        g = g * factor
        m.lerp_(g, 1 - b1)
        v.mul_(b2).add_((1 - b2) * g * g)
        p.mul_(1 - lr * wd)
        p.sub_(step_size * m / (v.sqrt() / bias2_sqrt + eps))
    return norm


_COMPILED: dict = {}


def compiled_update():
    """`update` compiled once per process (fullgraph, static shapes: one entry per device the replicas run on)."""
    if "u" not in _COMPILED:
        _COMPILED["u"] = compile_threads.compiled(update, fullgraph=True, dynamic=False)
    return _COMPILED["u"]


class CompiledAdamW:
    """Steps a torch.optim.AdamW (no amsgrad, not maximize) with `update`: its param_groups' lr, betas, eps and
    weight_decay, its state (`step` as a float32 CPU tensor, `exp_avg`, `exp_avg_sq`: what torch's foreach AdamW
    keeps, initialised the same way on the first step)."""

    def __init__(self, opt: torch.optim.AdamW, compiled: bool = True):
        if len(opt.param_groups) != 1:
            raise ValueError("CompiledAdamW steps one parameter group")
        g = opt.param_groups[0]
        if g.get("amsgrad") or g.get("maximize"):
            raise ValueError("CompiledAdamW: amsgrad and maximize are not supported")
        self.opt, self.group = opt, g
        self.params = list(g["params"])
        self.fn = compiled_update() if compiled else update
        dev = self.params[0].device
        self.hyper = torch.zeros(8, dtype=torch.float32, device=dev)
        self._set(BETA1, g["betas"][0])
        self._set(BETA2, g["betas"][1])
        self._set(EPS, g["eps"])
        self._set(WD, g["weight_decay"])
        self._lr = None

    def _set(self, i: int, value: float) -> None:
        self.hyper[i].fill_(value)     # a kernel with the value as its argument: no host-to-device copy, no sync

    def state(self) -> tuple[list, list, list]:
        """(steps, exp_avgs, exp_avg_sqs) of every parameter, made as torch's AdamW makes them on a first step; a
        `step` a checkpoint of the fused AdamW left on the device moves to the CPU (read on the host each step)."""
        steps, avgs, sqs = [], [], []
        for p in self.params:
            st = self.opt.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif st["step"].device.type != "cpu":
                st["step"] = st["step"].detach().to("cpu", torch.float32)
            steps.append(st["step"])
            avgs.append(st["exp_avg"])
            sqs.append(st["exp_avg_sq"])
        return steps, avgs, sqs

    def step(self, grads: list[torch.Tensor], scale: torch.Tensor, clip: float) -> torch.Tensor:
        """AdamW on `grads * scale`, clipped to `clip` (0: not clipped); returns the gradient norm (of grads*scale)."""
        steps, avgs, sqs = self.state()
        t = float(steps[0]) + 1
        torch._foreach_add_(steps, 1.0)
        b1, b2 = self.group["betas"]
        if self.group["lr"] != self._lr:
            self._lr = self.group["lr"]
            self._set(LR, self._lr)
        self._set(BIAS1, 1 - b1 ** t)
        self._set(BIAS2_SQRT, math.sqrt(1 - b2 ** t))
        self._set(CLIP, clip)
        with torch.no_grad():
            return self.fn(self.params, grads, avgs, sqs, scale.float(), self.hyper)

    def warm_up(self) -> None:
        """Compile (or just run) `update` on the run's own parameters and state with a step that changes nothing
        (module docstring): zero gradients, lr 0, betas 1, no bias correction; the step counts stay."""
        _, avgs, sqs = self.state()
        hyper = self.hyper.clone()
        for i, v in ((LR, 0.0), (BETA1, 1.0), (BETA2, 1.0), (BIAS1, 1.0), (BIAS2_SQRT, 1.0)):
            hyper[i].fill_(v)
        zeros = [torch.zeros_like(p) for p in self.params]
        with torch.no_grad():
            self.fn(self.params, zeros, avgs, sqs, torch.ones((), device=self.hyper.device), hyper)
