"""Speculative decoding: lossless greedy output, oracle/random drafters, cached drafter == training forward,
and the sampling rule preserving the target's distribution."""
from __future__ import annotations

import math

import pytest
import torch

from dflash.evaluate import (DFlashDraft, OracleDraft, RandomDraft, accept_sampling, speculative_generate,
                             target_generate)
from dflash.evaluate.acceptance import summarize
from dflash.model import Anchors
from support.specdec import prompts, tiny_drafter, tiny_target


@pytest.fixture(autouse=True)
def one_thread():   # tiny matmuls: threads only contend on the shared cores
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def test_greedy_speculative_is_lossless(target):
    draft = DFlashDraft(tiny_drafter(target))
    rand = RandomDraft(64, 4, seed=3)
    for prompt in prompts(12, 64):
        plain = target_generate(target, prompt, 24)
        for d in (draft, rand):
            spec = speculative_generate(target, d, prompt, 24, mask_token_id=63)
            assert spec.tokens == plain.tokens
            assert len(spec.tokens) == 24 and sum(spec.produced) == 23    # first token comes from the prefill


def test_stop_tokens_end_both_decoders_identically(target):
    prompt = prompts(1, 64, seed=5)[0]
    plain = target_generate(target, prompt, 30)
    stop = plain.tokens[7]
    a = target_generate(target, prompt, 30, stop_ids=[stop])
    b = speculative_generate(target, OracleDraft(target, 4), prompt, 30, stop_ids=[stop], mask_token_id=63)
    assert a.tokens == b.tokens == plain.tokens[: plain.tokens.index(stop) + 1]
    assert a.stopped and b.stopped


def test_oracle_tau_equals_block_size(target):
    B = 5
    oracle = OracleDraft(target, B)
    gens = [speculative_generate(target, oracle, p, 1 + 4 * B, mask_token_id=63) for p in prompts(4, 64, seed=2)]
    s = summarize(gens, [target_generate(target, p, 1 + 4 * B) for p in prompts(4, 64, seed=2)], B)
    assert s["tau"] == pytest.approx(B)
    assert s["acceptance_per_position"] == [1.0] * (B - 1)
    assert s["acceptance_histogram"][str(B)] == s["verify_steps"] == 16


def test_random_drafter_tau_close_to_one(target):
    rand = RandomDraft(64, 8, seed=0)
    gens = [speculative_generate(target, rand, p, 40, mask_token_id=63) for p in prompts(4, 64, seed=4)]
    s = summarize(gens, gens, 8)
    assert 1.0 <= s["tau"] < 1.3, s["tau"]


@pytest.mark.parametrize("window", [None, 2, 6], ids=["full", "mixed-window2", "mixed-window6"])
def test_cached_drafter_matches_training_forward(target, window):
    """The decoder's cached path and the training forward are one computation (windows below and above the
    block size of 4, in a mixed sliding/full layout)."""
    kw = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=window) if window else {}
    drafter = tiny_drafter(target, block_size=4, **kw)
    k = len(drafter.cfg.target_layer_ids)
    g = torch.Generator().manual_seed(0)
    S = 14
    feats = torch.randn(1, S, k * 32, generator=g)
    ids = torch.randint(0, 63, (1, S), generator=g)
    draft = DFlashDraft(drafter)
    draft.reset()
    prev = 0
    for start in (5, 7, 11):   # incremental: each call adds the positions accepted since the previous one
        block = torch.full((1, 4), 63, dtype=torch.long)
        block[0, 0] = ids[0, start]
        got = draft.propose(ids[:, prev:start], feats[:, prev:start], block, start)
        prev = start
        assert draft.cache.length == start
        anchors = Anchors(torch.tensor([[start]]), torch.tensor([[True]]), 4)
        ref = drafter.logits(drafter(feats, ids, anchors, backend="eager"))[:, 1:]
        torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-5)


def test_sampling_rule_preserves_target_distribution_exactly():
    """accept_sampling's output law is p, whatever q: checked exactly by enumerating draft tokens."""
    g = torch.Generator().manual_seed(0)
    V = 5
    p = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, V, generator=g) * 3, -1)
    counts = torch.zeros(V)
    N = 8000
    for _ in range(N):
        x = torch.multinomial(q[0], 1, generator=g)
        acc, bonus = accept_sampling(x, q, p, g)
        counts[int(x) if acc else bonus] += 1
    chi2 = float(((counts - N * p[0]) ** 2 / (N * p[0])).sum())
    assert chi2 < 20.5, chi2      # chi-square, 4 dof: p-value 0.0004


def test_sampling_speculative_preserves_target_distribution():
    """Temperature 1, sampled drafts, a deliberately bad drafter: the law of the 2nd and 3rd generated tokens (both drafted and
    verified in the first speculative step) matches the target's exact law (chi-square, fixed seed)."""
    V = 6
    target = tiny_target(vocab=V + 1, layers=2, hidden=16, init=0.5, seed=1)
    prompt = [1, 2, 3]
    with torch.inference_mode():
        def probs(seq):
            return torch.softmax(target(torch.tensor([seq])).logits[0, -1].float(), -1)
        p1 = probs(prompt)
        p2 = torch.stack([probs(prompt + [a]) for a in range(V + 1)])          # [V+1, V+1]
        p3 = torch.stack([torch.stack([probs(prompt + [a, b]) for b in range(V + 1)]) for a in range(V + 1)])
    law2 = p1 @ p2
    law3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    bad = RandomDraft(V + 1, 3, seed=7, scale=3.0)
    gen = torch.Generator().manual_seed(123)
    N = 1500
    c2, c3 = torch.zeros(V + 1), torch.zeros(V + 1)
    rejected = 0
    for _ in range(N):
        out = speculative_generate(target, bad, prompt, 3, temperature=1.0, mask_token_id=V, generator=gen,
                                   proposal="sample")
        c2[out.tokens[1]] += 1
        c3[out.tokens[2]] += 1
        rejected += out.accepted[0] < 2
    assert rejected > N // 4           # the drafter is bad: the residual path is exercised
    for counts, law in ((c2, law2), (c3, law3)):
        keep = law * N >= 5
        exp = law[keep] * N
        obs = counts[keep]
        rest = N - obs.sum()
        chi2 = float(((obs - exp) ** 2 / exp).sum()) + (float((rest - (N - exp.sum())) ** 2 / (N - exp.sum()))
                                                          if N - exp.sum() >= 5 else 0.0)
        dof = int(keep.sum())
        assert chi2 < dof + 4 * math.sqrt(2 * dof) + 5, (chi2, dof, counts, law * N)
