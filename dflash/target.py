"""Loading the frozen target: real `from_pretrained` on a directory; `build: random` builds from its config.

Public:
- `resolve_dtype(name, device)` -> torch.dtype (`auto`: bfloat16 on CUDA, float32 otherwise)
- `load_tokenizer(target_cfg)` -> tokenizer (AutoTokenizer.from_pretrained)
- `load_target(target_cfg, device="cpu", dtype=None, seed=0)` -> model in eval mode, requires_grad False
- `mask_token_id(tokenizer, vocab_size=None)` -> id of the drafter's mask token
- `stop_token_ids(tokenizer, model=None)` -> ids that end an assistant turn (for generate)
- `has_weights(path)` -> whether the folder holds weight files
"""
from __future__ import annotations

import logging
from pathlib import Path

from dflash.config_model import TargetSection
from dflash.errors import UserError

log = logging.getLogger("dflash.target")

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _path(target_cfg: TargetSection) -> Path:
    path = Path(target_cfg.path)
    if not path.is_dir():
        raise UserError(f"target.path {path}: no such directory (build it with the `target` stage, "
                        f"or point target.path at a transformers model folder)")
    if not (path / "config.json").is_file():
        raise UserError(f"target.path {path}: not a transformers model folder (no config.json)")
    return path


def has_weights(path) -> bool:
    path = Path(path)
    return any(any(path.glob(p)) for p in WEIGHT_PATTERNS)


def resolve_dtype(name, device="cpu"):
    import torch
    if name is None or name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if isinstance(name, torch.dtype):
        return name
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise UserError(f"target.dtype {name!r}: expected auto, float32 or bfloat16") from None


def resolve_device(name) -> str:
    import torch
    name = str(name or "auto")
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.isdigit():
        return f"cuda:{name}"
    return name


def load_tokenizer(target_cfg: TargetSection):
    from transformers import AutoTokenizer
    path = _path(target_cfg)
    try:
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=target_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"target.path {path}: cannot load the tokenizer: {_tokenizer_fault(path, e)}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# what a tokenizer is read from: the fast tokenizer's file, or a slow tokenizer's vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _tokenizer_fault(path: Path, e: Exception) -> str:
    """Why AutoTokenizer could not load the folder, naming the file and the remedy (transformers' message is several
    lines and names none)."""
    import json
    fast = path / "tokenizer.json"
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return (f"{fast} is missing (nor is there a slow tokenizer's {', '.join(TOKENIZER_FILES[1:])}): copy the "
                f"model's tokenizer files into {path}")
    if fast.is_file():
        try:
            json.loads(fast.read_text())
        except (OSError, ValueError) as bad:
            return f"{fast} is not a tokenizer file ({type(bad).__name__}: {bad}): copy it again from the model"
    return " ".join(str(e).split()) + f" (the tokenizer files in {path}: copy them again from the model)"


def load_target(target_cfg: TargetSection, device="cpu", dtype=None, seed=0):
    """The target in eval mode with requires_grad False, on `device` in `dtype` (default: target.dtype).

    A folder without weight files and `build: random` is built from its config.json with seeded random weights,
    initialised directly on the device in the target dtype (an 8B-shaped model is created on a GPU in seconds).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = _path(target_cfg)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype if dtype is not None else target_cfg.dtype, device)
    trust = target_cfg.trust_remote_code
    attn = target_cfg.attn_implementation
    try:
        if has_weights(path):
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn,
                                                         trust_remote_code=trust)
            model.to(device)
        elif target_cfg.build == "random":
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust)
            torch.manual_seed(seed)
            default_dtype = torch.get_default_dtype()
            try:
                torch.set_default_dtype(dtype)
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                             trust_remote_code=trust)
            finally:
                torch.set_default_dtype(default_dtype)
        else:
            raise UserError(f"target.path {path}: no weight files (*.safetensors or pytorch_model*.bin) and "
                            f"target.build is {target_cfg.build!r} (only `random` builds weights at load time)")
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target.path {path}: cannot load the model: {str(e).splitlines()[0]}") from None
    model.eval()
    model.requires_grad_(False)
    return model


def mask_token_id(tokenizer, vocab_size: int | None = None) -> int:
    """The drafter's mask token: the tokenizer's mask token or `<|mask|>`; else the first unused embedding row."""
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    tid = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None and tid >= 0:
        return tid
    if vocab_size is not None and len(tokenizer) < vocab_size:
        return len(tokenizer)
    raise UserError(f"the target tokenizer has no mask token ({MASK_TOKEN}) and no unused embedding row; "
                    f"set drafter.mask_token_id")


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Token ids that end an assistant turn: the generation config's eos ids, the tokenizer's eos, <|im_end|>."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None) if model is not None else None
    eos = getattr(gen, "eos_token_id", None)
    for x in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if x is not None:
            ids.append(int(x))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for t in END_OF_TURN_TOKENS:
        if t in vocab:
            ids.append(int(vocab[t]))
    return sorted(set(ids))
