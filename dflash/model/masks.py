"""Attention masks of the drafter, all from one Anchors description.

Keys are [context 0..S-1 ; blocks S..S+Q-1]; query q = j*Bk + i is offset i of block j (anchor a = pos[b, j]),
at position a + i; block key S + j'*Bk + i' is at position a' + i'. Rules (True = may attend):
  full-attention layers (the reference's non-causal layers):
    * context key p:  p < a                        (strictly before the anchor)
    * block key:      j' == j                      (own block, bidirectional)
  sliding-window layers, window W (the reference dflash 0.1.0 `is_causal` sliding layers: causal attention over
  [context ; block] positions, limited to the last W positions, the query's own included):
    * context key p:  p < a  and  (a + i) - p < W  (offset i sees the last W-1-i context positions)
    * block key:      j' == j  and  i' <= i  and  i - i' < W   (causal within the block; when W < Bk the window
                                                                  also hides the block's own earlier offsets)
  * padded blocks (valid False) see nothing; their attention output is defined as 0 (see attention.py).

Three products that tests hold equal:
  reference_allowed  plain Python loops over the rules (tests only)
  dense_mask         Bool[B, 1, Q, S+Q] with tensor ops (sdpa, eager)
  block_mask         flex BlockMask built directly from the anchors with tensor ops: per query tile the full and
                     partial kv tiles (BlockMask.from_kv_blocks) plus a mask_mod closing over per-query bounds.
                     No create_block_mask, no FX tracing, no compilation, no host sync.
Every rule is an interval per query row: context keys [lo, hi), block keys [blo, bhi) (key indices).
"""
from __future__ import annotations

import dataclasses

import torch

from .anchors import Anchors

TILE = 128


@dataclasses.dataclass
class QueryBounds:
    """Per query row: visible context keys [lo, hi), visible block keys [blo, bhi) (key indices, blo >= S;
    empty rows: hi = 0, blo = bhi = S). Padded to a multiple of `pad_to` rows."""
    lo: torch.Tensor    # Long[B, Qp]
    hi: torch.Tensor    # Long[B, Qp]
    blo: torch.Tensor   # Long[B, Qp]
    bhi: torch.Tensor   # Long[B, Qp]
    S: int
    Q: int
    block_size: int


def query_bounds(anchors: Anchors, S: int, window: int | None = None, pad_to: int = 1) -> QueryBounds:
    B, A = anchors.pos.shape
    Bk = anchors.block_size
    Q = A * Bk
    Qp = -(-Q // pad_to) * pad_to
    pos, valid = anchors.pos, anchors.valid
    if Qp > Q and Qp % Bk == 0:                     # pad with invalid blocks (they see nothing)
        pad = Qp // Bk - A
        pos = torch.cat([pos, pos.new_zeros(B, pad)], 1)
        valid = torch.cat([valid, valid.new_zeros(B, pad)], 1)
    Ab = pos.shape[1]
    dev = pos.device
    i = torch.arange(Bk, device=dev)                                                   # [Bk]
    first = S + torch.arange(Ab, device=dev)[:, None] * Bk                             # [Ab, 1] first key of block j
    v = valid[:, :, None]                                                               # [B, Ab, 1]
    hi = (pos * valid)[:, :, None].expand(B, Ab, Bk)                                   # [B, Ab, Bk]
    if window is None:
        lo = torch.zeros_like(hi)
        blo, bhi = first.expand(Ab, Bk), (first + Bk).expand(Ab, Bk)
    else:
        lo = (pos[:, :, None] + (i - window + 1)).clamp(min=0)
        blo, bhi = first + (i - window + 1).clamp(min=0), first + i + 1                 # [Ab, Bk]
    blo = torch.where(v, blo, S).reshape(B, Ab * Bk)
    bhi = torch.where(v, bhi, S).reshape(B, Ab * Bk)
    lo, hi = lo.reshape(B, Ab * Bk), hi.reshape(B, Ab * Bk)
    if Qp > hi.shape[1]:                            # block size does not divide the padding: pad rows
        pad = Qp - hi.shape[1]
        lo, hi = torch.cat([lo, lo.new_zeros(B, pad)], 1), torch.cat([hi, hi.new_zeros(B, pad)], 1)
        blo, bhi = torch.cat([blo, blo.new_full((B, pad), S)], 1), torch.cat([bhi, bhi.new_full((B, pad), S)], 1)
    return QueryBounds(lo, hi, blo, bhi, S, Q, Bk)


def reference_allowed(anchors: Anchors, S: int, window: int | None = None) -> torch.Tensor:
    """Bool[B, Q, S+Q] straight from the rules, with Python loops (for tests; slow)."""
    B, A = anchors.pos.shape
    Bk = anchors.block_size
    Q = A * Bk
    out = torch.zeros(B, Q, S + Q, dtype=torch.bool)
    pos, valid = anchors.pos.tolist(), anchors.valid.tolist()
    for b in range(B):
        for j in range(A):
            if not valid[b][j]:
                continue
            a = pos[b][j]
            for i in range(Bk):
                q = j * Bk + i
                for p in range(S):
                    if p < a and (window is None or (a + i) - p < window):
                        out[b, q, p] = True
                for i2 in range(Bk):
                    if window is None or (i2 <= i and i - i2 < window):
                        out[b, q, S + j * Bk + i2] = True
    return out


def dense_mask(anchors: Anchors, S: int, window: int | None = None) -> torch.Tensor:
    """Bool[B, 1, Q, S+Q] for sdpa / eager."""
    qb = query_bounds(anchors, S, window)
    kv = torch.arange(S + qb.Q, device=anchors.pos.device)
    ctx = (kv >= qb.lo[..., None]) & (kv < qb.hi[..., None])      # hi <= anchor < S: context keys only
    own = (kv >= qb.blo[..., None]) & (kv < qb.bhi[..., None])
    return (ctx | own)[:, None]


def _mask_mod(qb: QueryBounds):
    lo, hi, blo, bhi = qb.lo, qb.hi, qb.blo, qb.bhi

    def dflash_mask(b, h, q_idx, kv_idx):
        ctx = (kv_idx >= lo[b, q_idx]) & (kv_idx < hi[b, q_idx])
        own = (kv_idx >= blo[b, q_idx]) & (kv_idx < bhi[b, q_idx])
        return ctx | own

    return dflash_mask


_CONST: dict = {}


def _consts(device, S: int, Qp: int, tile: int):
    """Index tensors that depend only on the shapes (cached: fewer launches per build)."""
    key = (str(device), S, Qp, tile)
    c = _CONST.get(key)
    if c is None:
        KV = S + Qp
        KT = -(-KV // tile)
        k0 = torch.arange(KT, device=device) * tile                          # first key of each kv tile
        k1 = (k0 + tile).clamp(max=KV)                                        # one past its last key
        c = dict(k0=k0, k0t=k0 + tile, k1=k1, k1c=k1.clamp(max=S))
        if len(_CONST) > 256:
            _CONST.clear()
        _CONST[key] = c
    return c


def tile_masks(qb: QueryBounds, tile: int = TILE, window: int | None = None, consts=None):
    """(partial, full): Bool[B, QT, KT] per (query tile, kv tile): some key visible to some query but not
    all / every key visible to every query (only context tiles can be full; tiles with block keys are
    partial). Conservative where a tile mixes queries: extra partial tiles are filtered by mask_mod."""
    B, Qp = qb.lo.shape
    c = consts or _consts(qb.lo.device, qb.S, Qp, tile)
    hi, blo, bhi = qb.hi[..., None], qb.blo[..., None], qb.bhi[..., None]    # [B, Qp, 1]
    ctx = hi > c["k0"]                                                         # hi <= anchor < S
    full = hi >= c["k0t"]
    if window is not None:
        lo = qb.lo[..., None]
        ctx = ctx & (lo < c["k1c"]) & (lo < hi)
        full = full & (lo <= c["k0"])
    own = torch.maximum(blo, c["k0"]) < torch.minimum(bhi, c["k1"])          # [blo, bhi) meets the tile
    anyv = ctx | own
    QT, KT = Qp // tile, anyv.shape[-1]
    anyv = anyv.view(B, QT, tile, KT).any(2)
    full = full.view(B, QT, tile, KT).all(2)
    return anyv & ~full, full


def block_lists(m: torch.Tensor):
    """Bool[..., R, C] -> (count Int32[..., R], indices Int32[..., R, C]) with the True columns first
    (contiguous int32, as the flex kernels index them)."""
    m8 = m.to(torch.int8, memory_format=torch.contiguous_format)
    num = m8.sum(-1, dtype=torch.int32)
    idx = torch.argsort(m8, dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


def block_mask(anchors: Anchors, S: int, window: int | None = None, tile: int = TILE):
    """A flex BlockMask for queries [B, Q] against keys [context S ; blocks Q], built with tensor ops only
    (no create_block_mask, no vmap, no FX tracing, no compilation, no host sync)."""
    from torch.nn.attention.flex_attention import BlockMask
    qb = query_bounds(anchors, S, window, pad_to=tile)
    partial, full = tile_masks(qb, tile, window)
    pf = torch.stack([partial, full])[:, :, None]                              # [2, B, 1, QT, KT]
    kv_num, kv_idx = block_lists(pf)
    q_num, q_idx = block_lists(pf.transpose(-1, -2))             # the transposed lists, for the backward pass
    (kv_num, fkv_num), (kv_idx, fkv_idx), (q_num, fq_num), (q_idx, fq_idx) = kv_num, kv_idx, q_num, q_idx
    mm = _mask_mod(qb)
    try:
        return BlockMask(seq_lengths=(qb.Q, S + qb.Q), kv_num_blocks=kv_num, kv_indices=kv_idx,
                         full_kv_num_blocks=fkv_num, full_kv_indices=fkv_idx, q_num_blocks=q_num,
                         q_indices=q_idx, full_q_num_blocks=fq_num, full_q_indices=fq_idx,
                         BLOCK_SIZE=(tile, tile), mask_mod=mm)
    except TypeError:   # a torch whose BlockMask constructor differs: let it transpose the lists itself
        return BlockMask.from_kv_blocks(kv_num, kv_idx, fkv_num, fkv_idx, BLOCK_SIZE=tile, mask_mod=mm,
                                        seq_lengths=(qb.Q, S + qb.Q))


def block_mask_to_dense(bm, Q: int, KV: int) -> torch.Tensor:
    """Bool[B, Q, KV] of what a BlockMask lets through (full tiles, and partial tiles where mask_mod is True);
    used by tests to compare a BlockMask with the other products."""
    tq, tk = bm.BLOCK_SIZE
    def expand(num, idx):
        B, H, QT = num.shape
        KT = -(-KV // tk)
        sel = torch.arange(idx.shape[-1], device=num.device) < num[..., None]
        tiles = torch.zeros(B, H, QT, KT + 1, dtype=torch.bool, device=num.device)
        tiles.scatter_(-1, torch.where(sel, idx.long(), KT), sel)
        t = tiles[..., :KT]
        return t.repeat_interleave(tq, 2).repeat_interleave(tk, 3)[:, 0, :Q, :KV]
    partial = expand(bm.kv_num_blocks, bm.kv_indices)
    full = expand(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else partial & False
    B = partial.shape[0]
    dev = partial.device
    b = torch.arange(B, device=dev)[:, None, None]
    q = torch.arange(Q, device=dev)[None, :, None]
    k = torch.arange(KV, device=dev)[None, None, :]
    mm = bm.mask_mod(b, torch.zeros_like(b), q, k)
    return full | (partial & mm)
