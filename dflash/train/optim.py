"""The drafter's optimizer and its learning-rate schedule.

train.optimizer: `adamw` (the DFlash recipe: one AdamW over every trainable parameter at train.lr) or `muon`
(torch.optim.Muon on every 2-D weight, i.e. the layers' projections and fc, at train.muon_lr with Moonshot's
`match_rms_adamw` scaling; AdamW on the rest, the norm weights, at train.lr). Every trainable parameter is in exactly
one group, checked when building. Both follow one schedule: linear warm-up then cosine decay to min_lr_ratio, over
train.steps steps, or over train.time_budget_s seconds of training time (progress = elapsed / budget).
"""
from __future__ import annotations

import math

import torch

from dflash.config_model import TrainSection


# ---- the schedule ----------------------------------------------------------------------------------------------
def cosine(progress: float, min_ratio: float) -> float:
    """1 at progress 0 down to min_ratio at progress >= 1."""
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def lr_lambda(step: int, total: int, warmup_ratio: float, min_ratio: float) -> float:
    """LR factor of 0-based step `step` of `total`: warm-up over round(total * warmup_ratio) steps, then cosine."""
    warm = max(1, int(round(total * warmup_ratio)))
    if step < warm:
        return (step + 1) / warm
    return cosine((step - warm) / max(1, total - warm), min_ratio)


def time_lambda(elapsed: float, budget: float, warmup_ratio: float, min_ratio: float) -> float:
    """LR factor after `elapsed` of `budget` seconds: linear warm-up over warmup_ratio of the budget, then cosine."""
    warm = budget * warmup_ratio
    if elapsed < warm:
        return elapsed / warm
    return cosine((elapsed - warm) / max(budget - warm, 1e-9), min_ratio)


class Schedule:
    """The LR factor of each optimizer step and, with train.time_budget_s, the end of the run. `elapsed_s` is the
    training time (seconds after warm-up, summed over resumes) that every replica agreed on at the last step; it
    is the schedule's state in a checkpoint."""

    def __init__(self, train_cfg: TrainSection):
        self.steps, self.budget = train_cfg.steps, train_cfg.time_budget_s
        self.warmup_ratio, self.min_ratio = train_cfg.warmup_ratio, train_cfg.min_lr_ratio
        self.elapsed_s = 0.0

    def factor(self, step: int, elapsed_s: float) -> float:
        """The LR factor of 0-based step `step`, `elapsed_s` seconds into training (used with a time budget)."""
        if self.budget:
            return time_lambda(elapsed_s, self.budget, self.warmup_ratio, self.min_ratio)
        return lr_lambda(step, self.steps, self.warmup_ratio, self.min_ratio)

    def spent(self, elapsed_s: float) -> bool:
        """Whether the time budget is used up (progress >= 1): the run ends after this step."""
        return bool(self.budget) and elapsed_s >= self.budget

    def state_dict(self) -> dict:
        return {"elapsed_s": self.elapsed_s}

    def load_state_dict(self, state: dict) -> None:
        self.elapsed_s = float(state["elapsed_s"])


# ---- the optimizer ---------------------------------------------------------------------------------------------
def param_groups(named, optimizer: str) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """{optimizer name: [(name, parameter)]} of the trainable parameters `named`: all AdamW, or (muon) the 2-D
    weights to Muon and the rest to AdamW."""
    named = [(n, p) for n, p in named if p.requires_grad]
    if optimizer == "adamw":
        return {"adamw": named}
    return {"muon": [(n, p) for n, p in named if p.ndim == 2], "adamw": [(n, p) for n, p in named if p.ndim != 2]}


def check_partition(named, groups: dict[str, list]) -> None:
    """Every trainable parameter of `named` in exactly one group: RuntimeError naming any left out or doubled (a
    weight left out of Muon's group would silently train at another LR, as in vllm-project/speculators PR #1066)."""
    seen: dict[int, list[str]] = {}
    for group, items in groups.items():
        for _, p in items:
            seen.setdefault(id(p), []).append(group)
    left = [n for n, p in named if p.requires_grad and id(p) not in seen]
    doubled = [f"{n} (in {' and '.join(seen[id(p)])})" for n, p in named if len(seen.get(id(p), ())) > 1]
    known = {id(p) for _, p in named if p.requires_grad}
    foreign = [n for items in groups.values() for n, p in items if id(p) not in known]
    if left or doubled or foreign:
        raise RuntimeError("optimizer groups do not cover every trainable parameter once: "
                           + "; ".join(f"{what}: {', '.join(names)}" for what, names in
                                       (("left out", left), ("in two groups", doubled),
                                        ("not a trainable parameter", foreign)) if names))


class DrafterOptimizer:
    """The drafter's optimizers stepped as one (`parts`: {"adamw": AdamW} or {"muon": Muon, "adamw": AdamW}). Each
    group's LR is its peak LR (train.lr; train.muon_lr for Muon's) times the schedule's factor (`set_lr`). `compiled`
    (AdamW alone, on the compile path): the clip and AdamW's update as one compiled function (train/adamw.py)."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer], compiled: bool = False):
        self.parts = parts
        for g in self.param_groups:
            g["peak_lr"] = g["lr"]
        self.compiled = None
        if compiled and set(parts) == {"adamw"}:
            from dflash.train.adamw import CompiledAdamW
            self.compiled = CompiledAdamW(parts["adamw"])

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts.values() for g in opt.param_groups]

    @property
    def lr(self) -> float:
        """The current LR of train.lr's group (AdamW): the one metrics.jsonl shows."""
        return self.parts["adamw"].param_groups[0]["lr"]

    def set_lr(self, factor: float) -> None:
        for g in self.param_groups:
            g["lr"] = g["peak_lr"] * factor

    def step(self, params: list[torch.Tensor], scale: torch.Tensor, clip: float) -> torch.Tensor:
        """One step of every optimizer on `.grad * scale` (`scale` a 0-dim tensor) clipped to a global norm of `clip`
        (0: not clipped), as clip_grad_norm_ and then the optimizers, with one factor (scale x the clip coefficient)
        applied where the optimizer reads the gradients: in the compiled update, in the fused AdamW's own kernel
        (its grad_scale divides), or as one in-place multiply of the gradients (Muon has no grad_scale). Returns
        the norm of `.grad * scale`, in the gradients' dtype."""
        grads = [p.grad for p in params]
        if self.compiled is not None:
            return self.compiled.step(grads, scale, clip).to(grads[0].dtype)
        scale = scale.double()
        gnorm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True).double() * scale
        factor = scale * (torch.clamp(clip / (gnorm + 1e-6), max=1.0) if clip else 1.0)   # clip_grad_norm_'s coef
        for opt in self.parts.values():
            if opt.defaults.get("fused"):
                opt.grad_scale = (1 / factor).float()
            else:
                own = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
                torch._foreach_mul_(own, factor.to(own[0].dtype))
            opt.step()
        return gnorm.to(grads[0].dtype)

    def warm_up(self) -> None:
        """Compile the compiled update (a step that changes nothing: train/adamw.py); nothing to do otherwise."""
        if self.compiled is not None:
            self.compiled.warm_up()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.parts):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run's optimizer is {sorted(self.parts)}")
        for name, opt in self.parts.items():
            opt.load_state_dict(state[name])


def build(named, train_cfg: TrainSection, device: torch.device, compiled: bool = False
          ) -> tuple[DrafterOptimizer, Schedule]:
    """The optimizer of the trainable parameters `named` ((name, parameter) pairs) and its schedule. `compiled` (the
    run's compile path on a GPU): AdamW's step compiled with the clip (train/adamw.py), else torch's fused AdamW on a
    GPU, its for-each one on the CPU."""
    named = list(named)
    groups = param_groups(named, train_cfg.optimizer)
    check_partition(named, groups)
    parts: dict[str, torch.optim.Optimizer] = {}
    if "muon" in groups:
        parts["muon"] = torch.optim.Muon([p for _, p in groups["muon"]], lr=train_cfg.muon_lr,
                                         weight_decay=train_cfg.weight_decay, adjust_lr_fn="match_rms_adamw")
    compiled = compiled and "muon" not in parts
    parts["adamw"] = torch.optim.AdamW([p for _, p in groups["adamw"]], lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                       weight_decay=train_cfg.weight_decay,
                                       fused=device.type == "cuda" and not compiled)
    return DrafterOptimizer(parts, compiled), Schedule(train_cfg)
