"""Run metrics: the one owner of metrics.jsonl (a row every logging interval) and of the live progress bar.

Step statistics stay on the device as one small tensor per step and are read (one host sync) only at logging
intervals, so the hot loop never calls .item(). The summary (summary.json) is summary.py's.

What summary.json reports never depends on the operational keys (train.log_every, checkpoint_every, eval_every), which
only add rows: its loss, ce, kl, per-position accuracy and acceptance estimate are the step statistics weighted
DECAY**age over every optimizer step (age 0: the last one), not the last row's interval; Ktok/s, the time split and the
queue depth count every step of the measured window, and the pauses for evaluations and checkpoints are left out.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
from datetime import datetime, timezone

import torch

from dflash.atomic import atomic_write_text
from dflash.config_model import DflashConfig, TrainSection
from dflash.paths import RunFolder
from dflash.train import compile_guard
from dflash.train.failures import check_finite

log = logging.getLogger("dflash.train")
SPLIT = ("queue_wait", "target", "drafter", "optimizer")
# summary.json's final figures weight each step's statistics DECAY**age: the last 10 steps carry 65% of the weight,
# the last 20 88%, whatever the logging interval
DECAY = 0.9
SMOOTHED = "smoothed_stats"   # the key of those weighted sums in the last row a checkpoint keeps (rows_upto)


def loss_stats(out, tokens: int) -> torch.Tensor:
    """[weighted loss sum, weight sum (the loss's denominator), tokens, scored positions, blocks, accepted,
    weighted CE sum, weighted KL sum, correct_1..K, count_1..K] as one float64 vector: every entry is a sum, so
    replicas and micro-batches add them up."""
    dev = out.loss.device
    wsum = out.weight_sum.detach().double()
    head = torch.stack([out.loss.detach().double() * wsum, wsum,
                        torch.full((), float(tokens), dtype=torch.float64, device=dev),
                        out.count.sum().double(), out.blocks.double(), out.accept_sum.double(),
                        out.ce.double() * wsum, out.kl.double() * wsum])
    return torch.cat([head, out.correct.double(), out.count.double()])


def split_stats(v: list[float]) -> dict:
    k = (len(v) - 8) // 2
    return {"loss_sum": v[0], "weight_sum": v[1], "tokens": v[2], "positions": v[3], "blocks": v[4],
            "accepted": v[5], "ce_sum": v[6], "kl_sum": v[7], "correct": v[8:8 + k], "count": v[8 + k:]}


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


def log_due(train_cfg: TrainSection, step: int, start_step: int) -> bool:
    """Whether step ends a logging interval (its row is written and checked): the last excluded warm-up step, every
    train.log_every steps, every in-training evaluation's (train.eval_every: each tau gets its own row, whatever the
    logging interval) and the final one."""
    return step == start_step + train_cfg.warmup_steps_excluded or step % train_cfg.log_every == 0 \
        or bool(train_cfg.eval_every) and step % train_cfg.eval_every == 0 or step == train_cfg.steps


def interval_loss(total: list[float]) -> tuple[dict, float | None]:
    """A logging interval's summed loss_stats -> (split_stats, its loss: the weighted mean; None where nothing was
    scored). RunMetrics.flush and check_pending both read an interval through this."""
    st = split_stats(total)
    return st, (st["loss_sum"] / st["weight_sum"] if st["weight_sum"] else None)


def _finite(x):
    return x if x is None or math.isfinite(x) else None


def figures(st: dict, distills: bool) -> dict:
    """The figures of summed step statistics (split_stats): the loss and its ce and kl terms (normalised as the loss;
    kl only when the objective distills), the per-position top-1 accuracy and the acceptance estimate."""
    w = st["weight_sum"]
    return {"loss": _finite(st["loss_sum"] / w) if w else None, "ce": _finite(st["ce_sum"] / w) if w else None,
            "kl": _finite(st["kl_sum"] / w) if w and distills else None,
            "acc_per_position": [c / n if n else None for c, n in zip(st["correct"], st["count"])],
            "acceptance_estimate": st["accepted"] / st["blocks"] if st["blocks"] else None}


def check_pending(pending: list[tuple[int, torch.Tensor, object]]) -> None:
    """The finiteness check of a logging interval's (step, stats, gnorm) rows in one host sync, as flush makes it
    (on ranks that write no metrics): NonFinite when the loss or the gradient norm is not finite."""
    _, loss = interval_loss(torch.stack([p[1] for p in pending]).sum(0).tolist())
    check_finite(pending[-1][0], loss, float(pending[-1][2]))


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
    def __init__(self, ctx, progress: bool = True):
        self.ctx = ctx
        self.cfg: DflashConfig = ctx.cfg
        self.path = RunFolder(ctx.run_dir).metrics
        self.lock = threading.Lock()
        self.pending: list[tuple] = []
        self.rows: list[dict] = []
        self.warmup: list[dict] = []
        self.warmup_s = 0.0
        self.progress = progress
        self.bar = None
        self.sampler = None
        self.totals = {"tokens": 0.0, "positions": 0.0, "samples": 0, "seconds": 0.0, "steps": 0}
        self.split_total = dict.fromkeys(SPLIT, 0.0)
        self.split_steps = 0
        self.smoothed: torch.Tensor | None = None   # the step statistics weighted DECAY**age (summary.json's figures)
        self.queue_depth = [0, 0]                   # the feature-queue depth summed over this process's steps, steps
        self.pause_s = 0.0                          # seconds paused (checkpoints) since the last row
        self.split_set: dict[str, float] = {}
        self.last: dict = {}
        self.t_measure = None
        self.step = self.start_step = 0
        self.elapsed_base = 0.0   # a resumed run's elapsed_s before this process (start)
        self.graphs_after_warmup = None
        self.first_step_s = None
        self.train_s, self.finished_by = 0.0, None
        self.evals: list[dict] = []          # in-training evaluations (train.eval_every), as LiveEval records them
        self.pending_evals: list[dict] = []  # those not yet in a metrics.jsonl row
        self.eval_measured_s = 0.0           # their seconds inside the measured window (taken out of Ktok/s)
        self.paused_measured_s = 0.0         # those of the pauses (checkpoints) inside it (taken out too)
        self.started_at = datetime.now(timezone.utc)
        from dflash.model import uses_target
        self.distills = uses_target(self.cfg.train.objective)

    # -- called by the runtime ------------------------------------------------------------------------
    def set_warmup(self, records, seconds_: float):
        self.warmup, self.warmup_s = records, seconds_

    def set_training(self, seconds_: float, finished_by: str | None):
        """The training time the replicas agreed on (seconds after warm-up, over resumes) and, once the run reached
        its end, what ended it ("steps" | "time_budget"): summary.json's train_seconds and finished_by."""
        self.train_s, self.finished_by = seconds_, finished_by

    def start(self, start_step: int, history: list[dict] | None = None):
        """Begin at `start_step`; a resumed run's earlier rows (kept in its checkpoint) are written back first,
        so metrics.jsonl holds the whole run even when the file was deleted (Snakemake deletes a job's outputs), and
        the weighted step statistics the checkpoint kept (rows_upto) go on from there."""
        self.ctx.run_dir.mkdir(parents=True, exist_ok=True)
        kept = [r for r in (history or []) if r.get("step", 0) <= start_step] if start_step else []
        if kept and kept[-1].get("step") == start_step and kept[-1].get(SMOOTHED):
            self.smoothed = torch.tensor(kept[-1][SMOOTHED], dtype=torch.float64)
        self.rows = [{k: v for k, v in r.items() if k != SMOOTHED} for r in kept]
        # elapsed_s counts over resumes: a resumed run's rows continue from the last row kept (the last logged step
        # at or before the checkpoint's; the seconds of steps after that row and before the checkpoint are not counted)
        self.elapsed_base = float(self.rows[-1].get("elapsed_s") or 0.0) if self.rows else 0.0
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in self.rows))
        self.start_step = self.step = start_step
        self.started_at = datetime.now(timezone.utc)
        self.exclude_until = start_step + self.cfg.train.warmup_steps_excluded
        self.t_start = time.perf_counter()
        self.graphs_after_warmup = compile_guard.counters()
        if self.sampler is not None:
            self.sampler.start()  # utilisation from the first training step on, not during warm-up
        if self.exclude_until == start_step:
            self.t_measure = time.perf_counter()
        if self.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=self.cfg.train.steps, initial=start_step, desc=f"train {self.cfg.run_name}",
                            unit="step", dynamic_ncols=True, mininterval=0.5)

    def eval_done(self, record: dict):
        """An in-training evaluation of replica 0 ({step, tau, seconds, ...}: dflash/evaluate/live.py), made after
        its step and before that step's step_done: it joins the row of its logging interval."""
        with self.lock:
            self.evals.append(record)
            self.pending_evals.append(record)

    def step_done(self, step: int, stats: torch.Tensor, gnorm, lr: float, times: dict, qdepth: int):
        """Called by replica 0 after every optimizer step."""
        self.pending.append((step, stats, gnorm, lr, times, qdepth))
        self.step = step
        # on the device, no host sync: older steps' statistics decay by DECAY per step
        prev = self.smoothed
        self.smoothed = stats if prev is None else stats + DECAY * prev.to(stats.device)
        self.queue_depth[0] += qdepth
        self.queue_depth[1] += 1
        if self.first_step_s is None:
            import dflash
            self.first_step_s = round(time.time() - dflash.PROCESS_START, 2)
        if log_due(self.cfg.train, step, self.start_step):
            self.flush()

    def flush(self):
        """Write the pending steps as one row (one host sync). A non-finite loss or gradient norm stops the run."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        with self.lock:
            evals, self.pending_evals = self.pending_evals, []
        eval_s = sum(e["pause_s"] for e in evals)   # training paused for evaluations in this interval
        pause_s, self.pause_s = self.pause_s, 0.0      # and for checkpoints (paused)
        step = pending[-1][0]
        dev = pending[-1][1].device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        now = time.perf_counter()
        st, loss = interval_loss(torch.stack([p[1] for p in pending]).sum(0).tolist())   # the one host sync
        split = {k: sum(seconds(p[4][k]) for p in pending) for k in SPLIT}   # the interval's seconds of each part
        measured = self.t_measure is not None and pending[0][0] > self.exclude_until
        if measured:
            self._measure(len(pending), st, split, eval_s, pause_s, now)
        if step == self.exclude_until and self.t_measure is None:
            self.t_measure = now
        window = now - getattr(self, "_t_last", self.t_start) - eval_s - pause_s
        self._t_last = now
        gnorm = float(pending[-1][2])
        fig = figures(st, self.distills)
        row = {
            "step": step, "elapsed_s": round(self.elapsed_base + now - self.t_start, 3),
            # training seconds the replicas agreed on at this step (over resumes, pauses left out), x GPUs
            "train_s": round(self.train_s, 3), "gpu_s": self.gpu_seconds(self.train_s),
            "loss": fig["loss"], "lr": pending[-1][3], "grad_norm": _finite(gnorm),
            # the objective's parts, normalised as the loss: CE against the data, KL to the target (kl, ce+kl)
            "ce": fig["ce"], "kl": fig["kl"],
            "ktok_per_s": st["tokens"] / window / 1e3 if window > 0 else None,
            "acc_per_position": fig["acc_per_position"], "acceptance_estimate": fig["acceptance_estimate"],
            "time_split_s": {k: round(v / len(pending), 5) for k, v in split.items()},
            "queue_depth": pending[-1][5], "measured": measured,
            # tau of held-out prompts (train.eval_every), its step and training seconds, the pause; null between
            "tau": evals[-1]["tau"] if evals else None, "tau_step": evals[-1]["step"] if evals else None,
            "tau_train_s": evals[-1]["train_s"] if evals else None,
            "tau_gpu_s": self.gpu_seconds(evals[-1]["train_s"]) if evals else None,
            "eval_s": round(eval_s, 4) if evals else None,
        }
        if self.bar is None:
            self._log(row, loss)
        with self.lock:
            self.rows.append(row)
            self.last = row
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        check_finite(step, loss, gnorm)

    def _measure(self, steps: int, st: dict, split: dict, eval_s: float, pause_s: float, now: float) -> None:
        """Count an interval of measured steps (after the warm-up) towards Ktok/s and the time split; the pauses for
        evaluations and checkpoints left out of the measured seconds."""
        self.eval_measured_s += eval_s
        self.paused_measured_s += pause_s
        self.totals["tokens"] += st["tokens"]
        self.totals["positions"] += st["positions"]
        self.totals["samples"] += steps * len(self.ctx.placement.drafters) * self.cfg.train.grad_accum * \
            self.cfg.train.batch_size
        self.totals["steps"] += steps
        self.totals["seconds"] = now - self.t_measure - self.eval_measured_s - self.paused_measured_s
        for k in split:
            self.split_total[k] += split[k]
        self.split_steps += steps

    def _log(self, row: dict, loss: float | None) -> None:
        """A row as one log line (without a progress bar)."""
        acc1 = (row["acc_per_position"] or [None])[0]
        log.info("step %d/%d loss %s  %.3f Ktok/s  acc1 %s  accept %.2f%s", row["step"], self.cfg.train.steps,
                 f"{loss:.4f}" if loss is not None else "n/a", row["ktok_per_s"] or 0.0,
                 f"{acc1:.3f}" if acc1 is not None else "n/a", row["acceptance_estimate"] or 0.0,
                 f"  tau {row['tau']:.3f}" if row["tau"] is not None else "")

    def measured_window(self) -> tuple[float | None, float | None]:
        """(start, end) in perf_counter seconds of the measured steps (those Ktok/s counts); (None, None) before."""
        if self.t_measure is None or not self.totals["seconds"]:
            return None, None
        return self.t_measure, self.t_measure + self.totals["seconds"]

    def rows_upto(self, step: int) -> list[dict]:
        """The rows a checkpoint at `step` keeps (trainer.json `metrics`); when the last is `step`'s, it carries the
        weighted step statistics too (SMOOTHED), from which a run resumed there goes on (start)."""
        with self.lock:
            rows = [r for r in self.rows if r["step"] <= step]
        state = self._smoothed() if rows and rows[-1]["step"] == step == self.step else None
        if state is not None and all(map(math.isfinite, state)):
            rows[-1] = {**rows[-1], SMOOTHED: state}
        return rows

    def _smoothed(self) -> list[float] | None:
        if self.smoothed is None:
            return None
        if self.smoothed.device.type == "cuda":
            torch.cuda.synchronize(self.smoothed.device)
        return self.smoothed.tolist()

    def final(self) -> dict:
        """summary.json's loss, ce, kl, acc_per_position and acceptance_estimate: the figures of the step statistics
        weighted DECAY**age over every optimizer step of the run (age 0: its last step; a run resumed from a checkpoint
        of an older version weights only its own steps). None everywhere before the first step."""
        state = self._smoothed()
        if state is None:
            return dict.fromkeys(("loss", "ce", "kl", "acc_per_position", "acceptance_estimate"))
        return figures(split_stats(state), self.distills)

    def queue_depth_mean(self) -> float | None:
        """The feature-queue depth seen at each optimizer step of this process, averaged."""
        total, steps = self.queue_depth
        return total / steps if steps else None

    @contextlib.contextmanager
    def paused(self):
        """`with metrics.paused():` what stops training without being training (a checkpoint being written) is left
        out of Ktok/s, the row's window and the GPU utilisation, as the in-training evaluations are."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.pause_s += t1 - t0
            if self.sampler is not None:
                self.sampler.exclude(t0, t1)

    def refresh(self):
        if self.bar is None:
            return
        with self.lock:
            last = dict(self.last)
            tau = self.evals[-1]["tau"] if self.evals else None
        self.bar.n = self.step
        if last:
            self.bar.set_postfix(loss=f"{last['loss'] or 0:.3f}", ktok_s=f"{last['ktok_per_s'] or 0:.2f}",
                                 acc1=f"{(last['acc_per_position'] or [0])[0] or 0:.2f}",
                                 **({"tau": f"{tau:.2f}"} if tau is not None else {}), refresh=False)
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.refresh()
            self.bar.close()
            self.bar = None
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 — the run is ending; its status already says why
            log.warning("last metrics row: %s", e)

    # -- measured figures -------------------------------------------------------------------------------
    def throughput(self) -> dict:
        from dflash.train import flops
        s = self.totals["seconds"]
        if not s:
            return {"ktok_per_s": None, "samples_per_s": None, "draft_positions_per_s": None, "mfu": None,
                    "mfu_target": None, "mfu_drafter": None, "measured_seconds": 0.0}
        out = {"ktok_per_s": self.totals["tokens"] / s / 1e3, "samples_per_s": self.totals["samples"] / s,
               "draft_positions_per_s": self.totals["positions"] / s, "measured_seconds": round(s, 3)}
        gpus, ceiling = self.ctx.placement.gpu_count, self.cfg.train.matmul_tflops
        if not gpus or not ceiling:
            return {**out, "mfu": None, "mfu_target": None, "mfu_drafter": None}
        # achieved matmul FLOP/s over the measured bf16 ceiling times the number of GPUs used
        d = self.ctx.drafter_config
        tokens, samples = self.totals["tokens"], self.totals["samples"]
        mean_len = tokens / samples if samples else 0
        # kl / ce+kl: the target runs every layer, and the loss makes the target's logits (one forward matmul)
        layers = self.ctx.target_config.num_hidden_layers if self.distills else max(d.target_layer_ids) + 1
        f_t = flops.target_forward(self.ctx.target_config, int(mean_len), layers) * samples
        f_d = flops.drafter_train(d, int(mean_len), self.ctx.anchors_for(int(mean_len)), 0) * samples + \
            (3 + self.distills) * 2 * d.hidden_size * d.vocab_size * self.totals["positions"]
        peak = ceiling * 1e12 * gpus * s
        return {**out, "mfu": (f_t + f_d) / peak, "mfu_target": f_t / peak, "mfu_drafter": f_d / peak}

    def eval_summary(self) -> dict | None:
        """summary.json `eval`: the in-training evaluations of this process (train.eval_every; None when off): their
        count, seconds (total, per evaluation), the training step's mean seconds without them and the ratio, their
        share of the loop's wall time (Ktok/s and the training time exclude them), the last tau and its step, and the
        curve: each evaluation's step, training seconds, GPU-seconds and tau."""
        if not self.cfg.train.eval_every:
            return None
        total = sum(e["pause_s"] for e in self.evals)   # what training paused for them
        t_start = getattr(self, "t_start", None)   # None: the run failed before its first step
        loop_s = getattr(self, "_t_last", t_start) - t_start if t_start is not None else 0.0
        steps = self.step - self.start_step
        step_s = (loop_s - total) / steps if steps and loop_s > total else None
        per_eval = total / len(self.evals) if self.evals else None
        last = self.evals[-1] if self.evals else {}
        return {"every": self.cfg.train.eval_every, "prompts": last.get("prompts"),
                "max_new_tokens": last.get("max_new_tokens"),
                "evals": len(self.evals), "steps": [e["step"] for e in self.evals],
                "seconds": round(total, 3), "seconds_per_eval": per_eval, "step_s": step_s,
                "eval_over_step": per_eval / step_s if per_eval and step_s else None,
                "share": total / loop_s if loop_s > 0 else None,
                "tau": last.get("tau"), "step": last.get("step"), "method": last.get("method"),
                "tau_history": [e["tau"] for e in self.evals],
                "curve": [{"step": e["step"], "train_s": e["train_s"], "gpu_s": self.gpu_seconds(e["train_s"]),
                           "tau": e["tau"]} for e in self.evals]}

    def gpu_seconds(self, train_s: float) -> float | None:
        """GPU-seconds of `train_s` training seconds: x the run's GPUs (None on the CPU)."""
        gpus = self.ctx.placement.gpu_count
        return round(train_s * gpus, 3) if gpus else None

    def set_split(self, key: str, seconds_per_step: float):
        """A part of the time split measured outside this process (the distributed runtime's target ranks): its
        mean seconds per measured optimizer step."""
        self.split_set[key] = seconds_per_step

    def time_split(self) -> dict:
        return {k: (self.split_set.get(k, v / self.split_steps) if self.split_steps else None)
                for k, v in self.split_total.items()}
