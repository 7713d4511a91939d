"""Reference-format drafter directories: config.json + model.safetensors (keys exactly as DFlashDraftModel names
them; no embedding, no LM head), written atomically with the modes the umask gives (safetensors alone writes 0600);
loaded with safetensors only."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..atomic import atomic_dir
from .config import DrafterConfig
from .drafter import DFlashDrafter
from .serving import check, weight_names

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def reference_keys(num_layers: int) -> list[str]:
    """The exact tensor names of a reference DFlash drafter with `num_layers` layers (sorted)."""
    return weight_names(num_layers)


def reference_config(cfg: DrafterConfig, extra: dict | None = None, dtype: torch.dtype | str | None = None,
                     mask_token: str | None = None) -> dict:
    """The config.json dict of a drafter directory in the reference format (read by dflash 0.1.0, SGLang and
    vLLM): a Qwen3 config with the DFlash fields and the layer layout (`layer_types`, `sliding_window`,
    `use_sliding_window`). `extra` adds keys; `dtype` is the weights' dtype as written (default bfloat16);
    `mask_token` (the text of `mask_token_id` in the target's tokenizer) goes to `dflash_config.mask_token`, which
    SGLang checks against the tokenizer (docs/serving.md)."""
    config = cfg.to_hf_dict(extra)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    if mask_token is not None:
        config["dflash_config"] = {**config["dflash_config"], "mask_token": mask_token}
    return config


def write_drafter(drafter: DFlashDrafter, folder, extra: dict | None = None, dtype: torch.dtype | None = None,
                  mask_token: str | None = None) -> Path:
    """Write config.json and model.safetensors into `folder` (the caller makes it atomic). `extra` adds keys to
    config.json; `dtype` casts the weights (default: as they are); `mask_token` as in `reference_config`."""
    from safetensors.torch import save_file
    sd = drafter.state_dict()
    expected = reference_keys(drafter.cfg.num_layers)
    if sorted(sd) != expected:
        raise RuntimeError(f"drafter state_dict keys differ from the reference: "
                           f"extra {sorted(set(sd) - set(expected))}, missing {sorted(set(expected) - set(sd))}")
    tensors = {k: (v.to(dtype) if dtype is not None else v).detach().cpu().contiguous() for k, v in sd.items()}
    config = reference_config(drafter.cfg, extra, dtype or next(iter(tensors.values())).dtype, mask_token)
    folder = Path(folder)
    save_file(tensors, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return folder


def save_drafter(drafter: DFlashDrafter, out_dir, extra: dict | None = None, dtype: torch.dtype | None = None,
                 mask_token: str | None = None) -> Path:
    """`write_drafter` into `out_dir`, replaced in one rename, its files' modes as the umask gives."""
    with atomic_dir(out_dir) as tmp:
        write_drafter(drafter, tmp, extra, dtype, mask_token)
    return Path(out_dir)


def load_drafter(path, embed_tokens, lm_head, device=None, dtype: torch.dtype | None = None,
                 embed_scale: float | None = None) -> DFlashDrafter:
    """A DFlashDrafter from a reference-format directory (safetensors only); `embed_scale`: the target's."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    cfg_file, w_file = path / CONFIG, path / WEIGHTS
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing (a drafter directory holds {CONFIG} and {WEIGHTS})")
    try:
        cfg = DrafterConfig.from_hf_dict(json.loads(cfg_file.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{cfg_file}: not a DFlash drafter config: {e}") from None
    try:
        sd = load_file(str(w_file), device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{w_file}: cannot read safetensors: {e}") from None
    expected = set(reference_keys(cfg.num_layers))
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"{w_file}: weights do not match {cfg_file} ({cfg.num_layers} layers): "
                         f"missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    drafter = DFlashDrafter(cfg, embed_tokens, lm_head, embed_scale)
    try:
        drafter.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{w_file}: {e}") from None
    if device is not None or dtype is not None:
        drafter.to(device=device, dtype=dtype)
    return drafter


def serving_problems(path) -> list[str]:
    """Where the drafter directory `path` breaks the serving contract (`dflash.model.serving`, docs/serving.md):
    its config.json and the names and shapes of its tensors (read from the safetensors header only)."""
    from safetensors import safe_open
    path = Path(path)
    with safe_open(str(path / WEIGHTS), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    return check(json.loads((path / CONFIG).read_text()), shapes)
