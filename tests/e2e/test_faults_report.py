"""Issue 40, rules 8 and 10: a reported figure does not depend on an operational key; the console and the report speak
to the user (no known-harmless library lines at stage start, report.md answers a new user's three questions first)."""
import json
import logging
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from support.report_factory import acceptance, settings, summary, write_run
from dflash.cli import main
from support.train import REPO, prepared, run_dir, train_ok

from dflash.config import from_dict
from dflash.train import metrics as M

FIGURES = ("loss", "ce", "kl", "acc_per_position", "acceptance_estimate")


# ---- rule 8: summary.json's figures ------------------------------------------------------------------------------
def _metrics(tmp_path: Path, **train) -> M.RunMetrics:
    cfg = from_dict({"train": {"steps": 12, "warmup_steps_excluded": 2, **train}}).cfg
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, placement=SimpleNamespace(drafters=["cpu"], gpu_count=0))
    return M.RunMetrics(ctx, progress=False)


def _stats(step: int, k: int = 3) -> torch.Tensor:
    """A step's loss_stats vector (its layout), different every step."""
    g = torch.Generator().manual_seed(step)
    w = 1 + torch.rand((), generator=g, dtype=torch.float64)
    loss = 4 - step / 10 + torch.rand((), generator=g, dtype=torch.float64)
    count = torch.tensor([8.0] * k, dtype=torch.float64)
    correct = torch.floor(torch.rand(k, generator=g, dtype=torch.float64) * 8)
    f64 = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    head = torch.stack([loss * w, w, f64(100.0 + step), count.sum(), f64(2.0), correct.sum() / 4, loss * w, f64(0.0)])
    return torch.cat([head, correct, count])


def _run(m: M.RunMetrics, steps: range, checkpoints: tuple = (), evals: tuple = ()) -> None:
    """Feed the steps as the trainer does: an evaluation before its step's step_done, a checkpoint's flush after."""
    for step in steps:
        if step in evals:
            m.eval_done({"step": step, "tau": 1 + step / 100, "train_s": float(step), "pause_s": 0.0})
        m.step_done(step, _stats(step), 1.0, 1e-3, dict.fromkeys(M.SPLIT, 0.01), step % 4)
        if step in checkpoints:
            m.flush()


def test_final_figures_are_the_same_whatever_the_logging_interval(tmp_path):
    """summary.json's loss was the last row's interval: train.log_every changed it (3.1733 against 3.1959 for
    bit-identical weights). Now every figure is the steps' statistics weighted DECAY**age, as written here."""
    runs = []
    for i, (log_every, checkpoints) in enumerate(((1, ()), (5, (4, 8)), (12, (7,)))):
        m = _metrics(tmp_path / str(i), log_every=log_every)
        m.start(0)
        _run(m, range(1, 13), checkpoints)
        m.close()
        runs.append(m)
    finals = [m.final() for m in runs]
    assert finals[0] == finals[1] == finals[2]
    w = [M.DECAY ** (12 - s) for s in range(1, 13)]
    st = [M.split_stats(_stats(s).tolist()) for s in range(1, 13)]
    loss = sum(a * x["loss_sum"] for a, x in zip(w, st)) / sum(a * x["weight_sum"] for a, x in zip(w, st))
    assert finals[0]["loss"] == pytest.approx(loss, rel=1e-12) and finals[0]["kl"] is None
    assert finals[0]["acc_per_position"][0] == pytest.approx(
        sum(a * x["correct"][0] for a, x in zip(w, st)) / sum(a * x["count"][0] for a, x in zip(w, st)), rel=1e-12)
    # the queue depth of every step (not of the rows' last steps), the measured window, the time split per step
    assert {m.queue_depth_mean() for m in runs} == {sum(s % 4 for s in range(1, 13)) / 12}
    tokens = sum(100.0 + s for s in range(3, 13))
    assert {(m.totals["steps"], m.totals["tokens"], m.split_steps) for m in runs} == {(10, tokens, 10)}
    assert [m.time_split()["drafter"] for m in runs] == [pytest.approx(0.01)] * 3


def test_a_resumed_run_goes_on_with_the_weighted_statistics_its_checkpoint_kept(tmp_path):
    straight = _metrics(tmp_path / "a", log_every=2)
    straight.start(0)
    _run(straight, range(1, 13))
    first = _metrics(tmp_path / "b", log_every=3)
    first.start(0)
    _run(first, range(1, 8), checkpoints=(7,))
    kept = json.loads(json.dumps(first.rows_upto(7)))      # as trainer.json keeps them
    assert kept[-1]["step"] == 7 and len(kept[-1][M.SMOOTHED]) == 14
    resumed = _metrics(tmp_path / "b", log_every=5)
    resumed.start(7, kept)
    _run(resumed, range(8, 13))
    assert resumed.final() == straight.final()
    assert M.SMOOTHED not in (tmp_path / "b" / "metrics.jsonl").read_text()   # only the checkpoint keeps it


def test_every_in_training_evaluation_gets_its_own_row(tmp_path):
    """train.eval_every 3 with train.log_every 10: the rows at 10 and 12 held the tau of steps 9 and 12 only, so
    report.md's tau-while-training line and the training plot lost the evaluations of steps 3 and 6."""
    for log_every in (1, 10):
        m = _metrics(tmp_path / str(log_every), log_every=log_every, eval_every=3)
        m.start(0)
        _run(m, range(1, 13), evals=(3, 6, 9, 12))
        m.close()
        rows = [json.loads(x) for x in (tmp_path / str(log_every) / "metrics.jsonl").read_text().splitlines()]
        assert [(r["tau_step"], r["tau"]) for r in rows if r["tau"] is not None] == \
            [(s, 1 + s / 100) for s in (3, 6, 9, 12)]


def test_pauses_for_checkpoints_are_left_out_of_ktok_s(tmp_path, monkeypatch):
    """The trainer writes a checkpoint inside `metrics.paused()`: its seconds are left out of the measured window, as
    an evaluation's are (on fake time: 1 s per step, a 30 s checkpoint after step 6)."""
    now = [0.0]
    monkeypatch.setattr(M.time, "perf_counter", lambda: now[0])
    m = _metrics(tmp_path, log_every=4)
    m.start(0)
    for step in range(1, 13):
        now[0] += 1.0
        m.step_done(step, _stats(step), 1.0, 1e-3, dict.fromkeys(M.SPLIT, 0.01), 0)
        if step == 6:
            m.flush()
            with m.paused():
                now[0] += 30.0
    assert m.totals["seconds"] == 10.0 and m.throughput()["measured_seconds"] == 10.0
    assert m.rows[-1]["ktok_per_s"] == pytest.approx(sum(100.0 + s for s in (9, 10, 11, 12)) / 4 / 1e3)


def _report(runs_dir: Path, out: Path) -> tuple[dict, str]:
    from dflash.report import build
    build(runs_dir, out, settings())
    rows = list(__import__("csv").DictReader((out / "history.csv").open()))
    return rows[-1], (out / "report.md").read_text()


def test_log_every_and_checkpoint_every_change_no_reported_figure_even_over_a_resume(tmp_path):
    """The tiny CPU training three ways: log_every 1 and checkpoint_every 4 straight through; log_every 4 and
    checkpoint_every 5, stopped at step 7 and resumed from step 5 with log_every 4. The weights are bit-identical, and
    so is every figure summary.json, history.csv and report.md give of them."""
    one = {"steps": 10, "drafters": ["cpu"]}
    a = prepared(tmp_path / "a", log_every=1, checkpoint_every=4, **one)
    train_ok(a)
    stop = {"worker": "drafter-0", "step": 7}
    b = prepared(tmp_path / "b", log_every=4, checkpoint_every=5, fail_at_step=stop, **one)
    assert main(["train", "--config", str(b), "--no-progress"]) == 1
    raw = yaml.safe_load(b.read_text())
    raw["train"].update(log_every=4, fail_at_step=None)   # its last row: steps 9-10 (the first run's: 10)
    b.write_text(yaml.safe_dump(raw))
    train_ok(b)
    sa, sb = (json.loads((run_dir(c) / "summary.json").read_text()) for c in (a, b))
    assert 5 <= sb["resumed_from_step"] < 10 and sa["replica_checksums"] == sb["replica_checksums"]
    assert {k: sa[k] for k in FIGURES} == {k: sb[k] for k in FIGURES} and sa["loss"] is not None
    assert (sa["steps"], sa["checkpoint"]["step"]) == (sb["steps"], sb["checkpoint"]["step"]) == (10, 10)
    (ra, ma), (rb, mb) = (_report(run_dir(c).parent, tmp_path / c.parent.name / "report") for c in (a, b))
    assert (ra["loss"], ra["acceptance_estimate"]) == (rb["loss"], rb["acceptance_estimate"])
    cell = re.compile(r"^\| t-\S+ \|(?:[^|]*\|){3} ([0-9.]+) \|", re.M)       # report.md's loss column
    assert cell.search(ma).group(1) == cell.search(mb).group(1) == f"{sa['loss']:.3f}"


# ---- rule 10a: no known-harmless library lines at stage start -------------------------------------------------
HARMLESS_SEEN = ("Failed to load", "Detected no triton", "is an Enum subclass and is now natively supported",
                 "Loading weights")


def test_a_stage_shows_no_known_harmless_library_line_and_still_shows_a_genuine_warning(tmp_path):
    """`python -m dflash train` on the CPU printed torchao's missing-kernel lines and torch's `_pytree` deprecations
    (5 lines at every stage that loads a model, 22 in `make demo`), and transformers' progress bar into the log. Now
    none shows, while a genuine warning (buckets too short for train.num_anchors) still does."""
    cfg = prepared(tmp_path, steps=2, num_anchors=300, checkpoint_every=0, drafters=["cpu"], warmup_steps_excluded=1)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    r = subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--no-progress"], cwd=REPO,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [line for line in r.stderr.splitlines() if any(h in line for h in HARMLESS_SEEN)], r.stderr[-3000:]
    assert re.search(r"WARNING dflash\.train: .*asks for more anchors than the positions of bucket", r.stderr)


def test_only_the_listed_lines_are_dropped(caplog):
    """The filters match the known lines exactly: anything else the same loggers say still reaches the handlers."""
    from dflash import quiet
    quiet.install()
    quiet.install()   # once is enough; twice adds nothing
    assert [len(logging.getLogger(n).filters) for n, _ in quiet.HARMLESS] == [1, 1, 1]
    with caplog.at_level(logging.WARNING):
        ao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
        ao.warning("Failed to load /v/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                   "Could not load this library: /v/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")
        ao.warning("Failed to load /v/torchao/_C_cutlass_90a.abi3.so: Could not load this library: x")
        logging.getLogger("torchao.kernel.intmm").warning(
            "Warning: Detected no triton, on systems without Triton certain kernels will not work")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value "
                       "type.", "<enum 'KernelPreference'>")
        ao.warning("Failed to load /v/torchao/_C_mxfp8.so: undefined symbol: _ZN3c10")       # a real fault
        ao.warning("Skipping import of cpp extensions due to incompatible torch version.")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile", "<enum 'Mine'>")
    assert [r.getMessage()[:40] for r in caplog.records] == [
        "Failed to load /v/torchao/_C_mxfp8.so: u", "Skipping import of cpp extensions due to",
        "<enum 'Mine'> is an Enum subclass and is"]


# ---- rule 10b: report.md answers where the drafter is, how good it is, how long and how fast it trained ------------
def _newest(tmp_path, s: dict, evaluation: dict | None, exported: bool = True, exported_at: float | None = None):
    """report.md's three answers about run `s` (its drafter exported or not; at `exported_at`, a Unix time)."""
    runs = tmp_path / "runs"
    folder = write_run(runs, s, folder="demo", tau=None, evaluation=evaluation)
    if exported:
        (folder / "drafter").mkdir()
        (folder / "drafter" / "config.json").write_text("{}")
        if exported_at is not None:
            os.utime(folder / "drafter" / "config.json", (exported_at, exported_at))
    _, md = _report(runs, tmp_path / "report")
    top = md.split("**Latest run")[0]
    return [line for line in top.splitlines() if line.startswith("- **")]


def test_report_md_answers_a_new_users_three_questions_first(tmp_path):
    s = dict(summary(1, ktok=12.5), train_seconds=3600.0, resumed_from_step=None,
             started_at="2026-11-01T10:00:00+00:00", finished_at="2026-11-01T11:05:00+00:00")
    where, good, fast = _newest(tmp_path, s, acceptance(s, 6.4321, speedup=3.217, lossless=True, dtype="bfloat16",
                                                          device="cuda:0"))
    assert where == f"- **Where the drafter is:** `{tmp_path / 'runs' / 'demo' / 'drafter'}/`: config.json, " \
        "model.safetensors and a model card (README.md), the folder the reference package, SGLang and vLLM load " \
        "(docs/serving.md)."
    assert good == "- **How good it is:** tau 6.432 (tokens per target forward, greedy, 16 held-out prompts x 64 " \
        "tokens): up to about 6.43x the speed of plain decoding where verifying a block costs one decoding step (a " \
        "large target on a GPU); measured 3.22x plain decoding's tokens/s (cuda:0, bfloat16); lossless: its output " \
        "equals plain greedy decoding on every prompt."
    assert fast == "- **How long and how fast it trained:** 120 steps in 1 h 0 min of training on 8 GPUs, 8.00 " \
        "GPU-hours (1 h 5 min of wall clock from the first step to the summary, in-training evaluations included), " \
        "12.50 Ktok/s trained."


def test_report_md_says_what_is_missing_or_wrong_about_the_newest_drafter(tmp_path):
    s = dict(summary(1), train_seconds=72.04, started_at="2026-11-01T10:00:00+00:00",
             finished_at="2026-11-01T10:01:18+00:00", eval={"tau": 1.94, "step": 120},
             env=dict(summary(1)["env"], gpu={"count": 0}, cpu="Xeon"),
             devices=[{"device": "cpu", "roles": ["drafter"]}])
    where, good, fast = _newest(tmp_path / "a", s, None, exported=False)
    assert where == f"- **Where the drafter is:** not exported yet: the export stage writes it to " \
        f"`{tmp_path / 'a' / 'runs' / 'demo' / 'drafter'}/`."
    assert good == "- **How good it is:** not evaluated yet: the evaluate stage writes its tau to acceptance.json " \
        "(tau 1.940 while training, at step 120)."
    assert fast == "- **How long and how fast it trained:** 120 steps in 1 min 12 s of training on cpu Xeon " \
        "(1 min 18 s of wall clock from the first step to the summary, in-training evaluations included), 12.00 " \
        "Ktok/s trained."
    _, good, _ = _newest(tmp_path / "b", s, acceptance(s, 1.5, lossless=False, speedup=None))
    assert good.endswith("speed-up not measured; **not lossless**: its output differs from plain greedy decoding "
                         "(acceptance.json `sets`).")
    where, good, _ = _newest(tmp_path / "c", s, acceptance(s, 2.035, lossless=True, speedup=0.2149))
    assert where.startswith("- **Where the drafter is:** `")                   # exported after the run finished
    assert "; measured 0.21x plain decoding's tokens/s (cpu, float32; slower: here a speculative step costs more " \
        "than the plain steps it saves); lossless" in good
    before = datetime(2026, 11, 1, 9, tzinfo=timezone.utc).timestamp()
    where, _, _ = _newest(tmp_path / "d", s, None, exported_at=before)
    assert where == f"- **Where the drafter is:** `{tmp_path / 'd' / 'runs' / 'demo' / 'drafter'}/` holds an export " \
        "made before this run finished (an earlier run's): rerun the export stage."
    from dflash.report.history import Run
    from dflash.report.markdown import answers
    assert answers(Run(row={"run_id": "demo-1", "tau": "1.9", "ktok_per_s": ""}, restored_from="history.csv:2")) == [
        "Newest run `demo-1` (restored from history.csv, its run folder and snapshot gone): tau 1.90, not measured "
        "Ktok/s trained.", ""]
