"""Issue 40, a training run's lifecycle: one writer per run folder (rule 2), every stop short of SIGKILL checkpoints
(rule 3), a finished run still on disk is restored, not retrained (rule 5), a write-protected run folder is one line
before training (rule 7), and `drafter.init_from` takes our own export (rule 9). CPU, the threads runtime of
tests/test_train.py (tiny target, built-in corpus) unless marked slow (the distributed runtime)."""
import contextlib
import errno
import fcntl
import json
import os
import pty
import select
import shutil
import signal
import subprocess
import struct
import sys
import termios
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dflash.cli import main
from dflash.errors import UserError
from dflash.paths import RunFolder
from dflash.train import writer
from support.train import REPO, ckpt, home, prepared, run_dir, train_ok


def start(cfg, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), *args], cwd=REPO, **kw)


def wait_for_rows(cfg, n: int, proc=None, timeout=300) -> None:
    """Until metrics.jsonl holds `n` rows (the run is training)."""
    metrics, deadline = run_dir(cfg) / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and (proc is None or proc.poll() is None):
        with contextlib.suppress(FileNotFoundError):
            if len(metrics.read_text().splitlines()) >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"no {n} rows in {metrics} (exit code {proc.poll() if proc else None})")


def lock_record(cfg) -> dict:
    return json.loads(RunFolder(run_dir(cfg)).lock.read_text())


def wait_unlocked(cfg, timeout=120) -> None:
    """Until no process holds the run folder's lock (looked at, not taken: the record stays as it is)."""
    deadline = time.time() + timeout
    with open(RunFolder(run_dir(cfg)).lock) as f:
        while time.time() < deadline:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fcntl.flock(f, fcntl.LOCK_UN)
            except BlockingIOError:
                time.sleep(0.1)
    raise AssertionError("the run folder is still locked")


# ---- rule 2: one writer per run folder -------------------------------------------------------------------------
def test_a_second_train_on_a_folder_a_live_train_writes_is_refused_naming_it(tmp_path, capsys):
    """Snakemake killed with -9 leaves its train job running; `--unlock` and `--rerun-incomplete` (which deletes the
    job's outputs) then start a second train on the same run folder. It is refused in one line naming the live
    process (pid, host, start, command), before it loads the target or the data; the first one runs on, and stopped
    it checkpoints.
    The lock is that process: its record stays when it ends and blocks nothing."""
    cfg = prepared(tmp_path, steps=400, checkpoint_every=0)
    parent = subprocess.Popen(["bash", "-c", f"{sys.executable} -m dflash train --config {cfg} --no-progress "
                                             f"2>/dev/null & wait"], cwd=REPO, start_new_session=True)
    try:
        refused_while_it_trains(cfg, parent, capsys)
    finally:   # whatever happened, nothing of this test runs on
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)


def refused_while_it_trains(cfg, parent, capsys):
    wait_for_rows(cfg, 2, parent)
    pid = lock_record(cfg)["pid"]
    parent.send_signal(signal.SIGKILL)             # kill -9 of Snakemake: its job lives on
    parent.wait()
    os.kill(pid, 0)
    (run_dir(cfg) / "metrics.jsonl").unlink()      # what --rerun-incomplete does to the job's outputs
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash train: error: {run_dir(cfg).resolve()}: another train is "
                                               f"writing this run folder: pid {pid} on {os.uname().nodename}, "
                                               f"started "), err
    assert f"-m dflash train --config {cfg} --no-progress" in err[0] and f"kill {pid}" in err[0]
    assert not (run_dir(cfg) / "summary.json").exists()
    wait_for_rows(cfg, 1)                          # the first one still trains and writes its rows
    os.kill(pid, signal.SIGTERM)                   # stopped, it checkpoints first
    wait_unlocked(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "interrupted" and ckpt(cfg, s["steps"]).is_dir()
    assert lock_record(cfg)["pid"] == pid          # the stale record stays and blocks nothing
    with writer.hold(run_dir(cfg)):
        assert lock_record(cfg)["pid"] == os.getpid()




HOLDER = textwrap.dedent("""
    import sys, time
    from dflash.train import writer
    with writer.hold(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def test_the_lock_is_the_live_process_not_a_file(tmp_path):
    """A holder killed with -9 leaves its record and blocks nothing; a process our launcher starts (a distributed
    rank) shares its parent's lock, any other process is refused; the lock's fd does not survive into a forked
    child (which would hold the lock after its parent died)."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "held\n"
    with pytest.raises(UserError, match=f"pid {proc.pid} on .*kill {proc.pid}"):
        with writer.hold(run):
            pass
    proc.kill()
    proc.wait()
    assert json.loads(RunFolder(run).lock.read_text())["pid"] == proc.pid
    child = [sys.executable, "-c", "import sys; from dflash.train import writer\nwith writer.hold(sys.argv[1]): pass",
             str(run)]
    with writer.hold(run):                         # the stale record blocks nothing
        assert json.loads(RunFolder(run).lock.read_text())["pid"] == os.getpid()
        ours = subprocess.run(child, cwd=REPO, capture_output=True, text=True)
        assert ours.returncode == 0, ours.stderr   # a process this one started (the launcher's ranks)
        other = subprocess.run(child, cwd=REPO, capture_output=True, text=True,
                               env={k: v for k, v in os.environ.items() if k != writer.HELD})
        assert other.returncode == 1 and f"pid {os.getpid()}" in other.stderr
        pid = os.fork()
        if pid == 0:                                # a forked child: its copy of the fd is closed at once
            os._exit(0 if not writer._held else 1)
        assert os.waitpid(pid, 0)[1] == 0
    assert writer.HELD not in os.environ


# ---- rule 3: every stop short of SIGKILL checkpoints -------------------------------------------------------------
def test_sighup_of_a_closed_terminal_checkpoints_and_exits_129(tmp_path):
    """A closed terminal or SSH connection: the run (its progress bar on: stderr is a terminal) loses the terminal
    (every write to it fails with EIO), then gets SIGHUP. The replicas finish their step and checkpoint, the run
    exits 128 + 1, and the --log file has the whole story."""
    cfg = prepared(tmp_path, steps=400, checkpoint_every=0)
    log = tmp_path / "train.log"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))   # a terminal 120 columns wide
    proc = start(cfg, "--log", str(log), stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    done, seen = threading.Event(), []

    def drain():   # a terminal reads what the run writes (a full pty buffer would block it)
        while not done.is_set():
            if select.select([master], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    seen.append(os.read(master, 1 << 16))

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        wait_for_rows(cfg, 3, proc)
    finally:
        done.set()
        reader.join()
        os.close(master)                            # the terminal is gone: writes to it fail with EIO
    proc.send_signal(signal.SIGHUP)
    try:
        assert proc.wait(timeout=120) == 128 + signal.SIGHUP, log.read_text()[-3000:]
    finally:
        proc.kill()
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "interrupted" and 3 <= s["steps"] < 400
    assert s["checkpoint"]["path"] == f"checkpoints/{home(cfg).name}/step-{s['steps']:06d}"
    assert "SIGHUP: the replicas stop after the current step" in log.read_text()
    assert b"train t:" in b"".join(seen)             # the progress bar was on


# ---- rule 5: a finished run still on disk is restored ---------------------------------------------------------
def outputs(cfg) -> dict:
    return {n: (run_dir(cfg) / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}


def test_a_finished_run_without_its_record_is_restored_from_its_summary(tmp_path, caplog):
    """checkpoints/<identity>/finished.json gone (or never written: a kill between summary.json and it), summary.json
    and the final checkpoint intact: restored, not retrained, and finished.json written anew (as it was)."""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2)
    train_ok(cfg)
    before, record = outputs(cfg), (home(cfg) / "finished.json").read_text()
    (home(cfg) / "finished.json").unlink()
    caplog.clear()
    train_ok(cfg)
    assert outputs(cfg) == before
    assert (home(cfg) / "finished.json").read_text() == record
    assert any("restored, nothing trained" in r.getMessage() for r in caplog.records)
    assert not any("step 1/4" in r.getMessage() for r in caplog.records)
    assert [p.name for p in (run_dir(cfg) / "checkpoints").iterdir()] == [home(cfg).name]


@pytest.mark.parametrize("damage", ["gone", "damaged"])
def test_a_finished_run_is_restored_from_its_final_checkpoint_alone(tmp_path, caplog, damage):
    """Issue 47 item 4: Snakemake deletes summary.json and metrics.jsonl before it reruns train; with finished.json
    also gone or damaged there was nothing to restore from, and the finished run trained again. The final checkpoint
    keeps what rebuilds them (trainer.json: the metrics rows, and the summary as it stood at that step): restored,
    nothing trained, metrics.jsonl byte for byte, summary.json the run's (its workers and devices, gathered after the
    checkpoint, left empty), naming that very checkpoint; finished.json written anew."""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2)
    train_ok(cfg)
    before = outputs(cfg)
    record = home(cfg) / "finished.json"
    record.unlink() if damage == "gone" else record.write_text('{"checkpoint": {"path": 3}}')
    for name in before:
        (run_dir(cfg) / name).unlink()
    caplog.clear()
    train_ok(cfg)
    assert any("restored, nothing trained" in r.getMessage() for r in caplog.records)
    assert any("rebuilt from" in r.getMessage() and str(ckpt(cfg, 4)) in r.getMessage() for r in caplog.records)
    assert not any("step 1/4" in r.getMessage() for r in caplog.records)
    got = outputs(cfg)
    assert got["metrics.jsonl"] == before["metrics.jsonl"]
    was, now = json.loads(before["summary.json"]), json.loads(got["summary.json"])
    assert {k: v for k, v in now.items() if k not in ("workers", "devices", "replica_checksums", "replicas_identical",
                                                      "finished_at", "target_files")} == \
        {k: v for k, v in was.items() if k not in ("workers", "devices", "replica_checksums", "replicas_identical",
                                                   "finished_at", "target_files")}
    assert now["workers"] == now["devices"] == [] and now["checkpoint"]["path"].endswith("/step-000004")
    from dflash.records.summary import RunSummary
    from dflash.train.checkpoint import ended_with
    RunSummary.model_validate(now)
    assert ended_with(run_dir(cfg)) == ckpt(cfg, 4)                           # what evaluate and export read
    assert json.loads(record.read_text())["outputs"] == {k: v.decode() for k, v in got.items()}   # written anew


def test_a_model_folder_edited_in_place_is_another_run(tmp_path, caplog):
    """A user's model (target.build: none) whose weights change in place (one byte, size kept): train trains a new run
    in a folder of its own instead of restoring the finished run of the old weights (the run's identity holds the
    content of the files the config names that train reads, as the train rule's key stamp does); the old run is kept,
    and with the old bytes back it is restored. The same for drafter.init_from."""
    import yaml
    cfg = prepared(tmp_path, steps=2, checkpoint_every=0)
    raw = yaml.safe_load(cfg.read_text())
    mine = tmp_path / "mine"
    shutil.copytree(raw["target"]["path"], mine, ignore=shutil.ignore_patterns("build.json"))
    raw["target"] = {"path": str(mine), "build": "none"}
    cfg.write_text(yaml.safe_dump(raw))
    train_ok(cfg)
    first = home(cfg).name
    weights = mine / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x40                                       # a weight's bits, not the header: the file still loads
    weights.write_bytes(bytes(data))
    caplog.clear()
    train_ok(cfg)
    assert any("step 2/2 loss" in r.getMessage() for r in caplog.records)      # trained
    assert not any("restored, nothing trained" in r.getMessage() for r in caplog.records)
    names = sorted(p.name for p in (run_dir(cfg) / "checkpoints").iterdir())
    assert len(names) == 2 and first in names and all(n.count("-") == 2 for n in names)   # result-data-inputs
    data[-7] ^= 0x40
    weights.write_bytes(bytes(data))
    caplog.clear()
    train_ok(cfg)
    assert any("restored, nothing trained" in r.getMessage() for r in caplog.records)
    from dflash import config as C
    from dflash.train.run_folder import inputs_hash
    raw["drafter"]["init_from"] = str(mine)              # any folder: the hash is of its bytes
    was = inputs_hash(C.from_dict(raw).cfg)
    os.utime(weights, (1, 1))                            # a touch changes nothing
    assert inputs_hash(C.from_dict(raw).cfg) == was
    (mine / "config.json").write_text((mine / "config.json").read_text() + " ")
    assert inputs_hash(C.from_dict(raw).cfg) != was


def test_going_back_to_the_pipeline_config_restores_it_whatever_ran_by_hand(tmp_path, caplog):
    """The pipeline's run finishes; runs by hand with two other train.lr in its folder train into folders of their own
    (checkpoints/<identity>/; there was one checkpoints.previous/, so the second hand run deleted the pipeline's run).
    Going back to any of them (Snakemake deletes the outputs of the job it reruns) restores it byte for byte, nothing
    trained, nothing moved. `snakemake -R train` (--retrain), which evaluate's refusal of a hand run advises, restores
    the pipeline's run too while a hand run is the folder's latest; forced again, this config's run trains anew, the
    finished one kept aside."""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2)
    train_ok(cfg)
    pipeline = outputs(cfg)
    hand = {}
    for lr in ("0.001", "0.002"):
        train_ok(cfg, "--set", f"train.lr={lr}")
        hand[lr] = outputs(cfg)
    assert len({o["summary.json"] for o in (pipeline, *hand.values())}) == 3
    assert len(list((run_dir(cfg) / "checkpoints").iterdir())) == 3
    for want, args in ((pipeline, []), (hand["0.001"], ["--set", "train.lr=0.001"]), (pipeline, []),
                       (hand["0.002"], ["--set", "train.lr=0.002"]), (pipeline, ["--retrain"])):
        for name in want:
            (run_dir(cfg) / name).unlink()
        caplog.clear()
        train_ok(cfg, *args)
        assert outputs(cfg) == want
        messages = [r.getMessage() for r in caplog.records]
        assert any("restored, nothing trained" in m for m in messages)
        assert not any("starting from scratch" in m or "step 1/4" in m for m in messages)
    # evaluate and export read the checkpoint summary.json names: the one restored
    from dflash.train import checkpoint
    assert checkpoint.ended_with(run_dir(cfg)) == Path(run_dir(cfg), json.loads(pipeline["summary.json"])
                                                       ["checkpoint"]["path"])
    caplog.clear()
    train_ok(cfg, "--retrain")                     # this config's own run: trained anew, the finished one kept
    assert any("starting from scratch: the run finished at step 4" in r.getMessage() for r in caplog.records)
    assert json.loads(outputs(cfg)["summary.json"])["run_id"] != json.loads(pipeline["summary.json"])["run_id"]
    assert len([p for p in (run_dir(cfg) / "checkpoints").iterdir() if p.name.endswith(".1")]) == 1


def test_an_interrupted_forced_retrain_resumes_on_the_next_rerun(tmp_path, caplog):
    """Issue 47 item 4: `snakemake -R train` (--retrain) of a finished run stopped at step 3 (killed, failed): the
    next rerun (`--rerun-incomplete`, no --retrain) resumes the retrain from its step-2 checkpoint. It restored the old
    run instead and set the retrain's checkpoints aside, so the retrain could never be resumed."""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=1)
    train_ok(cfg)
    assert main(["train", "--config", str(cfg), "--no-progress", "--retrain", "--set",
                 "train.fail_at_step={worker: drafter-0, step: 3}"]) == 1
    for name in ("summary.json", "metrics.jsonl"):
        (run_dir(cfg) / name).unlink(missing_ok=True)
    caplog.clear()
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert (s["resumed_from_step"], s["status"], s["steps"]) == (2, "completed", 4)
    assert not any("restored, nothing trained" in r.getMessage() for r in caplog.records)
    aside = home(cfg).with_name(home(cfg).name + ".1")
    assert sorted(p.name for p in aside.iterdir()) == ["finished.json"] + [f"step-{k:06d}" for k in range(1, 5)]


# ---- rule 7: a write-protected run folder ------------------------------------------------------------------------
@contextlib.contextmanager
def write_protected(path: Path):
    """`path` not writable by this process: chmod for a user; root writes anyway, so the immutable flag there."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield
        finally:
            path.chmod(0o755)
        return
    if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root where chattr +i is not available: nothing is write-protected for root")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_write_protected_checkpoints_folder_is_one_line_before_training(tmp_path, capsys, caplog):
    """It used to train until the first checkpoint, then end in a PermissionError traceback. (In process: the CLI's
    own error line, no launch; a traceback would fail the call.)"""
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2)
    ckpts = run_dir(cfg) / "checkpoints"
    ckpts.mkdir(parents=True)
    capsys.readouterr()
    with write_protected(ckpts):
        code = main(["train", "--config", str(cfg), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dflash train: error: {ckpts}: not writable (") and "chmod -R u+w" in last, err
    assert "Traceback" not in err and "step 1/" not in err + caplog.text
    assert not (run_dir(cfg) / "metrics.jsonl").exists()


def test_an_unwritable_checkpoint_while_training_is_one_line(tmp_path, monkeypatch):
    """The same found mid-run (a folder made read-only meanwhile, a file system remounted read-only): the checkpoint
    names its path and what to do, no traceback."""
    from dflash.train import checkpoint as C, run_folder as R
    from support.checkpoint import fake_setup, trained

    def denied(obj, f, *a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(f.name))

    setup = fake_setup(tmp_path)
    monkeypatch.setattr(C.torch, "save", denied)
    folder = R.home(setup.run_dir, R.identity(setup))
    with pytest.raises(UserError, match=r"optimizer\.pt: not writable \(Permission denied\) while writing the "
                                        r"checkpoint; make .*checkpoints/c1-d1 writable and rerun"):
        C.save(folder, 4, 8, *trained(), R.identity(setup))
    assert [p.name for p in folder.iterdir()] == []


# ---- rule 9: init_from takes our own export ----------------------------------------------------------------------
def test_init_from_takes_our_own_export_and_names_a_real_mismatch(tmp_path):
    """The export adds dflash_config.mask_token (SGLang checks it) and states the dtype: no difference of drafter.
    A drafter of another shape is still refused, naming the field."""
    from dflash.config import from_dict
    from dflash.model import save_drafter
    from dflash.train.step import build_drafter
    from support.model import make_drafter, tiny_cfg
    d = make_drafter(tiny_cfg(), seed=3)
    save_drafter(d, tmp_path / "export", mask_token="<|mask|>")   # what the export stage writes
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dflash_config"]["mask_token"] == "<|mask|>"
    s = SimpleNamespace(cfg=from_dict({"drafter": {"init_from": str(tmp_path / "export")}}).cfg,
                        drafter_config=tiny_cfg(), compile=False)
    dr = build_drafter(s, d.embed_weight, d.lm_head_weight, torch.device("cpu"))
    assert all(torch.equal(v, d.state_dict()[k]) for k, v in dr.state_dict().items())
    s.drafter_config = tiny_cfg(target_layer_ids=[0, 2, 4])   # the same shapes, other target layers
    with pytest.raises(UserError, match=r"export/config\.json: the drafter there differs from the one configured: "
                                        r"target_layer_ids \[0, 2, 3\] there vs \[0, 2, 4\] here$"):
        build_drafter(s, d.embed_weight, d.lm_head_weight, torch.device("cpu"))


def test_a_run_starts_from_the_pipelines_own_export(tmp_path):
    """End to end: train, export (the stage), then a new run with drafter.init_from at that export trains."""
    cfg = prepared(tmp_path, steps=2, checkpoint_every=2)
    train_ok(cfg)
    assert main(["export", "--config", str(cfg)]) == 0
    export = run_dir(cfg) / "drafter"
    assert "mask_token" in json.loads((export / "config.json").read_text())["dflash_config"]
    train_ok(cfg, "--set", f"drafter.init_from={export}", "--set", "run_name=t2")
    s = json.loads((run_dir(cfg).parent / "t2" / "summary.json").read_text())
    assert s["status"] == "completed" and s["config"]["drafter"]["init_from"] == str(export)


@pytest.mark.slow
def test_the_distributed_launcher_is_the_one_writer_and_sigterm_checkpoints(tmp_path, capsys):
    """The distributed runtime (1 target rank, 2 drafter ranks on gloo; one launch): the launcher holds the run folder
    for its ranks (none of them is refused), a second train is refused naming the launcher. SLURM's SIGTERM reaches
    the launcher: it forwards SIGUSR1 to its ranks, the replicas agree to stop after their step, drafter rank 0
    checkpoints, the target stops and every rank exits; the launcher exits 143. (Any other stop signal is the same
    SIGUSR1 to the ranks: the launcher's part for each, SIGHUP of a closed terminal included, is the next test's.)"""
    cfg = prepared(tmp_path, steps=400, checkpoint_every=0)
    proc = start(cfg, "--no-progress", "--set", "train.runtime=distributed", stdout=subprocess.DEVNULL,
                 stderr=subprocess.PIPE, text=True)
    wait_for_rows(cfg, 3, proc)
    assert lock_record(cfg)["pid"] == proc.pid
    capsys.readouterr()
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 1
    assert f"another train is writing this run folder: pid {proc.pid} " in capsys.readouterr().err
    proc.send_signal(signal.SIGTERM)
    logged = json.loads((run_dir(cfg) / "metrics.jsonl").read_text().splitlines()[-1])["step"]   # at least this far
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["replicas_identical"] is True and 3 <= s["steps"] < 400
    assert s["steps"] - logged <= 8                           # a few steps after the signal, not hundreds
    assert s["checkpoint"]["path"] == f"checkpoints/{home(cfg).name}/step-{s['steps']:06d}"
    assert sorted(home(cfg).glob("step-*"))[-1].name == f"step-{s['steps']:06d}"


RANK = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGUSR1, lambda *a: sys.exit(10))
    print("up", flush=True)
    time.sleep(60)
""")


def test_the_launcher_forwards_every_stop_signal_to_its_ranks_and_exits_128_plus_it(tmp_path, monkeypatch):
    """The launcher's part of a stop signal, for each of failures.STOP_SIGNALS (SIGHUP: a closed terminal; SIGINT;
    SIGTERM; SIGUSR1), with a stand-in for torchrun's agent and a stand-in rank of this node: the signal is caught
    while the agent runs, forwarded to the rank as SIGUSR1 (what the ranks act on, whichever signal it was: the launch
    above), and the launcher exits 128 + the signal."""
    from torch.distributed.launcher import api

    from dflash.cli import build_parser
    from dflash.config import load
    from dflash.train import failures
    from dflash.train.context import prepare
    from dflash.train.runtime import distributed
    cfg = prepared(tmp_path, steps=4)
    argv = ["train", "--config", str(cfg), "--no-progress", "--set", "train.runtime=distributed"]
    ctx = prepare(load(str(cfg), {"train.runtime": "distributed"}))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")                # the launcher sets it for its ranks
    (ctx.run_dir / "ranks").mkdir(parents=True)
    for sig in failures.STOP_SIGNALS:
        rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
        assert rank.stdout.readline() == "up\n"
        (ctx.run_dir / "ranks" / "rank-1.json").write_text(json.dumps({"pid": rank.pid, "host": os.uname().nodename}))
        seen = []

        def agent(config, entrypoint):
            def run(*args):
                seen.append(signal.getsignal(sig) not in (signal.SIG_DFL, signal.SIG_IGN, None))
                if seen[-1]:                                   # caught: sent to this process, as a terminal would
                    os.kill(os.getpid(), sig)
                    seen.append(rank.wait(timeout=30))         # until the launcher forwarded it
            return run
        monkeypatch.setattr(api, "elastic_launch", agent)
        try:
            code = distributed.launch(ctx, build_parser().parse_args(argv))
        finally:
            rank.kill()
        assert seen == [True, 10] and code == 128 + sig, (signal.Signals(sig).name, seen, code)


def test_a_write_protected_output_folder_of_any_stage_is_one_line(tmp_path, capsys):
    """Rule 7's class at the command line: a PermissionError (or a read-only file system) that reaches it from any
    stage names the path and what to do, without a traceback (here the env stage's results/env/)."""
    out = tmp_path / "results" / "env"
    out.mkdir(parents=True)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path / 'results'}\n")
    with write_protected(out):
        code = main(["env", "--config", str(cfg)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"dflash env: error: {out}: ") and "make it writable for this user" in err[0], err


@pytest.mark.slow
def test_two_nodes_share_the_run_folder_with_one_writer(tmp_path, capsys):
    """train.rendezvous.nnodes 2 (both nodes on this machine, gloo, a co-located rank on each): a launcher on each node
    restores in turn, then the writer rank (drafter rank 0) holds the folder for the run: neither launcher is
    refused, and the record names that rank. A finished run is then restored by both launchers, nothing launched."""
    import socket as so
    with so.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    cfg = prepared(tmp_path, steps=4, checkpoint_every=2, targets=["cpu", "cpu"], drafters=["cpu", "cpu"],
                   runtime="distributed", rendezvous={"nnodes": 2, "endpoint": f"localhost:{port}", "id": "t2n"})
    nodes = [start(cfg, "--no-progress", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        errs = [p.communicate(timeout=400)[1] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(e[-2000:] for e in errs)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 4 and s["replicas_identical"] is True
    writer_rank = json.loads((run_dir(cfg) / "ranks" / "rank-0.json").read_text())["pid"]
    assert lock_record(cfg)["pid"] == writer_rank
    nodes = [start(cfg, "--no-progress", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0] and all("restored, nothing trained" in e for e in errs), errs
