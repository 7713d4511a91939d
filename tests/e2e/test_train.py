"""The threads runtime end to end on CPU: replicas in lockstep, exact resume after kill -9, failures named fast,
Ctrl-C checkpoints. Tiny target (tests/support/data.py), the built-in corpus without regeneration, sdpa."""
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dflash.cli import main
from dflash.records.summary import RunSummary
from dflash.records.checkpoint import Finished, TrainerState
from support.train import REPO, ckpt, home, prepared, run_dir, stop_here, train_ok

STOP_STEPS = 8   # steps a run may take from the signal to its stop: the logging interval (2), the step agreed on, slack

def test_two_replicas_train_in_lockstep(tmp_path):
    cfg = prepared(tmp_path)
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    RunSummary.model_validate(s)                                      # exactly dflash/records/summary.py's keys and types
    assert s["status"] == "completed" and s["steps"] == 12 and s["measured_steps"] == 10
    assert s["replicas_identical"] is True and len(s["replica_checksums"]) == 2
    assert s["throughput"]["ktok_per_s"] > 0 and s["compile"]["recompiles_after_warmup"] == 0
    assert {w["name"] for w in s["workers"]} == {"reader", "target-0", "drafter-0", "drafter-1"}
    assert all(w["steps"] > 0 for w in s["workers"])
    rows = [json.loads(l) for l in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert len(rows[-1]["acc_per_position"]) == 3  # block 4 -> positions 1..3
    assert sorted(p.name for p in home(cfg).iterdir()) == ["finished.json", "step-000004", "step-000008", "step-000012"]
    assert s["checkpoint"]["path"] == f"checkpoints/{home(cfg).name}/step-000012"   # what evaluate and export read
    # the checkpoint's trainer state and the finished run's record: exactly their models (records/checkpoint.py)
    state = TrainerState.model_validate_json((ckpt(cfg, 12) / "trainer.json").read_text())
    assert (state.step, state.finished_by, [r["step"] for r in state.metrics]) == (12, "steps", [2, 4, 6, 8, 10, 12])
    assert "smoothed_stats" in state.metrics[-1] and state.scheduler["elapsed_s"] > 0
    record = Finished.model_validate_json((home(cfg) / "finished.json").read_text())
    assert record.checkpoint.model_dump() == s["checkpoint"]
    assert record.outputs["summary.json"] == (run_dir(cfg) / "summary.json").read_text()
    # the target it trained on, as evaluate checks it: every file's size and mtime, the sha256 of the small ones
    import yaml

    from dflash.target import target_problem
    target = Path(yaml.safe_load(cfg.read_text())["target"]["path"])
    files = s["target_files"]
    assert files["config.json"]["size"] == (target / "config.json").stat().st_size and "sha256" in files["config.json"]
    assert "model.safetensors" in files and target_problem(target, files) is None
    copy = shutil.copytree(target, tmp_path / "target-copy")           # the shared tiny target stays untouched
    with open(copy / "config.json", "a") as f:
        f.write(" ")
    assert "config.json" in target_problem(copy, files)


def test_rerun_resumes_an_interrupted_run_restores_a_finished_one_and_retrains_it_when_told(tmp_path, caplog):
    """Snakemake deletes a job's outputs before rerunning it (`-R train`, a failed job, a newer input). A run whose
    final checkpoint is damaged resumes from the previous intact one (one line says which was skipped); a finished
    run with the same config and data is restored, not retrained (a newer but identical fingerprint, `-R data` with
    unchanged data, `--rerun-incomplete`); `--retrain` (what `snakemake -R train` passes) trains a new run, its
    checkpoints set aside in checkpoints.previous/."""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2)
    train_ok(cfg)
    final = ckpt(cfg, 4) / "model.safetensors"
    first = {k: v.clone() for k, v in load_file(str(final)).items()}  # not a view of the file truncated next
    final.write_bytes(final.read_bytes()[:1000])
    train_ok(cfg)
    assert [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()] == \
        [f"checkpoint {final.parent} skipped: model.safetensors is 1000 bytes, manifest.json says "
         f"{json.loads((final.parent / 'manifest.json').read_text())['files']['model.safetensors']['bytes']} "
         f"(truncated or overwritten)"]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["resumed_from_step"] == 2 and s["status"] == "completed" and s["steps"] == 4
    for k, v in load_file(str(final)).items():   # retrained exactly from step 2
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    outputs = {n: (run_dir(cfg) / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}
    for name in outputs:
        (run_dir(cfg) / name).unlink()
    caplog.clear()
    train_ok(cfg)
    assert {n: (run_dir(cfg) / n).read_bytes() for n in outputs} == outputs     # restored byte for byte
    assert any("finished at step 4" in r.getMessage() and "restored, nothing trained" in r.getMessage()
               for r in caplog.records)
    assert not any("step 1/4" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (run_dir(cfg) / "checkpoints").iterdir()] == [home(cfg).name]
    caplog.clear()
    train_ok(cfg, "--retrain")
    assert any("the run finished at step 4" in r.getMessage() for r in caplog.records)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["resumed_from_step"] is None and s["status"] == "completed" and s["steps"] == 4
    assert sorted(p.name for p in home(cfg).with_name(home(cfg).name + ".1").iterdir()) == \
        ["finished.json", "step-000002", "step-000004"]                # the retrained run: set aside, kept


def test_an_operational_key_changed_on_an_interrupted_run_resumes_it(tmp_path, caplog):
    """Rule 2: only keys that change the trained drafter start a new run. A run stopped at step 5 (the test hook
    makes it fail there), then rerun with another train.log_every, stall timeout and no hook, resumes from its step-4
    checkpoint (it started from scratch: every train key was in the identity)."""
    cfg = prepared(tmp_path, steps=6, checkpoint_every=2, fail_at_step={"worker": "drafter-0", "step": 5})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1
    raw = yaml.safe_load(cfg.read_text())
    raw["train"].update(log_every=3, stall_timeout_s=900, fail_at_step=None)
    cfg.write_text(yaml.safe_dump(raw))
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["resumed_from_step"] == 4 and s["status"] == "completed" and s["steps"] == 6
    assert not any("starting from scratch" in r.getMessage() for r in caplog.records)


def test_kill9_then_resume_trains_exactly_the_same(tmp_path):
    steps = 40   # long enough that the kill lands mid-run however loaded the machine is
    straight = prepared(tmp_path / "a", steps=steps)
    train_ok(straight)
    killed = prepared(tmp_path / "b", steps=steps)
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(killed), "--no-progress"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    made = lambda: list((run_dir(killed) / "checkpoints").glob("*/step-000008/trainer.json"))  # noqa: E731
    deadline = time.time() + 300
    while not made() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert made()
    done = sorted(p.name for p in home(killed).iterdir() if not p.name.startswith("."))
    final = f"step-{steps:06d}"
    assert final not in done  # killed mid-run
    (run_dir(killed) / "metrics.jsonl").unlink()    # Snakemake deletes a job's outputs before rerunning it
    train_ok(killed)
    rows = [json.loads(x) for x in (run_dir(killed) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(2, steps + 1, 2))   # the steps before the kill are kept
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0   # seconds of training over the resume, never from 0 again
    s = json.loads((run_dir(killed) / "summary.json").read_text())
    assert s["resumed_from_step"] == int(done[-1].split("-")[1]) and s["status"] == "completed"
    a = load_file(str(home(straight) / final / "model.safetensors"))
    b = load_file(str(home(killed) / final / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:  # same data order, same anchors, same updates: nothing skipped, nothing trained twice
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    ta = json.loads((home(straight) / final / "trainer.json").read_text())
    tb = json.loads((home(killed) / final / "trainer.json").read_text())
    assert ta["data_index"] == tb["data_index"] == steps * 2


@pytest.mark.parametrize("step", [0, 3])
def test_failing_replica_stops_the_run_fast_and_is_named(tmp_path, step, monkeypatch):
    from dflash.train import failures
    cfg = prepared(tmp_path, fail_at_step={"worker": "drafter-1", "step": step}, steps=40)
    failed, after = [], []                             # the injected failure; steps any worker began after it
    original = failures.injector

    def spy(train_cfg, name):
        fail = original(train_cfg, name)

        def counted(k):
            if failed:
                after.append(k)
            try:
                fail(k)
            except failures.InjectedFailure:
                failed.append(k)
                raise
        return counted

    monkeypatch.setattr(failures, "injector", spy)
    code = main(["train", "--config", str(cfg), "--no-progress"])
    assert code == 1 and failed == [step]
    assert max(after, default=step) <= step + 2          # the others stop within a step or two, not after all 40
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "failed" and (s["failure"]["kind"], s["failure"]["worker"]) == ("worker", "drafter-1")


def test_failure_message_names_the_worker(tmp_path, caplog):
    cfg = prepared(tmp_path, fail_at_step={"worker": "target-0", "step": 2})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1   # in process: the same log lines, no launch
    assert "worker target-0 failed" in caplog.text and "injected failure at step 2" in caplog.text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_stop_signals_checkpoint_and_exit_nonzero(tmp_path, sig, caplog):
    """Ctrl-C, what SLURM and scancel send (SIGTERM), a scheduler's early warning (SIGUSR1): the replicas finish
    their step, write a checkpoint, and the run exits 128 + the signal. In this process (the signal sent to it while
    it trains; no launch): tests/e2e/test_faults_runs.py's SIGHUP test stops a `python -m dflash train` process."""
    code, logged, s, last = stop_here(prepared(tmp_path, steps=400, checkpoint_every=0), sig)
    assert code == 128 + sig, s.get("failure")
    assert s["steps"] - logged <= STOP_STEPS and signal.Signals(sig).name in caplog.text   # a few steps, not hundreds
    assert s["status"] == "interrupted" and last == s["steps"] < 400


def test_diverged_replicas_stop_the_run_named(tmp_path, caplog):
    """The divergence guard: replica 1's weights are nudged after step 3; the exact checksums compared every
    2 steps differ at step 4, and the run stops there, naming the step and the replicas."""
    cfg = prepared(tmp_path, steps=40, check_every=2, diverge_at_step={"replica": 1, "step": 3})
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1   # in process: the same log lines, no launch
    err = "\n".join(r.getMessage() for r in caplog.records if "diverged" in r.getMessage())
    assert "replicas diverged at step 4" in err and "[0]" in err and "[1]" in err
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "failed" and s["failure"]["kind"] == "diverged" and s["steps"] <= 4
    assert s["replicas_identical"] is False and s["throughput"]["ktok_per_s"] is None
    assert not list((run_dir(cfg) / "checkpoints").glob("*/step-000004"))   # a diverged state is never saved
    assert s["diverged"] == {"step": 4, "replicas": [[0], [1]]}
    assert main(["report", "--config", str(cfg)]) == 0
    report = (run_dir(cfg).parent.parent / "report" / "report.md").read_text()
    assert "drafter replicas diverged at step 4 (replicas [[0], [1]])" in report


def test_a_run_that_cannot_fit_is_refused_before_the_first_step(tmp_path, monkeypatch, capsys):
    """`train.num_anchors=1000` on the CPU demo was ended by the OOM killer (24 GB RSS, rc 137): the memory
    estimate refuses it first, in one line naming the keys (here on a machine pretending to have 1 MiB free)."""
    from dflash.train import memory
    monkeypatch.setattr(memory, "capacity", lambda device: (2**20, "available RAM"))
    cfg = prepared(tmp_path, num_anchors=1000)
    assert main(["train", "--config", str(cfg), "--no-progress"]) != 0
    text = capsys.readouterr().err
    assert "train.num_anchors" in text and "train.batch_size" in text and "data.bucket_edges" in text
    assert not (run_dir(cfg) / "checkpoints").exists()


def weights(cfg: Path, step: int) -> dict:
    return load_file(str(ckpt(cfg, step) / "model.safetensors"))


def test_muon_trains_in_lockstep_and_resumes_to_the_same_weights(tmp_path):
    """train.optimizer muon, 2 replicas: the loss falls, the replicas stay bit-identical (compared every 2 steps),
    both optimizers' states are checkpointed, and a run resumed from its step-4 checkpoint (the later one gone, as
    after a kill) ends with exactly the uninterrupted run's weights."""
    cfg = prepared(tmp_path, optimizer="muon", steps=8, checkpoint_every=4, check_every=2)
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["replicas_identical"] is True and s["steps"] == 8
    assert s["finished"] is True and s["finished_by"] == "steps"
    rows = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    state = torch.load(ckpt(cfg, 4) / "optimizer.pt", weights_only=True)
    assert set(state) == {"muon", "adamw"} and len(state["muon"]["state"]) == 8   # fc + 7 matrices of 1 layer
    straight = weights(cfg, 8)
    shutil.rmtree(ckpt(cfg, 8))
    train_ok(cfg)
    assert json.loads((run_dir(cfg) / "summary.json").read_text())["resumed_from_step"] == 4
    resumed = weights(cfg, 8)
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=0)


def fake_clock(monkeypatch, seconds_per_step: dict) -> None:
    """The trainer's clock on fake time: each drafter thread's own clock advances by its seconds per training step
    (its micro-step; nothing else takes time), so the replicas' clocks disagree unless they agree on one time."""
    import threading

    from dflash.train import trainer
    local, step = threading.local(), trainer.micro_step

    def micro_step(*a, **k):
        local.now = getattr(local, "now", 0.0) + seconds_per_step.get(threading.current_thread().name, 1.0)
        return step(*a, **k)
    monkeypatch.setattr(trainer.Replica, "clock", staticmethod(lambda: getattr(local, "now", 0.0)))
    monkeypatch.setattr(trainer, "micro_step", micro_step)


def test_time_budget_ends_the_run_agreed_with_the_schedule_following_time(tmp_path, monkeypatch, caplog):
    """train.time_budget_s 7 on a fake clock where drafter-0 sees 1 s per step and drafter-1 2 s: the replicas agree
    on the mean, 1.5 s per step (alone, drafter-0 would stop after 7 steps, drafter-1 after 4), so both stop after
    step 5 (7.5 s >= 7), far before train.steps, identical. Each step's LR is the warm-up + cosine at the agreed
    time (warm-up 30% = 2.1 s). The run is finished (summary, trainer state); resumed from its step-4 checkpoint it
    ends at the same step with the same weights (the time survives resume); a rerun of it restores it (nothing
    trained) and --retrain trains a new run."""
    fake_clock(monkeypatch, {"drafter-0": 1.0, "drafter-1": 2.0})
    cfg = prepared(tmp_path, steps=50, time_budget_s=7, warmup_ratio=0.3, min_lr_ratio=0.1, lr=1e-3, log_every=1,
                   checkpoint_every=2, check_every=1)
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert (s["status"], s["steps"], s["finished"], s["finished_by"]) == ("completed", 5, True, "time_budget")
    assert (s["train_seconds"], s["time_budget_s"], s["replicas_identical"]) == (7.5, 7, True)
    rows = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (1.5 * k - 2.1) / 4.9))) for k in range(2, 6)]
    want = [1e-3 * f for f in [1.5 / 2.1] + cosine]         # step 1 at 1.5 s: in the warm-up
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12)
    final = ckpt(cfg, 5)
    trainer = json.loads((final / "trainer.json").read_text())
    assert (trainer["finished"], trainer["finished_by"], trainer["scheduler"]) == (True, "time_budget",
                                                                                     {"elapsed_s": 7.5})
    straight = weights(cfg, 5)
    shutil.rmtree(final)
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert (s["resumed_from_step"], s["steps"], s["train_seconds"]) == (4, 5, 7.5)
    resumed = weights(cfg, 5)
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=0)
    done = (run_dir(cfg) / "summary.json").read_text()
    (run_dir(cfg) / "summary.json").unlink()
    train_ok(cfg)                                            # finished by its budget: restored, nothing trained
    assert (run_dir(cfg) / "summary.json").read_text() == done
    caplog.clear()
    train_ok(cfg, "--retrain")
    assert any("the run finished at step 5" in r.getMessage() for r in caplog.records)
    assert json.loads((run_dir(cfg) / "summary.json").read_text())["resumed_from_step"] is None
