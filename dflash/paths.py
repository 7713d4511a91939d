"""Where each stage's inputs and outputs live by default, under `results_dir`.

The Snakefile builds its rules' inputs and outputs from these functions and hands every stage its paths
explicitly; a stage falls back to them only when run by hand (`python -m dflash <stage> --config X` without paths).
A run folder's own layout is `RunFolder`'s. Plain strings in, `Path` out, nothing imported beyond the standard library:
the Snakefile imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    """A run's folder (its layout: `RunFolder`)."""
    return Path(results, "runs", run_name)


@dataclass(frozen=True)
class RunFolder:
    """A run folder (results/runs/<run>/, the folder Snakemake or --run-dir hands a stage) and its layout, the one
    place its names are spelled: the train stage's outputs (`summary`, `metrics`: OUTPUTS), the config it ran with,
    its writer's lock, its checkpoints (one folder per identity it trained: train/run_folder.py), the ranks' records of
    a distributed run, the evaluations (`acceptance`: one per temperature) and the exported drafter."""
    root: Path

    SUMMARY = "summary.json"
    METRICS = "metrics.jsonl"
    OUTPUTS = (SUMMARY, METRICS)   # the train stage's outputs (its rule's), which a finished run's record keeps
    ACCEPTANCE = "acceptance.json"
    ACCEPTANCE_AT = "acceptance-t{temp}.json"   # at another temperature T (written `{T:g}`)
    DRAFTER = "drafter"

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    def __fspath__(self) -> str:   # a path wherever one is taken: Path(folder), open(), os.*
        return str(self.root)

    def __str__(self) -> str:
        return str(self.root)

    @property
    def summary(self) -> Path:
        return self.root / self.SUMMARY

    @property
    def metrics(self) -> Path:
        return self.root / self.METRICS

    @property
    def config(self) -> Path:
        """The resolved config the run trained with (written as it starts)."""
        return self.root / "config.yaml"

    @property
    def lock(self) -> Path:
        """The writer's lock (train/writer.py)."""
        return self.root / "train.lock"

    @property
    def checkpoints(self) -> Path:
        """One folder per identity the run trained (`checkpoints/<result hash>-<data hash>/`)."""
        return self.root / "checkpoints"

    @property
    def ranks(self) -> Path:
        """The ranks' records of a distributed run (`rank-N.json`)."""
        return self.root / "ranks"

    @property
    def drafter(self) -> Path:
        """The exported drafter (the export stage's folder)."""
        return self.root / self.DRAFTER

    def acceptance(self, temperature: float | None = None) -> Path:
        """The evaluation at evaluate.temperature (None: acceptance.json, the one the report, export and the gate
        read), or at another temperature of a sweep: acceptance-t<T>.json."""
        if temperature is None:
            return self.root / self.ACCEPTANCE
        return self.root / self.ACCEPTANCE_AT.format(temp=f"{temperature:g}")

    def evaluations(self) -> list[Path]:
        """Every evaluation in the folder (acceptance*.json, a failed one's record left out), sorted by name."""
        return [f for f in sorted(self.root.glob("acceptance*.json")) if not f.name.endswith(".failed.json")]


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


def checkpoint(folder, step: int) -> Path:
    """The checkpoint of `step` in an identity's folder: `<run>/checkpoints/<identity>/step-000050/`."""
    return Path(folder, f"step-{step:06d}")


def checkpoint_step(path) -> int | None:
    """50 for `.../step-000050`, None for anything else (the inverse of `checkpoint`)."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
