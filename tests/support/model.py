"""Shared helpers for the drafter model tests: tiny configs, a drafter with frozen target weights, batches."""
from __future__ import annotations

import torch

from dflash.model import Anchors, DFlashDrafter, DrafterConfig, sample_anchors


def tiny_cfg(**kw) -> DrafterConfig:
    base = dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=48, target_layer_ids=[0, 2, 3], mask_token_id=96,
                num_target_layers=6, block_size=4, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=512)
    base.update(kw)
    return DrafterConfig(**base)


def make_drafter(cfg: DrafterConfig, seed: int = 0, dtype=torch.float32) -> DFlashDrafter:
    g = torch.Generator().manual_seed(seed + 1000)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, dtype=dtype) * 0.2
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, embed, head).to(dtype)
    with torch.no_grad():   # non-trivial norm weights so that a wrong norm would show
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return d


def make_batch(cfg: DrafterConfig, B: int, S: int, A: int, seed: int = 0, dtype=torch.float32,
               supervised: float = 0.8, lengths=None):
    """target_hidden [B, S, k*H], input_ids [B, S], loss_mask [B, S], anchors."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, cfg.num_context_layers * cfg.hidden_size, generator=g, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size - 1, (B, S), generator=g)
    lm = torch.rand(B, S, generator=g) < supervised
    if lengths is not None:
        for b, n in enumerate(lengths):
            lm[b, n:] = False
    anchors = sample_anchors(lm, A, cfg.block_size, generator=g)
    return hidden, ids, lm, anchors


def anchors_of(pos, valid, block_size) -> Anchors:
    return Anchors(torch.as_tensor(pos, dtype=torch.long), torch.as_tensor(valid, dtype=torch.bool), block_size)
