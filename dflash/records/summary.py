"""summary.json, the record a training run leaves: one typed description for its writer (train/summary.py), its reader
(report/history.py) and the docs (docs/architecture.md, checked against it by a test).

`RunSummary` is every key the writer writes, with its meaning; `SummaryCore` is the part the report needs, which a
summary of any age must hold (older ones may lack the rest, and keys added later).
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from dflash.records import WRITTEN, Read, key_table as records_table, like


class GitCore(Read):
    commit: str | None = Field(description="HEAD of the checkout that ran (null outside a git checkout).")


class ThroughputCore(Read):
    ktok_per_s: float | None = Field(description=(
        "Trained Ktok/s: unpadded sequence tokens consumed by optimizer steps per wall second after the warm-up "
        "(null: too few steps to measure, or a diverged or non-finite run)."))


class Git(GitCore):
    model_config = WRITTEN

    dirty: bool | None = Field(description="Uncommitted changes to tracked files (null outside a git checkout).")


class Throughput(ThroughputCore):
    model_config = WRITTEN

    samples_per_s: float | None = Field(description="Sequences per second, measured as ktok_per_s.")
    draft_positions_per_s: float | None = Field(description="Scored block positions per second.")
    measured_seconds: float | None = Field(description=(
        "The wall seconds measured (after the warm-up; the pauses for in-training evaluations and checkpoints left "
        "out)."))
    mfu: float | None = Field(description="Model FLOPs utilisation against `train.matmul_tflops`, the measured bf16 "
                                "matmul ceiling (null on CPU); FP8 GEMMs (`train.precision: fp8`) run above it, so "
                                "with FP8 it can pass 1.")
    mfu_target: float | None = Field(description="The target's share of mfu.")
    mfu_drafter: float | None = Field(description="The drafter's share of mfu.")


class Compile(BaseModel):
    model_config = WRITTEN

    graphs: int = Field(description="Graphs compiled in the warm-up (every part, every device).")
    warmup_s: float = Field(description="Seconds of the warm-up.")
    cache_hits: int = Field(description="Compile-cache hits in the warm-up.")
    recompiles_after_warmup: int = Field(description="Graphs compiled after the warm-up (0 in a healthy run).")
    eager_fallbacks: int = Field(description="Compiled calls that fell back to eager.")
    per_device: list[dict] = Field(description=(
        "One warm-up record per part and device (`role` drafter or target, `shapes` [{batch, length, seconds}], "
        "`graphs`, `cache_hits`, `cache_misses`, `seconds`, `compiled`), as results/compile/<device>.json's."))


class EvalPoint(BaseModel):
    model_config = WRITTEN

    step: int = Field(description="The optimizer step after which it was measured.")
    train_s: float | None = Field(description="Seconds of training by then (summed over resumes; pauses left out).")
    gpu_s: float | None = Field(description="train_s x the run's GPUs (null on the CPU).")
    tau: float | None = Field(description="tau on the held-out prompts.")


class LiveEval(BaseModel):
    model_config = WRITTEN

    every: int = Field(description="train.eval_every.")
    prompts: int | None = Field(description="Held-out prompts decoded per evaluation.")
    max_new_tokens: int | None = Field(description="Tokens generated per prompt.")
    evals: int = Field(description="Evaluations made by this process (a resumed run counts only its own).")
    steps: list[int] = Field(description="The steps they were made at.")
    seconds: float = Field(description=(
        "The seconds training paused for them in all (left out of the training time and of Ktok/s)."))
    seconds_per_eval: float | None = Field(description="Seconds per evaluation.")
    step_s: float | None = Field(description="Mean seconds of a training step without them.")
    eval_over_step: float | None = Field(description="seconds_per_eval / step_s: an evaluation's cost in steps.")
    share: float | None = Field(description="Their share of the training loop's wall time.")
    tau: float | None = Field(description="tau of the last evaluation.")
    step: int | None = Field(description="Its step.")
    method: str | None = Field(description=(
        "How tau was measured: `replay` (greedy speculative decoding replayed on the target's greedy continuation, "
        "dflash/evaluate/replay.py)."))
    tau_history: list[float | None] = Field(description="tau of every evaluation, in order (null: nothing decoded).")
    curve: list[EvalPoint] = Field(description=(
        "tau against training seconds and GPU-seconds, one point per evaluation of this process (metrics.jsonl's "
        "`tau`, `tau_step`, `tau_train_s` hold every process's)."))


class CheckpointCore(Read):
    """How a record names a checkpoint (summary.json's `checkpoint`, checkpoints/<identity>/finished.json's), as its
    readers take it (train/run_folder.py: `restore`)."""
    path: str = Field(description="The checkpoint folder, relative to the run folder.")
    step: int = Field(description="Its step.")
    manifest: str = Field(description="xxh3_128 of its manifest.json.")


class CheckpointRef(CheckpointCore):
    model_config = WRITTEN


class RunSummary(BaseModel):
    """summary.json, every key in the file's order (train/summary.py builds it, records.write writes it)."""
    model_config = WRITTEN

    run_id: str = Field(description="`<run_name>-<start time, UTC>`: the run's key in the history.")
    run_name: str = Field(description="train's run_name.")
    started_at: str = Field(description="ISO-8601 start time.")
    finished_at: str = Field(description="ISO-8601 time the summary was written.")
    status: str = Field(description="completed, interrupted or failed.")
    failure: dict | None = Field(description=(
        "What stopped a failed run: {kind: diverged, non_finite, worker, stall or not_ready; worker; message}."))
    resumed_from_step: int | None = Field(description="The checkpoint step this process resumed from (null: none).")
    git: Git = Field(description="The checkout (`Git`).")
    config_hash: str = Field(description="dflash.config.config_hash of `config` (16 hex).")
    config: dict = Field(description="The resolved config (the YAML's keys plus every default).")
    env_hash: str = Field(description="Hash of the environment fingerprint (16 hex).")
    env: dict = Field(description="The environment fingerprint (results/env/fingerprint.json).")
    data_hash: str | None = Field(description="The dataset manifest's content hash (null without one).")
    data: dict = Field(description=(
        "The manifest's content_hash, num_samples, total_tokens, supervised_tokens, buckets, length_histogram, "
        "bucket_edges, max_length, truncation."))
    target_files: dict = Field(description=(
        "The target folder the run trained on: {file: {size, mtime_ns, sha256 (files up to 16 MiB, and larger ones "
        "build.json records)}}, build.json (the build's log) left out; `evaluate` refuses a target changed since, "
        "naming the file."))
    runtime: str = Field(description="threads or distributed.")
    attention: str = Field(description="flex, sdpa or eager.")
    steps: int = Field(description="Optimizer steps done.")
    measured_steps: int = Field(description="Steps that count towards Ktok/s (after train.warmup_steps_excluded).")
    finished: bool = Field(description="The run reached train.steps or its time budget: a rerun trains a new run.")
    finished_by: str | None = Field(description="steps, time_budget, or null (not finished).")
    train_seconds: float = Field(description=(
        "Training time after the warm-up that the replicas agreed on, summed over resumes (what the time budget "
        "counts)."))
    time_budget_s: float | None = Field(description="train.time_budget_s, null without one.")
    seconds_to_first_step: float | None = Field(description="Seconds from start to the first optimizer step.")
    throughput: Throughput = Field(description="Throughput figures (`Throughput`).")
    time_split_s: dict[str, float | None] = Field(description=(
        "Mean seconds per optimizer step of queue_wait, target, drafter, optimizer, seen by drafter replica 0 (on a "
        "shared GPU the parts overlap, so they can add up to more than the step)."))
    loss: float | None = Field(description=(
        "Weighted mean loss over the scored positions of the last optimizer steps (global normalisation), each step's "
        "sums weighted 0.9^age (age 0: the last step; the last 10 steps carry 65%, the last 20 88%): independent of "
        "train.log_every (dflash/train/metrics.py DECAY)."))
    ce: float | None = Field(description="Its cross-entropy term (against the data's tokens).")
    kl: float | None = Field(description="Its KL term (to the target's distribution); null unless train.objective "
                             "is kl or ce+kl.")
    acc_per_position: list[float | None] | None = Field(description=(
        "Top-1 accuracy per block position k = 1..B-1, over the same weighted steps as loss."))
    acceptance_estimate: float | None = Field(description=(
        "Expected accepted prefix estimated from the accuracies, over the same weighted steps as loss."))
    eval: LiveEval | None = Field(description=(
        "tau measured while training (train.eval_every) and its cost (`LiveEval`); null when off."))
    workers: list[dict] = Field(description="One row per worker: name, role, device, steps, ready_s, ...")
    devices: list[dict] = Field(description="One row per device: device, roles, peak_memory_gb, util_mean, ...")
    compile: Compile = Field(description="Compile counters (`Compile`).")
    replica_checksums: list[int] | None = Field(description=(
        "Each replica's exact weight checksum at the end (the sum of int64 sums of the weights' bit patterns)."))
    replicas_identical: bool | None = Field(description="All replica checksums equal (null: none taken).")
    check_every: int = Field(description="train.check_every of the divergence guard.")
    diverged: dict | None = Field(description="{step, replicas} of a divergence, else null.")
    queue_depth_mean: float | None = Field(description=(
        "Mean feature-queue depth seen at the optimizer steps of this process (a resumed run: its own steps)."))
    checkpoint: CheckpointRef | None = Field(description=(
        "The checkpoint the run ended with (null: none at its last step); evaluate and export read exactly it."))


class SummaryCore(Read):
    """What the report needs of a summary.json of any age (the module's docstring)."""
    run_id: str = like(RunSummary, "run_id")
    started_at: str = like(RunSummary, "started_at")
    status: str = like(RunSummary, "status")
    git: GitCore = like(RunSummary, "git")
    config_hash: str = like(RunSummary, "config_hash")
    config: dict = like(RunSummary, "config")
    env_hash: str = like(RunSummary, "env_hash")
    env: dict = like(RunSummary, "env")
    data_hash: str | None = like(RunSummary, "data_hash")
    data: dict = like(RunSummary, "data")
    throughput: ThroughputCore = like(RunSummary, "throughput")


def key_table() -> str:
    """The docs' table of summary.json's keys (docs/architecture.md holds it between its `summary-keys` markers)."""
    return records_table((("", RunSummary), ("git.", Git), ("throughput.", Throughput), ("compile.", Compile),
                          ("eval.", LiveEval), ("checkpoint.", CheckpointRef)))
