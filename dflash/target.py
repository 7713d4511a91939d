"""Loading the frozen target: real `from_pretrained` on a directory; `build: random` builds from its config.

Public:
- `resolve_dtype(name, device)` -> torch.dtype (`auto`: bfloat16 on CUDA, float32 otherwise)
- `load_tokenizer(target_cfg)` -> tokenizer (AutoTokenizer.from_pretrained)
- `target_config(target_cfg)` -> the target's transformers config (one-line error for a folder it cannot read)
- `load_target(target_cfg, device="cpu", dtype=None, seed=0)` -> model in eval mode, requires_grad False, checked
  (`dflash.families.check_model`: what the drafter reads of it is there and as its family says)
- `mask_token_id(tokenizer, vocab_size=None)` -> id of the drafter's mask token
- `stop_token_ids(tokenizer, model=None)` -> ids that end an assistant turn (for generate)
- `has_weights(path)` -> whether the folder holds weight files
- `write_build(out_dir, info)`: build.json, the target stage's record, with every file it wrote (size, mtime, sha256)
- `target_files(path)` -> a target folder's fingerprint (every file's size, mtime, sha256; build.json, the build's log
  with its timing, left out: a target is its weights, config and tokenizer)
- `target_record(path)` -> the same, cheaply: sha256 of the small files, and of large ones where build.json has them
- `target_identity(path, digests=None)` -> {file: sha256} of what loaders read: two builds that wrote the same bytes are
  the same target, whatever their timing
- `target_problem(path, files=None)` -> what changed since build.json (or `files`) recorded the folder, or None;
  `check_target(target_cfg)` raises it for a target the pipeline builds; every load (`load_tokenizer`,
  `load_target`) checks it first.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash.atomic import describe_files, files_in, sha256
from dflash.config_model import TargetSection
from dflash.errors import UserError, io_error

log = logging.getLogger("dflash.target")

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")
MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def _path(target_cfg: TargetSection) -> Path:
    path = Path(target_cfg.path)
    if not path.is_dir():
        raise UserError(f"target.path {path}: no such directory (build it with the `target` stage, "
                        f"or point target.path at a transformers model folder)")
    check_target(target_cfg)
    if not (path / "config.json").is_file():
        raise UserError(f"target.path {path}: not a transformers model folder (no config.json)")
    return path


# ---- the target's files: recorded when built, checked at every load ---------------------------------------------
BUILD = "build.json"        # the target stage's record in every folder it builds
HASH_ALWAYS = 16 << 20      # files up to 16 MiB (configs, the tokenizer, small weights) are hashed at every check
LOADED = (".json", ".safetensors", ".bin", ".pt", ".pth", ".jinja", ".py", ".model", ".tiktoken")   # what loaders read
_intact: set = set()        # (folder, record, its files' sizes and times) found intact in this process


def write_build(out_dir, info: dict) -> dict:
    """Write out_dir/build.json: `info` plus `files`, every file the build wrote with its size, mtime and sha256 (the
    hash is taken once, here), so that a file changed or added later is found (`target_problem`)."""
    info["files"] = describe_files(out_dir, skip={BUILD})
    (Path(out_dir) / BUILD).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _skipped(path) -> set:
    """What is not the target in its folder: hidden files and build.json (the build's log: its timing differs between
    two builds of the same weights)."""
    return _hidden(files_in(path)) | {BUILD}


def target_files(path) -> dict:
    """A target folder's fingerprint: every file's size, mtime and sha256 (hidden ones and build.json left out).
    Hashing costs about what loading the target costs (it reads every byte too), once, where the fingerprint is taken;
    `target_problem` checks it again with a stat per file (and hashes only files up to HASH_ALWAYS, or one whose mtime
    moved)."""
    return describe_files(path, skip=_skipped(path))


def _built(path: Path) -> dict:
    """build.json's record of each file ({name: {size, mtime_ns, sha256}}), {} when there is none to read."""
    try:
        files = json.loads((path / BUILD).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return {}
    return files if isinstance(files, dict) else {}


def target_record(path) -> dict:
    """What a run records of the target it trained on (summary.json `target_files`): every file's size and mtime, and
    its sha256 where it is cheap: a file up to HASH_ALWAYS is hashed, a larger one takes the sha256 build.json records
    for it when it is as recorded there (size and mtime). A many-GB target costs a stat per file to record; a later
    check (`target_problem(path, record)`) hashes a larger file only when its mtime moved, so a rebuild that wrote the
    same bytes passes."""
    path = Path(path)
    out, built = describe_files(path, skip=_skipped(path), hash_limit=HASH_ALWAYS), _built(path)
    for name, rec in out.items():
        was = built.get(name)
        if "sha256" not in rec and isinstance(was, dict) and was.get("sha256") and \
                (was.get("size"), was.get("mtime_ns")) == (rec["size"], rec["mtime_ns"]):
            rec["sha256"] = was["sha256"]
    return out


def target_identity(path, digests=None) -> dict:
    """What the target is, by content: {name: sha256} of every file a loader reads (LOADED; hidden files and build.json
    left out). A file's sha256 is build.json's where it records the file as it is (size and mtime), else computed
    (through `digests`, a dflash.content.Digests cache, when given): two builds that wrote the same bytes are one
    target, whatever their timing."""
    path = Path(path)
    built, skip = _built(path), _skipped(path)
    out = {}
    for name in files_in(path):
        p = path / name
        if name in skip or Path(name).suffix not in LOADED or not p.is_file():
            continue
        st, was = p.stat(), built.get(name)
        if isinstance(was, dict) and was.get("sha256") and (was.get("size"), was.get("mtime_ns")) == \
                (st.st_size, st.st_mtime_ns):
            out[name] = was["sha256"]
        else:
            out[name] = digests.sha256(p) if digests is not None else sha256(p)
    return out


def _hidden(names) -> set:
    return {n for n in names if any(part.startswith(".") for part in n.split("/"))}


def _changed(folder: Path, files: dict) -> str | None:
    """The first file of `files` ({name: {size, mtime_ns, sha256}}) that is not as recorded in `folder`, with why.
    Sizes and mtimes are compared for every file (one stat each); the sha256 of files up to HASH_ALWAYS always, of a
    larger one when its mtime moved (a copy keeps the content): the check stays cheap for a many-GB target."""
    for name, rec in sorted(files.items()):
        if name == BUILD:
            continue   # recorded by runs before build.json was left out: the build's log, not the target
        p = folder / name
        try:
            st = p.stat()
            if st.st_size != rec.get("size"):
                return f"{p}: {st.st_size} bytes, {rec.get('size')} when recorded"
            moved = st.st_mtime_ns != rec.get("mtime_ns")
            if rec.get("sha256") and (moved or st.st_size <= HASH_ALWAYS):
                if sha256(p) != rec["sha256"]:
                    return f"{p}: its content differs from the one recorded (sha256)"
            elif moved:
                return f"{p}: modified (its mtime moved; too large to hash at every check)"
        except FileNotFoundError:
            return f"{p}: missing"
        except OSError as e:
            raise io_error(e, p, "read") or UserError(f"{p}: cannot read it ({e})") from None
    return None


def target_problem(path, files: dict | None = None) -> str | None:
    """What changed in the target folder `path` since its files were recorded, in one line naming the file; None when
    intact or nothing is recorded. `files`: a record taken earlier (`target_files`, e.g. when a drafter was trained on
    it): the line says only what changed. None: the `files` of its build.json (a folder the target stage built), and
    the line says what to do. A file added beside the recorded ones counts when a loader reads it (LOADED)."""
    path = Path(path)
    record = path / BUILD
    built = files is None
    if built:
        if not record.is_file():
            return None
        try:
            files = json.loads(record.read_text()).get("files")
        except (OSError, ValueError, AttributeError) as e:
            return f"{record}: unreadable ({type(e).__name__}): rerun the target stage (snakemake -R target)"
        if not isinstance(files, dict):
            return None   # built before build.json listed its files
    names = files_in(path)
    try:   # ctime too: a write moves it even when the mtime is set back
        key = (str(path.resolve()), json.dumps(files, sort_keys=True),
               tuple((n, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for n in names for st in [(path / n).stat()]))
    except OSError:
        key = None
    if key in _intact:
        return None
    why = _changed(path, files)
    added = [n for n in names if n not in files and n != BUILD and not _hidden([n]) and Path(n).suffix in LOADED]
    if why is None and added:
        why = f"{path / added[0]}: added"
    if why is None:
        _intact.add(key)
        return None
    if not built:
        return why
    return (f"{why}, since the target stage built {path} ({BUILD} records its files): rerun the target stage "
            f"(snakemake -R target), or put the file back as it was; to use the model as it is now, set target.build: "
            f"none (the folder is then your input)")


def check_target(target_cfg: TargetSection) -> None:
    """A target the pipeline builds (target.build not none) as its build.json records it, or a UserError naming the
    file that changed and what to do (`target_problem`). A folder used with build none is the user's input."""
    problem = target_problem(target_cfg.path) if target_cfg.build != "none" else None
    if problem:
        raise UserError(problem)


def weights_problem(path) -> str | None:
    """A safetensors weight file of the folder `path` that is cut short or damaged, checked from its header alone (a
    few KB per file): 'FILE: why' or None."""
    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                size = f.stat().st_size
                if size < 8 or n > size - 8:
                    return f"{f}: {size} bytes, shorter than its header says"
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return f"{f}: its header is not a safetensors header"
        except OSError as e:
            raise io_error(e, f, "read") or UserError(f"{f}: cannot read it ({e})") from None
        if 8 + n + end != size:
            return f"{f}: {size} bytes, its header says {8 + n + end}"
    return None


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


def target_config(target_cfg: TargetSection):
    """The target's transformers config (AutoConfig of target.path), or a UserError in one line naming the folder."""
    from transformers import AutoConfig
    path = _path(target_cfg)
    try:
        return AutoConfig.from_pretrained(str(path), trust_remote_code=target_cfg.trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"target.path {path}: cannot read its config.json: "
                        f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None


def split_map(config, devices) -> dict[str, str]:
    """transformers' device_map of a target of `config` split over `devices` (train.target_split): its decoder layers
    in contiguous runs, as even as their count allows (the first devices take one more), everything of the decoder
    before and beside them (embedding, rotary tables) on the first device, the final norm and LM head on the last (a
    head tied to the embedding on the first, with it). Module names from the model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash.families import final_norm
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in model.named_modules()}
    decoder = model.get_decoder()
    layers, first, last = decoder.layers, str(devices[0]), str(devices[-1])
    k, extra = divmod(len(layers), len(devices))
    owner = [str(d) for i, d in enumerate(devices) for _ in range(k + (i < extra))]
    out = {names[id(m)]: owner[i] for i, m in enumerate(layers)}
    norm = final_norm(model)
    for name, m in decoder.named_children():
        if m is not layers:
            out[names[id(m)]] = last if m is norm else first
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, m in model.named_children():
        if m is not decoder:
            out[name] = first if tied and m is model.get_output_embeddings() else last
    return out


def fp8_loading(config, path: Path) -> dict:
    """from_pretrained's extra arguments for a block-wise FP8 checkpoint (`quant_method: fp8`, Qwen3-*-FP8's format):
    transformers runs its FP8 matmuls through the `kernels` package, which fetches its kernel from the Hub at the first
    forward; without it (or at a version transformers does not take) the forward fails on a GPU. Nothing here may
    download, so such a checkpoint is loaded dequantized to the target dtype (each weight its blocks times their
    scales, exactly: the same values, bf16 matmuls), said in the log. With a usable `kernels` installed (and its
    kernel in the Hub cache), transformers' own FP8 layers are kept. `config`: the target's (target_config), `path`
    named in the log."""
    qc = getattr(config, "quantization_config", None) or {}
    from transformers.utils import is_kernels_available
    if qc.get("quant_method") != "fp8" or is_kernels_available():
        return {}
    from transformers import FineGrainedFP8Config
    log.warning("target %s: an FP8 checkpoint, loaded dequantized (transformers' FP8 layers need the `kernels` "
                "package, which downloads its kernel: not installed here)", path)
    return {"quantization_config": FineGrainedFP8Config.from_dict({**qc, "dequantize": True})}


def load_target(target_cfg: TargetSection, device="cpu", dtype=None, seed=0, devices=None):
    """The target in eval mode with requires_grad False, on `device` in `dtype` (default: target.dtype). `devices`
    (train.target_split, `device` first): its layers split over them (`split_map`), loaded there directly.

    A folder without weight files and `build: random` is built from its config.json with seeded random weights,
    initialised directly on the device in the target dtype (an 8B-shaped model is created on a GPU in seconds).
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = _path(target_cfg)
    device = resolve_device(device)
    dtype = resolve_dtype(dtype if dtype is not None else target_cfg.dtype, device)
    split = devices is not None and len(devices) > 1
    trust = target_cfg.trust_remote_code
    attn = target_cfg.attn_implementation
    if not has_weights(path) and target_cfg.build != "random":
        raise UserError(f"target.path {path}: no weight files (*.safetensors or pytorch_model*.bin) and "
                        f"target.build is {target_cfg.build!r} (only `random` builds weights at load time)")
    from dflash.families import check_config, check_model
    config = target_config(target_cfg)   # read once: checked, split, quantization, a random build's
    why = check_config(config, attn)
    if why:
        raise UserError(f"target.path {path}: {why}")
    damaged = weights_problem(path)
    if damaged:
        raise UserError(f"{damaged}: the weight file is cut short or damaged; copy it again from the model (a target "
                        f"this pipeline built: rerun the target stage)")
    from safetensors import SafetensorError
    try:
        if has_weights(path):
            where = {"device_map": split_map(config, devices)} if split else {}
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=attn,
                                                         trust_remote_code=trust, **where, **fp8_loading(config, path))
        else:
            torch.manual_seed(seed)
            default_dtype = torch.get_default_dtype()
            try:
                torch.set_default_dtype(dtype)
                with torch.device(device):
                    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn,
                                                             trust_remote_code=trust)
            finally:
                torch.set_default_dtype(default_dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:   # a .bin torch.load cannot read: OSError
        raise io_error(e, action="read") or UserError(
            f"target.path {path}: cannot load the model: {(str(e).splitlines() or [type(e).__name__])[0]}; copy the "
            f"model's files again (a target this pipeline built: rerun the target stage)") from None
    if split and not has_weights(path):   # a random build: made on `device`, then its layers dispatched
        from accelerate import dispatch_model
        model = dispatch_model(model, split_map(model.config, devices))
    elif not split:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    why = check_model(model)   # a decoder to capture from, its embeddings as the drafter will take them
    if why:
        raise UserError(f"target.path {path}: {why}")
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
