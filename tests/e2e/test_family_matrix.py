"""The family matrix (docs/targets.md): for every family of dflash.families, a tiny random-weight target built by the
target stage's builder and loaded by `from_pretrained`, then the train stage's capture against the model's own
hidden states, the drafter's frozen parts against the target's own forward, a few training steps whose loss falls,
speculative decoding lossless at T=0 against the target's greedy decoding (with the family's cache: KV, sliding
window, recurrent state), the export and its serving contract. A wrong capture index or embedding scale fails it."""
import copy
import dataclasses

import pytest
import torch

from dflash import families as FAM
from dflash.evaluate import specdec as S
from support import families as F

CPU = torch.device("cpu")
ALL = sorted(FAM.FAMILIES)


@pytest.fixture(scope="module")
def built(tmp_path_factory, family_targets, one_thread):
    """{family: (ctx, target)}: every family's tiny target (built once per session), loaded once for the module."""
    root = tmp_path_factory.mktemp("contexts")
    return {f: F.context(family_targets(f), root / f) for f in ALL}


@pytest.fixture(scope="module")
def trained(built):
    """{family: (drafter, first loss, last loss)}: the train stage's drafter, 6 AdamW steps on one batch of its features."""
    from dflash.train.features import run_capture
    from dflash.train.step import build_drafter, frozen_head, micro_step
    out = {}
    for f, (ctx, target) in built.items():
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, ctx.drafter_config.vocab_size, (2, 48), generator=g)
        feats = run_capture(target, ctx)(ids).clone()
        d = build_drafter(ctx, *frozen_head(target, CPU), CPU)
        opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
        losses = []
        for _ in range(6):
            out_ = micro_step(d, feats, ids, torch.ones_like(ids, dtype=torch.bool), 0, ctx, None)
            (out_.loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(out_.loss))
        out[f] = (d.eval(), losses)
    return out


@pytest.mark.parametrize("family", ALL)
def test_capture_equals_the_models_hidden_states(built, family):
    ctx, target = built[family]
    L = target.config.num_hidden_layers
    ids = torch.randint(0, target.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    assert F.capture_problem(target, ids, list(range(L))) is None          # every id, L-1 (after the final norm) too
    assert F.capture_problem(target, ids, ctx.drafter_config.target_layer_ids) is None


@pytest.mark.parametrize("family", ALL)
def test_frozen_parts_are_the_targets_as_it_uses_them(built, trained, family):
    ctx, target = built[family]
    d, _ = trained[family]
    ids = torch.randint(0, target.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    assert torch.equal(d.embed(ids), F.first_layer_input(target, ids))    # Gemma: times sqrt(H), rounded as Gemma does
    out = F.hidden_states(target, ids)
    assert torch.allclose(F.softcap(d.logits(out.hidden_states[-1]), target.config), out.logits, atol=1e-5, rtol=0)
    V = target.config.vocab_size
    assert d.embed_weight.shape[0] == d.lm_head_weight.shape[0] == d.cfg.vocab_size == V == out.logits.shape[-1]
    tied = target.get_output_embeddings().weight is target.get_input_embeddings().weight
    assert tied == (d.embed_weight.data_ptr() == d.lm_head_weight.data_ptr())   # a tied head stays one tensor
    assert FAM.check_model(target) is None


def test_a_soft_capped_head_is_the_head_then_the_cap(built, trained, monkeypatch):
    """Gemma 2-style final_logit_softcapping (off in Gemma 3 by default, on here): the target's logits are the head on
    its last hidden state, capped; the argmax, all a served drafter's drafts use, is the uncapped head's."""
    ctx, target = built["gemma3_text"]
    d, _ = trained["gemma3_text"]
    monkeypatch.setattr(target.config, "final_logit_softcapping", 2.0)
    out = F.hidden_states(target, torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(5)))
    head = d.logits(out.hidden_states[-1])
    assert torch.allclose(F.softcap(head, target.config), out.logits, atol=1e-5, rtol=0)
    assert not torch.allclose(head, out.logits, atol=1e-3) and torch.equal(head.argmax(-1), out.logits.argmax(-1))


@pytest.mark.parametrize("family", ALL)
def test_training_steps_lower_the_loss(trained, family):
    _, losses = trained[family]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.98 * losses[0], losses


class NoisyOracle(S.OracleDraft):
    """The target's greedy continuation with one position replaced at random: partial acceptances every step."""

    def __init__(self, target, block_size):
        super().__init__(target, block_size)
        self.g = torch.Generator().manual_seed(0)

    def propose(self, ctx_ids, ctx_feats, block_ids, start):
        logits = super().propose(ctx_ids, ctx_feats, block_ids, start)
        logits[0, int(torch.randint(0, logits.shape[1], (1,), generator=self.g))] = 0
        return logits


@pytest.mark.parametrize("family", ALL)
def test_speculative_decoding_is_lossless_with_the_familys_cache(built, trained, family):
    ctx, target = built[family]
    d, _ = trained[family]
    prompt = torch.randint(0, target.config.vocab_size, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    want = S.target_generate(target, prompt, 24).tokens               # past the sliding window (8) of every family
    for draft in (S.DFlashDraft(d), NoisyOracle(target, 4)):
        got = S.speculative_generate(target, draft, prompt, 24, mask_token_id=d.cfg.mask_token_id)
        assert got.tokens == want, type(draft).__name__
        rewinds = got.target_forwards - 1 - got.steps
        rejected = sum(p < n + 1 for p, n in zip(got.produced, got.drafted))   # steps whose verify went past them
        assert rewinds == (rejected if FAM.FAMILIES[family].cache == FAM.RECURRENT else 0)
    assert sum(got.accepted) > 0                                       # the oracle's drafts were accepted in part


def test_cropping_a_recurrent_state_is_not_lossless(built):
    """Why the recurrent family rewinds: after a verify of 4 tokens of which 2 are kept, a plain crop (what the
    reference package does) leaves the 2 rejected ones in the gated DeltaNet's state; the rewind gives the state of a
    forward over the kept tokens alone."""
    ctx, target = built["qwen3_next"]
    ids = torch.randint(0, target.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(3))

    def after(kept_only, how):
        cache = S.make_cache(target)
        S.target_forward(target, ids[:, :19] if not kept_only else ids[:, :21], 0, cache, [])
        S.crop_cache(cache)
        if not kept_only:
            snap = S.snapshot(cache)
            S.target_forward(target, ids[:, 19:23], 19, cache, [])
            S.rewind(target, cache, snap, ids[:, 19:21], 19) if how == "rewind" else S.crop_cache(cache, 21)
        return [layer.recurrent_states[0] for layer in recurrent_layers(cache)]

    want = after(True, None)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after(False, "rewind"), want))
    assert not any(torch.allclose(a, b, atol=1e-3) for a, b in zip(after(False, "crop"), want))


def recurrent_layers(cache):
    return [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]


@pytest.mark.parametrize("family", ALL)
def test_export_meets_the_serving_contract(built, trained, family, tmp_path):
    from dflash.model import save_drafter
    from dflash.model.export import load_drafter, serving_problems
    ctx, target = built[family]
    d, _ = trained[family]
    save_drafter(d, tmp_path / "drafter", mask_token="<|mask|>")
    assert serving_problems(tmp_path / "drafter") == []
    back = load_drafter(tmp_path / "drafter", d.embed_weight, d.lm_head_weight, embed_scale=FAM.embed_scale(target.config))
    x = torch.randint(0, d.cfg.vocab_size, (1, 8))
    assert torch.equal(back.embed(x), d.embed(x))
    served = [e for e, s in FAM.FAMILIES[family].serving.items() if s.accepts]
    L = target.config.num_hidden_layers
    assert served and max(d.cfg.target_layer_ids) <= L + FAM.MAX_SERVED_ID   # the ids every engine reads alike


def test_the_reference_package_decodes_the_families_it_serves_as_we_do(built, trained, tmp_path):
    """The serving contract's reference column, run: the published package (0.1.0, .venv-interop) decodes with each
    family's target and our export; where dflash.families says it serves the family its tokens and acceptance lengths
    are our evaluator's and lossless; Qwen3-Next, which it does not, comes out other than the target's greedy decoding
    (its cropped cache keeps the rejected tokens in the recurrent state)."""
    import json
    import os
    from dflash.model import save_drafter
    problem = F.reference_problem()
    if problem:
        (pytest.fail if os.environ.get("DFLASH_INTEROP") == "required" else pytest.skip)(problem)
    case = {}
    for f in ALL:
        ctx, target = built[f]
        d, _ = trained[f]
        save_drafter(d, tmp_path / f)
        path = ctx.cfg.target.path
        if FAM.FAMILIES[f].cache == FAM.RECURRENT:   # a random tiny target's recurrent path is too faint to flip a
            target = copy.deepcopy(target)          # greedy token: its linear-attention weights 5x
            with torch.no_grad():
                for n, p in target.named_parameters():
                    if ".linear_attn." in n and n.endswith(".weight") and "norm" not in n:
                        p.mul_(5)
            target.save_pretrained(tmp_path / f"{f}-target")
            path = str(tmp_path / f"{f}-target")
        g, prompts = torch.Generator().manual_seed(4), []
        for _ in range(3):
            prompt = torch.randint(0, d.cfg.vocab_size, (19,), generator=g).tolist()
            ours = S.speculative_generate(target, S.DFlashDraft(d), prompt, 24, mask_token_id=d.cfg.mask_token_id)
            prompts.append({"prompt": prompt, "tokens": ours.tokens, "produced": ours.produced,
                            "greedy": S.target_generate(target, prompt, 24).tokens})
            assert ours.tokens == prompts[-1]["greedy"], f                  # ours is lossless on it
        case[f] = {"target": path, "drafter": str(tmp_path / f),
                   "attn": ctx.cfg.target.attn_implementation, "prompts": prompts}
    (tmp_path / "case.json").write_text(json.dumps(case))
    ran = F.run_reference("check_families.py", tmp_path)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    result = json.loads((tmp_path / "families.json").read_text())
    for f in ALL:
        if FAM.FAMILIES[f].serving["reference"].accepts:
            assert result[f] == [{"tokens_equal": True, "acceptance_equal": True, "lossless": True}] * 3, (f, result[f])
        else:
            assert "error" in result[f] or not all(r["lossless"] for r in result[f]), (f, result[f])


def test_a_wrong_capture_index_fails_the_matrix(built, monkeypatch):
    from dflash.train import features
    ctx, target = built["llama"]
    ids = torch.randint(0, target.config.vocab_size, (1, 10))
    init = features.LayerCapture.__init__
    monkeypatch.setattr(features.LayerCapture, "__init__", lambda self, m, layer_ids: init(self, m, [i + 1 for i in layer_ids]))
    assert "differs" in F.capture_problem(target, ids, [0, 1])


def test_a_wrong_embedding_scale_fails_the_matrix(built, trained, monkeypatch):
    ctx, target = built["gemma3_text"]
    d, _ = trained["gemma3_text"]
    ids = torch.randint(0, target.config.vocab_size, (1, 10))
    monkeypatch.setattr(d, "embed_scale", None)                                   # the drafter forgets sqrt(H)
    assert not torch.allclose(d.embed(ids), F.first_layer_input(target, ids))
    fam = dataclasses.replace(FAM.FAMILIES["gemma3_text"], embed_scale=lambda c: None)
    monkeypatch.setitem(FAM.FAMILIES, "gemma3_text", fam)                          # the table forgets it
    assert "scaled by 5.65685" in FAM.check_model(target)
