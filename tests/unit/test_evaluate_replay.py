"""The replay of greedy speculative decoding (dflash/evaluate/replay.py) equals speculative decoding step for step:
the same tokens, and per verification step the same produced, accepted and drafted counts, with stop tokens, narrower
last blocks and sliding-window layers; and its walk alone against hand-made cases."""
from __future__ import annotations

import pytest

from dflash.evaluate import DFlashDraft, speculative_generate
from dflash.evaluate.acceptance import summarize
from dflash.evaluate.replay import replay, walk
from support.specdec import prompts, tiny_drafter, tiny_target

pytestmark = pytest.mark.usefixtures("one_thread")


def decoded(target, drafter, ps, max_new, stops):
    d = DFlashDraft(drafter)
    return [speculative_generate(target, d, p, max_new, stops, 0.0, drafter.cfg.mask_token_id) for p in ps]


@pytest.mark.parametrize("layout,block", [({}, 5), ({"layer_types": ["sliding_attention", "full_attention"],
                                                       "sliding_window": 6}, 5), ({}, 2)])
def test_replay_equals_speculative_decoding(layout, block, monkeypatch):
    # vocab 12: a random drafter's drafts are often right, so steps accept 0..block-1 tokens; blocks of 2: whole
    # blocks accepted (then the bonus is the target's token after the last draft), 10 of 122 steps here
    target = tiny_target(vocab=12, init=0.5)
    target.generation_config.repetition_penalty = 1.3     # a model's generation defaults: not the argmax, ignored
    monkeypatch.setattr("dflash.evaluate.replay.ANCHOR_CHUNK", 7)   # the anchors in several drafter forwards
    drafter = tiny_drafter(target, block_size=block, **layout)
    ps = prompts(6, 12, seed=4)
    for max_new, stops in ((23, []), (30, [3])):        # 23: the last blocks are narrower than 5
        want = decoded(target, drafter, ps, max_new, stops)
        done = replay(target, drafter, ps, max_new, stops)
        got = done.generations
        assert done.mismatches == 0                     # float32: y is the whole-sequence forward's argmax throughout
        for w, g in zip(want, got):
            assert (g.tokens, g.produced, g.accepted, g.drafted, g.stopped) == \
                   (w.tokens, w.produced, w.accepted, w.drafted, w.stopped)
        assert sum(a > 0 for g in got for a in g.accepted) >= 3                 # drafts were accepted, not only bonuses
        assert block == 2 or stops or sum(g.drafted[-1] < 4 for g in got if g.drafted) >= 1   # narrower last blocks
        assert block > 2 or sum(a == d for g in got for a, d in zip(g.accepted, g.drafted)) >= 3   # whole blocks
        s, t = summarize(got, [], block), summarize(want, [], block)
        assert s["tau"] == t["tau"] and s["acceptance_per_position"] == t["acceptance_per_position"]
    assert any(g.stopped for g in got)


def test_batched_greedy_continuations_are_batch_1_decoding():
    """Left-padded batches of prompts of different lengths: each row's tokens are its own batch-1 greedy decode."""
    from dflash.evaluate import target_generate
    from dflash.evaluate.replay import greedy_continuations
    target = tiny_target(vocab=64)
    ps = prompts(5, 64, seed=2, lo=1, hi=15)
    assert greedy_continuations(target, ps, 9, batch_size=3) == [target_generate(target, p, 9).tokens for p in ps]


def test_walk_by_hand():
    y = [5, 6, 7, 8, 9, 1, 2]                           # greedy tokens of positions 10..16 (prompt of 10)
    table = {10: [6, 7, 0], 13: [9, 1, 2], 16: []}      # anchor 10: two right; anchor 13: all three right

    def draft_at(start, vs):
        return table[start][:vs - 1]
    g = walk(10, y, 7, 4, set(), draft_at)
    assert g.tokens == y and g.produced == [3, 3] and g.accepted == [2, 3] and g.drafted == [3, 3]
    # the step that reaches max_length: vs = 17 - 16 = 1 never runs (start + 1 == max_length)
    g = walk(10, y, 7, 4, {8}, draft_at)                # a stop token inside the first accepted run
    assert g.tokens == [5, 6, 7, 8] and g.produced == [3] and g.stopped


@pytest.mark.gpu
def test_replay_equals_speculative_decoding_on_cuda():
    """On a GPU in float32 too (the in-training evaluation's device): the same steps as batch-1 decoding, and in
    bfloat16 the same tau up to the rounding the docstring names (only a few greedy positions part)."""
    import torch
    target = tiny_target(vocab=12, init=0.5).cuda()
    drafter = tiny_drafter(target, block_size=5).cuda()      # the target's embedding and head: already on the GPU
    ps = prompts(6, 12, seed=4)
    want = decoded(target, drafter, ps, 23, [3])
    done = replay(target, drafter, ps, 23, [3])
    assert done.mismatches == 0
    assert [(g.tokens, g.produced, g.accepted) for g in done.generations] == \
           [(w.tokens, w.produced, w.accepted) for w in want]
    half = replay(target.to(torch.bfloat16), drafter.to(torch.bfloat16), ps, 23, [3])
    assert half.mismatches <= 6 and sum(g.steps for g in half.generations) >= 50   # (prompt 1 stops at its first token)
