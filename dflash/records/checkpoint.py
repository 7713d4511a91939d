"""A checkpoint's trainer.json and a run's checkpoints/<identity>/finished.json, the train stage's records beside
its weights: one typed description for their writer and readers (train/checkpoint.py `save` and train/run_folder.py
`record_finished` check what they write; resume, restore and `load` read through the cores) and the docs
(docs/architecture.md, checked against it by a test).

`TrainerState` is every key `save` writes, `TrainerCore` what resuming reads, which a trainer.json of any age holds
(older ones lack `metrics`, `finished`, `finished_by`, `summary`); a trainer.json that does not fit it makes its
checkpoint not intact. `Finished` is finished.json, `FinishedCore` what `restore` reads of it.
"""
from __future__ import annotations

from pydantic import Field

from dflash.records import WRITTEN, Read, key_table as records_table, like
from dflash.records.summary import CheckpointCore, CheckpointRef


class TrainerCore(Read):
    step: int = Field(description="Optimizer steps done: the checkpoint's step.")
    data_index: int = Field(description=(
        "The batch of the seeded batch stream (dflash/train/reader.py) the next step starts at: a resumed run reads "
        "the same batches from there."))
    scheduler: dict = Field(description=(
        "The LR schedule's state_dict: `{\"elapsed_s\"}`, the training seconds the replicas agreed on, summed over "
        "resumes (what train.time_budget_s counts and a time schedule follows)."))
    python_random: tuple[int, list[int], float | None] = Field(description=(
        "Python's `random.getstate()` as [version, state, gauss] (torch's generators are in rng.pt)."))
    result_hash: str | None = Field(None, description=(
        "The config's result hash (`dflash.config.result_hash`: the keys whose role decides the trained drafter): a "
        "checkpoint resumes, and a finished run is restored, only under the same one."))
    data_hash: str | None = Field(None, description=(
        "The dataset manifest's `content_hash` (null: a manifest without one): resuming and restoring need the same "
        "one too."))
    inputs_hash: str | None = Field(None, description=(
        "The content of the files the config names that train reads (a target folder with build none, "
        "drafter.init_from; `run_folder.inputs_hash`), null when it names none: resuming and restoring need the same "
        "one too (a model edited in place is another run)."))
    metrics: list[dict] | None = Field(None, description=(
        "metrics.jsonl's rows up to this step, which a resumed run writes back first; the last, when it is this "
        "step's, also holds `smoothed_stats`: the step statistics weighted DECAY**age, from which a resumed run's "
        "summary figures (loss, ce, kl, accuracies) go on (dflash/train/metrics.py `rows_upto`)."))
    finished: bool = Field(False, description=(
        "The run ended at this step (`finished_by`): a rerun restores it or trains a new run, never resumes it "
        "(`run_folder.finished`, which counts a step at train.steps as the end too)."))
    finished_by: str | None = Field(None, description="steps, time_budget, or null (not finished).")
    summary: dict | None = Field(None, description=(
        "At the final checkpoint of a run, the run's summary.json as it stood there (its workers, devices and "
        "replica checksums, gathered after it, left empty; its `checkpoint` null): with `metrics` what rebuilds the "
        "train stage's outputs from this checkpoint alone when checkpoints/<identity>/finished.json is gone or "
        "damaged (train/run_folder.py). Null at every other step."))


class TrainerState(TrainerCore):
    model_config = WRITTEN

    result_hash: str = like(TrainerCore, "result_hash")
    data_hash: str | None = like(TrainerCore, "data_hash")
    inputs_hash: str | None = like(TrainerCore, "inputs_hash")
    metrics: list[dict] = like(TrainerCore, "metrics")
    finished: bool = like(TrainerCore, "finished")
    finished_by: str | None = like(TrainerCore, "finished_by")
    summary: dict | None = like(TrainerCore, "summary")


class FinishedCore(Read):
    checkpoint: CheckpointCore = Field(description=(
        "The checkpoint the run ended with, as summary.json names it (its `checkpoint`): `restore` takes it only while "
        "it is the newest intact one of its identity's folder, its manifest unchanged."))
    outputs: dict[str, str] = Field(description=(
        "{file: its text} of the train stage's outputs (summary.json, metrics.jsonl) as the run wrote them: a rerun "
        "with the same identity writes them back instead of training."))


class Finished(FinishedCore):
    model_config = WRITTEN

    checkpoint: CheckpointRef = like(FinishedCore, "checkpoint")


def trainer_key_table() -> str:
    """The docs' table of trainer.json's keys (docs/architecture.md holds it between its `trainer-keys` markers)."""
    return records_table((("", TrainerState),))


def finished_key_table() -> str:
    """The docs' table of finished.json's keys (docs/architecture.md holds it between its `finished-keys` markers)."""
    return records_table((("", Finished), ("checkpoint.", CheckpointRef)))
