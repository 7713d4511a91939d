"""Target features: LayerCapture gives hidden_states[id + 1] for every id, the last layer's included (after the
target's final norm, as the reference, SGLang and our evaluator read them)."""
import torch

from dflash.train.features import LayerCapture


def test_features_equal_hidden_states_for_every_layer_including_the_last():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 2.0)   # a final norm that visibly changes its input
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states      # L + 1 entries
    for layer_ids in ([2], [0, 2], [1], [2, 0, 1]):
        got = LayerCapture(target, layer_ids)(ids)
        want = torch.cat([hs[i + 1] for i in layer_ids], -1)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # the last layer's raw output is not what the inference stacks read
    raw = {}
    target.model.layers[2].register_forward_hook(lambda m, a, o: raw.setdefault("o", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        target(ids)
    assert (raw["o"] - hs[3]).abs().max() > 1e-2


def test_a_distillation_run_also_captures_the_final_norm_state():
    """train.objective kl / ce+kl: the run's capture is the context layers, then layer L-1 (hidden_states[L], after
    the final norm: the LM head's input, so the target's logits are lm_head(those columns)); ce captures only
    the context layers. feature_width says the same."""
    from types import SimpleNamespace

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash import config as C
    from dflash.train.features import feature_width, run_capture
    from support.model import tiny_cfg
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    dcfg = tiny_cfg(hidden_size=32, target_layer_ids=[0, 1], num_target_layers=4)
    for objective, extra in (("ce", []), ("kl", [4]), ("ce+kl", [4])):
        train = C.from_dict({"train": {"objective": objective}}).cfg.train
        got = run_capture(target, SimpleNamespace(drafter_config=dcfg, cfg=SimpleNamespace(train=train)))(ids)
        want = torch.cat([out.hidden_states[i] for i in [1, 2, *extra]], -1)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert got.shape[-1] == feature_width(dcfg, train)
        if extra:
            with torch.no_grad():
                torch.testing.assert_close(target.lm_head(got[..., -32:]), out.logits, rtol=1e-5, atol=1e-5)
