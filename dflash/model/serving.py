"""The serving contract: what the reference package (dflash 0.1.0), vLLM and SGLang read from an exported drafter
folder, as data (`FIELDS`, `ABSENT`, `LAYER_WEIGHTS`), and `check(config, shapes)`, which lists where an export
breaks it. docs/serving.md explains each row and its sources; tests/unit/test_serving_contract.py holds the doc, the
export and this table together.

Sources (read for this table): the PyPI wheels dflash 0.1.0 (`dflash/model.py`), vllm 0.33.0
(`vllm/model_executor/models/qwen3_dflash.py`, `vllm/v1/worker/gpu/spec_decode/dflash/speculator.py`,
`vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`, `vllm/v1/spec_decode/llm_base_proposer.py`) and
sglang 0.5.23 (`sglang/srt/models/dflash.py`, `sglang/srt/speculative/dflash_utils.py`,
`sglang/srt/speculative/dflash_worker_v2.py`, `sglang/srt/models/qwen3.py`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

FULL, SLIDING = "full_attention", "sliding_attention"
STACKS = ("reference", "vllm", "sglang")


def _at(config: dict, key: str):
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def _int(v, low=1):
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


# ---- checks of one field: (value, whole config) -> problem text or None -------------------------------------
def _pos_int(v, c):
    return None if _int(v) else f"must be a positive integer, is {v!r}"


def _eq(expected):
    def check(v, c):
        return None if v == expected else f"must be {expected!r}, is {v!r}"
    return check


def _layer_types(v, c):
    n = c.get("num_hidden_layers")
    if not isinstance(v, list) or len(v) != n or any(t not in (FULL, SLIDING) for t in v):
        return f"must list {FULL!r} or {SLIDING!r} for each of the {n} layers, is {v!r}"
    return None


def _use_sliding_window(v, c):
    sliding = SLIDING in (c.get("layer_types") or [])
    return None if v is sliding else f"must be {sliding} (layer_types {'has' if sliding else 'has no'} sliding layers)"


def _sliding_window(v, c):
    if SLIDING in (c.get("layer_types") or []):
        return None if _int(v) else f"must be the window (an integer >= 1) of the sliding layers, is {v!r}"
    return None if v is None else f"must be null without sliding layers, is {v!r}"


def _block_size(v, c):
    return None if _int(v, 2) else f"must be an integer >= 2, is {v!r}"


def _same_as(key):
    def check(v, c):
        other = _at(c, key)
        return None if v == other else f"must equal {key} ({other!r}), is {v!r}"
    return check


def _target_layer_ids(v, c):
    L = c.get("num_target_layers")
    if not isinstance(v, list) or not v or not all(_int(i, 0) for i in v):
        return f"must be a non-empty list of target layer ids, is {v!r}"
    if _int(L) and max(v) > L - 2:
        return (f"has id {max(v)}, but the target has {L} layers: an id above L-2 = {L - 2} is read after the final "
                "norm by the reference, before it by vLLM, and not at all by SGLang")
    return None


def _mask_token_id(v, c):
    vocab = c.get("vocab_size")
    return None if _int(v, 0) and _int(vocab) and v < vocab else f"must be a token id below vocab_size {vocab}, is {v!r}"


def _mask_token(v, c):
    return None if isinstance(v, str) and v else f"must be the mask token's text in the target tokenizer, is {v!r}"


def _pos_number(v, c):
    return None if isinstance(v, (int, float)) and v > 0 else f"must be a positive number, is {v!r}"


@dataclasses.dataclass(frozen=True)
class Field:
    key: str                                  # dotted path in config.json
    readers: tuple[str, ...]                  # the stacks that read it (STACKS)
    check: Callable[[object, dict], str | None]
    meaning: str


# Every field an export must carry, and what it must hold.
FIELDS: tuple[Field, ...] = (
    Field("architectures", STACKS, _eq(["DFlashDraftModel"]),
          "the model class: vLLM's registry and SGLang's EntryClass map DFlashDraftModel to their DFlash drafter"),
    Field("model_type", STACKS, _eq("qwen3"), "transformers' Qwen3Config parses the file for all three"),
    Field("hidden_size", STACKS, _pos_int, "H: the target's hidden size (embedding and LM head are shared)"),
    Field("num_hidden_layers", STACKS, _pos_int, "drafter layers"),
    Field("num_attention_heads", STACKS, _pos_int, "query heads"),
    Field("num_key_value_heads", STACKS, _pos_int, "key/value heads"),
    Field("head_dim", STACKS, _pos_int, "head size (q_norm/k_norm width)"),
    Field("intermediate_size", STACKS, _pos_int, "MLP width"),
    Field("vocab_size", STACKS, _pos_int, "the target's vocabulary; no reduced draft vocabulary"),
    Field("rms_norm_eps", STACKS, _pos_number, "epsilon of every RMSNorm"),
    Field("max_position_embeddings", STACKS, _pos_int, "RoPE table length"),
    Field("rope_parameters.rope_theta", STACKS, _pos_number, "RoPE base (neox layout, full head_dim)"),
    Field("rope_parameters.rope_type", STACKS, _eq("default"), "plain RoPE, no scaling"),
    Field("hidden_act", ("vllm", "sglang"), _eq("silu"), "MLP activation (the reference hard-codes SiLU)"),
    Field("attention_bias", STACKS, _eq(False), "no q/k/v/o biases"),
    Field("layer_types", STACKS, _layer_types,
          "per layer: full_attention (non-causal) or sliding_attention (causal within the window)"),
    Field("use_sliding_window", ("reference", "sglang"), _use_sliding_window,
          "transformers' Qwen3Config keeps sliding_window only when this is true"),
    Field("sliding_window", STACKS, _sliding_window, "W, the window of the sliding layers (the query included)"),
    Field("block_size", ("reference", "sglang"), _block_size, "B: anchor + B-1 masked positions per draft"),
    Field("dflash_config.block_size", ("reference", "sglang"), _same_as("block_size"),
          "B again; dflash_config wins over the top level"),
    Field("num_target_layers", ("reference", "sglang"), _pos_int, "L: the target's decoder layers"),
    Field("dflash_config.target_layer_ids", STACKS, _target_layer_ids,
          "ids of the target layers whose outputs (hidden_states[id+1]) are concatenated into fc"),
    Field("dflash_config.mask_token_id", STACKS, _mask_token_id, "the token that fills the B-1 masked positions"),
    Field("dflash_config.mask_token", ("sglang",), _mask_token,
          "its text: SGLang refuses a tokenizer whose id for this text differs (default text <|MASK|>)"),
)

# Fields that must be absent: each makes a stack run the drafter differently from how it was trained.
ABSENT: dict[str, str] = {
    "is_causal": "overrides the per-layer causality of layer_types in all three",
    "dflash_config.causal": "vLLM: overrides causality for every layer",
    "dflash_config.use_swa": "vLLM: forces a sliding window on every layer",
    "dflash_config.swa_window_size": "vLLM: window instead of sliding_window",
    "sample_from_anchor": "vLLM/SGLang (DSpark layout): the anchor position would predict",
    "dflash_config.sample_from_anchor": "vLLM refuses it for DFlash; the anchor position is not a prediction",
    "draft_vocab_size": "vLLM: a reduced draft vocabulary with its own lm_head and d2t map",
    "has_own_lm_head": "vLLM: keeps an LM head of the drafter instead of the target's",
    "eagle_aux_hidden_state_layer_ids": "vLLM: read before dflash_config.target_layer_ids (other id semantics)",
    "target_hidden_size": "vLLM: fc input width from it instead of hidden_size",
    "use_aux_hidden_state": "vLLM: false drops fc and the target features",
    "dflash_config.use_aux_hidden_state": "vLLM: false drops fc and the target features",
    "logit_scale": "vLLM: scales the draft logits",
    "dflash_config.output_multiplier": "reference/SGLang: scales the draft logits",
    "dflash_config.final_logit_softcapping": "reference/SGLang: soft-caps the draft logits",
    "dflash_config.input_embedding_scale": "reference: scales the block's embeddings",
    "dflash_config.attention_value_scale": "vLLM/SGLang: scales V",
    "dflash_config.attention_sink_bias": "vLLM/SGLang: per-head attention sinks (weights we do not train)",
    "dflash_config.conv_kernel_size": "SGLang/reference DFlash2: grouped convolutions",
    "dflash_config.projector_type": "SGLang: Domino projector",
    "is_neox_style": "vLLM: false switches RoPE to the interleaved layout",
    "rope_is_neox_style": "SGLang: false switches RoPE to the interleaved layout",
    "use_gemma_norm": "SGLang: (1 + w) RMSNorm",
    "has_embed_tokens": "SGLang: the drafter's own embedding (Nemotron 3.5 layout)",
}

# The weights of model.safetensors: per drafter layer, then the three shared tensors; shapes in terms of
# H hidden, I intermediate, Q = heads * head_dim, KV = kv heads * head_dim, D head_dim, K = len(target_layer_ids).
LAYER_WEIGHTS: dict[str, tuple[str, ...]] = {
    "input_layernorm.weight": ("H",),
    "self_attn.q_proj.weight": ("Q", "H"),
    "self_attn.k_proj.weight": ("KV", "H"),
    "self_attn.v_proj.weight": ("KV", "H"),
    "self_attn.o_proj.weight": ("H", "Q"),
    "self_attn.q_norm.weight": ("D",),
    "self_attn.k_norm.weight": ("D",),
    "post_attention_layernorm.weight": ("H",),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
}
SHARED_WEIGHTS: dict[str, tuple[str, ...]] = {"fc.weight": ("H", "KH"), "hidden_norm.weight": ("H",),
                                              "norm.weight": ("H",)}


def weight_names(num_layers: int) -> list[str]:
    """The exact tensor names of an exported drafter with `num_layers` layers (sorted)."""
    return sorted([*SHARED_WEIGHTS, *(f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_WEIGHTS)])


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor an export of `config` (a config.json dict) must hold."""
    H, D = config["hidden_size"], config["head_dim"]
    dims = {"H": H, "I": config["intermediate_size"], "D": D, "Q": config["num_attention_heads"] * D,
            "KV": config["num_key_value_heads"] * D,
            "KH": len(config["dflash_config"]["target_layer_ids"]) * H}
    shapes = {k: tuple(dims[d] for d in s) for k, s in SHARED_WEIGHTS.items()}
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"layers.{i}.{k}": tuple(dims[d] for d in s) for k, s in LAYER_WEIGHTS.items()})
    return shapes


def check(config: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Where an export (its config.json dict and its tensors' name -> shape) breaks the contract; [] if nowhere."""
    problems = []
    for f in FIELDS:
        v = _at(config, f.key)
        if v is _MISSING:
            problems.append(f"config.json: {f.key} is missing (read by {', '.join(f.readers)}: {f.meaning})")
        elif (why := f.check(v, config)) is not None:
            problems.append(f"config.json: {f.key} {why}")
    problems += [f"config.json: {k} must be absent ({why})" for k, why in ABSENT.items()
                 if _at(config, k) is not _MISSING]
    if problems:   # the weights' shapes follow from a config that holds
        return problems
    expected = weight_shapes(config)
    for name in sorted(set(expected) - set(shapes)):
        problems.append(f"model.safetensors: {name} is missing")
    for name in sorted(set(shapes) - set(expected)):
        problems.append(f"model.safetensors: {name} is not a drafter weight (vLLM would load embed_tokens/lm_head/"
                        "d2t as the drafter's own; SGLang ignores unknown names)")
    for name in sorted(set(shapes) & set(expected)):
        if tuple(shapes[name]) != expected[name]:
            problems.append(f"model.safetensors: {name} has shape {tuple(shapes[name])}, config.json says "
                            f"{expected[name]}")
    return problems
