"""Both draft policies at temperature > 0 (issue 39, item 4): `argmax` (argmax drafts verified against a one-hot
proposal: vLLM, SGLang, TensorRT-LLM) and `sample` (drafts sampled from the drafter: DeepSpec, the reference package)
are each exact: speculative decoding's output law is the target's own. Deliberately wrong rules fail the same check."""
from __future__ import annotations

import math
import types

import pytest
import torch

from dflash.evaluate import specdec
from dflash.evaluate.specdec import _sample, accept_onehot, accept_sampling, speculative_generate

V, T, PROMPT, NEW = 5, 0.8, [1, 2, 3], 3


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py's: one torch thread for tiny matmuls


class MarkovTarget(torch.nn.Module):
    """A target whose logits at a position depend on the token there and the position (W[token] + P[position]): its
    law is exact by enumeration, a forward costs microseconds. It keeps no KV cache (its cache stays empty)."""

    def __init__(self, seed=0, scale=1.5):
        super().__init__()
        from transformers import Qwen3Config
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(V, V, generator=g) * scale, requires_grad=False)
        self.P = torch.nn.Parameter(torch.randn(16, V, generator=g) * scale, requires_grad=False)
        self.config = Qwen3Config(vocab_size=V, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=8)

    def forward(self, input_ids, position_ids, logits_to_keep=0, **_):
        logits = self.W[input_ids] + self.P[position_ids]
        return types.SimpleNamespace(logits=logits[:, -logits_to_keep:], hidden_states=None)

    def law(self, prompt, n, temperature) -> torch.Tensor:
        """The exact law of the first n sampled tokens, [V] * n (a Markov chain: token k depends on token k-1)."""
        m = len(prompt)
        out = torch.softmax((self.W[prompt[-1]] + self.P[m - 1]) / temperature, -1)
        for k in range(1, n):
            step = torch.softmax((self.W + self.P[m - 1 + k]) / temperature, -1)     # [previous token, token]
            out = out[..., None] * step[(None,) * (k - 1)]
        return out


class FixedDraft:
    """Draft logits = the target's position term plus fixed noise: right often enough to be accepted, wrong often
    enough to be rejected (both paths exercised), never the target's law."""
    target_layer_ids: list[int] = []

    def __init__(self, target, block_size=3, seed=1, scale=2.5):
        self.target, self.block_size = target, block_size
        self.noise = torch.randn(1, block_size - 1, V, generator=torch.Generator().manual_seed(seed)) * scale

    def reset(self):
        pass

    def propose(self, ctx_ids, ctx_feats, block_ids, start):
        g = block_ids.shape[1] - 1
        return self.target.P[start:start + g][None] + self.noise[:, :g]


def decode_law(target, proposal, n=4000, seed=0, block_size=3):
    """Empirical law of the first NEW tokens over n speculative decodes, and the share of first steps that rejected
    their first draft token / accepted all of them."""
    g = torch.Generator().manual_seed(seed)
    draft = FixedDraft(target, block_size)
    counts = torch.zeros((V,) * NEW)
    rejected = full = 0
    for _ in range(n):
        out = speculative_generate(target, draft, PROMPT, NEW, temperature=T, mask_token_id=0, generator=g,
                                   proposal=proposal)
        counts[tuple(out.tokens)] += 1
        rejected += out.accepted[0] == 0
        full += out.accepted[0] == out.drafted[0]
    return counts / n, rejected / n, full / n


def tv_bound(law: torch.Tensor, n: int, fail_p=1e-6) -> float:
    """A bound the total variation between an n-sample empirical law and its true law exceeds with probability below
    fail_p: E[TV] <= 1/2 sum sqrt(p(1-p)/n) (Jensen), and TV moves by at most 1/n per sample (McDiarmid:
    P(TV >= E + t) <= exp(-2 n t^2))."""
    return 0.5 * float((law * (1 - law) / n).sqrt().sum()) + math.sqrt(math.log(1 / fail_p) / (2 * n))


def tv(a, b) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.fixture(scope="module")
def target():
    return MarkovTarget()


@pytest.fixture(scope="module")
def law(target):
    return target.law(PROMPT, NEW, T)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_each_policy_samples_the_targets_law(target, law, proposal):
    """The joint law of the first 3 tokens (125 outcomes, drafted and verified over one or more steps) equals the
    target's exact law, within a total-variation bound a correct rule exceeds with probability < 1e-6."""
    emp, rejected, full = decode_law(target, proposal)
    assert 0.2 < rejected and 0.05 < full, (rejected, full)      # residual and bonus paths both exercised
    bound = tv_bound(law, 4000)
    assert bound < 0.09
    assert tv(emp, law) < bound, (tv(emp, law), bound)


@pytest.mark.parametrize("proposal", ["argmax", "sample"])
def test_each_policy_samples_the_targets_law_through_the_bonus(target, law, proposal):
    """Blocks of 2 (one draft token): the first step's bonus, drawn after a fully accepted block, is the third token,
    inside the law checked (with blocks of 3 it falls past NEW and is never seen): a third of the first steps or more
    end that way."""
    emp, rejected, full = decode_law(target, proposal, block_size=2)
    assert 0.3 < full and 0.3 < rejected, (rejected, full)
    assert tv(emp, law) < tv_bound(law, 4000), tv(emp, law)


def _bonus_from_the_last_draft_row(real):
    """`real`'s acceptance, but after a fully accepted block the bonus is drawn from p_{g-1} (the last draft
    position's row) instead of p_g."""
    def rule(draft_tokens, *rest):
        p, generator = rest[-2], rest[-1]
        acc, tok = real(draft_tokens, *rest)
        g = draft_tokens.shape[0]
        return (acc, int(_sample(p[g - 1], generator).item())) if acc == g else (acc, tok)
    return rule


@pytest.mark.slow   # out of make test-fast: its heavy check runs in make test
@pytest.mark.parametrize("proposal,name", [("argmax", "accept_onehot"), ("sample", "accept_sampling")])
def test_a_wrong_bonus_row_fails_the_bonus_check(target, law, monkeypatch, proposal, name):
    """(With blocks of 3, test_each_policy_samples_the_targets_law, this wrong rule passes: its bonus is never seen.)"""
    monkeypatch.setattr(specdec, name, _bonus_from_the_last_draft_row(getattr(specdec, name)))
    emp, _, full = decode_law(target, proposal, block_size=2)
    assert full > 0.3 and tv(emp, law) > 1.25 * tv_bound(law, 4000), tv(emp, law)


def _accept_every_argmax_draft(draft_tokens, p, generator):
    g = draft_tokens.shape[0]
    return g, int(_sample(p[g], generator).item())


def _residual_keeps_the_draft(draft_tokens, p, generator):   # replacement from p_i, x_i not removed
    g = draft_tokens.shape[0]
    px = p[:g].gather(-1, draft_tokens[:, None])[:, 0]
    acc = int((torch.rand(g, generator=generator, dtype=p.dtype) < px).to(torch.int64).cumprod(0).sum().item())
    return acc, int(_sample(p[acc], generator).item())


def _sampling_residual_p(draft_tokens, q, p, generator):     # replacement from p_i, not norm(max(0, p_i - q_i))
    acc, _ = accept_sampling(draft_tokens, q, p, generator)
    return acc, int(_sample(p[acc], generator).item())


@pytest.mark.slow   # out of make test-fast: its heavy check runs in make test
@pytest.mark.parametrize("proposal,name,rule", [
    ("argmax", "accept_onehot", _accept_every_argmax_draft),
    ("argmax", "accept_onehot", _residual_keeps_the_draft),
    ("sample", "accept_sampling", _sampling_residual_p),
])
def test_a_wrong_rule_fails_the_same_check(target, law, monkeypatch, proposal, name, rule):
    monkeypatch.setattr(specdec, name, rule)
    emp, _, _ = decode_law(target, proposal)
    assert tv(emp, law) > 2 * tv_bound(law, 4000), tv(emp, law)


# ---- accept_onehot ---------------------------------------------------------------------------------------------
def test_accept_onehot_accepts_with_the_targets_probability_of_the_draft():
    g = torch.Generator().manual_seed(0)
    x = torch.tensor([2, 0])
    sure = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.3, 0.7]])
    for _ in range(20):   # p_i(x_i) = 1: always accepted; the bonus from p_g
        acc, bonus = accept_onehot(x, sure, g)
        assert acc == 2 and bonus in (1, 2)
    never = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    got = [accept_onehot(x, never, g) for _ in range(400)]   # p_0(x_0) = 0: rejected at once, from p_0
    assert {a for a, _ in got} == {0} and {t for _, t in got} == {0, 1}
    assert abs(sum(t for _, t in got) / 400 - 0.5) < 0.1


def test_accept_onehot_output_law_is_p_whatever_the_draft():
    """One draft token x (the drafter's argmax, whatever it is): accepted with probability p(x), else the replacement
    is drawn from p without x: the output's law is p. Checked for every x, with the acceptance rate itself."""
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 4, generator=g) * 1.5, -1)
    N = 3000
    for x in range(4):
        counts, accepted = torch.zeros(4), 0
        for _ in range(N):
            acc, tok = accept_onehot(torch.tensor([x]), p, g)
            accepted += acc
            counts[x if acc else tok] += 1
            assert acc or tok != x                              # a rejected draft is never the replacement
        assert abs(accepted / N - float(p[0, x])) < 4 * math.sqrt(0.25 / N)
        assert tv(counts / N, p[0]) < tv_bound(p[0], N), (x, counts / N, p[0])


def test_unknown_proposal_is_refused(target):
    with pytest.raises(ValueError, match="proposal must be 'argmax' or 'sample'"):
        speculative_generate(target, FixedDraft(target), PROMPT, 3, temperature=T, proposal="greedy")


def test_at_temperature_0_both_policies_are_the_same_greedy_decode(target):
    a, s = (speculative_generate(target, FixedDraft(target), PROMPT, 8, proposal=k) for k in ("argmax", "sample"))
    assert a.tokens == s.tokens and a.accepted == s.accepted


# ---- what a tau at temperature > 0 is labelled with ---------------------------------------------------------------
def _acceptance(temperature, by=None, tau=2.0):
    acc = {"temperature": temperature, "tau": tau, "num_prompts": 4, "max_new_tokens": 16, "lossless": True}
    if by:
        acc.update(proposal=next(iter(by)), by_proposal={k: {"tau": v} for k, v in by.items()})
    return acc


def test_policies_follow_evaluate_proposal():
    from dflash.records.acceptance import policies
    assert policies("auto", 0.0) == policies("both", 0.0) == policies("sample", 0.0) == ["argmax"]
    assert policies("auto", 0.7) == policies("both", 0.7) == ["argmax", "sample"]
    assert policies("sample", 0.7) == ["sample"] and policies("argmax", 1.0) == ["argmax"]


def test_model_card_names_the_policy_of_each_tau():
    from dflash import config as C
    from dflash.records.acceptance import AcceptanceCore
    from dflash.evaluate.modelcard import model_card
    cfg = C.from_dict({}).cfg
    tconf = types.SimpleNamespace(architectures=["Qwen3ForCausalLM"], num_hidden_layers=2, hidden_size=8,
                                  vocab_size=10)
    dcfg = types.SimpleNamespace(num_layers=1, block_size=4, target_layer_ids=[0], mask_token_id=3)

    def line(acc):
        view = AcceptanceCore.model_validate(acc) if acc is not None else None   # as export reads the file
        card = model_card(cfg, tconf, dcfg, "ckpt", {}, view, {}, {"dtype": "float32"})
        return next(x for x in card.splitlines() if x.startswith("| acceptance length tau |"))
    assert "| 2.000 (temperature 0, greedy: the same under every engine; 4 held-out prompts" in line(_acceptance(0.0))
    both = line(_acceptance(0.7, {"argmax": 2.96, "sample": 1.16}))
    assert ("| 2.960 with argmax drafts (vLLM (default), SGLang, TensorRT-LLM); 1.160 with sample drafts "
            "(DeepSpec, ") in both
    assert "vLLM draft_sample_method: probabilistic (lossless from vLLM PR #54282))" in both
    assert "(temperature 0.7; 4 held-out prompts, 16 new tokens, lossless True) |" in both
    assert "1.400 with sample drafts (DeepSpec" in line(_acceptance(1.0, tau=1.4))   # before by_proposal: sampled
    assert "not evaluated when exported" in line(None)



def test_the_exact_law_is_the_product_of_the_targets_conditionals(target, law):
    assert abs(float(law.sum()) - 1) < 1e-5
    for seq in ((4, 0, 2), (0, 0, 0), (1, 3, 4)):
        ids, pr = PROMPT + list(seq), 1.0
        for k in range(NEW):
            pos = len(PROMPT) - 1 + k
            pr *= float(torch.softmax((target.W[ids[pos]] + target.P[pos]) / T, -1)[seq[k]])
        assert float(law[seq]) == pytest.approx(pr, rel=1e-5)
