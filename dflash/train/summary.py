"""summary.json: the one record of a finished (or failed, or interrupted) run that the report reads, built here as
its model (dflash/records/summary.py: RunSummary) and written through records.write."""
from __future__ import annotations

import logging
from datetime import datetime, timezone

from dflash import records
from dflash.paths import RunFolder
from dflash.records.summary import RunSummary
from dflash.target import target_record
from dflash.train import checkpoint, compile_guard, run_folder
from dflash.train.context import data_summary, git_state, read_manifest

log = logging.getLogger("dflash.train")


def write(ctx, metrics, workers: list[dict], status: str, devices: list[dict], checksums=None,
          failure: dict | None = None) -> RunSummary:
    """summary.json (`build`, naming the checkpoint the run ended with); a completed run's outputs are also kept in its
    identity's folder (train/run_folder.py: a rerun restores them)."""
    metrics.close()
    folder = run_folder.home(ctx.run_dir, run_folder.identity(ctx))
    final = checkpoint.describe(ctx.run_dir, checkpoint.step_dir(folder, metrics.step))
    summary = build(ctx, metrics, workers, status, devices, checksums, failure, final)
    records.write(RunFolder(ctx.run_dir).summary, summary)
    if status == "completed" and final:   # a rerun of this finished run restores these outputs
        run_folder.record_finished(ctx.run_dir, final)
        run_folder.prune(ctx.run_dir, ctx.cfg.train.keep_runs, folder)
    tp = summary.throughput.ktok_per_s
    log.info("run %s %s: %d steps, %s Ktok/s, loss %s", summary.run_id, status, metrics.step,
             f"{tp:.3f}" if tp else "n/a", f"{summary.loss:.4f}" if summary.loss is not None else "n/a")
    return summary


def build(ctx, metrics, workers: list[dict], status: str, devices: list[dict], checksums=None,
          failure: dict | None = None, final: dict | None = None) -> RunSummary:
    """The run's summary as it stands, naming checkpoint `final` (None: none): `checksums`, each replica's exact
    weight checksum (a list of ints) at the end; `failure`, what stopped a failed run ({"kind": "diverged" |
    "non_finite" | "worker", "message", ...}). The final checkpoint keeps it as it stood there (its workers and
    devices empty, its `checkpoint` null: trainer.py)."""
    fig = metrics.final()   # weighted over every step: the same whatever train.log_every
    after = compile_guard.counters()
    before = metrics.graphs_after_warmup or after
    manifest = read_manifest(ctx)
    started, now = metrics.started_at, datetime.now(timezone.utc)
    identical = (len({tuple(c) for c in checksums}) == 1) if checksums else None
    finite = status == "completed" or not failure or failure.get("kind") not in ("diverged", "non_finite")
    return RunSummary(
        run_id=f"{ctx.cfg.run_name}-{started.strftime('%Y%m%dT%H%M%SZ')}",
        run_name=ctx.cfg.run_name,
        started_at=started.isoformat(), finished_at=now.isoformat(), status=status,
        failure=failure,
        resumed_from_step=metrics.start_step or None,
        git=git_state(),
        config_hash=ctx.loaded.hash, config=ctx.loaded.raw,
        env_hash=ctx.env["hash"], env=ctx.env,
        data_hash=manifest.get("content_hash"), data=data_summary(manifest),
        target_files=target_record(ctx.cfg.target.path),   # evaluate refuses a target changed since
        runtime=ctx.placement.runtime, attention=ctx.backend,
        steps=metrics.step, measured_steps=metrics.totals["steps"],
        # finished: the run reached train.steps or its time budget (finished_by), and a rerun trains a new run
        finished=metrics.finished_by is not None, finished_by=metrics.finished_by,
        train_seconds=round(metrics.train_s, 3), time_budget_s=ctx.cfg.train.time_budget_s or None,
        seconds_to_first_step=metrics.first_step_s,
        # figures of a run whose replicas diverged or whose loss blew up are not throughput to compare against
        throughput=metrics.throughput() if finite else dict.fromkeys(metrics.throughput()),
        time_split_s=metrics.time_split(),
        loss=fig["loss"], ce=fig["ce"], kl=fig["kl"],
        acc_per_position=fig["acc_per_position"], acceptance_estimate=fig["acceptance_estimate"],
        eval=metrics.eval_summary(),   # tau measured while training (train.eval_every), its cost; None when off
        workers=workers,
        devices=devices,
        compile={"graphs": sum(w["graphs"] for w in metrics.warmup), "warmup_s": round(metrics.warmup_s, 3),
                 "cache_hits": sum(w["cache_hits"] for w in metrics.warmup),
                 "recompiles_after_warmup": after["graphs"] - before["graphs"],
                 "eager_fallbacks": after["eager_fallbacks"], "per_device": metrics.warmup},
        replica_checksums=[sum(c) for c in checksums] if checksums else None,
        replicas_identical=identical,
        check_every=ctx.cfg.train.check_every,
        diverged=({"step": failure.get("step"), "replicas": failure.get("replicas")}
                  if failure and failure.get("kind") == "diverged" else None),
        queue_depth_mean=metrics.queue_depth_mean(),
        checkpoint=final,   # what evaluate and export read, exactly
    )
