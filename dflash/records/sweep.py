"""sweep.json, the sweep table's record: one typed description for its writer (report/sweep.py) and its readers (the
docs that quote it, a later bench table). Every figure of sweep.md and sweep_tau_gpu_seconds.png is in it."""
from __future__ import annotations

from pydantic import BaseModel, Field

from dflash.records import WRITTEN


class Point(BaseModel):
    model_config = WRITTEN

    x: float = Field(description="Training GPU-seconds (CPU seconds on the CPU; steps for old rows: `x_unit`).")
    tau: float = Field(description="tau of the in-training evaluation then.")


class SweepRun(BaseModel):
    model_config = WRITTEN

    run: str = Field(description="The run (results/runs/<run>/).")
    own: bool = Field(description="The config's own run (no overrides).")
    overrides: dict = Field(description="Its keys beside the config's ({} for the config's own run).")
    group: str = Field(description=(
        "Its seed group: the first run of the sweep with the same keys that change the drafter, `seed` aside."))
    seed: int = Field(description="Its seed.")
    dataset: str = Field(description="The dataset it trained on.")
    samples: int | None = Field(description="Training samples of that dataset (its manifest), null: not there.")
    status: str | None = Field(description="summary.json status (completed, interrupted, failed); null: not trained.")
    steps: int | None = Field(description="Optimizer steps done.")
    train_seconds: float | None = Field(description="Seconds of training (over resumes, evaluations left out).")
    ktok_per_s: float | None = Field(description="Trained Ktok/s.")
    tau: float | None = Field(description="tau at temperature 0 on the held-out prompts.")
    tau_by: str | None = Field(description=(
        "Where `tau` comes from: evaluate (acceptance.json) or in-training replay (its last in-training evaluation, "
        "the evaluate stage's measure)."))
    lossless: bool | None = Field(description="The evaluate stage's losslessness at temperature 0 (null: not decoded).")
    hot: dict[str, dict[str, float | None]] = Field(description=(
        "{temperature: {draft policy: tau}} of its evaluations at temperatures above 0."))
    curve: list[Point] = Field(description="Its in-training tau against training time (`Point`).")


class Group(BaseModel):
    model_config = WRITTEN

    group: str = Field(description="The group's name (its first run).")
    overrides: dict = Field(description="Its keys beside the config's that change the drafter, but seed.")
    runs: list[str] = Field(description="Its runs (its seeds).")
    n: int = Field(description="Runs with a tau at temperature 0.")
    mean: float | None = Field(description="Their mean tau.")
    spread: float | None = Field(description="max - min of their tau (null below 2 runs).")
    vs_baseline: float | None = Field(description="mean - the baseline group's mean.")
    beats_spread: bool | None = Field(description=(
        "|vs_baseline| > the larger of the two groups' spreads (null: a group with fewer than 2 seeds, or the "
        "baseline itself)."))


class SweepRecord(BaseModel):
    model_config = WRITTEN

    config: str = Field(description="The config file of the sweep.")
    source: str = Field(description="Where its rows are: the runs sheet, or the config.")
    baseline: str = Field(description="The baseline group (sweep.baseline's run's group).")
    temperatures: list[str] = Field(description="The temperatures above 0 any run was evaluated at.")
    x_unit: str = Field(description="The unit of the curves' x: gpu_s, train_s (CPU) or step.")
    devices: list[str] = Field(description="The GPUs the runs trained on (their env fingerprints); [] on the CPU.")
    runs: list[SweepRun] = Field(description="Every run, in the sweep's order (`SweepRun`).")
    groups: list[Group] = Field(description="Every seed group, the baseline's first (`Group`).")
