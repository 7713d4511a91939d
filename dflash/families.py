"""Target families: what each architecture the serving engines serve is to a DFlash trainer, as data.

`FAMILIES[model_type]` is a `Family`:
- `config` (the transformers config class) and `tiny(arch)`: the keys beyond `target.arch`'s shape a tiny target of
  the family needs (the target stage builds one: `target.arch.family`);
- `cache`: what the target's decoding cache holds, which decides how speculative decoding rolls a rejected draft
  back (dflash/evaluate/specdec.py): `kv` (every layer attends over the whole past: crop), `sliding` (some layers keep
  a window: crop with the past recorded), `conv` (short-convolution layers keep their last inputs: crop them with the
  past recorded), `recurrent` (linear-attention layers carry a state that no crop can undo: snapshot before verifying,
  restore and re-run the accepted tokens);
- `moe`: its MLPs are mixtures of experts (a captured layer's output is the sum over its routed experts);
- `final_norm`: the decoder's attribute holding the norm the LM head reads (feature id L-1 is its output);
- `embed_scale(config)`: the factor by which the target's first layer sees its token embeddings scaled (Gemma:
  sqrt(hidden_size)); the drafter embeds its block the same way (`DFlashDrafter(embed_scale=)`);
- `serving`: per engine, whether it accepts a DFlash drafter for a target of this family, read from the released code
  (docs/targets.md names the files): vLLM 0.33.0 needs the target class to implement `SupportsEagle3` (its auxiliary
  hidden states; `gpu_model_runner._setup_eagle3_aux_hidden_state_outputs` refuses others), SGLang 0.5.23 needs
  `set_dflash_layers_to_capture` (`configure_aux_hidden_state_capture` refuses others), the reference `dflash` 0.1.0
  runs any transformers target through `target.model.embed_tokens`, `target.lm_head` and a cropped `DynamicCache`;
- `limits`: what is known not to work.

Every engine that accepts a drafter reads `dflash_config.target_layer_ids` with the same rule for every family
(`TARGET_LAYER_IDS`): ids 0..L-2 mean the same in all three; L-1 does not (docs/serving.md).

`check_config(config)`, `check_json(config.json as a dict)` (at config load, dflash.config.check_here): why a target
cannot be trained on here (one line naming what is missing), or None.
`check_model(model)`: the same for a loaded target, and that its first layer sees the embedding `embed_scale` says.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

ENGINES = ("reference", "vllm", "sglang")
KV, SLIDING, CONV, RECURRENT = "kv", "sliding", "conv", "recurrent"
TARGET_LAYER_IDS = {
    "reference": "hidden_states[id + 1] (`extract_context_feature`): the output of layer id, after the final norm for "
                 "id L-1",
    "vllm": "auxiliary layer id + 1 (`get_eagle3_aux_layers_from_config`): hidden + residual after layer id, before "
            "the final norm for id L-1",
    "sglang": "the input of layer id + 1 (`set_dflash_layers_to_capture`): ids 0..L-2 only, L-1 is never captured",
}
MAX_SERVED_ID = -2   # every engine agrees on ids 0..L-2: the export warns past it (dflash.model.serving)


@dataclasses.dataclass(frozen=True)
class Serving:
    accepts: bool
    why: str          # where the engine's code says so


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    label: str                      # what users call it
    config: str                     # transformers config class
    cache: str                      # KV | SLIDING | RECURRENT
    moe: bool
    serving: dict[str, Serving]
    tiny: Callable = lambda arch: {}
    attention: tuple[str, ...] = ("sdpa", "eager")   # the target.attn_implementation values transformers runs it with
    final_norm: str = "norm"
    embed_scale: Callable = lambda config: None
    limits: tuple[str, ...] = ()


def _sqrt_hidden(config) -> float:
    return float(config.hidden_size) ** 0.5


def _ref(ok=True, why="`dflash_generate`: `target.model.embed_tokens`, `target.lm_head`, `DynamicCache.crop`"):
    return Serving(ok, why)


def _vllm(cls, ok=True):
    return Serving(ok, f"`{cls}` {'implements' if ok else 'does not implement'} `SupportsEagle3`")


def _sglang(cls, ok=True):
    return Serving(ok, f"`{cls}` {'has' if ok else 'has no'} `set_dflash_layers_to_capture`")


def _moe(arch, experts="num_experts", size="moe_intermediate_size"):
    out = {experts: arch.num_experts, "num_experts_per_tok": arch.experts_per_token}
    return {**out, size: arch.intermediate_size} if size else out


def _sliding(arch, **pattern):
    return {"sliding_window": arch.sliding_window, **pattern}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("llama", "Llama 3.x", "LlamaConfig", KV, False,
           {"reference": _ref(), "vllm": _vllm("LlamaForCausalLM"), "sglang": _sglang("LlamaForCausalLM")}),
    Family("qwen2", "Qwen2 / Qwen2.5", "Qwen2Config", KV, False,
           {"reference": _ref(), "vllm": _vllm("Qwen2ForCausalLM"), "sglang": _sglang("Qwen2ForCausalLM", False)},
           limits=("SGLang 0.5.23 does not serve a DFlash drafter for it (no capture hook in `models/qwen2.py`)",)),
    Family("qwen3", "Qwen3", "Qwen3Config", KV, False,
           {"reference": _ref(), "vllm": _vllm("Qwen3ForCausalLM"), "sglang": _sglang("Qwen3ForCausalLM")}),
    Family("qwen3_moe", "Qwen3-MoE (30B-A3B, 235B-A22B)", "Qwen3MoeConfig", KV, True,
           {"reference": _ref(), "vllm": _vllm("Qwen3MoeForCausalLM"), "sglang": _sglang("Qwen3MoeForCausalLM")},
           tiny=lambda a: {**_moe(a), "decoder_sparse_step": 1, "norm_topk_prob": True}),
    Family("gemma3_text", "Gemma 3 (text)", "Gemma3TextConfig", SLIDING, False,
           {"reference": _ref(), "vllm": _vllm("Gemma3ForCausalLM", False),
            "sglang": _sglang("Gemma3ForCausalLM", False)},
           tiny=lambda a: {**_sliding(a, sliding_window_pattern=2), "query_pre_attn_scalar": a.head_dim,
                           "rope_parameters": {"full_attention": _rope(a.rope_theta),
                                               "sliding_attention": _rope(10000.0)}},
           embed_scale=_sqrt_hidden,
           limits=("vLLM 0.33.0 and SGLang 0.5.23 serve no DFlash drafter for it: the reference package only",
                   "a target with final_logit_softcapping: train.objective ce only (the KL teacher is not capped)")),
    Family("mistral", "Mistral", "MistralConfig", SLIDING, False,
           {"reference": _ref(), "vllm": _vllm("MistralForCausalLM"), "sglang": _sglang("MistralForCausalLM")},
           tiny=lambda a: _sliding(a)),
    Family("gpt_oss", "GPT-OSS (20B, 120B)", "GptOssConfig", SLIDING, True,
           {"reference": _ref(), "vllm": _vllm("GptOssForCausalLM"), "sglang": _sglang("GptOssForCausalLM")},
           tiny=lambda a: {**_moe(a, "num_local_experts", None), **_sliding(a),
                           "rope_parameters": _rope(a.rope_theta)},
           attention=("eager",),
           limits=("target.attn_implementation eager: transformers has no sdpa path with its attention sinks",
                   "its MXFP4 checkpoints load dequantized to bfloat16 on a CPU and without the `kernels` package "
                   "(transformers' Mxfp4HfQuantizer): served precision needs a GPU",)),
    Family("qwen3_next", "Qwen3-Next (hybrid: gated DeltaNet + attention, MoE)", "Qwen3NextConfig", RECURRENT, True,
           {"reference": _ref(False, "`dflash_generate` crops a `DynamicCache`: a gated DeltaNet layer's recurrent "
                                     "state is not cropped, so a rejected draft stays in it (not lossless)"),
            "vllm": _vllm("Qwen3NextForCausalLM"), "sglang": _sglang("Qwen3NextForCausalLM")},
           tiny=lambda a: {**_moe(a), "shared_expert_intermediate_size": a.intermediate_size,
                           "linear_num_value_heads": a.num_attention_heads,
                           "linear_num_key_heads": a.num_key_value_heads, "linear_key_head_dim": a.head_dim,
                           "linear_value_head_dim": a.head_dim, "full_attention_interval": 2},
           limits=("the reference package's decoding is not lossless on it (recurrent state cropped): vLLM or SGLang",
                   "speculative decoding here re-runs the accepted tokens after a rejection (one more target forward)",
                   "data.regenerate.decoder static (the GPU default) holds no recurrent state: regeneration uses "
                   "generate")),
    Family("lfm2", "LFM2 (hybrid: short convolutions + attention)", "Lfm2Config", CONV, False,
           {"reference": _ref(), "vllm": _vllm("Lfm2ForCausalLM", False), "sglang": _sglang("Lfm2ForCausalLM")},
           tiny=lambda a: {"block_auto_adjust_ff_dim": False,
                           "full_attn_idxs": list(range(1, a.num_hidden_layers, 2))},
           final_norm="embedding_norm",
           limits=("vLLM 0.33.0 serves no DFlash drafter for it (Lfm2ForCausalLM lacks SupportsEagle3)",
                   "data.regenerate.decoder static (the GPU default) holds no convolution state: regeneration uses "
                   "generate")),
)}


def family(config) -> Family | None:
    """The family of a transformers config (its `model_type`), None for one outside the matrix."""
    return FAMILIES.get(getattr(config, "model_type", None))


def hf_config(arch, **keys):
    """The transformers config of a tiny target of `arch` (an ArchSection) in its family, plus `keys`."""
    import transformers
    fam = FAMILIES[arch.family]
    kw = dict(vocab_size=arch.vocab_size, hidden_size=arch.hidden_size, intermediate_size=arch.intermediate_size,
              num_hidden_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
              num_key_value_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
              max_position_embeddings=arch.max_position_embeddings, rope_parameters=_rope(arch.rope_theta))
    return getattr(transformers, fam.config)(**{**kw, **fam.tiny(arch), **keys})


def _rope(theta) -> dict:
    return {"rope_type": "default", "rope_theta": float(theta)}


def final_norm(model):
    """The target's final norm module (what its LM head reads; feature id L-1 is its output), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    fam = family(model.config)
    return getattr(decoder, fam.final_norm if fam is not None else "norm", None)


def embed_scale(config) -> float | None:
    """The factor by which the target's first layer sees its embeddings scaled, None for none."""
    fam = family(config)
    return fam.embed_scale(config) if fam is not None else None


REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")


def check_json(d: dict, attn: str | None = None, sizes: bool = True) -> str | None:
    """Why a target of this config.json (as read, a dict: at config load, without transformers) cannot be trained on
    here with target.attn_implementation `attn`, in one line naming what is missing, or None; `sizes`: its REQUIRED
    keys too (at config load the stages' own checks name a missing size, dflash.config.check_here)."""
    name = f"target model_type {d.get('model_type')!r}"
    if d.get("text_config") is not None and d.get("num_hidden_layers") is None:
        return (f"{name}: a multimodal config (its decoder is text_config); point target.path at the text model "
                f"(e.g. a *ForCausalLM folder) instead")
    missing = [k for k in REQUIRED if d.get(k) is None] if sizes else []
    if missing:
        return f"{name}: its config has no {missing[0]} (the drafter reads {', '.join(REQUIRED)})"
    fam = FAMILIES.get(d.get("model_type"))
    if attn is not None and fam is not None and attn not in fam.attention:
        return (f"{name} ({fam.label}) runs with target.attn_implementation {' or '.join(fam.attention)} only, not "
                f"{attn}: set target.attn_implementation: {fam.attention[0]}")
    if d.get("final_logit_softcapping") and fam is None:
        return f"{name}: soft-capped logits (final_logit_softcapping) in a family outside the matrix (docs/targets.md)"
    return None


def check_config(config, attn: str | None = None) -> str | None:
    """check_json on a transformers config, and that transformers has a causal-LM class for it. Families outside the
    matrix pass when they have what the drafter reads."""
    from transformers import AutoModelForCausalLM
    why = check_json({k: getattr(config, k, None) for k in (*REQUIRED, "model_type", "text_config",
                                                            "final_logit_softcapping")}, attn)
    if why is None and type(config) not in AutoModelForCausalLM._model_mapping:
        why = (f"target model_type {getattr(config, 'model_type', None)!r}: transformers has no AutoModelForCausalLM "
               f"class for it (trust_remote_code off?)")
    return why


def check_model(model) -> str | None:
    """Why a loaded target cannot be trained on here (check_config, a decoder without `layers`, a first layer that sees
    its embeddings otherwise than F.embedding(ids, W) * embed_scale), or None. Runs the embedding and stops before the
    first layer: a few tokens, no layer computed."""
    import torch
    import torch.nn.functional as F
    why = check_config(model.config)
    if why:
        return why
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return f"target {type(model).__name__}: its decoder has no `layers` list to capture from"
    seen = {}

    class Stop(Exception):
        pass

    def hook(module, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        raise Stop

    for what, m in (("embedding", model.get_input_embeddings()), ("LM head", model.get_output_embeddings())):
        t = getattr(m, "weight", None)
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.element_size() < 2:
            return (f"target {type(model).__name__}: its {what} is not a float tensor ({getattr(t, 'dtype', None)}); "
                    f"the drafter shares it: keep it out of the checkpoint's quantization (modules_to_not_convert)")
    w = model.get_input_embeddings().weight
    ids = torch.arange(min(4, w.shape[0]), device=w.device)[None]
    h = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            decoder(input_ids=ids, use_cache=False)
    except Stop:
        pass
    finally:
        h.remove()
    x = F.embedding(ids, w)
    scale = embed_scale(model.config)
    if scale is not None:
        x = x * torch.tensor(scale, dtype=torch.float32).to(x.dtype)   # as Gemma's scaled embedding rounds it
    if "x" not in seen or not torch.equal(seen["x"], x):
        got = (seen["x"].float().norm() / F.embedding(ids, w).float().norm()).item() if "x" in seen else None
        return (f"target {type(model).__name__}: its first layer sees its embeddings scaled by {got:.6g}, not "
                f"{scale or 1.0:.6g} (dflash.families: add its family with embed_scale)")
    return None
