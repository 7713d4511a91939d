"""Run metrics: metrics.jsonl every logging interval, summary.json at the end, a live progress bar.

Step statistics stay on the device as one small tensor per step and are read (one host sync) only at logging
intervals, so the hot loop never calls .item().
"""
from __future__ import annotations

import json
import logging
import threading
import time
from datetime import datetime, timezone

import torch

from dflash.atomic import atomic_write_json
from dflash.train import compile_guard, flops

log = logging.getLogger("dflash.train")


def loss_stats(out, tokens: int) -> torch.Tensor:
    """[loss, tokens, scored positions, blocks, accepted, correct_1..K, count_1..K] as one float64 vector."""
    dev = out.loss.device
    head = torch.stack([out.loss.detach().double(), torch.full((), float(tokens), dtype=torch.float64, device=dev),
                        out.count.sum().double(), out.blocks.double(), out.accept_sum.double()])
    return torch.cat([head, out.correct.double(), out.count.double()])


def weight_checksum(module) -> float:
    """Sum of all trainable weights in float64: equal across replicas iff they stayed in lockstep (practically)."""
    with torch.no_grad():
        return float(sum(p.detach().double().sum() for p in module.parameters() if p.requires_grad))


def split_stats(v: list[float]) -> dict:
    k = (len(v) - 5) // 2
    return {"loss_sum": v[0], "tokens": v[1], "positions": v[2], "blocks": v[3], "accepted": v[4],
            "correct": v[5:5 + k], "count": v[5 + k:]}


class DeviceTimer:
    """`with timer:` intervals; CUDA intervals are event pairs resolved later (no sync in the loop)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.items: list = []

    def __enter__(self):
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.items.append((self._start, end))
        else:
            self.items.append(time.perf_counter() - self._start)
        return False

    def pop(self) -> list:
        items, self.items = self.items, []
        return items


def seconds(items) -> float:
    total = 0.0
    for it in items if isinstance(items, list) else [items]:
        if isinstance(it, list):
            total += seconds(it)
        elif isinstance(it, tuple):
            it[1].synchronize()
            total += it[0].elapsed_time(it[1]) / 1000.0
        else:
            total += float(it)
    return total


class RunMetrics:
    def __init__(self, setup, progress: bool = True):
        self.setup = setup
        self.cfg = setup.cfg
        self.path = setup.run_dir / "metrics.jsonl"
        self.lock = threading.Lock()
        self.pending: list[tuple] = []
        self.rows: list[dict] = []
        self.warmup: list[dict] = []
        self.warmup_s = 0.0
        self.progress = progress
        self.bar = None
        self.totals = {"tokens": 0.0, "positions": 0.0, "samples": 0, "seconds": 0.0, "steps": 0}
        self.split_total = {"queue_wait": 0.0, "target": 0.0, "drafter": 0.0, "optimizer": 0.0}
        self.split_steps = 0
        self.last: dict = {}
        self.t_measure = None
        self.step = 0
        self.graphs_after_warmup = None
        self.first_step_s = None

    # -- called by the runtime ------------------------------------------------------------------------
    def set_warmup(self, records, seconds_: float):
        self.warmup, self.warmup_s = records, seconds_

    def start(self, start_step: int, workers):
        self.setup.run_dir.mkdir(parents=True, exist_ok=True)
        if not start_step and self.path.exists():
            self.path.unlink()
        self.start_step = self.step = start_step
        self.started_at = datetime.now(timezone.utc)
        self.exclude_until = start_step + self.cfg.train.warmup_steps_excluded
        self.t_start = time.perf_counter()
        self.graphs_after_warmup = compile_guard.counters()
        if getattr(self, "sampler", None) is not None:
            self.sampler.start()  # utilisation from the first training step on, not during warm-up
        if self.exclude_until == start_step:
            self.t_measure = time.perf_counter()
        if self.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=self.cfg.train.steps, initial=start_step, desc=f"train {self.cfg.run_name}",
                            unit="step", dynamic_ncols=True, mininterval=0.5)

    def step_done(self, step: int, stats: torch.Tensor, gnorm, lr: float, times: dict, qdepth: int):
        """Called by replica 0 after every optimizer step."""
        self.pending.append((step, stats, gnorm, lr, times, qdepth))
        self.step = step
        if self.first_step_s is None:
            import dflash
            self.first_step_s = round(time.time() - dflash.PROCESS_START, 2)
        final = step == self.cfg.train.steps
        if step == self.exclude_until or step % self.cfg.train.log_every == 0 or final:
            self._flush(step, sync_device=True)

    def _flush(self, step: int, sync_device: bool):
        pending, self.pending = self.pending, []
        if not pending:
            return
        dev = pending[-1][1].device
        if sync_device and dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        total = torch.stack([p[1] for p in pending]).sum(0).tolist()   # the one host sync per interval
        st = split_stats(total)
        n_micro = len(self.setup.placement.drafters) * self.cfg.train.grad_accum
        split = {k: sum(seconds(p[4][k]) for p in pending) / len(pending) for k in self.split_total}
        measured = self.t_measure is not None and pending[0][0] > self.exclude_until
        if measured:
            self.totals["tokens"] += st["tokens"]
            self.totals["positions"] += st["positions"]
            self.totals["samples"] += len(pending) * n_micro * self.cfg.train.batch_size
            self.totals["steps"] += len(pending)
            self.totals["seconds"] = now - self.t_measure
            for k in split:
                self.split_total[k] += split[k] * len(pending)
            self.split_steps += len(pending)
        if step == self.exclude_until and self.t_measure is None:
            self.t_measure = now
        window = now - getattr(self, "_t_last", self.t_start)
        self._t_last = now
        row = {
            "step": step, "elapsed_s": round(now - self.t_start, 3),
            "loss": st["loss_sum"] / (len(pending) * n_micro),
            "lr": pending[-1][3], "grad_norm": float(pending[-1][2]),
            "ktok_per_s": st["tokens"] / window / 1e3 if window > 0 else None,
            "acc_per_position": [c / n if n else None for c, n in zip(st["correct"], st["count"])],
            "acceptance_estimate": st["accepted"] / st["blocks"] if st["blocks"] else None,
            "time_split_s": {k: round(v, 5) for k, v in split.items()},
            "queue_depth": pending[-1][5], "measured": measured,
        }
        if self.bar is None:
            log.info("step %d/%d loss %.4f  %.3f Ktok/s  acc1 %s  accept %.2f", step, self.cfg.train.steps, row["loss"],
                     row["ktok_per_s"] or 0.0, f"{row['acc_per_position'][0]:.3f}" if row["acc_per_position"] and
                     row["acc_per_position"][0] is not None else "n/a", row["acceptance_estimate"] or 0.0)
        with self.lock:
            self.rows.append(row)
            self.last = row
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def refresh(self):
        if self.bar is None:
            return
        with self.lock:
            last = dict(self.last)
        self.bar.n = self.step
        if last:
            self.bar.set_postfix(loss=f"{last['loss']:.3f}", ktok_s=f"{last['ktok_per_s'] or 0:.2f}",
                                 acc1=f"{(last['acc_per_position'] or [0])[0] or 0:.2f}", refresh=False)
        self.bar.refresh()

    # -- the summary ----------------------------------------------------------------------------------
    def throughput(self) -> dict:
        s = self.totals["seconds"]
        if not s:
            return {"ktok_per_s": None, "samples_per_s": None, "draft_positions_per_s": None, "mfu": None,
                    "mfu_target": None, "mfu_drafter": None, "measured_seconds": 0.0}
        out = {"ktok_per_s": self.totals["tokens"] / s / 1e3, "samples_per_s": self.totals["samples"] / s,
               "draft_positions_per_s": self.totals["positions"] / s, "measured_seconds": round(s, 3)}
        out.update(self.mfu(s))
        return out

    def mfu(self, s: float) -> dict:
        """Achieved matmul FLOP/s over the measured bf16 ceiling times the number of GPUs used."""
        gpus = self.setup.placement.gpus
        ceiling = self.cfg.train.matmul_tflops
        if not gpus or not ceiling:
            return {"mfu": None, "mfu_target": None, "mfu_drafter": None}
        d = self.setup.drafter_config
        tokens, samples = self.totals["tokens"], self.totals["samples"]
        mean_len = tokens / samples if samples else 0
        layers_run = max(d.target_layer_ids) + 1
        f_t = flops.target_forward(self.setup.target_config, int(mean_len), layers_run) * samples
        f_d = flops.drafter_train(d, int(mean_len), self.cfg.train.num_anchors, 0) * samples + \
            3 * 2 * d.hidden_size * d.vocab_size * self.totals["positions"]
        peak = ceiling * 1e12 * len(gpus) * s
        return {"mfu": (f_t + f_d) / peak, "mfu_target": f_t / peak, "mfu_drafter": f_d / peak}

    def finish(self, setup, workers: list[dict], status: str, resumed_from=None, devices=None, checksums=None):
        from dflash.train.setup import data_summary, git_state, read_manifest
        from dflash.train.telemetry import device_report

        if self.bar is not None:
            self.refresh()
            self.bar.close()
        if self.pending:
            self._flush(self.step, sync_device=True)
        last = self.rows[-1] if self.rows else {}
        after = compile_guard.counters()
        before = self.graphs_after_warmup or after
        manifest = read_manifest(setup)
        now = datetime.now(timezone.utc)
        started = getattr(self, "started_at", now)
        split = {k: (v / self.split_steps if self.split_steps else None) for k, v in self.split_total.items()}
        summary = {
            "run_id": f"{self.cfg.run_name}-{started.strftime('%Y%m%dT%H%M%SZ')}",
            "run_name": self.cfg.run_name,
            "started_at": started.isoformat(), "finished_at": now.isoformat(), "status": status,
            "resumed_from_step": resumed_from,
            "git": git_state(),
            "config_hash": setup.loaded.hash, "config": setup.loaded.raw,
            "env_hash": setup.env["hash"], "env": setup.env,
            "data_hash": manifest.get("content_hash"), "data": data_summary(manifest),
            "runtime": setup.placement.runtime, "attention": setup.backend,
            "steps": self.step, "measured_steps": self.totals["steps"],
            "seconds_to_first_step": self.first_step_s,
            "throughput": self.throughput(),
            "time_split_s": split,
            "loss": last.get("loss"), "acc_per_position": last.get("acc_per_position"),
            "acceptance_estimate": last.get("acceptance_estimate"),
            "workers": workers,
            "devices": devices or device_report(setup.placement, getattr(self, "sampler", None)),
            "compile": {"graphs": sum(w["graphs"] for w in self.warmup), "warmup_s": round(self.warmup_s, 3),
                        "cache_hits": sum(w["cache_hits"] for w in self.warmup),
                        "recompiles_after_warmup": after["graphs"] - before["graphs"],
                        "eager_fallbacks": after["eager_fallbacks"], "per_device": self.warmup},
            "replica_checksums": checksums,
            "replicas_identical": (len(set(checksums)) == 1) if checksums else None,
            "queue_depth_mean": (sum(r["queue_depth"] for r in self.rows) / len(self.rows)) if self.rows else None,
        }
        atomic_write_json(setup.run_dir / "summary.json", summary)
        tp = summary["throughput"]
        log.info("run %s %s: %d steps, %s Ktok/s, loss %s", summary["run_id"], status, self.step,
                 f"{tp['ktok_per_s']:.3f}" if tp["ktok_per_s"] else "n/a",
                 f"{summary['loss']:.4f}" if summary["loss"] is not None else "n/a")
        return summary
