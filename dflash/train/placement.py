"""Where each worker runs: device strings from config, validated against the machine."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash.errors import UserError


def parse_device(spec: str | int) -> torch.device:
    """'cpu', 'cuda', 'cuda:3' or '3' -> torch.device."""
    s = str(spec).strip()
    if s.isdigit():
        s = f"cuda:{s}"
    try:
        dev = torch.device(s)
    except RuntimeError:
        raise UserError(f"train placement: '{spec}' is not a device (use cpu, cuda:N or N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"train placement: '{spec}' asks for a GPU but CUDA is not available here")
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"train placement: '{spec}' but only {torch.cuda.device_count()} GPU(s) are visible")
        dev = torch.device("cuda", index)
    elif dev.type != "cpu":
        raise UserError(f"train placement: device type '{dev.type}' is not supported (cpu or cuda)")
    return dev


def _norm(spec) -> str:
    s = str(spec).strip()
    return f"cuda:{s}" if s.isdigit() else ("cuda:0" if s == "cuda" else s)


def colocated(train_cfg) -> bool:
    """train.targets and train.drafters list the same devices in the same order: in the distributed runtime each rank
    then runs a target and a drafter replica on its device (no feature transport; replicas in one DDP group)."""
    return [_norm(d) for d in train_cfg.targets] == [_norm(d) for d in train_cfg.drafters]


@dataclass(frozen=True)
class Placement:
    targets: tuple[torch.device, ...]
    drafters: tuple[torch.device, ...]
    runtime: str  # threads | distributed
    colocated: bool = False   # distributed: rank r runs a target and drafter replica r on drafters[r]

    @property
    def devices(self) -> tuple[torch.device, ...]:
        seen = []
        for d in self.targets + self.drafters:
            if d not in seen:
                seen.append(d)
        return tuple(seen)

    @property
    def gpus(self) -> tuple[torch.device, ...]:
        return tuple(d for d in self.devices if d.type == "cuda")


def resolve(train_cfg) -> Placement:
    targets = tuple(parse_device(d) for d in train_cfg.targets)
    drafters = tuple(parse_device(d) for d in train_cfg.drafters)
    runtime = train_cfg.runtime
    gpu_ranks = [d for d in targets + drafters if d.type == "cuda"]
    shared = sorted({str(d) for d in gpu_ranks if gpu_ranks.count(d) > 1})
    if runtime == "auto":   # a process per GPU where every worker has its own GPU; threads otherwise
        runtime = "distributed" if len(set(gpu_ranks)) > 1 and not shared else "threads"
    coloc = runtime == "distributed" and colocated(train_cfg)
    if coloc:   # one rank per drafter entry, each with its target: only a GPU listed twice is shared
        shared = sorted({str(d) for d in drafters if d.type == "cuda" and drafters.count(d) > 1})
    if runtime == "distributed" and shared:
        raise UserError(f"train.runtime is distributed but {', '.join(shared)} hold several workers (targets + "
                        "drafters): NCCL takes one rank per GPU; use train.runtime: threads for shared GPUs, or list "
                        "the same GPUs, once each, in train.targets and train.drafters (each rank then runs a target "
                        "and a drafter replica)")
    return Placement(targets, drafters, runtime, coloc)


def attention_backend(train_cfg, drafter_devices) -> str:
    """auto: flex where every drafter is on a GPU, sdpa otherwise (flex has no CPU backward in torch >= 2.11)."""
    if train_cfg.attention != "auto":
        return train_cfg.attention
    return "flex" if all(d.type == "cuda" for d in drafter_devices) else "sdpa"


def autocast_dtype(train_cfg, device: torch.device):
    """bf16 autocast on GPU, none (float32) on CPU, unless the config says otherwise."""
    if train_cfg.dtype == "float32" or (train_cfg.dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16
