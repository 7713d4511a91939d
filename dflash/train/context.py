"""The run context: everything a training run derives from its config, built once (placement, attention backend,
paths, the target's and the drafter's configs, loss decay, environment) and handed to every part of the trainer."""
from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dflash import fingerprint
from dflash import paths
from dflash.config import REPO, Loaded
from dflash.config_model import DflashConfig, TrainSection
from dflash.errors import UserError
from dflash.train import placement as P, precision

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from dflash.model import DrafterConfig

log = logging.getLogger("dflash.train")


@dataclass
class RunContext:
    loaded: Loaded                 # the validated config, its hash and source
    placement: P.Placement
    backend: str                   # flex | sdpa | eager
    run_dir: Path
    data_dir: Path
    target_config: PretrainedConfig   # the target's transformers config
    drafter_config: DrafterConfig
    gamma: float                   # loss decay
    env: dict                      # environment fingerprint
    compile: bool                  # compiled drafter layers and loss kernel
    pad_id: int = 0
    shapes: list[tuple[int, int]] = field(default_factory=list)   # (batch, length) of every bucket: the warm-up set

    @property
    def cfg(self) -> DflashConfig:
        return self.loaded.cfg

    @property
    def compiled_workers(self) -> int:
        """Compiled workers in one process of this run (dynamo's entries are per shape and per device, and a process
        holds them for all its workers; compile_guard.recompile_limit): Placement.compiled_workers; 1 without one."""
        return self.placement.compiled_workers(self.cfg.train.compile_target) if self.placement else 1

    @property
    def batches_per_step(self) -> int:
        """Micro-batches one optimizer step consumes over every replica: drafter replicas x train.grad_accum."""
        return len(self.placement.drafters) * self.cfg.train.grad_accum

    def open_reader(self):
        """The run's batch stream: a step's micro-batches from one length bucket (equal work on every replica)."""
        from dflash.train.reader import ShardReader
        t = self.cfg.train
        return ShardReader(self.data_dir, t.batch_size, self.cfg.seed, self.pad_id, group=self.batches_per_step)

    def anchors_wanted(self, length: int) -> int:
        """num_anchors, or round(length * anchors_per_token) up to num_anchors where that is set."""
        t = self.cfg.train
        return t.num_anchors if t.anchors_per_token is None else \
            max(1, min(t.num_anchors, round(length * t.anchors_per_token)))

    def anchors_for(self, length: int) -> int:
        """Anchors per sequence in a bucket of this length: anchors_wanted, capped by the positions that can hold one."""
        return max(1, min(self.anchors_wanted(length), length - 1))


def check_live_eval(train_cfg: TrainSection, placement) -> None:
    """Refuse, before anything is loaded, an in-training evaluation that cannot run or would measure something else:
    drafter replica 0 needs a target in its process (not the distributed runtime's split layout). (That the target is
    the one `evaluate` decodes with, not quantized by train.fp8_target, the config itself enforces.)"""
    if not train_cfg.eval_every:
        return
    if train_cfg.runtime == "distributed" and not placement.colocated:
        raise UserError("train.eval_every: drafter replica 0 has no target in its process to decode with "
                        "(the split layout of the distributed runtime); co-locate the target (the same devices "
                        "in train.targets and train.drafters), use train.runtime: threads, or set "
                        "train.eval_every: 0 (the evaluate stage still measures tau after training)")


def prepare(loaded: Loaded, need_data: bool = True, run_dir=None, data_dir=None) -> RunContext:
    from transformers import AutoConfig

    from dflash.families import check_config
    from dflash.model import DrafterConfig, default_gamma
    from dflash.target import load_tokenizer, mask_token_id, target_config

    cfg = loaded.cfg
    placement = P.resolve(cfg.train)
    precision.check(cfg.train, placement)
    check_live_eval(cfg.train, placement)
    backend = P.attention_backend(cfg.train, placement.drafters)
    if backend == "flex" and any(d.type != "cuda" for d in placement.drafters):
        raise UserError("train.attention is flex but a drafter is on the CPU: flex_attention has no CPU backward; "
                        "use sdpa there")
    tpath = Path(cfg.target.path)
    if not (tpath / "config.json").is_file():
        raise UserError(f"{tpath}: target folder has no config.json (run the target stage, or set target.path)")
    tconf = target_config(cfg.target)
    why = check_config(tconf, cfg.target.attn_implementation)
    if why:
        raise UserError(f"target.path {tpath}: {why}")
    quant = getattr(tconf, "quantization_config", None)
    if quant and cfg.train.fp8_target:
        raise UserError(f"train.fp8_target: the target is a quantized checkpoint already "
                        f"({quant.get('quant_method') if isinstance(quant, dict) else getattr(quant, 'quant_method', '')}): it "
                        f"loads in its own precision; set train.fp8_target: false")
    cap = getattr(tconf, "final_logit_softcapping", None)
    if cap and cfg.train.objective != "ce":
        raise UserError(f"train.objective {cfg.train.objective}: the target soft-caps its logits "
                        f"(final_logit_softcapping {cap}), the KL teacher here does not; use train.objective: ce")
    tok = load_tokenizer(cfg.target)
    mask_id = cfg.drafter.mask_token_id if cfg.drafter.mask_token_id is not None else \
        mask_token_id(tok, tconf.vocab_size)   # a padded vocabulary's first unused row, as the data stage takes it
    dconf = DrafterConfig.from_target(tconf, cfg.drafter, mask_id)
    data_dir = Path(data_dir or paths.dataset(cfg.results_dir, cfg.dataset_name))
    if need_data and not (data_dir / "manifest.json").is_file():
        raise UserError(f"{data_dir}/manifest.json: dataset not found (run the data stage first)")
    return RunContext(
        loaded, placement, backend, Path(run_dir or paths.run(cfg.results_dir, cfg.run_name)),
        data_dir, tconf, dconf,
        cfg.train.gamma if cfg.train.gamma is not None else default_gamma(dconf.block_size),
        fingerprint.collect(), cfg.train.compile and backend != "eager",
        tok.pad_token_id if tok.pad_token_id is not None else 0)


def set_shapes(ctx: RunContext, shapes) -> None:
    """Record the bucket shapes (what the warm-up compiles); warn once where anchors are capped."""
    ctx.shapes = list(shapes)
    n = ctx.cfg.train.num_anchors
    capped = [s for _, s in ctx.shapes if ctx.anchors_for(s) < ctx.anchors_wanted(s)]
    if capped:
        key = (f"train.anchors_per_token={ctx.cfg.train.anchors_per_token}" if ctx.cfg.train.anchors_per_token
               else f"train.num_anchors={n}")
        log.warning("%s asks for more anchors than the positions of bucket(s) %s: capped to length-1 there "
                    "(anchors beyond the positions would be padding, computed for nothing)", key, capped)


def git_state() -> dict:
    """The commit of this project's own repository; None where the package is not inside its git checkout
    (a copy without .git must not report the commit of an enclosing repository)."""
    def git(*args):
        try:
            r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
            return r.stdout.strip() if r.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            return ""
    top = git("rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != REPO.resolve():
        return {"commit": None, "dirty": None}
    return {"commit": git("rev-parse", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def data_summary(manifest: dict) -> dict:
    keys = ("content_hash", "num_samples", "total_tokens", "supervised_tokens", "buckets", "length_histogram",
            "bucket_edges", "max_length", "truncation")
    return {k: manifest.get(k) for k in keys}


def read_manifest(ctx: RunContext) -> dict:
    """The dataset's manifest as the data stage wrote it (its own hash checked; the reader checks the files)."""
    from dflash.data.shards import read_manifest
    return read_manifest(ctx.data_dir)
