"""DFlashDrafter: a few Qwen3-style decoder layers conditioned on the target's hidden states (KV injection).

Math (matches the reference `DFlashDraftModel` of z-lab dflash 0.1.0 for the same weights):
  ctx = hidden_norm(fc(concat of k target layers))                   [B, S, H]   (fused once, shared by layers)
  x   = embed([anchor, MASK x (Bk-1)] per block)                     [B, Q, H]
  per layer:  h = input_layernorm(x)
              q = rope(q_norm(q_proj(h)))                   at block positions a..a+Bk-1
              k = rope(k_norm(k_proj([ctx ; h])))           at positions [0..S-1 ; block positions]
              v = v_proj([ctx ; h])
              x = x + o_proj(attention(q, k, v, mask));  x = x + mlp(post_attention_layernorm(x))
  out = norm(x)                                                      [B, Q, H]
mask: dflash.model.masks (full layers: context before the anchor + the whole own block; sliding layers: causal
over [context ; block] positions within the window, as the reference's sliding layers).
The embedding and LM head are the target's: frozen, held by reference, not parameters of this module. The block is
embedded as the target's first layer sees its tokens: times `embed_scale` where the target scales (Gemma: sqrt(H),
rounded to the weight's dtype as Gemma's scaled embedding rounds it; dflash.families.embed_scale).

One computation, `run`, serves training (`forward`: many blocks over the whole context) and speculative decoding
(`draft`: one block per call, the context K/V of earlier calls kept in a DrafterCache).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .anchors import Anchors, build_blocks
from .attention import Mask, attention, make_mask
from .config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):   # normalise in float32, scale in the input dtype (as Qwen3RMSNorm)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Linear(nn.Linear):
    """nn.Linear whose autocast copy of the weight can be recast in the backward instead of kept from the forward
    (`recompute_cast`, for compiled layers: Inductor's partition then keeps the float32 weight, alive anyway, not its
    bf16 copy). Same values and gradients; state_dict names as nn.Linear."""
    recompute_cast = False

    def forward(self, x):
        if self.recompute_cast and torch.is_grad_enabled() and torch.is_autocast_enabled(x.device.type):
            return F.linear(x, checkpoint(_autocast_copy, self.weight, use_reentrant=False), self.bias)
        return super().forward(x)


def _autocast_copy(w):
    return w.to(torch.get_autocast_dtype(w.device.type))


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos, sin [..., head_dim] for integer positions `pos` (default RoPE, computed in float32)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
    with torch.autocast(device_type=pos.device.type, enabled=False):
        f = pos.float()[..., None] * inv                                       # [..., D/2]
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):   # x [B, H, T, D]; cos/sin [B, T, D]
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, D
        self.q_proj = Linear(H, self.nh * D, bias=False)
        self.k_proj = Linear(H, self.nkv * D, bias=False)
        self.v_proj = Linear(H, self.nkv * D, bias=False)
        self.o_proj = Linear(self.nh * D, H, bias=False)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def kv(self, x, cos, sin):   # x [B, T, H] -> k, v [B, nkv, T, D] (k normed and rotated)
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.nkv, self.hd)).transpose(1, 2)
        return apply_rope(k, cos, sin), self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)

    def forward(self, h, ctx, ctx_rope, q_rope, mask: Mask, cache: "LayerKV | None" = None):
        """h [B, Q, H] block states; ctx [B, m, H] the new context (all of it without a cache); keys are
        [cached context ; ctx ; block]."""
        B, Q, _ = h.shape
        kc, vc = self.kv(ctx.to(h.dtype), *ctx_rope)                           # [B, nkv, m, D]
        if cache is not None:
            kc, vc = cache.extend(kc, vc)                                      # [B, nkv, P+m, D]
        kb, vb = self.kv(h, *q_rope)                                           # [B, nkv, Q, D]
        q = self.q_norm(self.q_proj(h).view(B, Q, self.nh, self.hd)).transpose(1, 2)     # [B, nh, Q, D]
        q = apply_rope(q, *q_rope)
        y = attention(q, torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2), mask)   # [B, nh, Q, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, self.nh * self.hd))


class LayerKV:
    """One layer's cached context K/V [B, nkv, P, D] (after k_norm and RoPE)."""

    def __init__(self):
        self.k = self.v = None

    def extend(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class DrafterCache:
    """Context K/V of every drafter layer for positions 0..length-1. Only context positions are ever cached
    (a block's own K/V never is), so speculative decoding only appends accepted positions and never crops."""

    def __init__(self, num_layers: int):
        self.layers = [LayerKV() for _ in range(num_layers)]
        self.length = 0


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):   # silu(gate) * up is recomputed in the backward: only gate and up [B, Q, I] are kept
        g, u = self.gate_proj(x), self.up_proj(x)
        a = checkpoint(_silu_mul, g, u, use_reentrant=False) if torch.is_grad_enabled() else _silu_mul(g, u)
        return self.down_proj(a)


def _silu_mul(g, u):
    return F.silu(g) * u


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig, idx: int):
        super().__init__()
        self.window = cfg.window(idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, ctx, ctx_rope, q_rope, masks: dict, cache: LayerKV | None = None):
        x = x + self.self_attn(_normed(self.input_layernorm, x), ctx, ctx_rope, q_rope, masks[self.window], cache)
        return x + self.mlp(_normed(self.post_attention_layernorm, x))


def _normed(norm: RMSNorm, x):
    """norm(x), in the dtype the projections read it in (autocast's); under grad, recomputed in the backward from x
    (kept anyway) instead of keeping a second [B, Q, H] copy for the projections' weight gradients."""
    if not torch.is_grad_enabled():
        return norm(x)
    return checkpoint(_norm_cast, norm, x, use_reentrant=False)


def _norm_cast(norm, x):
    y = norm(x)
    return y.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else y


def _weight(m) -> torch.Tensor:
    return m if isinstance(m, torch.Tensor) else m.weight


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_tokens, lm_head, embed_scale: float | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed_scale = embed_scale
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.set_target_weights(embed_tokens, lm_head)
        self.reset_parameters()

    # The target's embedding and LM head: a plain tuple, so they are not submodules, not in state_dict, not
    # in parameters(), never moved or copied by .to(); pass the copies on the drafter's device.
    def set_target_weights(self, embed_tokens, lm_head):
        e, w = _weight(embed_tokens), _weight(lm_head)
        if e.shape[-1] != self.cfg.hidden_size or w.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"embedding {tuple(e.shape)} / LM head {tuple(w.shape)} do not match drafter "
                             f"hidden_size {self.cfg.hidden_size}")
        self._target = (e, w)

    @property
    def embed_weight(self) -> torch.Tensor:   # [V, H]
        return self._target[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        return self._target[1]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:   # [..] -> [.., H]: what the target's first layer sees
        x = F.embedding(ids, self.embed_weight)
        return x if self.embed_scale is None else x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02):
        """HF Qwen3 init: linear weights N(0, std), norm weights 1 (seed the global RNG before)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)

    def forward(self, target_hidden: torch.Tensor, input_ids: torch.Tensor, anchors: Anchors,
                backend: str = "sdpa", masks: dict | None = None) -> torch.Tensor:
        """Training: target_hidden [B, S, k*H] (context positions 0..S-1), input_ids [B, S], one block per anchor
        -> hidden [B, Q, H] (Q = A*Bk, after the final norm). `masks` (from make_mask) may be passed when built
        elsewhere; otherwise built here once."""
        S = target_hidden.shape[1]
        if anchors.block_size != self.cfg.block_size:
            raise ValueError(f"anchors have block_size {anchors.block_size}, the drafter {self.cfg.block_size}")
        if masks is None:
            masks = make_mask(anchors, S, backend, self.cfg.windows())
        ids, qpos = build_blocks(input_ids, anchors, self.cfg.mask_token_id)   # [B, Q], [B, Q]
        return self.run(self.embed(ids), qpos, target_hidden, masks)

    def run(self, x: torch.Tensor, qpos: torch.Tensor, target_hidden: torch.Tensor, masks: dict,
            cache: DrafterCache | None = None) -> torch.Tensor:
        """The drafter proper, shared by training and decoding: block embeddings x [B, Q, H] at positions
        qpos [B, Q], conditioned on the features target_hidden [B, m, k*H] of context positions P..P+m-1
        (P = cache.length; 0 without a cache, then the context is all of target_hidden). Keys are
        [context 0..P+m-1 ; blocks]; `masks` come from make_mask(anchors, P+m, ...). Returns [B, Q, H]."""
        cfg = self.cfg
        P = cache.length if cache is not None else 0
        m = target_hidden.shape[1]
        ctx = self.context(target_hidden)                                        # [B, m, H]
        cpos = torch.arange(P, P + m, device=qpos.device)[None]                 # [1, m]
        ctx_rope = rope_cos_sin(cpos, cfg.head_dim, cfg.rope_theta, x.dtype)   # [1, m, D] x2
        q_rope = rope_cos_sin(qpos, cfg.head_dim, cfg.rope_theta, x.dtype)     # [B, Q, D] x2
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, ctx_rope, q_rope, masks, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.length = P + m
        return self.final_norm(x)

    # The two pieces of `run` outside the layers; build_drafter compiles them beside the layers (regional
    # compilation), so their float32 norm work is fused instead of a dozen eager kernels forward and backward.
    def context(self, target_hidden: torch.Tensor) -> torch.Tensor:   # [B, m, k*H] -> [B, m, H]
        return self.hidden_norm(self.fc(target_hidden))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:            # [B, Q, H] -> [B, Q, H], x's dtype
        # in the blocks' dtype (bf16 under autocast): the LM head reads it in that dtype anyway, and no float32
        # [B, Q, H] copy outlives the norm (same values and gradients as rounding it there)
        return self.norm(x).to(x.dtype)

    def new_cache(self) -> DrafterCache:
        return DrafterCache(self.cfg.num_layers)

    @torch.no_grad()
    def draft(self, block_ids: torch.Tensor, target_hidden: torch.Tensor, cache: DrafterCache,
              backend: str = "sdpa") -> torch.Tensor:
        """Speculative decoding, one block per row: target_hidden [B, m, k*H], the features of the positions
        accepted since the last call (P..P+m-1, P = cache.length; appended to the cache); block_ids [B, vs] (the
        anchor token then MASK) at positions start..start+vs-1, start = P+m. The same computation as forward()
        with one anchor at `start` over the whole context. Returns hidden [B, vs, H]."""
        dev = self.fc.weight.device
        block_ids, target_hidden = block_ids.to(dev), target_hidden.to(device=dev, dtype=self.fc.weight.dtype)
        B, vs = block_ids.shape
        start = cache.length + target_hidden.shape[1]
        anchors = Anchors(torch.full((B, 1), start, device=dev), torch.ones(B, 1, dtype=torch.bool, device=dev), vs)
        masks = make_mask(anchors, start, backend, self.cfg.windows())
        qpos = torch.arange(start, start + vs, device=dev).expand(B, vs)
        x = self.embed(block_ids).to(self.fc.weight.dtype)
        return self.run(x, qpos, target_hidden, masks, cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head_weight.t()
