"""A toy Qwen3 target, a DFlash drafter over it, random prompts: the speculative decoding tests' models."""
import torch

from dflash.model import DFlashDrafter, DrafterConfig


def tiny_target(vocab=64, layers=4, hidden=32, seed=0, init=0.1):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=init, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def tiny_drafter(target, block_size=4, layer_types=None, sliding_window=None, seed=0):
    tc = target.config
    cfg = DrafterConfig(vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, num_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, intermediate_size=48, target_layer_ids=[0, 1],
                        mask_token_id=tc.vocab_size - 1, num_target_layers=tc.num_hidden_layers,
                        block_size=block_size, rope_theta=float(tc.rope_parameters["rope_theta"]),
                        layer_types=layer_types, sliding_window=sliding_window)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    d.reset_parameters(std=0.2)
    return d.eval().requires_grad_(False)


def prompts(n, vocab, seed=1, lo=3, hi=12):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
