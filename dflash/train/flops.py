"""Analytic FLOP counts (matmuls only, 2 FLOP per multiply-add) for MFU against the measured matmul ceiling."""
from __future__ import annotations


def target_forward(tcfg, seq_len: int, layers_run: int) -> float:
    """Forward FLOPs of `layers_run` decoder layers over one causal sequence (no LM head: we stop early)."""
    h, nq, nkv = tcfg.hidden_size, tcfg.num_attention_heads, tcfg.num_key_value_heads
    hd = getattr(tcfg, "head_dim", None) or h // nq
    proj = 2 * h * hd * (2 * nq + 2 * nkv)            # q, k, v, o per token
    mlp = 2 * 3 * h * tcfg.intermediate_size           # gate, up, down per token
    attn = 2 * nq * hd * seq_len                       # QK^T + PV, causal average S/2 keys, x2 matmuls
    return layers_run * seq_len * (proj + mlp + attn)


def drafter_forward(dcfg, seq_len: int, num_blocks: int, scored: int) -> float:
    """Forward FLOPs of the drafter for one sequence with `num_blocks` blocks and `scored` scored positions."""
    h, nq, nkv, hd, bk = dcfg.hidden_size, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim, dcfg.block_size
    q = num_blocks * bk
    fc = 2 * len(dcfg.target_layer_ids) * h * h * seq_len
    per_layer = (2 * h * nq * hd * 2 * q                    # q, o from the block
                 + 2 * h * nkv * hd * 2 * (seq_len + q)     # k, v from [context ; block]
                 + 2 * 3 * h * dcfg.intermediate_size * q   # MLP on the block
                 + 2 * 2 * nq * hd * q * (seq_len / 2 + bk))  # attention: ~half the context visible + own block
    head = 2 * h * dcfg.vocab_size * scored
    return fc + dcfg.num_layers * per_layer + head


def drafter_train(dcfg, seq_len: int, num_blocks: int, scored: int) -> float:
    return 3 * drafter_forward(dcfg, seq_len, num_blocks, scored)  # backward ~ 2x forward
