"""Memory a drafter replica needs, estimated before the first step, and a refusal of a run that cannot fit.

Per replica: weights, gradients and AdamW state (float32: 16 bytes per parameter) and the feature queue
(`train.queue_size` + 1 micro-batches of target features), plus the larger of two phases: the forward/backward of
one micro-batch at the largest bucket (saved activations, the chunked loss, one layer's gradients) or the gradient
reduction after it (at most 8 bytes per parameter: the flat gradients, this replica's shard of their sum and one
peer's shard in flight). Per layer, with b sequences
of S tokens, Q = num_anchors * block_size block queries and T = S + Q keys, uncompiled (e: 4 fp32, 2 bf16):
  norms (float32 always)   4 * (4*b*Q*H + 2*b*Q*nh*D + 2*b*T*nkv*D)
  linears, attention, MLP  e * (3*b*Q*H + b*T*H + 4*b*Q*nh*D + 2*b*T*nkv*D + 4*b*Q*I)
  attention mask           sdpa: the boolean mask made additive, saved per layer (4*b*Q*T on CPU, e*b*Q*T on
                           GPU, where k and v are also repeated for GQA); eager: the probabilities (2 copies of
                           b*nh*Q*T floats); flex: none (a block mask of tiles).
Compiled layers save only the matmul inputs, e * (4*b*Q*H + b*T*H + 2*b*Q*nh*D + 2*b*T*nkv*D + 2*b*Q*I) (the MLP
keeps gate and up; silu(gate)*up is recomputed), and under bf16 autocast the bf16 copies of the weights (2 bytes per
parameter) unless `train.recompute_weight_casts` recasts them in the backward (`bench/drafter_memory.py` lists
what one layer keeps).
The b*Q*T terms dominate at many anchors: `num_anchors=1000` on the CPU demo needs ~11.6 GiB per replica.

Calibrated on CPU (float32, uncompiled, the demo drafter: H 128, 4/2 heads of 32, I 384, vocab 2048, block 16)
against the peak RSS one micro-step (forward, backward, AdamW) adds to the process (`CALIBRATION`: the estimate is
1.01-1.23x each; tests/e2e/test_memory.py re-measures one). On a GPU (bf16, compiled flex, one replica, no reduction
buffers) against the drafter step of `bench/h200.py --sections specforge` (bench/results/2026-11-29-h200-r2/): 24.3,
30.1 and 41.5 GiB estimated (features excluded) for 21.9, 26.7 and 36.5 GiB measured at 3072/512, 8192/1024 and
16384/2048 (1.11-1.14x; tests/e2e/test_memory.py holds it to that file): it errs on the safe side.
"""
from __future__ import annotations

import torch

from dflash.config_model import TrainSection
from dflash.errors import UserError
from dflash.model import uses_target
from dflash.train.features import feature_width

GiB = 2 ** 30
# (batch, bucket, anchors, layers, backend) -> peak RSS added by one micro-step, bytes (measured, torch 2.13 CPU)
CALIBRATION = {
    (4, 128, 32, 2, "sdpa"): 146_309_120,
    (4, 512, 32, 2, "sdpa"): 195_162_112,
    (4, 512, 128, 1, "sdpa"): 360_927_232,
    (4, 512, 128, 2, "sdpa"): 579_358_720,
    (4, 512, 128, 4, "sdpa"): 1_019_228_160,
    (4, 512, 256, 2, "sdpa"): 1_319_780_352,
    (2, 512, 256, 2, "sdpa"): 748_425_216,
    (4, 512, 512, 2, "sdpa"): 3_698_364_416,
    (4, 512, 128, 2, "eager"): 1_775_030_272,
}
FIT = 0.9   # refuse when the estimate exceeds this share of the device's capacity


def num_params(d) -> int:
    """Trainable parameters of a drafter of config `d` (fc, norms, layers; not the target's embedding/head)."""
    H, D, I = d.hidden_size, d.head_dim, d.intermediate_size
    layer = H * d.num_attention_heads * D * 2 + H * d.num_key_value_heads * D * 2 + 3 * H * I + 2 * H + 2 * D
    return d.num_context_layers * H * H + 2 * H + d.num_layers * layer


def estimate(d, train: TrainSection, max_len: int, backend: str, device_type: str = "cpu",
             num_anchors: int | None = None, compiled: bool | None = None, reduce: str = "flat") -> dict:
    """Bytes one drafter replica of config `d` needs for `train` (batch_size, num_anchors, loss_chunk, dtype,
    queue_size, compile) at sequences of `max_len` tokens: per part, and `total` (the parameters, their state and
    the feature queue, plus the larger of the forward/backward peak and the gradient reduction's buffers).
    `reduce`: how the replicas' gradients are summed: "flat" (threads, several replicas: a flat copy reduced by
    shards, at most 8 bytes per parameter), "ddp" (DDP's buckets, 4 bytes per parameter) or "none" (one replica: scaled in place)."""
    b, S = train.batch_size, max_len
    A = num_anchors if num_anchors is not None else train.num_anchors
    compiled = (train.compile and backend != "eager") if compiled is None else compiled
    Bk, H, D, I, V = d.block_size, d.hidden_size, d.head_dim, d.intermediate_size, d.vocab_size
    nh, nkv, L = d.num_attention_heads, d.num_key_value_heads, d.num_layers
    bf16 = train.dtype == "bfloat16" or (train.dtype == "auto" and device_type == "cuda")
    e = 2 if bf16 else 4
    Q, T = A * Bk, S + A * Bk
    P = num_params(d)

    bQT = b * Q * T
    if backend == "sdpa":
        mask_layer, mask_once = (4 if device_type == "cpu" else e) * bQT, bQT
        gqa = 2 * e * b * T * nh * D if device_type != "cpu" and nh != nkv else 0
    elif backend == "eager":
        mask_layer, mask_once, gqa = 2 * 4 * b * nh * Q * T, bQT, 2 * e * b * T * nh * D
    else:   # flex: a block mask of 128x128 tiles, negligible
        mask_layer, mask_once, gqa = 0, 0, 0
    if compiled:   # Inductor keeps the matmul inputs and recomputes the pointwise work (norms, rope, SiLU)
        saved = e * (4 * b * Q * H + b * T * H + 2 * b * Q * nh * D + 2 * b * T * nkv * D + 2 * b * Q * I)
    else:          # eager autograd: every intermediate, the norms' in float32
        saved = (4 * (4 * b * Q * H + 2 * b * Q * nh * D + 2 * b * T * nkv * D)
                 + e * (3 * b * Q * H + b * T * H + 4 * b * Q * nh * D + 2 * b * T * nkv * D + 4 * b * Q * I))
    per_layer = saved + gqa + mask_layer
    once = (mask_once * len(d.windows()) + e * b * S * H + 2 * 4 * b * S * H   # masks, fc output, its norm
            + e * b * Q * H + 2 * e * b * T * D)                                # block embeddings, rope cos/sin
    N = b * A * (Bk - 1)                                                         # scored positions
    C = min(train.loss_chunk, N)
    # hidden rows and d(hidden); per chunk the logits, overwritten by their gradient (+ float32 work when eager);
    # kl / ce+kl: the target's final states at the blocks and, per chunk, its logits (+ float32 work when eager)
    kl = uses_target(train.objective)
    loss = 2 * e * N * H + C * V * (e if compiled else e + 12) \
        + kl * (e * b * Q * H + C * V * (e if compiled else e + 8))
    backward = saved + gqa + (4 * b * nh * Q * T if backend == "eager" else 0)   # one layer's gradients at a time
    parts = {
        "weights": 4 * P, "grads": 4 * P, "optimizer": 8 * P,
        "weight_casts": 2 * P if bf16 and not (compiled and train.recompute_weight_casts) else 0,
        "features": (train.queue_size + 1) * b * S * (feature_width(d, train) * e + 9),
        "activations": L * per_layer + once, "loss": loss, "backward": backward,
        # flat gradients, my shard of their sum and a peer's shard in flight (1/n each, n >= 2); DDP's buckets; none
        "grad_buffers": {"flat": 8 * P, "ddp": 4 * P, "none": 0}[reduce],
        # train.fp8_lm_head: the head's two FP8 copies (model/fp8.py FrozenHead) and one chunk's quantized input
        "fp8_head": 2 * V * H + C * V if train.fp8_lm_head else 0,
    }
    parts["total"] = (sum(parts[x] for x in ("weights", "grads", "optimizer", "features", "fp8_head"))
                      + max(parts["activations"] + parts["loss"] + parts["backward"] + parts["weight_casts"],
                            parts["grad_buffers"]))
    return parts


def target_bytes(model) -> dict:
    """{device: bytes} of a loaded target's weights (and buffers) on each device it spans (train.target_split splits
    its layers; a quantized checkpoint counts in its stored precision)."""
    out: dict = {}
    for t in list(model.parameters()) + list(model.buffers()):
        out[t.device] = out.get(t.device, 0) + t.numel() * t.element_size()
    return out


def capacity(device) -> tuple[int, str]:
    """(bytes, what): a GPU's total memory; on the CPU the RAM available now (what the process holds excluded)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, "total"
    import psutil
    return psutil.virtual_memory().available, "available"


def check(d, train: TrainSection, max_len: int, device, backend: str, replicas: int = 1, resident: int = 0,
          num_anchors: int | None = None, compiled: bool | None = None, reduce: str = "flat") -> dict:
    """Refuse (UserError, one line naming the keys to change) a run whose `replicas` drafter replicas on `device`
    plus `resident` bytes already bound there (on a GPU: the target's weights, a copy of its embedding and LM
    head; on the CPU they are out of the available RAM already) would not fit. Call it before the replicas are
    built. Returns the per-replica estimate plus `device_total` and `capacity`."""
    device = torch.device(device)
    A = num_anchors if num_anchors is not None else train.num_anchors

    def need(a):
        return replicas * estimate(d, train, max_len, backend, device.type, a, compiled, reduce)["total"] + resident

    part = estimate(d, train, max_len, backend, device.type, A, compiled, reduce)
    total, (cap, what) = need(A), capacity(device)
    if total <= FIT * cap:
        return dict(part, device_total=total, capacity=cap)
    fit = _largest(lambda a: need(a) <= FIT * cap, A)
    act = replicas * (part["activations"] + part["backward"] + part["loss"])
    hint = f"set train.num_anchors to {fit} or less, or lower" if fit else "lower train.num_anchors,"
    raise UserError(
        f"train would need about {total / GiB:.1f} GiB on {device} ({replicas} drafter replica(s); "
        f"{act / GiB:.1f} GiB of activations for batch_size {train.batch_size} x {max_len}-token bucket x "
        f"num_anchors {A} x block {d.block_size}, attention {backend}), more than {FIT:.0%} of its "
        f"{cap / GiB:.1f} GiB {what}: {hint} train.batch_size or the largest of data.bucket_edges ({max_len})")


def _largest(ok, upper: int) -> int:
    """The largest a in 1..upper with ok(a) (ok monotone decreasing), 0 if none."""
    if not ok(1):
        return 0
    lo, hi = 1, upper
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return hi if ok(hi) else lo
