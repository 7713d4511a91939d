"""regressions.json, the report stage's verdicts: one typed description for its writer (report/__init__.py `build`,
from the records of report/regress.py and report/placement.py), its reader (stages/gate.py, through
`dflash.records.read`) and the docs (docs/architecture.md, checked against it by a test).

`Regressions` is every key the writer writes, with its meaning, in the file's order (the report builds it and writes it
through records.write);
`RegressionsCore` is what the gate relies on: each run's id, run name, verdicts and sentence (a record written before
quality was judged lacks `regressed` and `quality`: its Ktok/s verdict alone).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from dflash.records import WRITTEN, Read, key_table as records_table, like

Verdict = Literal["regression", "improvement", "ok", "not measured", "baseline", "first run", "no baseline"]
VERDICTS = ("regression (the change below `threshold`), improvement (above -`threshold`), ok, not measured, baseline "
            "(the pinned report.baseline_run itself), first run or no baseline.")


class Change(BaseModel):
    model_config = WRITTEN

    key: str = Field(description=(
        "What differs: a package name, `python`, `GPU <key>`, `lock file` (environment); `num_samples`, `mean length`, "
        "`length p50`, `bucket <edge>`, another manifest key, `target <file>` (data); a dotted config key, "
        "`evaluate.<key>` (config); `commit`, `dirty` (code); or the hash column when the snapshots cannot say how."))
    old: Any = Field(description=(
        "Its value in the run compared with (the newest baseline run, or `previous`; null or \"absent\": not there)."))
    new: Any = Field(description="Its value in this run.")


class Changed(BaseModel):
    model_config = WRITTEN

    environment: list[Change] = Field(description="Packages, python, CUDA, cuDNN, CPU, GPU models/count/driver, lock "
                                                  "file (`Change`).")
    data: list[Change] = Field(description="The dataset manifest's figures and the target's files.")
    config: list[Change] = Field(description=(
        "The hashed config keys, dotted; for tau also the evaluation's settings (`evaluate.<key>`)."))
    code: list[Change] = Field(description="The git commit (12 hex) and a dirty tree.")


class Baseline(BaseModel):
    model_config = WRITTEN

    run_id: str = Field(description="The newest baseline run.")
    ktok_per_s: float = Field(description="The median Ktok/s of the baseline runs.")
    runs: list[str] = Field(description=(
        "The baseline runs: identical comparable runs (same config, data, environment, code), the last "
        "report.baseline_window; or the pinned report.baseline_run."))


class TauBaseline(BaseModel):
    model_config = WRITTEN

    run_id: str = Field(description="The newest baseline run.")
    tau: float = Field(description="The median tau of the baseline runs.")
    runs: list[str] = Field(description="The baseline runs (as `Baseline`'s, evaluated the same way too).")


class Previous(BaseModel):
    model_config = WRITTEN

    run_id: str = Field(description="The newest earlier completed run with Ktok/s, of any run name, hardware or "
                                     "placement.")
    ktok_per_s: float = Field(description="Its Ktok/s.")
    ratio: float | None = Field(description="This run's Ktok/s / its Ktok/s (null: not measured).")
    changed: Changed = Field(description="What differs from it (`Changed`).")


class Anomaly(BaseModel):
    model_config = WRITTEN

    kind: Literal["status", "not_measured", "replicas_diverged", "recompiles", "eager_fallbacks", "silent_worker",
                  "memory_imbalance", "low_utilisation"] = Field(description=(
                      "status (not completed), not_measured (no Ktok/s), replicas_diverged, recompiles (after the "
                      "warm-up), eager_fallbacks, silent_worker (a worker without a step), memory_imbalance (a drafter "
                      "replica's peak memory off the median of its peers by more than report.memory_imbalance), "
                      "low_utilisation (a GPU under report.min_utilisation)."))
    message: str = Field(description="The anomaly in words.")
    step: int | None = Field(None, description="replicas_diverged: the step they diverged at (null: unknown).")
    count: int | None = Field(None, description="recompiles, eager_fallbacks: how many.")
    worker: str | None = Field(None, description="silent_worker: its name.")
    device: str | None = Field(None, description="silent_worker, memory_imbalance, low_utilisation: the device.")
    share: float | None = Field(None, description="memory_imbalance: its peak memory / the median - 1.")
    util_mean: float | None = Field(None, description="low_utilisation: its mean utilisation, %.")


class Quality(BaseModel):
    model_config = WRITTEN

    tau: float | None = Field(description="tau at temperature 0 (null: no such evaluation).")
    tau_earlier: list[float] = Field(description="The tau of the evaluations the current one replaced, oldest first.")
    loss: float | None = Field(description="The run's final loss (summary.json `loss`).")
    baseline: TauBaseline | None = Field(description="The baseline (`TauBaseline`); null: none, see baseline_reason.")
    baseline_reason: str = Field(description="Why that baseline, or why none.")
    spread: float | None = Field(description=(
        "The run-to-run spread of tau among identical earlier comparable runs (1.4826 x the median absolute "
        "deviation); null without two of them."))
    threshold: float = Field(description=(
        "The tau change below which it regresses: report.tau_threshold, widened to report.noise_sigmas x spread, "
        "never beyond report.tau_threshold_cap."))
    ratio: None = Field(description="Always null: tau is compared as a difference.")
    change: float | None = Field(description="tau - the baseline's tau (null: no baseline or no tau).")
    changed: Changed = Field(description="What differs from the newest baseline run, evaluation settings included "
                                         "(`Changed`; empty lists without a baseline).")
    outlier: bool = Field(description="As the run's, for tau.")
    verdict: Verdict = Field(description=f"The tau verdict: {VERDICTS}")
    what_changed: str = Field(description="`changed` in words ('' without a baseline).")
    sentence: str = Field(description="The quality verdict in words ('' without tau and without a quality baseline).")


class RunVerdict(BaseModel):
    model_config = WRITTEN

    run_id: str = Field(description="The run (runs are in history order: by start time).")
    run_name: str | None = Field(description="Its run name (the gate judges the newest run of its own).")
    started_at: str | None = Field(description="Its start time (the history's `started_at`).")
    status: str | None = Field(description="completed, interrupted or failed.")
    ktok_per_s: float | None = Field(description="Its trained Ktok/s (null: not measured).")
    tau: float | None = Field(description="Its tau at temperature 0 (null: no such evaluation).")
    loss: float | None = Field(description="Its final loss.")
    mfu: float | None = Field(description="Its MFU (null on the CPU).")
    restored_from: str | None = Field(description=(
        "\"history.csv:N\" when only its history row survives (compared by its hashes alone), else null."))
    baseline: Baseline | None = Field(description="The Ktok/s baseline (`Baseline`); null: none, see baseline_reason.")
    baseline_reason: str = Field(description=(
        "Why that baseline (\"the previous comparable run\", \"median of N identical run(s), ...\", \"pinned "
        "(report.baseline_run)\"), or why none. Comparable runs share run name, hardware and placement."))
    spread: float | None = Field(description=(
        "The run-to-run spread of Ktok/s among identical earlier comparable runs (1.4826 x the median absolute "
        "relative deviation); null without two of them."))
    threshold: float = Field(description=(
        "The relative change below which it regresses: report.threshold, widened to report.noise_sigmas x spread, "
        "never beyond report.threshold_cap."))
    ratio: float | None = Field(description="Ktok/s / the baseline's (null: no baseline or no Ktok/s).")
    change: float | None = Field(description="ratio - 1 (null: no baseline or no Ktok/s).")
    changed: Changed = Field(description=(
        "What differs from the newest baseline run, per category (`Changed`; empty lists without a baseline)."))
    outlier: bool = Field(description=(
        "A regression with nothing changed (noise: a loaded machine): left out of later baselines and spreads."))
    verdict: Verdict = Field(description=(
        f"The Ktok/s verdict: {VERDICTS[:-1]}; a Ktok/s drop of 50% or more is a regression whatever the threshold."))
    what_changed: str = Field(description="`changed` in words ('' without a baseline or when nothing changed).")
    previous: Previous | None = Field(description=(
        "Without a baseline (and not the pinned one): how it compares with the run before it (`Previous`); else null."))
    quality: Quality = Field(description="The same judgement for tau (`Quality`).")
    regressed: list[Literal["throughput", "quality"]] = Field(description=(
        "What regressed: [\"throughput\", \"quality\"] or a part of it ([]: nothing)."))
    anomalies: list[Anomaly] = Field(description="What looks wrong in the run itself (`Anomaly`).")
    sentence: str = Field(description="Both verdicts in words: the Ktok/s sentence, then the quality one.")


class Split(BaseModel):
    model_config = WRITTEN

    targets: int = Field(description="GPUs running a target.")
    drafters: int = Field(description="GPUs running a drafter replica.")


class Placement(BaseModel):
    model_config = WRITTEN

    run_id: str = Field(description="The newest run, whose time split it reads.")
    gpus: int = Field(description="Its distinct GPUs (every node's).")
    target_s: float = Field(description="time_split_s.target / train.grad_accum: target seconds per micro-batch.")
    drafter_s: float = Field(description=(
        "(time_split_s.drafter + time_split_s.optimizer) / train.grad_accum: drafter seconds per micro-batch."))
    current: Split = Field(description="The run's split (`Split`).")
    colocated: bool = Field(description="Every GPU runs both roles: the split balances by itself.")
    suggested: Split | None = Field(description=(
        "The split of the GPUs that maximises the slower side's micro-batches per second (a tie keeps the current); "
        "null when co-located."))
    waiting: Literal["target", "drafter"] | None = Field(description=(
        "The side that idles under the current split (null: balanced within 0.5%, co-located, or some GPUs run both)."))
    wait_share: float | None = Field(description="The fraction of time it idles (separate GPUs only).")
    expected_speedup: float | None = Field(description=(
        "The suggested split's micro-batches per second over the current's (an upper bound: queues and transfers "
        "are not modelled; separate GPUs only)."))
    colocated_speedup: float | None = Field(description=(
        "Co-locating every GPU (gpus / (target_s + drafter_s)) over the current split (separate GPUs only)."))
    target_share: float | None = Field(None, description=(
        "Co-located only: target_s / (target_s + drafter_s), each GPU's share of target work."))
    sentence: str = Field(description="The suggestion in words (report.md's Placement section).")


class Skipped(BaseModel):
    model_config = WRITTEN

    file: str = Field(description="The input skipped (a summary.json, an acceptance.json, a snapshot, "
                                  "history.csv[:line]).")
    reason: str = Field(description="Why.")


class Regressions(BaseModel):
    model_config = WRITTEN

    settings: dict = Field(description="The config's `report` section, every key.")
    latest: str | None = Field(description="The newest run's run_id (null: no runs).")
    latest_run_name: str | None = Field(description="Its run name.")
    latest_verdict: Verdict | None = Field(description="Its Ktok/s verdict.")
    latest_quality_verdict: Verdict | None = Field(description="Its tau verdict.")
    latest_regressed: list[str] | None = Field(description="Its `regressed`.")
    latest_sentence: str | None = Field(description="Its `sentence`.")
    placement: Placement | None = Field(description=(
        "The target:drafter split suggested for the newest run (`Placement`); null when it used no GPU, measured no "
        "time split, or ran on one GPU without co-locating."))
    skipped: list[Skipped] = Field(description="Inputs the report could not use, named (`Skipped`).")
    runs: list[RunVerdict] = Field(description="One record per run of the history, in its order (`RunVerdict`).")


class QualityCore(Read):
    verdict: str = like(Quality, "verdict")


class RunCore(Read):
    run_id: str = like(RunVerdict, "run_id")
    run_name: str | None = like(RunVerdict, "run_name")
    verdict: str = like(RunVerdict, "verdict")
    sentence: str = like(RunVerdict, "sentence")
    regressed: list[str] | None = like(RunVerdict, "regressed", None)
    quality: QualityCore | None = like(RunVerdict, "quality", None)


class RegressionsCore(Read):
    """What the gate reads of regressions.json (the module's docstring)."""
    runs: list[RunCore] = like(Regressions, "runs")


def key_table() -> str:
    """The docs' table of regressions.json's keys (docs/architecture.md holds it between its `regressions-keys`
    markers)."""
    return records_table((("", Regressions), ("skipped[].", Skipped), ("runs[].", RunVerdict),
                          ("runs[].baseline.", Baseline), ("runs[].changed.", Changed),
                          ("runs[].changed.<category>[].", Change), ("runs[].previous.", Previous),
                          ("runs[].quality.", Quality), ("runs[].quality.baseline.", TauBaseline),
                          ("runs[].anomalies[].", Anomaly), ("placement.", Placement), ("placement.current.", Split)))
