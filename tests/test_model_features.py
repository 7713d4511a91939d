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
