"""The DFlash objective: a position-weighted loss of the block predictions through the target's LM head.

Per scored block position (k >= 1) the row loss is the objective's (train.objective, docs/recipes.md):
  ce     cross-entropy against the data's token (label input_ids[a+k])
  kl     KL(p_target || q_drafter), p the target's own next-token distribution for that label: the softmax of the
         target's LM head on its final-norm state at position a+k-1 (`teacher`)
  ce+kl  their sum
Weights (train.loss_weighting):
  decay  exp(-(k-1)/gamma) (block_labels); the loss is sum(w * row) / sum(w)
  dpace  D-PACE (docs/recipes.md): detached weights from the drafter's confidence in the label, q_k = exp(-ce_k),
         smoothed q~ = alpha + (1 - alpha) q, C_k = prod_{i<=k} q~_i, w_k = sum_{m>=k} C_m (scored positions only);
         the loss is sum(w * row) / (blocks with a scored position)
`weight_sum` is that denominator: numerator and denominator are both sums over positions, so micro-batches and
replicas add them up and the step divides once (the trainer's global normalisation).

Full-vocabulary logits are made `chunk` positions at a time, inside torch.utils.checkpoint or fused with their
gradient (fused_ce), so at most one chunk of [chunk, V] logits (and its gradient; one more for the target's) exists
at once. Only block positions k >= 1 are gathered (position 0 is never scored); to stay free of host syncs,
unscored positions among them (padded blocks, labels past the end or outside the loss mask) are still evaluated
but weigh 0. Every row's loss is known before the weights are applied (D-PACE's depend on the whole block).

Metrics (tensors, no .item()):
  correct[k-1], count[k-1]   per block position k = 1..Bk-1: argmax == label among scored positions / scored
  accept_sum, blocks         per block whose position 1 is scored: the accepted prefix length = the number of
                             leading positions k = 1, 2, ... that are scored and predicted correctly (stops at
                             the first wrong or unscored one); accept_sum sums it, blocks counts the blocks.
                             acceptance_estimate = accept_sum / blocks (add 1 for tokens per verify step, tau).
  ce, kl                     the weighted means of the rows' CE and KL (kl 0 without a teacher), normalised as loss
"""
from __future__ import annotations

import dataclasses
import functools

import torch
from torch.utils.checkpoint import checkpoint

from .anchors import IGNORE
from .fused_ce import TERMS, fused_linear_loss, loss_chunk


def uses_target(objective: str) -> bool:
    """Whether an objective reads the target's next-token distribution (its final-norm states at the labels)."""
    return TERMS[objective][1] != 0


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor          # scalar: sum(w * row loss) / weight_sum
    correct: torch.Tensor       # Long[Bk-1]
    count: torch.Tensor         # Long[Bk-1]
    accept_sum: torch.Tensor    # Long[]
    blocks: torch.Tensor        # Long[]
    weight_sum: torch.Tensor    # Float[]: the denominator (decay: sum of weights; dpace: blocks with a scored position)
    ce: torch.Tensor            # Float[]: sum(w * ce) / weight_sum (detached)
    kl: torch.Tensor            # Float[]: sum(w * kl) / weight_sum (detached; 0 without a teacher)

    @property
    def acceptance_estimate(self) -> torch.Tensor:
        return self.accept_sum.float() / self.blocks.clamp(min=1).float()

    @property
    def accuracy(self) -> torch.Tensor:   # Float[Bk-1]
        return self.correct.float() / self.count.clamp(min=1).float()


def dpace_weights(ce: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights, detached: ce, scored [..., K] (a block's positions k = 1..K) -> w [..., K].
    q = exp(-ce) (the drafter's probability of the label), q~ = alpha + (1 - alpha) q (an unscored position is a
    no-op: q~ = 1), C_k = prod_{i<=k} q~_i, w_k = sum_{m>=k} C_m over scored m; 0 at unscored positions."""
    with torch.no_grad():
        one = torch.ones((), dtype=ce.dtype, device=ce.device)
        smooth = torch.where(scored, alpha + (1.0 - alpha) * torch.exp(-ce), one)
        cum = torch.cumprod(smooth, dim=-1) * scored                               # C_k
        return cum.flip(-1).cumsum(-1).flip(-1) * scored                           # suffix sums


def _chunk_rows(h: torch.Tensor, w_head: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None,
                objective: str):
    """h [n, H], labels [n], teacher [n, H] or None -> (objective loss [n], ce [n], kl [n], argmax == label [n])."""
    logits = (h @ w_head.t()).to(torch.promote_types(h.dtype, torch.float32))     # [n, V], in >= float32
    logq = torch.log_softmax(logits, dim=-1)
    ce = -logq.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)                  # [n]
    kl = torch.zeros_like(ce)
    if teacher is not None:
        logp = torch.log_softmax((teacher @ w_head.t()).to(logits.dtype), dim=-1)
        kl = torch.nn.functional.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)   # KL(p || q)
    c, k = TERMS[objective]
    loss = ce if not k else kl if not c else ce + kl
    return loss, ce.detach(), kl.detach(), logits.argmax(-1) == labels


def dflash_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                block_size: int, chunk: int = 2048, checkpointed: bool = True, fused: bool = False,
                kernel=None, *, objective: str = "ce", teacher: torch.Tensor | None = None,
                weighting: str = "decay", dpace_alpha: float = 0.5) -> LossOutput:
    """hidden [B, Q, H], lm_head_weight [V, H], labels/weights [B, Q] (Q = A * block_size; weights: the decay's,
    used by weighting "decay"); teacher [B, Q, H] for objective kl / ce+kl (anchors.block_teacher: row q is the
    target's final-norm state whose LM-head softmax is the target's distribution for labels[q]).

    fused: the gradient w.r.t. hidden is computed inside the forward (fused_ce); `kernel` may be a compiled
    fused_ce.loss_chunk with this objective bound."""
    if uses_target(objective) != (teacher is not None):
        raise ValueError(f"objective {objective} {'needs' if teacher is None else 'takes no'} teacher states")
    B, Q, H = hidden.shape
    Bk = block_size
    A = Q // Bk

    def rows(x):   # [B, Q, ...] -> block positions k >= 1, flattened: [N, ...], N = B*A*(Bk-1)
        return x.reshape(B, A, Bk, *x.shape[2:])[:, :, 1:].reshape(-1, *x.shape[2:])

    acc = torch.promote_types(hidden.dtype, torch.float32)
    h, lab = rows(hidden), rows(labels)
    t = rows(teacher) if teacher is not None else None
    if fused:
        loss_rows, ce, kl, hit = fused_linear_loss(h, lm_head_weight, lab, t, chunk,
                                                   kernel or functools.partial(loss_chunk, objective=objective))
    else:
        parts = []
        for s in range(0, h.shape[0], chunk):
            args = (h[s:s + chunk], lm_head_weight, lab[s:s + chunk], t[s:s + chunk] if t is not None else None,
                    objective)
            parts.append(checkpoint(_chunk_rows, *args, use_reentrant=False)
                         if checkpointed and torch.is_grad_enabled() else _chunk_rows(*args))
        loss_rows, ce, kl, hit = (torch.cat(x) for x in zip(*parts))
    sc = (lab != IGNORE).view(B, A, Bk - 1)                                     # [B, A, Bk-1] scored
    if weighting == "dpace":
        w = dpace_weights(ce.view(B, A, Bk - 1), sc, dpace_alpha).reshape(-1)
        wsum = sc.any(-1).sum().to(acc)                                         # blocks with a scored position
    elif weighting == "decay":
        w = torch.where(sc.reshape(-1), rows(weights).to(acc), torch.zeros((), dtype=acc, device=weights.device))
        wsum = w.sum()
    else:
        raise ValueError(f"unknown loss weighting {weighting!r} (decay | dpace)")
    norm = wsum.clamp(min=torch.finfo(acc).tiny)
    ok = hit.view(B, A, Bk - 1) & sc
    prefix = ok.long().cumprod(-1).sum(-1)                                      # [B, A] accepted prefix
    counted = sc[..., 0]
    return LossOutput(
        loss=(loss_rows * w).sum() / norm,
        correct=ok.sum((0, 1)),
        count=sc.sum((0, 1)),
        accept_sum=(prefix * counted).sum(),
        blocks=counted.sum(),
        weight_sum=wsum,
        ce=(ce * w).sum().detach() / norm,
        kl=(kl * w).sum().detach() / norm,
    )
