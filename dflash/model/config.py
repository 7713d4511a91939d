"""DrafterConfig: the drafter's shape, built from the target's HF config and the `drafter` config section.

The reference format (z-lab `dflash` 0.1.0, `DFlashDraftModel`) is a Qwen3 config.json plus `block_size`,
`num_target_layers` (the number of decoder layers of the *target*) and
`dflash_config: {mask_token_id, target_layer_ids}`; `to_hf_dict` / `from_hf_dict` convert both ways.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dflash.config import ConfigError
from dflash.config_model import DrafterSection, drafter_misfit

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FULL, SLIDING = "full_attention", "sliding_attention"


def default_target_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """k target layer ids spread uniformly over 1..L-3 (L = the target's decoder layers), rounded as the
    reference does (Python round, i.e. half to even); k == 1 takes the middle layer L // 2."""
    if k < 1:
        raise ValueError(f"need at least one target layer, got k={k}")
    if k == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (k - 1))) for i in range(k)]


def default_gamma(block_size: int) -> float:
    """Loss decay of exp(-(k-1)/gamma): 7 for block 16, scaled linearly with the number of predicted
    positions (block_size - 1): gamma = 7 * (block_size - 1) / 15."""
    return 7.0 * (block_size - 1) / 15.0


def _rope_theta(d: dict) -> float:
    """The RoPE base of an HF config as a dict: `rope_parameters` (transformers 5), `rope_scaling`, or the older
    top-level `rope_theta` (the transformers default 10000 when none is given)."""
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    return float(theta if theta is not None else d.get("rope_theta", 10000.0))


def _layer_layout(d: dict, num_layers: int) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of a reference config.json as the inference stacks read it (transformers'
    Qwen3Config: the window counts only with use_sliding_window; without layer_types, layers from
    max_window_layers on slide). Settings that would run layers differently from ours are refused."""
    dc = d.get("dflash_config") or {}
    for key, value in (("is_causal", d.get("is_causal")), ("dflash_config.causal", dc.get("causal")),
                       ("dflash_config.use_swa", dc.get("use_swa")),
                       ("dflash_config.swa_window_size", dc.get("swa_window_size"))):
        if value is not None:
            raise ValueError(f"{key}={value!r} is not supported: layer attention follows layer_types (sliding layers "
                             "causal within the window, full layers bidirectional)")
    window = d.get("sliding_window", 4096) if d.get("use_sliding_window") else None
    types = d.get("layer_types")
    if types is None and window is not None:
        mwl = int(d.get("max_window_layers", 28))
        types = [SLIDING if i >= mwl else FULL for i in range(num_layers)]
    if types is not None and SLIDING in types and window is None:
        raise ValueError("layer_types has sliding_attention layers but use_sliding_window is not true (the inference "
                         "stacks would run them without a window)")
    if types is not None and SLIDING not in types:
        window = None
    return (list(types) if types is not None else None), window


@dataclasses.dataclass
class DrafterConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int                 # decoder layers of the TARGET (config.json `num_target_layers`)
    block_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    # per layer: full_attention | sliding_attention; None: every layer slides when sliding_window is set (one window on
    # every layer, the speculators default), every layer is full otherwise
    layer_types: list[str] | None = None
    sliding_window: int | None = None

    def __post_init__(self):
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = [SLIDING if self.sliding_window else FULL] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers")
        bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
        if bad:
            raise ValueError(f"unknown layer type {bad[0]!r} (allowed: {FULL}, {SLIDING})")
        if SLIDING in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need drafter.sliding_window")
        if self.sliding_window is not None and int(self.sliding_window) < 1:
            raise ValueError(f"sliding_window must be at least 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty")
        for i in self.target_layer_ids:
            if not 0 <= i < self.num_target_layers:
                raise ValueError(f"target layer id {i} is outside the target's {self.num_target_layers} layers")

    @property
    def num_context_layers(self) -> int:   # k: target layers fused by fc
        return len(self.target_layer_ids)

    def window(self, layer: int) -> int | None:
        """The sliding window of drafter layer `layer` (None for full attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def windows(self) -> tuple[int | None, ...]:
        """The distinct windows used by the layers (None = full): one mask each."""
        return tuple(dict.fromkeys(self.window(i) for i in range(self.num_layers)))

    # ---- construction --------------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target_config: PretrainedConfig, drafter: DrafterSection | dict | None = None,
                    mask_token_id: int | None = None) -> "DrafterConfig":
        """The drafter of the config's `drafter` section (a dict is read as that section: its missing keys take the
        section's defaults) for a target of `target_config` (its HF config): sizes left null come from the target;
        hidden_size must equal the target's (the embedding and LM head are shared)."""
        sec = drafter if isinstance(drafter, DrafterSection) else DrafterSection.model_validate(drafter or {})
        t = target_config
        if sec.hidden_size is not None and sec.hidden_size != t.hidden_size:
            raise ValueError(f"drafter.hidden_size {sec.hidden_size} must equal the target's hidden_size "
                             f"{t.hidden_size} (the drafter uses the target's embedding and LM head)")
        why = drafter_misfit(sec, t.vocab_size, t.num_attention_heads, t.num_key_value_heads, "the target")
        if why:
            raise ConfigError(why)
        heads = sec.num_attention_heads or t.num_attention_heads
        mask_id = sec.mask_token_id if sec.mask_token_id is not None else mask_token_id
        if mask_id is None:
            raise ValueError("drafter.mask_token_id is null and no mask token id was given (the tokenizer needs "
                             "a mask token)")
        ids, L = sec.target_layer_ids, t.num_hidden_layers
        if ids is None:
            ids = default_target_layer_ids(L, sec.num_target_layers)
            if not all(0 <= i < L for i in ids):
                raise ConfigError(f"drafter.num_target_layers ({sec.num_target_layers}) spreads the ids {ids} over a "
                                  f"target of {L} layers: give drafter.target_layer_ids (ids 0-{L - 1})")
        past = [i for i in ids if i >= L]
        if past:
            raise ConfigError(f"drafter.target_layer_ids has id {past[0]}, past the {L} layers of the target "
                              f"(ids 0-{L - 1})")
        return cls(
            vocab_size=t.vocab_size,
            hidden_size=t.hidden_size,
            num_layers=sec.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=sec.num_key_value_heads or t.num_key_value_heads,
            # head_dim: not every architecture's config has one (hidden / heads then)
            head_dim=sec.head_dim or getattr(t, "head_dim", None) or t.hidden_size // heads,
            intermediate_size=sec.intermediate_size or t.intermediate_size,
            target_layer_ids=list(ids),
            mask_token_id=int(mask_id),
            num_target_layers=t.num_hidden_layers,
            block_size=sec.block_size,
            # LFM2 names it norm_eps
            rms_norm_eps=float(getattr(t, "rms_norm_eps", None) or getattr(t, "norm_eps", None) or 1e-6),
            rope_theta=_rope_theta(t.to_dict()),
            max_position_embeddings=t.max_position_embeddings,
            layer_types=list(sec.layer_types) if sec.layer_types is not None else None,
            sliding_window=sec.sliding_window,
        )

    # ---- reference config.json ----------------------------------------------------------------------------
    def to_hf_dict(self, extra: dict | None = None) -> dict[str, Any]:
        """The reference config.json: a Qwen3 config + DFlash fields (read by dflash 0.1.0, SGLang, vLLM)."""
        sliding = SLIDING in self.layer_types
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "tie_word_embeddings": False,
            "use_cache": True,
            "dtype": "bfloat16",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "max_window_layers": self.num_layers,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "mask_token_id": self.mask_token_id,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "block_size": self.block_size,
            },
        }
        if extra:
            d.update(extra)
        return d

    @classmethod
    def from_hf_dict(cls, d: dict) -> "DrafterConfig":
        dc = d.get("dflash_config") or {}
        num_layers = int(d["num_hidden_layers"])
        ids = dc.get("target_layer_ids", d.get("target_layer_ids"))
        L = d.get("num_target_layers")
        if ids is None:
            if L is None:
                raise ValueError("config.json has neither dflash_config.target_layer_ids nor num_target_layers")
            ids = default_target_layer_ids(int(L), num_layers)   # the reference's fallback: k = drafter layers
        if L is None:
            L = max(ids) + 4
        mask_id = dc.get("mask_token_id", d.get("mask_token_id"))
        if mask_id is None:
            raise ValueError("config.json has no dflash_config.mask_token_id")
        layer_types, sliding = _layer_layout(d, num_layers)
        heads = int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            intermediate_size=int(d["intermediate_size"]),
            target_layer_ids=list(ids),
            mask_token_id=int(mask_id),
            num_target_layers=int(L),
            block_size=int(dc.get("block_size", d.get("block_size", 16))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(d),
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            layer_types=layer_types,
            sliding_window=sliding,
        )

