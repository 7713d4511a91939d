"""attention(q, k, v, mask, backend) for the drafter: eager (readable reference), sdpa (dense boolean mask),
flex (compiled flex_attention with a BlockMask).

Shapes: q [B, Hq, Q, D], k and v [B, Hkv, S+Q, D] (Hq a multiple of Hkv, GQA). Output [B, Hq, Q, D].

Rows with no visible key (padded blocks) output exactly 0 on every backend: eager and sdpa run them with an
all-True row (finite, never NaN) and zero the result; flex returns 0 for them natively and is zeroed the same
way. Their gradients are therefore 0 too.
"""
from __future__ import annotations

import dataclasses
import threading

import torch
import torch.nn.functional as F

from dflash.compile_threads import compiled

from .anchors import Anchors
from .masks import block_mask, dense_mask

BACKENDS = ("eager", "sdpa", "flex")


@dataclasses.dataclass
class Mask:
    """One attention mask in the form its backend wants, plus the rows that have any visible key."""
    backend: str
    window: int | None
    keep: torch.Tensor            # Bool[B, 1, Q, 1]: the query row belongs to a valid block
    dense: torch.Tensor | None = None   # Bool[B, 1, Q, S+Q] (eager/sdpa), empty rows made all-True
    block: object | None = None         # flex BlockMask
    capability: tuple | None = None     # flex: the GPU's compute capability (picks tuned kernel options)


# flex kernel options measured faster than torch's defaults for the drafter's attention, per (compute capability,
# dtype, head dim). H200, bf16, head dim 128, 3072 context, 512 anchors x 16 (bench/h200.py flex_tune,
# bench/results/2026-11-29-h200-r4): forward 0.73 ms with 128 x 128 tiles vs 0.90 ms with torch's 128 x 64; no
# backward option was faster than torch's own by more than noise.
FLEX_TUNED = {
    ((9, 0), torch.bfloat16, 128): {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3},
}


def make_mask(anchors: Anchors, S: int, backend: str, windows=(None,)) -> dict:
    """{window: Mask} for each distinct window used by the layers (None = full attention); build it once per
    forward and let every layer pick its own."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (choose from {', '.join(BACKENDS)})")
    B, A = anchors.pos.shape
    keep = anchors.valid[:, None, :, None].repeat_interleave(anchors.block_size, dim=2)   # [B, 1, Q, 1]
    out = {}
    for w in dict.fromkeys(windows):
        if backend == "flex":
            dev = anchors.pos.device
            cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
            out[w] = Mask(backend, w, keep, block=block_mask(anchors, S, w), capability=cap)
        else:
            out[w] = Mask(backend, w, keep, dense=dense_mask(anchors, S, w) | ~keep)
    return out


_FLEX = None
_FLEX_LOCK = threading.Lock()


def compiled_flex(**compile_kwargs):
    """The process-wide compiled flex_attention, created on first call (the caller decides when compilation
    happens: it runs on the first call of the returned function for each new shape). Later calls return the
    same object; compile_kwargs only count on the first call (default: fullgraph, dynamic=False). Compiled through
    dflash.compile_threads.compiled, so the threads runtime's replicas may call it at once."""
    global _FLEX
    with _FLEX_LOCK:
        if _FLEX is None:
            from torch.nn.attention.flex_attention import flex_attention
            _FLEX = compiled(flex_attention, **{"fullgraph": True, "dynamic": False, **compile_kwargs})
        return _FLEX


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, backend: str | None = None):
    backend = backend or mask.backend
    groups = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    if backend == "eager":
        k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
        scores = (q @ k.transpose(-1, -2)) * scale                              # [B, Hq, Q, S+Q]
        scores = scores.masked_fill(~mask.dense, float("-inf"))
        p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
        out = p @ v
    elif backend == "sdpa":
        if groups > 1 and q.device.type != "cpu":
            k, v = _repeat_kv(k, groups), _repeat_kv(v, groups)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale,
                                                 enable_gqa=groups > 1)
    elif backend == "flex":
        if q.device.type == "cpu" and q.shape[-1] < 32:
            raise ValueError(f"flex attention on CPU needs head_dim >= 32 (got {q.shape[-1]}): compiled CPU "
                             "flex_attention returns wrong values for smaller heads (torch 2.13); use sdpa")
        if torch.compiler.is_compiling():   # inside a compiled layer: the enclosing graph compiles flex itself
            from torch.nn.attention.flex_attention import flex_attention as flex
        else:
            flex = compiled_flex()
        opts = FLEX_TUNED.get((mask.capability, q.dtype, q.shape[-1]))
        out = flex(q, k, v, block_mask=mask.block, scale=scale, enable_gqa=groups > 1,
                   kernel_options=dict(opts) if opts else None)
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    return torch.where(mask.keep, out, torch.zeros((), dtype=out.dtype, device=out.device))
