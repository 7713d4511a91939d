"""Anchors, blocks, labels and the three mask products (reference loops, dense, flex BlockMask)."""
import math

import pytest
import torch

from dflash.model import (IGNORE, Anchors, block_labels, block_mask, build_blocks, default_gamma,
                          default_target_layer_ids, dense_mask, reference_allowed, sample_anchors)
from dflash.model.anchors import eligible_positions
from dflash.model.masks import block_mask_to_dense
from support.model import anchors_of


def test_default_target_layer_ids_match_reference_values():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]     # z-lab Qwen3-8B/4B drafters
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert default_target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert default_target_layer_ids(11, 3) == [1, 4, 8]              # 4.5 -> 4: Python round, half to even
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(8, 3) == [1, 3, 5]


def test_default_gamma():
    assert default_gamma(16) == 7.0
    assert default_gamma(8) == pytest.approx(7 * 7 / 15)


def test_sample_anchors_rules_and_padding():
    g = torch.Generator().manual_seed(0)
    B, S = 6, 50
    lm = torch.rand(B, S, generator=g) < 0.6
    lm[4] = False
    lm[4, 10:13] = True            # exactly two eligible positions: 10, 11
    lm[5] = False                  # none
    an = sample_anchors(lm, 8, 4, generator=g)
    elig = eligible_positions(lm)
    assert an.pos.shape == (B, 8) and an.valid.dtype == torch.bool and an.block_size == 4
    for b in range(B):
        n = min(8, int(elig[b].sum()))
        assert int(an.valid[b].sum()) == n
        assert an.valid[b, :n].all() and not an.valid[b, n:].any()          # padding at the end
        p = an.pos[b, :n]
        assert (p[1:] > p[:-1]).all()                                         # sorted, no repeats
        assert elig[b, p].all() and lm[b, p].all() and lm[b, p + 1].all()
        assert (an.pos[b, n:] == 0).all()
    assert an.pos[4, :2].tolist() == [10, 11]
    # more anchors than positions
    an2 = sample_anchors(torch.ones(1, 5, dtype=torch.bool), 9, 4, generator=g)
    assert an2.pos.shape == (1, 9) and an2.valid.sum() == 4 and an2.pos[0, :4].tolist() == [0, 1, 2, 3]


def test_sample_anchors_is_uniform():
    g = torch.Generator().manual_seed(1)
    lm = torch.zeros(1, 30, dtype=torch.bool)
    lm[0, 5:16] = True                         # eligible 5..14 (10 positions)
    counts = torch.zeros(30)
    n = 3000
    lms = lm.expand(n, 30)
    an = sample_anchors(lms, 3, 4, generator=g)
    counts.index_add_(0, an.pos[an.valid], torch.ones(int(an.valid.sum())))
    freq = counts[5:15] / n
    assert counts.sum() == 3 * n and counts[:5].sum() == 0 and counts[15:].sum() == 0
    assert (freq - 0.3).abs().max() < 0.04     # each candidate chosen with probability 3/10


def test_build_blocks_and_labels_values():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    lm = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    an = anchors_of([[2, 5, 0]], [[True, True, False]], 3)
    blocks, pos = build_blocks(ids, an, mask_token_id=99)
    assert blocks.tolist() == [[12, 99, 99, 15, 99, 99, 99, 99, 99]]
    assert pos.tolist() == [[2, 3, 4, 5, 6, 7, 0, 1, 2]]
    labels, w = block_labels(ids, lm, an, gamma=2.0)
    I = IGNORE
    # anchor 2: k=1 -> 13 (sup), k=2 -> 14 (sup); anchor 5: k=1 -> 16 (unsupervised), k=2 -> 17 (sup)
    assert labels.tolist() == [[I, 13, 14, I, I, 17, I, I, I]]
    e = math.exp(-0.5)
    assert torch.allclose(w, torch.tensor([[0, 1, e, 0, 0, e, 0, 0, 0]]))
    # beyond the end of the sequence
    an = anchors_of([[6]], [[True]], 4)
    labels, w = block_labels(ids, torch.ones_like(lm), an)
    assert labels.tolist() == [[I, 17, I, I]] and w[0, 1] == 1.0 and w[0, 2:].sum() == 0


CASES = [  # B, S, A, Bk, window, tile, seed
    (2, 29, 6, 4, 3, 8, 6),      # kv tiles straddling the context/block boundary, short window
    (2, 20, 4, 4, None, 8, 0),
    (3, 37, 6, 3, 5, 8, 1),
    (2, 50, 5, 4, 9, 16, 2),
    (2, 64, 7, 5, 2, 16, 3),     # window smaller than the block
    (1, 45, 9, 4, None, 128, 4),
    (2, 33, 8, 2, 6, 128, 5),
    (2, 40, 5, 8, 3, 16, 7),     # window well below the block: block keys limited by the window too
    (1, 30, 4, 6, 1, 8, 8),      # window 1: each offset sees only itself
    (2, 41, 6, 4, 4, 16, 9),     # window equal to the block
]


def _random_anchors(B, S, A, Bk, seed):
    g = torch.Generator().manual_seed(seed)
    lm = torch.rand(B, S, generator=g) < 0.7
    lm[-1, 6:] = False             # a short sequence: padded anchors
    return sample_anchors(lm, A, Bk, generator=g)


@pytest.mark.parametrize("B,S,A,Bk,window,tile,seed", CASES)
def test_three_mask_products_agree(B, S, A, Bk, window, tile, seed):
    an = _random_anchors(B, S, A, Bk, seed)
    assert not an.valid.all()
    ref = reference_allowed(an, S, window)
    Q = A * Bk
    assert ref.shape == (B, Q, S + Q)
    dense = dense_mask(an, S, window)
    assert dense.shape == (B, 1, Q, S + Q) and dense.dtype == torch.bool
    assert torch.equal(dense[:, 0], ref)
    bm = block_mask(an, S, window, tile=tile)
    assert torch.equal(block_mask_to_dense(bm, Q, S + Q), ref)
    # the query-side lists (backward) are the transposes of the kv-side ones, as flex computes them
    from torch.nn.attention.flex_attention import BlockMask
    ref_bm = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                      BLOCK_SIZE=tile, seq_lengths=(Q, S + Q))
    for name in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert torch.equal(getattr(bm, name), getattr(ref_bm, name)), name
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        t = getattr(bm, name)
        assert t.dtype == torch.int32 and t.is_contiguous(), name   # the kernels assume contiguous int32
    # padded blocks see nothing; a valid block sees its whole own block (full), or itself and its earlier
    # offsets within the window (sliding)
    rows = an.valid.repeat_interleave(Bk, 1)
    assert not ref[~rows].any()
    own = ref[..., S:].view(B, A, Bk, A, Bk).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)   # [B, A, Bk, Bk]
    i = torch.arange(Bk)
    want = torch.ones(Bk, Bk, dtype=torch.bool) if window is None else \
        (i[None] <= i[:, None]) & (i[:, None] - i[None] < window)
    assert torch.equal(own[an.valid], want.expand(int(an.valid.sum()), Bk, Bk))
    assert ref[..., S:].sum() == own.sum()                         # no other block's keys


def test_block_mask_uses_full_tiles_and_skips_invisible_ones():
    S, Bk, tile = 96, 4, 8
    an = anchors_of([[80, 85, 90, 5]], [[True, True, True, True]], Bk)
    bm = block_mask(an, S, None, tile=tile)
    Q = 16
    assert torch.equal(block_mask_to_dense(bm, Q, S + Q), reference_allowed(an, S))
    # query tile 0 (anchors 80, 85): context tiles 0..9 fully visible, tile 10 (80..87) partial
    assert bm.full_kv_num_blocks[0, 0, 0] == 10
    # query tile 1 (anchors 90, 5): nothing is full; context tiles 0..11 and its block tile are partial
    assert bm.full_kv_num_blocks[0, 0, 1] == 0
    assert bm.kv_num_blocks[0, 0, 1] == 12 + 1
    bm_w = block_mask(an, S, 6, tile=tile)   # with a window, far context tiles are skipped entirely
    assert int(bm_w.kv_num_blocks[0, 0, 0] + bm_w.full_kv_num_blocks[0, 0, 0]) <= 4
    assert torch.equal(block_mask_to_dense(bm_w, Q, S + Q), reference_allowed(an, S, 6))


@pytest.mark.parametrize("window", [None, 2, 5, 12])
def test_one_anchor_mask_is_the_inference_rule(window):
    """One block at anchor a with context 0..a-1: keys are positions 0..a+Bk-1, so the mask must be the
    inference stacks' rule on positions: full layers see every key; sliding layers (dflash 0.1.0 is_causal,
    SGLang window_left = W-1, vLLM causal sliding layers) see key k from query position t when k <= t and
    t - k < W."""
    a, Bk = 9, 5
    an = anchors_of([[a]], [[True]], Bk)
    t = torch.arange(a, a + Bk)[:, None]
    k = torch.arange(a + Bk)[None]
    want = torch.ones(Bk, a + Bk, dtype=torch.bool) if window is None else (k <= t) & (t - k < window)
    assert torch.equal(dense_mask(an, a, window)[0, 0], want)
    assert torch.equal(reference_allowed(an, a, window)[0], want)
