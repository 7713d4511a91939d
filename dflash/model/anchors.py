"""Anchors: the one description of the blocks every mask, block and label is built from.

Block j of sequence b starts at anchor a = pos[b, j]: its tokens are [input_ids[a], MASK x (Bk-1)] at positions
a..a+Bk-1, and block position k is trained to predict input_ids[a+k] (k >= 1). Padded anchors: valid=False, pos=0.
"""
from __future__ import annotations

import dataclasses
import math

import torch

IGNORE = -100


@dataclasses.dataclass
class Anchors:
    pos: torch.Tensor     # Long[B, A]  anchor positions (0 where padded)
    valid: torch.Tensor   # Bool[B, A]
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.pos.shape[1]

    @property
    def num_queries(self) -> int:  # Q = A * Bk
        return self.pos.shape[1] * self.block_size

    def to(self, device) -> "Anchors":
        return Anchors(self.pos.to(device), self.valid.to(device), self.block_size)


def eligible_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Bool[B, S]: p is an anchor candidate when loss_mask[p] and loss_mask[p+1] (the last position never)."""
    lm = loss_mask.bool()
    ok = torch.zeros_like(lm)
    ok[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return ok


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int,
                   generator: torch.Generator | None = None) -> Anchors:
    """Up to `num_anchors` anchors per sequence, uniformly without replacement among eligible positions, sorted
    by position; rows with fewer candidates are padded at the end (valid=False, pos=0). Fully vectorised:
    one uniform key per position, ineligible positions get key -1, top-k keys win."""
    B, S = loss_mask.shape
    ok = eligible_positions(loss_mask)
    keys = torch.rand((B, S), generator=generator, device=loss_mask.device)
    keys = torch.where(ok, keys, torch.full_like(keys, -1.0))
    k = min(num_anchors, S)
    top, idx = keys.topk(k, dim=1)                                   # [B, k]
    valid = top >= 0
    order_key = torch.where(valid, idx, idx.new_full((), S) + idx)  # invalid after all valid, stable
    order = order_key.argsort(dim=1)
    pos = torch.where(valid, idx, torch.zeros_like(idx)).gather(1, order)
    valid = valid.gather(1, order)
    pos = torch.where(valid, pos, torch.zeros_like(pos))
    if k < num_anchors:   # more anchors asked than positions: pad
        pad = num_anchors - k
        pos = torch.cat([pos, pos.new_zeros(B, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], 1)
    return Anchors(pos.long(), valid, block_size)


def block_positions(anchors: Anchors) -> torch.Tensor:
    """Long[B, A*Bk]: position ids of the block tokens, a..a+Bk-1 for each anchor."""
    B, A = anchors.pos.shape
    k = torch.arange(anchors.block_size, device=anchors.pos.device)
    return (anchors.pos[:, :, None] + k).reshape(B, A * anchors.block_size)


def build_blocks(input_ids: torch.Tensor, anchors: Anchors, mask_token_id: int):
    """Block token ids Long[B, A*Bk] ([anchor token, MASK x (Bk-1)] per anchor; padded blocks are all MASK)
    and their position ids Long[B, A*Bk]."""
    B, A = anchors.pos.shape
    Bk = anchors.block_size
    ids = torch.full((B, A, Bk), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    first = input_ids.gather(1, anchors.pos)
    ids[:, :, 0] = torch.where(anchors.valid, first, torch.full_like(first, mask_token_id))
    return ids.reshape(B, A * Bk), block_positions(anchors)


def block_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: Anchors, gamma: float | None = None):
    """Labels Long[B, A*Bk] and weights Float[B, A*Bk].

    Block position k of anchor a has label input_ids[a+k] and weight exp(-(k-1)/gamma); ignored (label -100,
    weight 0): k = 0, padded anchors, a+k beyond the sequence, a+k outside the loss mask.
    gamma None -> default_gamma(block_size) (7 for block 16)."""
    from .config import default_gamma
    B, S = input_ids.shape
    Bk = anchors.block_size
    gamma = default_gamma(Bk) if gamma is None else float(gamma)
    k = torch.arange(Bk, device=input_ids.device)
    t = anchors.pos[:, :, None] + k                                   # [B, A, Bk] target positions
    inside = t < S
    tc = t.clamp(max=S - 1).reshape(B, -1)
    lab = input_ids.gather(1, tc).view_as(t)
    sup = loss_mask.bool().gather(1, tc).view_as(t)
    ok = anchors.valid[:, :, None] & (k >= 1) & inside & sup
    labels = torch.where(ok, lab, torch.full_like(lab, IGNORE))
    w = torch.exp(-(k.float() - 1.0) / gamma)                         # [Bk]
    weights = torch.where(ok, w.expand_as(t), torch.zeros((), device=t.device))
    return labels.reshape(B, -1), weights.reshape(B, -1)


def block_teacher(final: torch.Tensor, anchors: Anchors) -> torch.Tensor:
    """final [B, S, H] (the target's states after its final norm) -> [B, A*Bk, H]: for block position k of anchor a
    the state at position a+k-1, whose LM-head softmax is the target's distribution for the label input_ids[a+k]
    (clamped into the sequence: position 0 and labels past the end are never scored)."""
    pos = (block_positions(anchors) - 1).clamp(0, final.shape[1] - 1)          # [B, Q]
    return final.gather(1, pos[..., None].expand(-1, -1, final.shape[2]))


def padded_length(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)
