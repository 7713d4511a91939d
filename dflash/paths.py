"""Where each stage's inputs and outputs live by default, under `results_dir`.

The Snakefile builds its rules' inputs and outputs from these functions and hands every stage its paths
explicitly; a stage falls back to them only when run by hand (`python -m dflash <stage> --config X` without paths).
Plain strings in, `Path` out, no imports beyond pathlib: the Snakefile imports this module.
"""
from __future__ import annotations

from pathlib import Path


def fingerprint(results: str) -> Path:
    return Path(results, "env", "fingerprint.json")


def dataset(results: str, dataset_name: str) -> Path:
    """Arrow shards per bucket, holdout.jsonl and manifest.json."""
    return Path(results, "data", dataset_name)


def device_slug(spec) -> str:
    """'cuda:3' / '3' -> 'cuda3'; 'cpu' -> 'cpu' (the file name of a device's warm-up record)."""
    s = str(spec)
    return f"cuda{s}" if s.isdigit() else s.replace(":", "")


def compile_record(results: str, device) -> Path:
    return Path(results, "compile", f"{device_slug(device)}.json")


def runs(results: str) -> Path:
    return Path(results, "runs")


def run(results: str, run_name: str) -> Path:
    """metrics.jsonl, summary.json, checkpoints/, acceptance.json, drafter/."""
    return Path(results, "runs", run_name)


def report(results: str) -> Path:
    return Path(results, "report")


def stamps(results: str) -> Path:
    """The rules' key stamps (dflash.stamps) and the digest cache of the files the config names."""
    return Path(results, "stamps")


def digests(results: str) -> Path:
    """sha256 of files, cached by their size and times (dflash.content.Digests)."""
    return Path(results, "stamps", "digests.json")


def logs(results: str) -> Path:
    return Path(results, "logs")


def benchmarks(results: str) -> Path:
    return Path(results, "benchmarks")


def checkpoints(run_dir) -> Path:
    """A run's checkpoints: one folder per identity it trained (`checkpoints/<result hash>-<data hash>/`)."""
    return Path(run_dir, "checkpoints")


def checkpoint(folder, step: int) -> Path:
    """The checkpoint of `step` in an identity's folder: `<run>/checkpoints/<identity>/step-000050/`."""
    return Path(folder, f"step-{step:06d}")


def checkpoint_step(path) -> int | None:
    """50 for `.../step-000050`, None for anything else (the inverse of `checkpoint`)."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
