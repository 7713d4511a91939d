"""Checkpoints: drafter weights (safetensors), optimizer + RNG (torch.save, loaded weights_only), trainer state (JSON).

`checkpoints/step-000050/` is written into a temporary folder and renamed, so a kill -9 never leaves half of one.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash.atomic import atomic_dir, atomic_write_json, read_json


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir, "checkpoints", f"step-{step:06d}")


def save(run_dir, step: int, data_index: int, drafter, optimizer, scheduler, extra: dict | None = None) -> Path:
    out = step_dir(run_dir, step)
    with atomic_dir(out) as tmp:
        state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save({"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, tmp / "rng.pt")
        atomic_write_json(tmp / "trainer.json", {
            "step": step, "data_index": data_index, "scheduler": scheduler.state_dict(),
            "python_random": _py_state(), **(extra or {})})
    return out


def _py_state():
    version, state, gauss = random.getstate()
    return [version, list(state), gauss]


def latest(run_dir) -> Path | None:
    dirs = sorted(Path(run_dir, "checkpoints").glob("step-*"))
    dirs = [d for d in dirs if (d / "trainer.json").is_file()]
    return dirs[-1] if dirs else None


def load(path: Path, drafter, optimizer, scheduler) -> dict:
    """Restore in place; returns trainer.json (step, data_index, ...)."""
    path = Path(path)
    state = load_file(str(path / "model.safetensors"), device=str(next(drafter.parameters()).device))
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"{path}/model.safetensors: missing keys {missing}, unexpected keys {unexpected}")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    trainer = read_json(path / "trainer.json")
    scheduler.load_state_dict(trainer["scheduler"])
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    v, s, g = trainer["python_random"]
    random.setstate((v, tuple(s), g))
    return trainer


def identity(setup) -> dict:
    """What a checkpoint must match to be resumed: the config (names aside) and the data content."""
    from dflash.train.context import read_manifest
    return {"config_hash": setup.loaded.hash, "data_hash": read_manifest(setup).get("content_hash")}


def resumable(setup) -> Path | None:
    """The newest checkpoint of this run if it was made with the same config and data; stale ones are set aside."""
    import logging
    import os
    import time
    path = latest(setup.run_dir)
    if path is None:
        return None
    saved = read_json(path / "trainer.json")
    want = identity(setup)
    if all(saved.get(k) == v for k, v in want.items()):
        return path
    stale = Path(setup.run_dir, f"checkpoints.stale-{time.strftime('%Y%m%dT%H%M%S')}")
    os.replace(Path(setup.run_dir, "checkpoints"), stale)
    logging.getLogger("dflash.train").warning(
        "checkpoints in %s were made with another config or data (%s); moved to %s, starting fresh",
        setup.run_dir, {k: saved.get(k) for k in want}, stale)
    return None


OUTPUTS = ("summary.json", "metrics.jsonl")


def archive_outputs(run_dir, step: int) -> None:
    """Keep the finished run's summary and metrics beside its final checkpoint (restored if a rerun finds it)."""
    import shutil
    ckpt = step_dir(run_dir, step)
    if ckpt.is_dir():
        for name in OUTPUTS:
            if Path(run_dir, name).is_file():
                shutil.copy2(Path(run_dir, name), ckpt / name)


def finished(setup) -> bool:
    """A rerun of a run that already finished with this config and data: restore its outputs instead of
    training again. A final checkpoint without archived outputs is set aside (the run is trained afresh)."""
    import logging
    import shutil
    path = resumable(setup) if setup.cfg.train.resume else None
    if path is None or read_json(path / "trainer.json")["step"] < setup.cfg.train.steps:
        return False
    log = logging.getLogger("dflash.train")
    if all((path / name).is_file() for name in OUTPUTS):
        for name in OUTPUTS:
            shutil.copy2(path / name, Path(setup.run_dir, name))
        log.info("run already finished with this config and data (%s): outputs restored, nothing to train", path)
        return True
    stale = Path(setup.run_dir, f"checkpoints.stale-{path.name}")
    shutil.rmtree(stale, ignore_errors=True)
    Path(setup.run_dir, "checkpoints").rename(stale)
    log.warning("%s is final but holds no run outputs; moved to %s and training afresh", path, stale)
    return False
