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


def quantized_copy(src: Path, out: Path, method: str) -> dict:
    """A copy of the built target `src` as a quantized checkpoint transformers loads: `fp8` (block-wise float8_e4m3fn
    weights of every decoder Linear with float32 `weight_scale_inv` per 16 x 16 block, as Qwen3-*-FP8 ships at 128 x
    128) or `mxfp4` (GPT-OSS's experts as 4-bit E2M1 values in blocks of 32 with an E8M0 exponent each, `_blocks` and
    `_scales`). Returns {parameter: the float32 weight the checkpoint encodes}."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, out)
    (out / "build.json").unlink()
    sd, q, want = load_file(str(src / "model.safetensors")), {}, {}
    for k, w in sd.items():
        if method == "fp8" and ".layers." in k and k.endswith("proj.weight"):
            r, c = w.shape
            blocks = w.reshape(r // 16, 16, c // 16, 16)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0
            qw = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
            q[k], q[k.replace("weight", "weight_scale_inv")] = qw.reshape(r, c), scale.float().contiguous()
            want[k] = (qw.float() * scale[:, None, :, None]).reshape(r, c)
        elif method == "mxfp4" and k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q[k + "_blocks"], q[k + "_scales"], want[k] = _mxfp4(w)
        else:
            q[k] = w
    save_file(q, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]} if method == "fp8" else
        {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]})
    (out / "config.json").write_text(json.dumps(cfg))
    return want


_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mxfp4(w):
    """GptOssExperts' [E, in, out] weight -> blocks [E, out, in/32, 16] (two E2M1 codes a byte, low nibble first),
    scales [E, out, in/32] (E8M0: exponent + 127), and the weight those encode."""
    g = w.transpose(1, 2).float().reshape(*w.shape[:1], w.shape[2], w.shape[1] // 32, 32)
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    x = g / torch.exp2(e)[..., None]
    code = ((x.abs()[..., None] - _E2M1).abs().argmin(-1) + 8 * (x < 0)).to(torch.uint8)
    value = _E2M1[(code % 8).long()] * (1 - 2 * (code >= 8).float()) * torch.exp2(e)[..., None]
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
    return blocks, (e + 127).to(torch.uint8).contiguous(), value.reshape(g.shape[:2] + (-1,)).transpose(1, 2)


REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / ".venv-interop" / "bin" / "python"   # the published reference package's side venv (make interop)


def reference_problem() -> str | None:
    """Why the reference package's side venv cannot run here (None: it can)."""
    import os
    import subprocess
    if not REFERENCE.exists():
        return "side venv .venv-interop not built (`make interop` builds it: needs the package index for dflash==0.1.0)"
    probe = subprocess.run([str(REFERENCE), "-c", "from dflash import DFlashDraftModel"], cwd="/", capture_output=True,
                           text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    return None if probe.returncode == 0 else f".venv-interop cannot import the reference: {probe.stderr[-300:]}"


def run_reference(script: str, out: Path):
    import os
    import subprocess
    return subprocess.run([str(REFERENCE), str(REPO / "tests" / "interop" / script), str(out)], cwd=out,
                          capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
