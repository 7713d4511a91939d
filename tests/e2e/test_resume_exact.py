"""Issue 47 item 5: resume changes nothing that is learned. A run cut at any step and resumed ends with the uncut run's
weights, optimizer moments, data index, schedule state, metrics rows and 0.9^age summary figures, bit for bit; under a
time budget too, where "the same" is defined on a clock where each training step takes the same time: the training
time counts training steps only (warm-up, checkpoint writes and in-training evaluations left out), the schedule's state
(`elapsed_s`) is restored exactly, so the cut run follows the uncut run's LR at every step and ends at the same step.
The distributed runtime's cut (gloo) is in tests/e2e/test_distributed.py (its one uncut launch serves both).
In process, the threads runtime (tests/support/train.py)."""
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.train import ckpt, home, prepared, run_dir, train_ok

LEARNED = ("step", "loss", "ce", "lr", "grad_norm", "acc_per_position", "acceptance_estimate")
FIGURES = ("steps", "loss", "ce", "acc_per_position", "acceptance_estimate", "finished_by")
TIMED = ("train_s",)   # the training time: learned from (the schedule) under a time budget, on the step clock


def rows(cfg: Path, keys=LEARNED) -> list[dict]:
    return [{k: r[k] for k in keys} for r in map(json.loads, (run_dir(cfg) / "metrics.jsonl").read_text()
                                                 .splitlines())]


def cut(uncut: Path, cfg: Path, step: int) -> None:
    """`cfg`'s run folder as the uncut run's was when it was cut after checkpoint `step`: its checkpoints up to `step`
    (the same identity), no later one, no outputs (Snakemake deletes them before it reruns train)."""
    shutil.rmtree(run_dir(cfg), ignore_errors=True)
    folder = run_dir(cfg) / home(uncut).relative_to(run_dir(uncut))
    folder.mkdir(parents=True)
    for p in home(uncut).glob("step-*"):
        if int(p.name.split("-")[1]) <= step:
            shutil.copytree(p, folder / p.name)


def same_end(uncut: Path, resumed: Path, final: int, timed: bool = False) -> None:
    """The final checkpoints hold the same weights, optimizer moments and trainer state (data index, metrics rows with
    the smoothed statistics; `timed`: the schedule's state, the training time); the outputs the same learned
    figures."""
    learned = LEARNED + TIMED * timed
    a, b = ckpt(uncut, final), ckpt(resumed, final)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = (torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b))
    def flat(state):   # every optimizer's every moment tensor, in order
        return [(k, t) for g in state.values() for st in g["state"].values() for k, t in sorted(st.items())]
    assert [(k, torch.equal(x, y)) for (k, x), (_, y) in zip(flat(oa), flat(ob))] == [(k, True) for k, _ in flat(oa)]
    assert [g["lr"] for s in oa.values() for g in s["param_groups"]] == \
        [g["lr"] for s in ob.values() for g in s["param_groups"]]
    ta, tb = (json.loads((p / "trainer.json").read_text()) for p in (a, b))
    assert (ta["data_index"], ta["finished_by"]) == (tb["data_index"], tb["finished_by"])
    assert not timed or ta["scheduler"] == tb["scheduler"]
    assert [{k: r.get(k) for k in (*learned, "smoothed_stats")} for r in ta["metrics"]] == \
        [{k: r.get(k) for k in (*learned, "smoothed_stats")} for r in tb["metrics"]]
    assert rows(uncut, learned) == rows(resumed, learned)
    sa, sb = (json.loads((run_dir(c) / "summary.json").read_text()) for c in (uncut, resumed))
    figures = FIGURES + ("train_seconds",) * timed
    assert {k: sa[k] for k in figures} == {k: sb[k] for k in figures}


def test_a_run_cut_at_any_step_and_resumed_ends_as_the_uncut_run(tmp_path):
    """Two replicas, a checkpoint at every step, metrics rows every 2 steps (so a resumed interval spans the cut):
    cut after each step 1..4 of 5 and resumed, the run ends as the uncut one, bit for bit (optimizer moments, data
    order and anchors through the data index, the LR schedule, the 0.9^age statistics of summary.json)."""
    uncut = prepared(tmp_path / "a", steps=5, checkpoint_every=1, log_every=2, warmup_steps_excluded=1)
    train_ok(uncut)
    resumed = prepared(tmp_path / "b", steps=5, checkpoint_every=1, log_every=2, warmup_steps_excluded=1)
    for step in range(1, 5):
        cut(uncut, resumed, step)
        train_ok(resumed)
        assert json.loads((run_dir(resumed) / "summary.json").read_text())["resumed_from_step"] == step
        same_end(uncut, resumed, 5)


class StepClock:
    """The trainer's clock on fake time where each training step takes 1 s (the micro-step advances it) and writing a
    checkpoint `slow_save_s` (a slow disk): what a resume must not change is defined on it."""

    def __init__(self, monkeypatch, slow_save_s: float):
        from dflash.train import checkpoint, trainer
        self.local = threading.local()
        monkeypatch.setattr(trainer.Replica, "clock", staticmethod(lambda: getattr(self.local, "now", 0.0)))
        step, save = trainer.micro_step, checkpoint.save

        def micro_step(*a, **k):
            self.local.now = getattr(self.local, "now", 0.0) + 1.0
            return step(*a, **k)

        def slow_save(*a, **k):
            self.local.now = getattr(self.local, "now", 0.0) + slow_save_s
            return save(*a, **k)
        monkeypatch.setattr(trainer, "micro_step", micro_step)
        monkeypatch.setattr(checkpoint, "save", slow_save)

    def restart(self):
        """A new process: its clock starts anew."""
        self.local = threading.local()


@pytest.mark.parametrize("at", [2, 5])
def test_a_time_budget_run_cut_and_resumed_follows_the_uncut_schedule(tmp_path, monkeypatch, at):
    """train.time_budget_s 8 s, one replica, 1 s per step and 3 s per checkpoint written (every 2 steps): the
    training time counts the steps only, so the run ends after step 8 at 8.0 s with the LR of 1, 2, ... 8 s. Cut after
    step `at` and resumed, it follows the same LR at every step and ends at the same step with the same weights. On
    eb0a841 the uncut run counted its checkpoint writes as training time and a resumed one did not count the write of
    the checkpoint it resumed from: the two schedules parted at the cut."""
    import math
    clock = StepClock(monkeypatch, slow_save_s=3.0)
    keys = dict(steps=50, time_budget_s=8, warmup_ratio=0.25, min_lr_ratio=0.1, lr=1e-3, log_every=1,
                checkpoint_every=1 if at == 5 else 2, drafters=["cpu"], warmup_steps_excluded=1)
    uncut = prepared(tmp_path / "a", **keys)
    train_ok(uncut)
    s = json.loads((run_dir(uncut) / "summary.json").read_text())
    assert (s["steps"], s["finished_by"], s["train_seconds"]) == (8, "time_budget", 8.0)
    want = [1e-3 * (t / 2 if t < 2 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (t - 2) / 6))) for t in range(1, 9)]
    assert [r["lr"] for r in rows(uncut)] == pytest.approx(want, rel=1e-12)
    resumed = prepared(tmp_path / "b", **keys)
    cut(uncut, resumed, at)
    clock.restart()
    train_ok(resumed)
    assert json.loads((run_dir(resumed) / "summary.json").read_text())["resumed_from_step"] == at
    same_end(uncut, resumed, 8, timed=True)
