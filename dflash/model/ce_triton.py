"""The fused loss's per-chunk kernel (fused_ce.ce_chunk's contract) as two Triton kernels, for CUDA.

ce_chunk needs, per row of a [n, V] logits chunk, the log-sum-exp, the argmax and the label's logit, then writes
the gradient (softmax - onehot) * w over the logits. torch.compile makes that three passes over the logits (a max
pass, a sum-exp + argmax pass, the gradient pass); here the statistics take one pass (an online log-sum-exp, as
flash attention's softmax), so the chunk is read twice and written once instead of read three times.

  _row_stats  one program per row: running max m and sum s of exp(x - m) over V in blocks, the first index of the
              maximum, then lse = m + log(s); loss_i = (lse - x[label]) * w, hit_i = argmax == label
  _grad       one program per (row, block of V): logits <- (exp(x - lse) - [col == label]) * w, in place
Float32 arithmetic on any float logits; labels < 0 weigh 0 (their gradient row is 0). Same values as ce_chunk up to
float32 summation order (tests/test_loss_gpu.py holds them together).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only installs: ce_chunk (compiled or eager) is used instead
    triton = None

BLOCK = 4096


def available(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda


if triton is not None:
    @triton.jit(do_not_specialize=["V"])
    def _row_stats(x_ptr, lab_ptr, w_ptr, lse_ptr, loss_ptr, hit_ptr, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)     # per lane: running max, sum, first argmax
        s = tl.zeros([BLOCK], tl.float32)
        arg = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < V, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            s = tl.where(m_new == float("-inf"), 0.0, s)       # a lane that saw only padding
            arg = tl.where(x > m, idx, arg)                      # strictly greater: the first index of a lane's max
            m = m_new
        mx = tl.max(m, 0)
        lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
        big = 2147483647
        first = tl.min(tl.where(m == mx, arg, big), 0)           # the first index among lanes holding the max
        lab = tl.load(lab_ptr + row)
        w = tl.load(w_ptr + row).to(tl.float32)
        w = tl.where(lab >= 0, w, 0.0)
        picked = tl.load(base + tl.maximum(lab, 0)).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, (lse - picked) * w)
        tl.store(hit_ptr + row, (first == lab).to(tl.int8))

    @triton.jit(do_not_specialize=["V"])
    def _grad(x_ptr, lab_ptr, w_ptr, lse_ptr, V, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ptr = x_ptr + row * stride + idx
        keep = idx < V
        x = tl.load(ptr, mask=keep, other=0.0).to(tl.float32)
        lab = tl.load(lab_ptr + row)
        w = tl.load(w_ptr + row).to(tl.float32)
        w = tl.where(lab >= 0, w, 0.0)
        lse = tl.load(lse_ptr + row)
        g = (tl.exp(x - lse) - (idx == lab).to(tl.float32)) * w
        tl.store(ptr, g.to(x_ptr.dtype.element_ty), mask=keep)


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """fused_ce.ce_chunk on CUDA: logits [n, V] (rows contiguous), labels [n] (< 0: ignored), weights [n] ->
    (sum of weighted CE [] float32, hits [n] bool); the logits are overwritten with that sum's gradient."""
    n, V = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("ce_triton.ce_chunk needs rows with unit stride")
    lse = torch.empty(n, device=logits.device, dtype=torch.float32)
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)
    hits = torch.empty(n, device=logits.device, dtype=torch.int8)
    if n:
        labels = labels.contiguous()
        weights = weights.contiguous()
        _row_stats[(n,)](logits, labels, weights, lse, loss, hits, V, logits.stride(0), BLOCK=BLOCK, num_warps=8)
        _grad[(n, triton.cdiv(V, BLOCK))](logits, labels, weights, lse, V, logits.stride(0), BLOCK=BLOCK,
                                          num_warps=8)
    return loss.sum(), hits.bool()
