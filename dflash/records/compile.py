"""results/compile/<device>.json, the warm-up stage's record: one typed description for its writer (train/warmup.py,
from the parts that train/step.py `warm_up` and train/features.py `LayerCapture.warm_up` return), its reader and the
docs (docs/architecture.md, checked against it by a test).

`CompileRecord` is every key the warm-up writes, in the file's order (the warm-up builds it, the stage writes it);
`CompileRecordCore` is what makes a file the stage's own, which it checks before a rerun replaces one. `WarmupPart` is
one part's record: a train run keeps the same, per part and device, in summary.json's `compile.per_device`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from dflash.records import WRITTEN, Read, key_table as records_table, like


class Shape(BaseModel):
    model_config = WRITTEN

    batch: int = Field(description="Sequences per micro-batch (train.batch_size).")
    length: int = Field(description="The length bucket's edge, in tokens.")
    seconds: float = Field(description="Seconds of its forward (the drafter's: and backward), compile included.")


class WarmupPart(BaseModel):
    model_config = WRITTEN

    device: str = Field(description="The device it ran on (torch's name: cpu, cuda:N).")
    role: Literal["drafter", "target"] = Field(description="drafter, or target (train.compile_target).")
    backend: str | None = Field(None, description="The drafter only: its attention backend (flex, sdpa or eager).")
    compiled: bool = Field(description=(
        "Its forward is compiled (the drafter: train.compile and a backend other than eager; the target: "
        "train.compile_target); an uncompiled part runs each shape once, eagerly."))
    shapes: list[Shape] = Field(description=(
        "Every (batch, length) shape run, in order: one per length bucket that holds a full batch (`Shape`)."))
    modules: int | None = Field(None, description=(
        "The target only: the modules it runs through, each forward compiled: the decoder layers up to the last "
        "captured one, and the final norm when the last layer is captured."))
    graphs: int = Field(description="Graphs dynamo compiled while it ran.")
    cache_hits: int = Field(description=(
        "Inductor FX-graph cache hits while it ran (graphs found in the compile cache)."))
    cache_misses: int = Field(description="Inductor FX-graph cache misses while it ran (graphs compiled and stored).")
    seconds: float = Field(description="Seconds of its warm-up.")


class CompileRecord(BaseModel):
    model_config = WRITTEN

    device: str = Field(description="The device warmed up (torch's name: cpu, cuda:N; the file is named cpu, cudaN).")
    graphs: int = Field(description="Graphs compiled, all parts.")
    cache_hits: int = Field(description="Compile-cache hits, all parts.")
    cache_misses: int = Field(description="Compile-cache misses, all parts.")
    seconds: float = Field(description="Seconds of every part's warm-up.")
    per_role: list[WarmupPart] = Field(description=(
        "One record per part, in the train stage's order: the drafter (on a device that runs a replica, or that runs "
        "nothing compiled), then the compiled target (with train.compile_target, on a device that runs one) "
        "(`WarmupPart`)."))
    env_hash: str = Field(description=(
        "The hash of this environment's fingerprint (results/env/fingerprint.json's `hash`), which names the cache."))
    cache_dir: str = Field(description=(
        "The Inductor cache folder it filled (absolute: results/compile/cache-<env_hash>)."))


class CompileRecordCore(Read):
    """What makes a file the warm-up's own (checked before a rerun replaces it)."""
    device: str = like(CompileRecord, "device")
    env_hash: str = like(CompileRecord, "env_hash")


def key_table() -> str:
    """The docs' table of the compile record's keys (docs/architecture.md holds it between its `compile-keys`
    markers)."""
    return records_table((("", CompileRecord), ("per_role[].", WarmupPart), ("per_role[].shapes[].", Shape)))
