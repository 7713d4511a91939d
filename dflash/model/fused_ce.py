"""Fused linear + per-row loss over a frozen LM head, the gradient computed in the forward pass.

For N scored positions the logits [N, V] never exist at once: per chunk of rows the forward computes the logits,
each row's loss and its gradient w.r.t. the hidden states, and keeps only that [n, H] gradient. The logits' gradient
is written over the logits, and a chunk's buffer is released before the next chunk's is made, so the loss needs one
[chunk, V] buffer (1.2 GB at chunk 4096, vocabulary 151936, bf16), two with a distillation objective (the target's
logits of the same rows). Backward scales each row's kept gradient by the row's incoming gradient (the position
weight over the global normaliser): the weights may be computed after every row's loss is known (D-PACE's are).
Two matmuls per chunk (three with the target's logits; no recompute, no checkpointing) instead of the three (four)
of a checkpointed chunked loss. The LM head is the target's, frozen: no gradient for it.

Per row, with q = softmax(drafter logits) and p = softmax(target logits):
  ce = -log q[label]                 d/dlogits = q - onehot(label)
  kl = KL(p || q) = sum p log(p/q)   d/dlogits = q - p
  objective ce | kl | ce+kl: the row's loss is that term (the sum for ce+kl), its gradient the sum of theirs.
"""
from __future__ import annotations

import torch

TERMS = {"ce": (1.0, 0.0), "kl": (0.0, 1.0), "ce+kl": (1.0, 1.0)}   # objective -> (CE coefficient, KL coefficient)


def loss_chunk(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None = None,
               objective: str = "ce"):
    """logits [n, V] (any float dtype), labels [n] (< 0: unscored, computed with label 0: their weight is 0),
    target_logits [n, V] or None (the target's logits of the same rows; needed by kl and ce+kl)
    -> (loss [n] the objective per row, ce [n], kl [n] (zeros without target logits), hits [n] bool), in >= float32.
    The logits are overwritten with d(loss row)/d(logits row), unweighted and in their dtype, so a chunk holds one
    [n, V] buffer for them, not a second one for their gradient (the target's logits may be overwritten too)."""
    c, k = TERMS[objective]
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(lf, dim=-1)                                            # [n]
    safe = labels.clamp(min=0)
    ce = lse - lf.gather(1, safe[:, None]).squeeze(1)                            # [n]
    hits = lf.argmax(-1) == labels
    kl = torch.zeros_like(ce)
    if k:   # KL(p || q) = sum p (log p - log q) = sum p (t - logits) - lse(t) + lse(logits), as sum p = 1
        tf = target_logits.to(lf.dtype)
        tlse = torch.logsumexp(tf, dim=-1)
    if torch.compiler.is_compiling():   # one fused pass, stored straight into the logits (p made twice, never kept)
        grad = (c + k) * torch.exp(lf - lse[:, None])
        if c:
            grad = grad - c * (torch.arange(lf.shape[1], device=lf.device) == safe[:, None]).to(lf.dtype)
        if k:
            kl = (torch.exp(tf - tlse[:, None]) * (tf - lf)).sum(-1) - tlse + lse
            grad = grad - k * torch.exp(tf - tlse[:, None])
        logits.copy_(grad)
    else:                               # eager: in place, one float32 [n, V] buffer (two with p) besides the logits
        if k:                           # in place in tf: a float32 copy, or the target's logits (a scratch buffer)
            p = torch.exp(tf - tlse[:, None])
            kl = tf.sub_(lf).mul_(p).sum(-1) - tlse + lse
        grad = lf.sub_(lse[:, None]).exp_().mul_(c + k)    # lf: a float32 copy, or the logits (overwritten anyway)
        if c:
            grad[torch.arange(grad.shape[0], device=grad.device), safe] -= c
        if k:
            grad.sub_(p, alpha=k)
        logits.copy_(grad)
    return c * ce + k * kl, ce, kl, hits


def _head(weight, dtype):
    """The frozen head's two matmuls, (x -> x @ W.T, g -> g @ W): `weight` a tensor [V, H] (cast to `dtype`), or
    FP8 copies made once (model.fp8.FrozenHead: `logits`, `input_grad`)."""
    if isinstance(weight, torch.Tensor):
        w = weight.to(dtype)
        return (lambda x: x @ w.t()), (lambda g: g @ w)
    return weight.logits, weight.input_grad


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, teacher, chunk, kernel):
        # h [N, H], weight [V, H] (frozen; or its FP8 copies, fp8.FrozenHead), labels [N], teacher [N, H] or None
        dtype = weight.dtype if h.is_cuda else torch.promote_types(h.dtype, weight.dtype)
        hc = h.to(dtype)
        logits_of, back = _head(weight, dtype)
        tc = teacher.to(dtype) if teacher is not None else None
        grad_h = torch.empty_like(hc) if ctx.needs_input_grad[0] else None
        N, acc = h.shape[0], torch.promote_types(dtype, torch.float32)
        loss, ce, kl = (torch.empty(N, dtype=acc, device=h.device) for _ in range(3))
        hits = torch.empty(N, dtype=torch.bool, device=h.device)
        for s in range(0, N, chunk):
            e = min(s + chunk, N)
            g = logits_of(hc[s:e])                                                   # [n, V] logits
            t = logits_of(tc[s:e]) if tc is not None else None                       # [n, V] the target's logits
            loss[s:e], ce[s:e], kl[s:e], hits[s:e] = kernel(g, labels[s:e], t)       # g: now d(loss)/d(logits)
            if grad_h is not None:
                grad_h[s:e] = back(g)                                                # [n, H] d(loss row)/d(h row)
            del g, t   # before the next chunk's logits: one [n, V] buffer (two with the target's) at a time
        ctx.save_for_backward(grad_h)
        ctx.in_dtype = h.dtype
        ctx.mark_non_differentiable(ce, kl, hits)
        return loss, ce, kl, hits

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        (grad_h,) = ctx.saved_tensors                                                # [N, H]; grad_loss [N]
        return (grad_h * grad_loss[:, None].to(grad_h.dtype)).to(ctx.in_dtype), None, None, None, None, None


def fused_linear_loss(h, weight, labels, teacher=None, chunk: int = 4096, kernel=loss_chunk):
    """Per row: (objective loss [N] (differentiable w.r.t. h), ce [N], kl [N], argmax hits [N]) of the logits
    h @ weight.T against `labels` and, for kl / ce+kl, the target's distribution softmax(teacher @ weight.T); the
    gradient w.r.t. h is computed in the forward. `kernel`: loss_chunk with its objective bound, or a compiled one
    (fuses the [n, V] elementwise work); without a teacher it must be the ce objective's."""
    if weight.requires_grad:
        raise ValueError("fused_linear_loss assumes a frozen LM head (the target's); it computes no weight gradient")
    return _FusedLinearLoss.apply(h, weight, labels, teacher, chunk, kernel)
