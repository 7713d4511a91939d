"""FP8 matmuls through torchao (float8 e4m3 with scales), for the three places a training step spends its GEMMs.

- `convert_layers(drafter, recipe)`: every Linear of the drafter's decoder layers becomes torchao's `Float8Linear`
  (float8 training: input, weight and output gradient cast to FP8 with fresh scales at each matmul; recipe
  tensorwise | rowwise | rowwise_with_gw_hp). `Float8Linear.from_float` keeps the module's own weight Parameter (the
  fp32 master), so state_dict names and values, the optimizer, checkpoints, replica checksums and the export are
  those of the bf16 drafter. fc and the target's embedding / LM head are not converted.
- `FrozenHead(weight)`: the target's frozen LM head W [V, H], quantized ONCE (its values never change) in the two
  layouts the fused loss reads: `logits(h) = h @ W.T` reads W rowwise over V, `input_grad(g) = g @ W` reads W.T
  [H, V] rowwise over H (a scale may not run along the contracted dimension). h and the logits' gradient g are
  quantized per chunk, rowwise e4m3, by `quantize_rows` (compiled on the compile path: one pass over g). On the CPU
  the input gradient measured 2.7% relative error rowwise against 11% in the worst row with one scale per tensor:
  rowwise keeps confident rows, whose g is tiny, apart from the rest.
- `quantize_frozen(module)`: every Linear inside `module` gets its weight quantized once, as FrozenHead's (rowwise
  e4m3 weights, activations rowwise per call): the target's decoder layers, run under inference_mode.

Everything here is pure torch/torchao and runs on the CPU too (torch's CPU `_scaled_mm`), slowly: the train stage
refuses FP8 off an FP8-capable GPU (dflash.train.precision), the tests run it small on the CPU.
"""
from __future__ import annotations

import torch
from torch import nn

# The smallest row maximum a scale is taken from, for weights and inputs alike: a row of zeros (the input of a token
# whose embedding is zero, as the pad token's of a target built with padding_idx; a zero row of a tied LM head)
# quantizes to zeros with this floor, to NaN (0 / 0) without it, and one NaN row of K or V makes every row of the
# attention NaN (a weight of 0 times NaN). torchao's float8 training floors its amax the same way (1e-12). torchao
# clamps in the input's dtype: right for bf16 and fp32 (the only ones here); 1e-12 would underflow to 0 in fp16.
AMAX_FLOOR = 1e-12


def convert_layers(drafter: nn.Module, recipe: str) -> int:
    """Swap every nn.Linear inside drafter.layers for torchao's Float8Linear (in place, before any compile);
    returns how many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    config = Float8LinearConfig.from_recipe_name(recipe)
    n = sum(isinstance(m, nn.Linear) for m in drafter.layers.modules())
    convert_to_float8_training(drafter.layers, config=config)
    return n


def _rowwise(weight: torch.Tensor, quantize_inputs: bool = True):
    """weight [N, K] -> a torchao Float8Tensor (e4m3, one scale per row) for F.linear(x, it) (fast accumulation);
    x [.., K] quantized rowwise inside that call (quantize_inputs, a zero row to zeros: AMAX_FLOOR), or passed in
    already quantized (as_input)."""
    from torchao.float8.inference import Float8MMConfig
    from torchao.quantization import Float8Tensor, PerRow
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs
    return Float8Tensor.from_hp(weight.detach().contiguous(), granularity=PerRow(), hp_value_lb=AMAX_FLOOR,
                                mm_config=Float8MMConfig(use_fast_accum=True),
                                act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=PerRow(),
                                                                              hp_value_lb=AMAX_FLOOR)
                                if quantize_inputs else None)


def quantize_rows(x: torch.Tensor):
    """x [n, K] -> (e4m3 data [n, K], float32 scales [n, 1]): torchao's rowwise quantization (a zero row to zeros:
    AMAX_FLOOR), as plain tensors so that a compiled caller (train/precision.py) fuses it into one pass over x
    (eager, torchao makes float32 copies of x).
    Its torch kernels, named: the automatic choice asks importlib for optional packages, which dynamo cannot trace
    (torch 2.11 on the H200: "find_spec ... should not be traced")."""
    from torchao.quantization import Float8Tensor, PerRow
    from torchao.quantization.quantize_.common import KernelPreference
    q = Float8Tensor.from_hp(x, granularity=PerRow(), kernel_preference=KernelPreference.TORCH, hp_value_lb=AMAX_FLOOR)
    return q.qdata, q.scale


def as_input(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, like):
    """quantize_rows' output for x as the input of F.linear(it, like) (like: a weight from _rowwise)."""
    from torchao.quantization import Float8Tensor
    return Float8Tensor(data, scale, block_size=[1, x.shape[-1]], mm_config=like.mm_config, dtype=x.dtype)


class FrozenHead:
    """The frozen LM head's FP8 copies, made once: w [V, H] for the logits, wt [H, V] for the input gradient; the
    inputs quantized per call by `quantize` (quantize_rows, or a compiled quantize_rows). Stands where the fused loss
    takes the head's weight (fused_ce): `dtype`, `shape`, `requires_grad` as the weight's."""

    requires_grad = False

    def __init__(self, weight: torch.Tensor, quantize=quantize_rows):
        self.dtype, self.shape, self.device = weight.dtype, weight.shape, weight.device
        self.quantize = quantize
        self.w = _rowwise(weight, quantize_inputs=False)          # [V, H]
        self.wt = _rowwise(weight.t(), quantize_inputs=False)     # [H, V]

    def _mm(self, x, w):   # x [n, K] @ w.T, w [N, K] FP8
        return torch.nn.functional.linear(as_input(x, *self.quantize(x), like=w), w)

    def logits(self, h: torch.Tensor) -> torch.Tensor:      # h [n, H] -> [n, V] in h's dtype
        return self._mm(h, self.w)

    def input_grad(self, g: torch.Tensor) -> torch.Tensor:  # g [n, V] (d loss / d logits) -> [n, H] = g @ W
        return self._mm(g, self.wt)


def quantize_frozen(module: nn.Module) -> int:
    """Replace, once and in place, the weight of every nn.Linear inside `module` (frozen: inference only) by its
    rowwise FP8 copy (`_rowwise`: what torchao's quantize_ with Float8DynamicActivationFloat8WeightConfig(PerRow)
    makes, without that config's refusal to run on the CPU, and with weights and inputs floored at AMAX_FLOOR);
    returns how many (a weight already FP8 is left)."""
    todo = [m for m in module.modules() if isinstance(m, nn.Linear) and not is_fp8(m.weight)]
    for m in todo:
        m.weight = nn.Parameter(_rowwise(m.weight), requires_grad=False)
    return len(todo)


def is_fp8(weight) -> bool:
    """Whether a module's weight is an FP8 copy made by quantize_frozen (a torchao Float8Tensor)."""
    from torchao.quantization import Float8Tensor
    return isinstance(weight, Float8Tensor)
