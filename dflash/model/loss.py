"""The DFlash objective: weighted cross-entropy of the block predictions through the target's LM head.

Full-vocabulary logits are made `chunk` positions at a time inside torch.utils.checkpoint, so at most one
chunk of [chunk, V] logits (and its gradient) exists at once. Only block positions k >= 1 are gathered
(position 0 is never scored); to stay free of host syncs, unscored positions among them (padded blocks,
labels past the end or outside the loss mask) are still evaluated but weigh 0.

Metrics (tensors, no .item()):
  correct[k-1], count[k-1]   per block position k = 1..Bk-1: argmax == label among scored positions / scored
  accept_sum, blocks         per block whose position 1 is scored: the accepted prefix length = the number of
                             leading positions k = 1, 2, ... that are scored and predicted correctly (stops at
                             the first wrong or unscored one); accept_sum sums it, blocks counts the blocks.
                             acceptance_estimate = accept_sum / blocks (add 1 for tokens per verify step, tau).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .anchors import IGNORE
from .fused_ce import ce_chunk, fused_linear_ce


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor          # scalar: sum(w * ce) / sum(w) over scored positions
    correct: torch.Tensor       # Long[Bk-1]
    count: torch.Tensor         # Long[Bk-1]
    accept_sum: torch.Tensor    # Long[]
    blocks: torch.Tensor        # Long[]
    weight_sum: torch.Tensor    # Float[]

    @property
    def acceptance_estimate(self) -> torch.Tensor:
        return self.accept_sum.float() / self.blocks.clamp(min=1).float()

    @property
    def accuracy(self) -> torch.Tensor:   # Float[Bk-1]
        return self.correct.float() / self.count.clamp(min=1).float()


def _chunk_ce(h: torch.Tensor, w_head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """h [n, H], labels/weights [n] -> (sum(weights * ce), argmax == label [n])."""
    logits = (h @ w_head.t()).to(torch.promote_types(h.dtype, torch.float32))  # [n, V], CE in >= float32
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")        # [n]
    return (ce * weights).sum(), logits.argmax(-1) == labels


def dflash_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                block_size: int, chunk: int = 2048, checkpointed: bool = True, fused: bool = False,
                kernel=None) -> LossOutput:
    """hidden [B, Q, H], lm_head_weight [V, H], labels/weights [B, Q] (Q = A * block_size).

    fused: the gradient w.r.t. hidden is computed inside the forward (fused_ce), two matmuls per chunk instead
    of three; `kernel` may be a compiled fused_ce.ce_chunk."""
    B, Q, H = hidden.shape
    Bk = block_size
    A = Q // Bk
    scored = labels != IGNORE
    acc = torch.promote_types(hidden.dtype, torch.float32)
    w = torch.where(scored, weights.to(acc), torch.zeros((), dtype=acc, device=weights.device))
    h = hidden.reshape(B, A, Bk, H)[:, :, 1:].reshape(-1, H)                       # [N, H], N = B*A*(Bk-1)
    lab = labels.view(B, A, Bk)[:, :, 1:].reshape(-1)
    wk = w.view(B, A, Bk)[:, :, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=acc)
    hits = []
    if fused:
        total, hit = fused_linear_ce(h, lm_head_weight, lab, wk, chunk, kernel or ce_chunk)
        hits.append(hit)
    for s in range(0, h.shape[0] if not fused else 0, chunk):
        args = (h[s:s + chunk], lm_head_weight, lab[s:s + chunk], wk[s:s + chunk])
        if checkpointed and torch.is_grad_enabled():
            part, hit = checkpoint(_chunk_ce, *args, use_reentrant=False)
        else:
            part, hit = _chunk_ce(*args)
        total = total + part
        hits.append(hit)
    sc = scored.view(B, A, Bk)[:, :, 1:]                                        # [B, A, Bk-1]
    ok = torch.cat(hits).view(B, A, Bk - 1) & sc
    wsum = wk.sum()
    loss = total / wsum.clamp(min=torch.finfo(acc).tiny)
    prefix = ok.long().cumprod(-1).sum(-1)                                      # [B, A] accepted prefix
    counted = sc[..., 0]
    return LossOutput(
        loss=loss,
        correct=ok.sum((0, 1)),
        count=sc.sum((0, 1)),
        accept_sum=(prefix * counted).sum(),
        blocks=counted.sum(),
        weight_sum=wsum,
    )
