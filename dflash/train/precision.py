"""What a run's FP8 switches ask for (train.precision, train.fp8_recipe, train.fp8_lm_head, train.fp8_target):
refused where they cannot run, applied to the drafter and the target where they can (model/fp8.py does the work).

- `check(train_cfg, placement)`: one UserError naming the key for FP8 on a CPU device or a GPU below compute capability
  8.9 (FP8 tensor cores: Ada, Hopper and later), for the FP8 head with the checkpointed loss (it runs inside the fused
  loss only), or without torchao. RunContext's `prepare` calls it, so both runtimes and the warm-up stage refuse alike.
- `apply_drafter(drafter, train_cfg)`: before the drafter's layers are compiled: their Linears to float8 training
  (train.precision fp8) and the LM head's FP8 copies, made once (train.fp8_lm_head), kept on the drafter.
- `loss_head(drafter)`: what the loss multiplies by: those FP8 copies, or the head's weight.
- `apply_target(model, layers)`: the target's decoder layers that run (0..last captured) quantized once
  (train.fp8_target), before their forward is compiled.
"""
from __future__ import annotations

import torch

from dflash.config_model import TrainSection
from dflash.errors import UserError

FP8_CAPABILITY = (8, 9)
_HEAD = "_fp8_lm_head"   # the drafter's attribute holding its FrozenHead (a plain attribute: not in state_dict)


def wanted(train_cfg: TrainSection) -> list[str]:
    """The FP8 switches a config turns on, as `key=value` strings."""
    return [k for k, on in (("train.precision=fp8", train_cfg.precision == "fp8"),
                            ("train.fp8_lm_head=true", train_cfg.fp8_lm_head),
                            ("train.fp8_target=true", train_cfg.fp8_target)) if on]


def check(train_cfg: TrainSection, placement) -> None:
    """Refuse FP8 switches that cannot run on this placement (see the module docstring)."""
    keys = wanted(train_cfg)
    if not keys:
        return
    devices = {k: (placement.targets if k.startswith("train.fp8_target") else placement.drafters) for k in keys}
    for key, devs in devices.items():
        for d in devs:
            if d.type != "cuda":
                raise UserError(f"{key}: FP8 matmuls need a CUDA GPU of compute capability >= 8.9 (Ada, Hopper), "
                                f"but this run places them on {d}; drop {key} from the config (FP8 is off by "
                                f"default) or place the run on such a GPU")
            cap = torch.cuda.get_device_capability(d)
            if tuple(cap) < FP8_CAPABILITY:
                raise UserError(f"{key}: {d} ({torch.cuda.get_device_name(d)}) has compute capability "
                                f"{cap[0]}.{cap[1]}, and FP8 matmuls need >= 8.9 (Ada, Hopper); drop {key} from "
                                f"the config (FP8 is off by default)")
    try:
        import torchao  # noqa: F401
    except ImportError:
        raise UserError(f"{keys[0]}: FP8 needs torchao (envs/requirements.txt pins torchao==0.18.0); install it "
                        "or turn the FP8 switches off") from None


def apply_drafter(drafter, train_cfg: TrainSection, compiled: bool) -> None:
    """train.precision fp8: the layers' Linears to float8 training (train.fp8_recipe); train.fp8_lm_head: the frozen
    head's FP8 copies, made here once, its inputs quantized by quantize_rows (`compiled`: compiled once per process,
    its graphs traced in the warm-up, like the loss kernel). Call before the layers are compiled."""
    from dflash.model import fp8
    if train_cfg.precision == "fp8":
        fp8.convert_layers(drafter, train_cfg.fp8_recipe)
    if train_cfg.fp8_lm_head:
        setattr(drafter, _HEAD, fp8.FrozenHead(drafter.lm_head_weight, quantizer(compiled)))


_QUANTIZE: dict = {}


def quantizer(compiled: bool):
    """fp8.quantize_rows, compiled (once per process) on the compile path."""
    from dflash.model import fp8
    if compiled and "q" not in _QUANTIZE:
        from dflash import compile_threads
        _QUANTIZE["q"] = compile_threads.compiled(fp8.quantize_rows, fullgraph=True, dynamic=False)
    return _QUANTIZE["q"] if compiled else fp8.quantize_rows


def loss_head(drafter):
    """The LM head the loss multiplies by: its FP8 copies (train.fp8_lm_head) or the head's weight [V, H]."""
    return getattr(drafter, _HEAD, None) or drafter.lm_head_weight


def apply_target(layers, train_cfg: TrainSection) -> None:
    """train.fp8_target: quantize, once, the weights of the target layers the capture runs (inference only)."""
    if train_cfg.fp8_target:
        from dflash.model import fp8
        fp8.quantize_frozen(layers)
