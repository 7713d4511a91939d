"""Fused linear + weighted cross-entropy over a frozen LM head, gradient computed in the forward pass.

For N scored positions the logits [N, V] never exist at once: per chunk of rows the forward computes the logits,
the weighted CE and its gradient w.r.t. the hidden states (softmax - onehot) @ W, and keeps only that [n, H]
gradient. The logits' gradient is written over the logits, and a chunk's buffer is released before the next
chunk's is made, so the loss needs one [chunk, V] buffer (1.2 GB at chunk 4096, vocabulary 151936, bf16).
Backward just scales the kept gradient. Two matmuls per chunk (no recompute, no checkpointing) instead of the three
of a checkpointed chunked loss. The LM head is the target's, frozen: no gradient for it.
"""
from __future__ import annotations

import torch


def ce_chunk(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """logits [n, V] (any float dtype), labels [n] (< 0: ignored), weights [n] -> (sum of weighted CE [],
    hits [n] bool). The logits are overwritten with the gradient of that sum w.r.t. them (in their dtype), so a
    chunk holds one [n, V] buffer, not a second one for its gradient."""
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(lf, dim=-1)                                            # [n]
    safe = labels.clamp(min=0)
    picked = lf.gather(1, safe[:, None]).squeeze(1)
    w = torch.where(labels >= 0, weights.to(lf.dtype), torch.zeros_like(lse))
    loss = ((lse - picked) * w).sum()
    hits = (lf.argmax(-1) == labels)
    if torch.compiler.is_compiling():   # (softmax - onehot) * w: one fused pass, stored straight into the logits
        onehot = torch.arange(lf.shape[1], device=lf.device) == safe[:, None]
        logits.copy_((torch.exp(lf - lse[:, None]) - onehot.to(lf.dtype)) * w[:, None])
    else:                               # eager: in place, one float32 [n, V] buffer besides the logits
        grad = lf.sub_(lse[:, None]).exp_()      # lf: a float32 copy, or the logits (overwritten anyway)
        grad[torch.arange(grad.shape[0], device=grad.device), safe] -= 1
        logits.copy_(grad.mul_(w[:, None]))
    return loss, hits


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, weights, chunk, kernel):
        # h [N, H], weight [V, H] (frozen), labels [N], weights [N]
        dtype = weight.dtype if h.is_cuda else torch.promote_types(h.dtype, weight.dtype)
        hc_all = h.to(dtype)
        w = weight.to(dtype)
        grad_h = torch.empty_like(hc_all) if ctx.needs_input_grad[0] else None
        total = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=h.device)
        hits = torch.empty(h.shape[0], dtype=torch.bool, device=h.device)
        for s in range(0, h.shape[0], chunk):
            e = min(s + chunk, h.shape[0])
            g = hc_all[s:e] @ w.t()                                                 # [n, V] logits
            loss, hit = kernel(g, labels[s:e], weights[s:e])                         # g: now d(loss)/d(logits)
            total += loss
            hits[s:e] = hit
            if grad_h is not None:
                grad_h[s:e] = g @ w                                                  # [n, H]
            del g   # before the next chunk's logits: one [n, V] buffer at a time
        ctx.save_for_backward(grad_h)
        ctx.in_dtype = h.dtype
        ctx.mark_non_differentiable(hits)
        return total, hits

    @staticmethod
    def backward(ctx, grad_total, grad_hits):
        (grad_h,) = ctx.saved_tensors
        return (grad_h * grad_total).to(ctx.in_dtype), None, None, None, None, None


def fused_linear_ce(h, weight, labels, weights, chunk: int = 4096, kernel=ce_chunk):
    """(sum over rows of weights * CE(h @ weight.T, labels), argmax hits [N]); d/dh computed in the forward.
    `kernel` may be a compiled version of ce_chunk (fuses the [n, V] elementwise work)."""
    if weight.requires_grad:
        raise ValueError("fused_linear_ce assumes a frozen LM head (the target's); it computes no weight gradient")
    return _FusedLinearCE.apply(h, weight, labels, weights, chunk, kernel)
