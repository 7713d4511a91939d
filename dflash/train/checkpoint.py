"""Checkpoints: `checkpoints/<identity>/step-000050/` holds the drafter in the reference format (config.json +
model.safetensors, loadable as is by `DFlashDraftModel`, SGLang, vLLM), the optimizer and RNG state (torch.save, read
back with weights_only=True), trainer.json (the trainer's state: records.checkpoint.TrainerState), and last
manifest.json (size and xxh3-128 hash of every file). Which identity folder a run uses, resumes or restores is
train/run_folder.py's.

A checkpoint is written into a temporary folder and renamed, so a kill -9 never leaves half of one; the manifest
catches what happens to it later (a truncated copy, rotten bytes). Resume takes the newest checkpoint whose files
match its manifest (and whose trainer.json is a trainer state), saying in one line which ones it skipped and why
(`latest`). summary.json names the checkpoint a run ended with (`describe`); evaluate and export read exactly that one
(`ended_with`). `load_drafter` is the package's one loader of drafter weights (evaluate, export, `drafter.init_from`):
the drafter's shape comes from the folder's config.json, never from the YAML.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path

import torch
from pydantic import ValidationError

from dflash import paths
from dflash.atomic import atomic_dir, atomic_write_json, read_json
from dflash.errors import UserError, disk_full, io_error
from dflash.records import problem, write
from dflash.records.checkpoint import TrainerCore, TrainerState

log = logging.getLogger("dflash.train")

CONFIG, WEIGHTS, OPTIMIZER, RNG, TRAINER, MANIFEST = (
    "config.json", "model.safetensors", "optimizer.pt", "rng.pt", "trainer.json", "manifest.json")
FILES = (CONFIG, WEIGHTS, OPTIMIZER, RNG, TRAINER)
HASH = "xxh3_128"


# a checkpoint's folder (in an identity's folder) and its step: one naming, in dflash/paths.py (evaluate reads it too)
step_dir, step_of = paths.checkpoint, paths.checkpoint_step


# ---- writing -------------------------------------------------------------------------------------------------
def save(folder, step: int, data_index: int, drafter, optimizer, scheduler, identity: dict, metrics: list[dict] = (),
         finished_by: str | None = None, summary: dict | None = None) -> Path:
    """Write checkpoint `step` into `folder` (the run's identity folder: run_folder.home; the drafter's config from
    `drafter.cfg`); its trainer.json holds the run's `identity`, its metrics rows up to `step`, what finished it (None:
    not finished) and, at the final step, the run's `summary` as it stands (what rebuilds the outputs from this
    checkpoint alone), checked against TrainerState first. A full disk raises UserError naming the folder and leaves
    nothing behind."""
    from dflash.model.export import save_drafter
    out = step_dir(folder, step)
    state = TrainerState(step=step, data_index=data_index, scheduler=scheduler.state_dict(), python_random=_py_state(),
                         **identity, metrics=list(metrics), finished=finished_by is not None, finished_by=finished_by,
                         summary=summary)
    try:
        with atomic_dir(out) as tmp:
            save_drafter(drafter, tmp / "drafter")           # the reference format, exactly as `export` writes it
            for name in (CONFIG, WEIGHTS):
                os.replace(tmp / "drafter" / name, tmp / name)
            (tmp / "drafter").rmdir()
            _torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
            _torch_save({"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, tmp / RNG)
            write(tmp / TRAINER, state)
            atomic_write_json(tmp / MANIFEST, {"step": step, "hash": HASH,
                                               "files": {n: _describe(tmp / n) for n in FILES}})
    except Exception as e:
        if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise UserError(f"{e.filename or out.parent}: not writable ({e.strerror}) while writing the checkpoint; "
                            f"make {out.parent} writable and rerun: training resumes from the previous "
                            f"checkpoint") from None
        if disk_full(e):
            free = shutil.disk_usage(out.parent).free if out.parent.is_dir() else 0
            raise UserError(f"{out}: no space left on device while writing the checkpoint ({free / 2**20:.0f} MiB "
                            f"free now); nothing was left half-written. Free space on that disk (or set results_dir "
                            f"elsewhere) and rerun: training resumes from the previous checkpoint") from None
        raise
    return out


def _torch_save(obj, path: Path):
    with open(path, "wb") as f:   # a Python file: a full disk surfaces as OSError(ENOSPC), not "unexpected pos"
        torch.save(obj, f)


def _py_state():
    version, state, gauss = random.getstate()
    return version, list(state), gauss


def _describe(path: Path) -> dict:
    import xxhash
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return {"bytes": path.stat().st_size, HASH: h.hexdigest()}


# ---- finding and verifying -----------------------------------------------------------------------------------
def verify(path, names=FILES) -> str | None:
    """None if the files `names` of checkpoint `path` match its manifest (and trainer.json, when among them, fits
    records.checkpoint.TrainerCore), else why not (one phrase)."""
    path = Path(path)
    try:
        files = read_json(path / MANIFEST)["files"]
        wants = {name: (int(files[name]["bytes"]), str(files[name][HASH])) for name in names if name in files}
    except FileNotFoundError:
        return f"no {MANIFEST} (incomplete, or written before checkpoints had one)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    for name in names:
        f = path / name
        if name not in wants:
            return f"{name} is not in {MANIFEST}"
        if not f.is_file():
            return f"{name} is missing"
        size, (want_size, want_hash) = f.stat().st_size, wants[name]
        if size != want_size:
            return f"{name} is {size} bytes, {MANIFEST} says {want_size} (truncated or overwritten)"
        if _describe(f)[HASH] != want_hash:
            return f"{name} does not match its hash in {MANIFEST} (corrupted)"
    if TRAINER in names:
        try:
            TrainerCore.model_validate_json((path / TRAINER).read_bytes())
        except ValidationError as e:
            return f"{TRAINER} is not a trainer state ({problem(e)})"
    return None


def trainer_state(path) -> TrainerCore:
    """Checkpoint `path`'s trainer.json through its reader view (records.checkpoint.TrainerCore); UserError naming the
    file and the key otherwise."""
    f = Path(path, TRAINER)
    try:
        return TrainerCore.model_validate_json(f.read_bytes())
    except OSError as e:
        raise UserError(f"{f}: unreadable ({e.strerror or type(e).__name__})") from None
    except ValidationError as e:
        raise UserError(f"{f}: not a trainer state ({problem(e)})") from None


def candidates(folder) -> list[Path]:
    """The `step-N/` checkpoints of `folder` (an identity's folder), newest first (whatever their state)."""
    root = Path(folder)
    dirs = [d for d in root.iterdir() if d.is_dir() and step_of(d) is not None] if root.is_dir() else []
    return sorted(dirs, key=step_of, reverse=True)


def latest(folder, names=FILES) -> Path | None:
    """The newest checkpoint of `folder` whose files `names` match its manifest; one warning line per newer one
    skipped."""
    for path in candidates(folder):
        why = verify(path, names)
        if why is None:
            return path
        log.warning("checkpoint %s skipped: %s", path, why)
    return None


def newest_intact(folder) -> Path | None:
    """The newest checkpoint of `folder` whose files match its manifest (quietly: a look, not a resume)."""
    return next((p for p in candidates(folder) if verify(p) is None), None)


# ---- the checkpoint a run ended with -------------------------------------------------------------------------
def describe(run_dir, path) -> dict | None:
    """How summary.json names the checkpoint `path` a run ended with: {"path" (relative to the run folder), "step",
    "manifest" (xxh3 of its manifest.json: that very checkpoint, not a later one of the same name)}; None when there
    is none."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        return None
    return {"path": path.relative_to(run_dir).as_posix(), "step": step_of(path), "manifest": manifest_hash(path)}


def manifest_hash(path) -> str:
    """xxh3 of checkpoint `path`'s manifest.json: that very checkpoint (what summary.json names it by)."""
    return _describe(Path(path, MANIFEST))[HASH]


def ended_with(run_dir) -> Path:
    """The checkpoint a run ended with, exactly as its summary.json names it (`describe`): that very folder (its
    manifest.json's hash) with its drafter intact. What evaluate and export read; anything missing or changed is a
    UserError naming it, never another checkpoint in its place."""
    summary = paths.RunFolder(run_dir).summary
    again = "retrain the run (snakemake -R train), or give a drafter folder by hand"
    try:
        final = read_json(summary).get("checkpoint")
    except FileNotFoundError:
        raise UserError(f"{summary}: missing, so the run's final checkpoint is unknown: train the run first, or "
                        f"give a drafter folder by hand") from None
    except OSError as e:                           # permissions, a folder in its place: not a damaged run
        raise io_error(e, summary, "read") or UserError(f"{summary}: cannot read it ({e.strerror})") from None
    except (ValueError, AttributeError):
        raise UserError(f"{summary}: damaged (not a JSON object); {again}") from None
    if not isinstance(final, dict) or not final.get("path"):
        raise UserError(f"{summary}: names no final checkpoint (the run failed before one, or an older train stage "
                        f"wrote it); {again}")
    path = Path(run_dir, final["path"])
    if not (path / MANIFEST).is_file() or not _within(path, run_dir):
        raise UserError(f"{path}: missing ({summary} says the run ended with it); {again}")
    if manifest_hash(path) != final.get("manifest"):
        raise UserError(f"{path}: not the checkpoint the run ended with (its {MANIFEST} changed after {summary} "
                        f"was written); {again}")
    why = verify(path, (CONFIG, WEIGHTS))
    if why:
        raise UserError(f"{path}: {why}: the run's final drafter is damaged; {again}")
    return path


def _within(path: Path, run_dir) -> bool:
    return Path(path).resolve().is_relative_to(Path(run_dir).resolve())


# ---- reading -------------------------------------------------------------------------------------------------
def load(path, drafter, optimizer, scheduler) -> TrainerCore:
    """Restore a replica in place from a verified checkpoint; returns its trainer state (step, data_index, ...)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = Path(path)
    _same_config(path, drafter.cfg)
    try:
        state = load_file(str(path / WEIGHTS), device=str(next(drafter.parameters()).device))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path / WEIGHTS}: cannot read safetensors: {e}") from None
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"{path / WEIGHTS}: missing keys {missing}, unexpected keys {unexpected}")
    optimizer.load_state_dict(_torch_load(path / OPTIMIZER))
    trainer = trainer_state(path)
    try:
        scheduler.load_state_dict(trainer.scheduler)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path / TRAINER}: not a trainer state (its scheduler: {type(e).__name__}: {e})") from None
    v, s, g = trainer.python_random
    rng = _torch_load(path / RNG)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate((v, tuple(s), g))
    return trainer


def _torch_load(path: Path):
    """torch.load(weights_only=True); a file that is not one is named, without torch's advice to load unsafely.
    Damaged bytes fail in the weights-only unpickler in many ways (UnpicklingError, EOFError, IndexError from its
    stack, KeyError, struct.error, ...): every one means the same thing here."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - see above
        raise UserError(f"{path}: not a readable checkpoint file ({type(e).__name__}): the checkpoint is damaged; "
                        f"remove its folder to resume from the previous one") from None


def _same_config(path: Path, cfg):
    """Refuse a drafter folder (a checkpoint or an export) whose config.json describes another drafter than `cfg` (a
    DrafterConfig), naming the fields. The architecture is compared (config.json as the drafter reads it), not the
    file: what a folder adds that no drafter reads (an export's dflash_config.mask_token, the weights' dtype, keys a
    later export writes) is no difference."""
    from dataclasses import fields

    from dflash.model import DrafterConfig
    try:
        saved = DrafterConfig.from_hf_dict(read_json(path / CONFIG))
    except FileNotFoundError:
        raise UserError(f"{path / CONFIG}: missing (a checkpoint written before checkpoints described their "
                        f"drafter; train anew)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path / CONFIG}: not a DFlash drafter config ({type(e).__name__}: {e})") from None
    diff = [f.name for f in fields(cfg) if getattr(saved, f.name) != getattr(cfg, f.name)]
    if diff:
        raise UserError(f"{path / CONFIG}: the drafter there differs from the one configured: "
                        + ", ".join(f"{k} {getattr(saved, k)} there vs {getattr(cfg, k)} here" for k in diff))


def load_drafter(path, embed=None, head=None, device=None, dtype=None, expect=None, embed_scale=None):
    """The one loader of drafter weights: a checkpoint folder (its manifest verified) or an exported drafter
    folder, both config.json + model.safetensors in the reference format; the drafter's shape is config.json's.
    `embed`/`head` are the target's weights; None gives shape-only stand-ins on the meta device (export).
    `expect` (a DrafterConfig) refuses a drafter of another shape, naming the fields; `embed_scale`: the target's
    (dflash.families.embed_scale)."""
    from dflash.model import DrafterConfig
    from dflash.model.export import load_drafter as read_reference
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{path}: not a drafter folder (a checkpoint or an export: config.json + model.safetensors)")
    if (path / MANIFEST).is_file():
        why = verify(path, (CONFIG, WEIGHTS))
        if why:
            raise UserError(f"{path}: {why}")
    if expect is not None:
        _same_config(path, expect)
    if embed is None or head is None:
        try:
            c = DrafterConfig.from_hf_dict(read_json(path / CONFIG))
        except FileNotFoundError:
            raise UserError(f"{path / CONFIG}: missing (a drafter folder holds {CONFIG} and {WEIGHTS}; a "
                            f"checkpoint written before checkpoints described their drafter has none)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path / CONFIG}: not a DFlash drafter config: {e}") from None
        embed = head = torch.empty(c.vocab_size, c.hidden_size, device="meta")
    try:
        drafter = read_reference(path, embed, head, device=device, dtype=dtype, embed_scale=embed_scale)
    except FileNotFoundError as e:
        raise UserError(f"{e}; a checkpoint written before checkpoints described their drafter has no "
                        f"{CONFIG}") from None
    except ValueError as e:
        raise UserError(str(e)) from None
    return drafter
