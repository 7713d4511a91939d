"""A run folder (its layout: dflash.paths.RunFolder) keeps every identity it trained: `checkpoints/<result hash>-<data
hash>/` holds that identity's `step-N/` checkpoints (train/checkpoint.py) and, once its run finished, `finished.json`
(the run's outputs as written).
The identity is what the trained drafter depends on (`identity`: the config's result hash and the data's content hash),
so a config tried by hand in the run folder trains into a folder of its own, and going back restores the first. Nothing
the pipeline does itself deletes or retrains a finished run:

- `restore`: this identity's newest intact checkpoint is the final one of a finished run: its outputs (summary.json,
  metrics.jsonl, which Snakemake deletes before it reruns train) are written back from finished.json, or where that is
  gone or damaged from the run folder's outputs naming that checkpoint, else from the final checkpoint alone (its
  trainer.json keeps the metrics rows and the summary as it stood);
- `resumable`: it is an interrupted run (an interrupted forced retrain too): it resumes from there;
- a finished run trained anew (`--retrain`, what `snakemake -R train` passes, unless the run folder's latest run is
  another identity's: then it is restored; `train.resume: false`) first moves its folder aside to `<identity>.N/`
  (`set_aside`): kept, never resumed nor restored again;
- `prune`: with `train.keep_runs: K`, the K most recently written other folders are kept and the rest deleted, each
  named in a log line, when a run finishes or is restored; null (the default) keeps every one.

`migrate` moves the layout before issue 47 (`checkpoints/step-N/`, `checkpoints.previous/`) into this one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from pydantic import ValidationError

from dflash import paths
from dflash.atomic import atomic_write_json, atomic_write_text
from dflash.errors import UserError
from dflash.records import problem, write
from dflash.train.checkpoint import (MANIFEST, candidates, describe, latest, manifest_hash, newest_intact, step_of,
                                     trainer_state)
from dflash.records.checkpoint import Finished, FinishedCore, TrainerCore

log = logging.getLogger("dflash.train")

FINISHED = "finished.json"   # in an identity's folder: its final checkpoint's name and the run's outputs, byte for byte
OUTPUTS = paths.RunFolder.OUTPUTS   # the train stage's outputs (the rule's), kept there and restored
SUMMARY, METRICS = OUTPUTS
LEGACY = ("checkpoints", "checkpoints.previous")   # where checkpoints were before issue 47 (`migrate`)


# ---- an identity and its folder ------------------------------------------------------------------------------
def identity(setup) -> dict:
    """What a checkpoint must match to be resumed (or a finished run to be restored): the config's result hash (the
    keys whose role decides the drafter, those of switched-off features left out, paths in one spelling:
    dflash.config.result_hash), the data's content hash (from a manifest that matches its own hash), never a name, and
    the content of the other files and folders train reads by the config (`inputs_hash`)."""
    from dflash.train.context import read_manifest
    return {"result_hash": setup.loaded.result_hash, "data_hash": read_manifest(setup).get("content_hash"),
            "inputs_hash": inputs_hash(setup.cfg)}


def inputs_hash(cfg) -> str | None:
    """The content of the files and folders the config names that train reads (dflash.inputs: a target folder with
    build none, drafter.init_from), as the train rule's key stamp records it (dflash.content.record, through the
    results folder's digest cache: a model folder is read once): a model or init_from folder edited in place is
    another run. None when the config names none (a target the pipeline builds is its config's)."""
    import hashlib

    from dflash.content import Digests, record
    from dflash.inputs import named
    files = named(cfg, "train")
    if not files:
        return None
    digests = Digests(paths.digests(cfg.results_dir))
    what = {n.key: record(n.path, digests) for n in files}
    try:
        digests.save()
    except OSError:   # a read-only results folder: the digests are a cache
        pass
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def home(run_dir, ident: dict) -> Path:
    """The folder of identity `ident` in the run folder: `checkpoints/<result hash>-<data hash>[-<inputs hash>]/`."""
    tail = f"-{ident['inputs_hash']}" if ident.get("inputs_hash") else ""
    return paths.RunFolder(run_dir).checkpoints / f"{ident['result_hash']}-{ident['data_hash'] or 'none'}{tail}"


def _identity(saved: TrainerCore) -> dict:
    return {"result_hash": saved.result_hash, "data_hash": saved.data_hash, "inputs_hash": saved.inputs_hash}


def finished(saved: TrainerCore, setup) -> bool:
    """Whether a checkpoint's trainer state (trainer.json) ends its run: the one test of "finished" (train.steps
    reached, or the run ended by its train.time_budget_s: trainer.json's `finished`)."""
    return saved.finished or saved.step >= setup.cfg.train.steps


# ---- resume ---------------------------------------------------------------------------------------------------
def resumable(setup) -> Path | None:
    """The checkpoint to resume from: the newest intact one of this identity's folder, when its run was interrupted
    (not `finished`: an interrupted forced retrain resumes too). A finished run found there is trained anew only when
    `restore` did not restore it (--retrain, or nothing to rebuild its outputs from): its folder is set aside first,
    as with `train.resume: false`. Checkpoints none of which is intact: UserError naming the folder."""
    run_dir = Path(setup.run_dir)
    migrate(run_dir)
    folder = home(run_dir, identity(setup))   # its name is the identity (of a migrated run too: `migrate`)
    if not candidates(folder):
        return None
    if not setup.cfg.train.resume:
        set_aside(folder, "train.resume is false")
        return None
    path = latest(folder)
    if path is None:
        raise UserError(f"{folder}: no intact checkpoint to resume from (each is named above with its fault); move "
                        f"that folder away to train from scratch, or set train.resume: false")
    saved = trainer_state(path)
    if not finished(saved, setup):
        return path
    set_aside(folder, f"the run finished at step {saved.step} ({path.name}), so this rerun trains a new run")
    return None


def set_aside(folder: Path, why: str) -> Path:
    """Move an identity's folder aside to `<identity>.N/` (the first N free), with one log line: kept, not used."""
    n = 1
    while (dest := folder.with_name(f"{folder.name}.{n}")).exists():
        n += 1
    os.replace(folder, dest)
    log.warning("starting from scratch: %s; its checkpoints moved to %s (kept; train.keep_runs prunes old ones)", why,
                dest)
    return dest


# ---- a finished run's outputs --------------------------------------------------------------------------------
def record_finished(run_dir, final: dict, outputs: dict[str, str] | None = None) -> None:
    """Keep a finished run's outputs (OUTPUTS, as written; or `outputs`) in its identity's folder, beside the
    checkpoint `final` (summary.json's `checkpoint`) it ended with: finished.json (records.checkpoint.Finished)."""
    record = Finished(checkpoint=final, outputs=outputs or {n: Path(run_dir, n).read_text() for n in OUTPUTS})
    write(Path(run_dir, final["path"]).parent / FINISHED, record)


def restore(setup, retrain: bool = False) -> FinishedCore | None:
    """A finished run whose identity (result keys and data) did not change is never trained again: when the newest
    intact checkpoint of this identity's folder is the final one of a finished run, write back the outputs it finished
    with (Snakemake deletes a job's outputs before a rerun it forces for a timestamp, an identical fingerprint or an
    incomplete marker) and return its record: finished.json, else the run folder's outputs where summary.json names
    that very checkpoint, else rebuilt from the checkpoint alone (then finished.json is written anew). `retrain`
    (--retrain: snakemake -R train) restores only where the run folder's latest run is another identity's (a run by
    hand, which evaluate refuses, advising -R train); otherwise `resumable` sets the finished run aside, or resumes
    an interrupted retrain. Otherwise None and nothing is touched."""
    run_dir = Path(setup.run_dir)
    if not setup.cfg.train.resume:
        return None
    migrate(run_dir)
    folder = home(run_dir, identity(setup))
    final = newest_intact(folder)
    if final is None or not finished(trainer_state(final), setup):
        return None
    if retrain:
        other = _current(run_dir)
        if other is None or other == folder:
            return None
        log.warning("--retrain: the run folder's latest run is another config's (%s, e.g. one by hand), so this "
                    "config's finished run is restored, not trained anew (force train again to retrain it)", other)
    found = _record(run_dir, final)
    if found is None:
        return None
    record, rebuilt = found
    for name in OUTPUTS:
        atomic_write_text(run_dir / name, record.outputs[name])
    if rebuilt:
        log.warning("%s: %s", folder / FINISHED, rebuilt)
        record_finished(run_dir, record.checkpoint.model_dump(), record.outputs)
    os.utime(folder / FINISHED)   # this identity's outputs are the run folder's now (`_current`)
    prune(run_dir, setup.cfg.train.keep_runs, folder)
    return record


def _current(run_dir: Path) -> Path | None:
    """The identity folder whose run the run folder's outputs are: the one last trained or restored (`_written`); set
    aside folders (`<identity>.N`) are none."""
    root = paths.RunFolder(run_dir).checkpoints
    folders = [d for d in root.iterdir() if d.is_dir() and "." not in d.name] if root.is_dir() else []
    return max(folders, key=_written, default=None)


def _record(run_dir: Path, final: Path) -> tuple[FinishedCore, str | None] | None:
    """(the record of the run that ended with checkpoint `final`, None) from its folder's finished.json; where that is
    gone or damaged, (one rebuilt, how it was): from the run folder's outputs where summary.json names `final`, else
    from `final` alone. None when neither can be (a checkpoint written before trainer.json kept the summary)."""
    ref, path = describe(run_dir, final), final.parent / FINISHED
    try:
        record = FinishedCore.model_validate_json(path.read_bytes())
        lacks = [n for n in OUTPUTS if n not in record.outputs]
        if not lacks and record.checkpoint.model_dump() == ref:
            return record, None
        why = f"missing key 'outputs.{lacks[0]}'" if lacks else f"names {record.checkpoint.path}, not {ref['path']}"
    except FileNotFoundError:
        why = "missing"
    except OSError as e:
        why = f"unreadable ({e.strerror or type(e).__name__})"
    except ValidationError as e:
        why = problem(e)
    outputs = _outputs_on_disk(run_dir, ref)
    if outputs is not None:
        return FinishedCore.model_validate({"checkpoint": ref, "outputs": outputs}), \
            f"{why}: written again from {paths.RunFolder(run_dir).summary} and the checkpoint it names"
    outputs = _outputs_of(final, ref)
    if outputs is not None:
        return FinishedCore.model_validate({"checkpoint": ref, "outputs": outputs}), \
            f"{why}: summary.json and metrics.jsonl rebuilt from {final} alone (its trainer.json)"
    log.warning("%s: %s, and %s keeps no summary (written before checkpoints did): the finished run cannot be "
                "restored", path, why, final)
    return None


def _outputs_on_disk(run_dir: Path, ref: dict) -> dict[str, str] | None:
    """The run folder's outputs as they are, when summary.json is that of a completed run naming checkpoint `ref`."""
    try:
        outputs = {n: (run_dir / n).read_text() for n in OUTPUTS}
        summary = json.loads(outputs[SUMMARY])
        return outputs if summary["status"] == "completed" and summary["checkpoint"] == ref else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _outputs_of(final: Path, ref: dict) -> dict[str, str] | None:
    """summary.json and metrics.jsonl rebuilt from the final checkpoint's trainer.json: the summary as it stood at
    that step (naming the checkpoint), the metrics rows byte for byte as the run wrote them."""
    from dflash.records.summary import RunSummary
    from dflash.train.metrics import SMOOTHED
    saved = trainer_state(final)
    if saved.summary is None or saved.metrics is None:
        return None
    summary = {**saved.summary, "checkpoint": ref}
    try:
        RunSummary.model_validate(summary)
    except ValidationError as e:
        log.warning("%s: its summary is not one (%s)", final / "trainer.json", problem(e))
        return None
    rows = [{k: v for k, v in r.items() if k != SMOOTHED} for r in saved.metrics]
    return {SUMMARY: json.dumps(summary, indent=2, sort_keys=False, default=str) + "\n",
            METRICS: "".join(json.dumps(r) + "\n" for r in rows)}


# ---- pruning --------------------------------------------------------------------------------------------------
def prune(run_dir, keep: int | None, current: Path) -> None:
    """train.keep_runs: keep the `keep` most recently written identity folders besides `current` (other configs' runs,
    runs set aside), delete the others, each named in one log line. None keeps every one."""
    root = paths.RunFolder(run_dir).checkpoints
    if keep is None or not root.is_dir():
        return
    others = sorted((d for d in root.iterdir() if d.is_dir() and d != current and not d.name.startswith(".")),
                    key=_written, reverse=True)
    for d in others[keep:]:
        steps = candidates(d)
        shutil.rmtree(d)
        log.warning("train.keep_runs is %d: deleted %s (%s)", keep, d,
                    f"checkpoints up to step {step_of(steps[0])}" if steps else "no checkpoint")


def _written(folder: Path) -> float:
    """When an identity's folder was last trained or restored: its newest checkpoint written, its finished.json
    written or touched by `restore` (else the folder's own time)."""
    steps = candidates(folder)
    marks = [p for p in (steps[0] / MANIFEST if steps else None, folder / FINISHED) if p is not None and p.exists()]
    return max((p.stat().st_mtime for p in marks), default=folder.stat().st_mtime)


# ---- the layout before issue 47 ------------------------------------------------------------------------------
def migrate(run_dir) -> None:
    """Move checkpoints of the old layout (`checkpoints/step-N/` + finished.json: the current run;
    `checkpoints.previous/`: the one a config change or a retrain moved aside) into their identities' folders, the
    current run first, and point finished.json and the run's summary.json at their new place (the same checkpoint:
    its manifest's hash). An identity is the recorded result hash recomputed from the run's recorded config (that of
    finished.json or summary.json: the hash's rules changed with issue 47), else the recorded one (an interrupted run:
    kept, trained anew). One log line each; nothing is deleted."""
    run_dir = Path(run_dir)
    swap = run_dir / "checkpoints.swap"   # a swap of the old layout cut short: finished first
    if swap.exists():
        os.replace(swap, run_dir / (LEGACY[0] if not (run_dir / LEGACY[0]).exists() else LEGACY[1]))
    for name in LEGACY:
        old = run_dir / name
        steps = candidates(old)
        if not steps:
            if name == LEGACY[1] and old.is_dir() and not any(old.iterdir()):
                old.rmdir()
            continue
        dest = home(run_dir, _legacy_identity(run_dir, old, steps))
        n = 0
        while dest.exists():
            dest = dest.with_name(f"{dest.name.split('.')[0]}.{(n := n + 1)}")
        dest.mkdir(parents=True)
        for p in steps + [old / FINISHED] * (old / FINISHED).is_file():
            os.replace(p, dest / p.name)
        _repoint(run_dir, dest)
        if name == LEGACY[1] and not any(old.iterdir()):
            old.rmdir()
        log.warning("%s: checkpoints of the layout before issue 47 moved to %s", old, dest)


def _legacy_identity(run_dir: Path, old: Path, steps: list[Path]) -> dict:
    from dflash.config import result_hash
    try:
        saved = trainer_state(steps[0])
        ident = _identity(saved)
    except UserError:
        ident = {"result_hash": "unknown", "data_hash": None, "inputs_hash": None}
    for summary in (_old_record_summary(old), _json(paths.RunFolder(run_dir).summary)):
        ref = (summary or {}).get("checkpoint") or {}
        step = old / Path(str(ref.get("path", ""))).name
        if isinstance(summary.get("config") if summary else None, dict) and step in steps and \
                (step / MANIFEST).is_file() and manifest_hash(step) == ref.get("manifest"):
            return {**ident, "result_hash": result_hash(summary["config"])}
    return ident


def _old_record_summary(old: Path) -> dict | None:
    record = _json(old / FINISHED)
    try:
        return json.loads(record["outputs"][SUMMARY])
    except (TypeError, KeyError, ValueError):
        return None


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _repoint(run_dir: Path, dest: Path) -> None:
    """finished.json in `dest` and the run folder's summary.json name their checkpoint's new path (where they name one
    of `dest`'s checkpoints by its manifest's hash)."""
    where = {manifest_hash(p): p.relative_to(run_dir).as_posix() for p in candidates(dest) if (p / MANIFEST).exists()}

    def moved(summary: dict) -> dict | None:
        ref = summary.get("checkpoint") if isinstance(summary, dict) else None
        new = where.get((ref or {}).get("manifest")) if isinstance(ref, dict) else None
        return {**summary, "checkpoint": {**ref, "path": new}} if new and new != ref.get("path") else None

    def dumped(summary: dict) -> str:
        return json.dumps(summary, indent=2, sort_keys=False, default=str) + "\n"

    record = _json(dest / FINISHED)
    if isinstance(record, dict) and (ref := moved(record)) is not None:
        outputs = dict(record.get("outputs") or {})
        if (inner := moved(_json_text(outputs.get(SUMMARY)))) is not None:
            outputs[SUMMARY] = dumped(inner)
        atomic_write_json(dest / FINISHED, {**ref, "outputs": outputs})
    top = paths.RunFolder(run_dir).summary
    if (fixed := moved(_json(top))) is not None:
        atomic_write_text(top, dumped(fixed))


def _json_text(text) -> dict | None:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None
