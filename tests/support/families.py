"""The family matrix's targets and checks: a tiny random-weight target of every family (dflash.families), written by
the target stage's own builder (tokenizer trained locally, safetensors) and loaded by `load_target` (the real
`from_pretrained` of the folder); a run context over it from a config file, as the train stage prepares one."""
from pathlib import Path

import torch
import yaml

from dflash.families import FAMILIES

ARCH = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": 320, "num_hidden_layers": 4, "max_position_embeddings": 512, "sliding_window": 8}
DRAFTER = {"num_layers": 1, "block_size": 4, "num_target_layers": 2, "target_layer_ids": [1, 2]}   # ids <= L-2


def build(family: str, root: Path) -> Path:
    """target.path of a tiny `family` target under root (the target stage's builder, no pre-training)."""
    from dflash.config_model import TargetSection
    from dflash.data.tiny_target import build_target
    out = root / family
    cfg = TargetSection.model_validate({"path": str(out), "build": "tiny", "pretrain": {"steps": 0},
                                        "arch": {"family": family, **ARCH}})
    build_target(cfg, out, corpus_size=200, progress=False)
    return out


def context(path: Path, tmp: Path, **drafter):
    """The train stage's RunContext for a target folder (no data), and the loaded target."""
    from dflash import config as C
    from dflash.target import load_target
    from dflash.train.context import prepare
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = tmp / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "results_dir": str(tmp / "results"), "run_name": "t",
        "target": {"path": str(path), "build": "tiny", "arch": {"family": path.name, **ARCH},
                   "attn_implementation": FAMILIES[path.name].attention[0]},
        "drafter": {**DRAFTER, **drafter},
        "train": {"targets": ["cpu"], "drafters": ["cpu"], "attention": "sdpa", "compile": False, "num_anchors": 8,
                  "loss_chunk": 64}}))
    ctx = prepare(C.load(cfg), need_data=False)
    return ctx, load_target(ctx.cfg.target, "cpu")


def hidden_states(model, ids) -> tuple:
    with torch.inference_mode():
        return model(input_ids=ids, output_hidden_states=True, use_cache=False)


def capture_problem(model, ids, layer_ids) -> str | None:
    """The train stage's capture (forward hooks) against the model's own output_hidden_states[id + 1]."""
    from dflash.train.features import LayerCapture
    cap = LayerCapture(model, layer_ids)
    try:
        got = cap(ids)
    finally:
        cap.remove()
    hs = hidden_states(model, ids).hidden_states
    want = torch.cat([hs[i + 1] for i in layer_ids], -1)
    if got.shape != want.shape or not torch.allclose(got, want, atol=1e-6, rtol=0):
        diff = (got - want).abs().max().item() if got.shape == want.shape else f"shape {tuple(got.shape)}"
        return f"capture of {layer_ids} differs from hidden_states (max diff {diff})"
    return None


def first_layer_input(model, ids) -> torch.Tensor:
    """What the target's first decoder layer receives for `ids`."""
    from dflash.train.features import decoder_layers
    seen = {}

    def hook(module, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).clone()
    h = decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        hidden_states(model, ids)
    finally:
        h.remove()
    return seen["x"]


def softcap(logits, config):
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if not cap else torch.tanh(logits / cap) * cap
