"""Checkpoints: self-describing (the reference format, loadable by DFlashDraftModel as is), verified by their
manifest, damaged ones skipped on resume in one line, a full disk named, a finished run's rerun trains anew."""
from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from dflash.errors import UserError
from dflash.model import save_drafter
from dflash.train import checkpoint as C, run_folder as R
from dflash.records.summary import CheckpointRef
from dflash.records.checkpoint import Finished, TrainerCore, TrainerState
from support.checkpoint import fake_setup, saved, trained
from support.model import tiny_cfg

REPO = Path(__file__).resolve().parents[2]
SIDE = REPO / ".venv-interop" / "bin" / "python"


def home(setup) -> Path:
    """`setup`'s identity folder in its run folder."""
    return R.home(setup.run_dir, R.identity(setup))


def at(setup, step: int) -> Path:
    """`setup`'s checkpoint of `step`."""
    return C.step_dir(home(setup), step)


def test_checkpoint_is_the_reference_format_and_restores_exactly(tmp_path):
    setup = fake_setup(tmp_path)
    d, opt, sched = saved(setup, (4,))
    ck = at(setup, 4)
    assert sorted(p.name for p in ck.iterdir()) == sorted([*C.FILES, C.MANIFEST])
    # config.json is exactly what an export writes
    save_drafter(d, tmp_path / "export")
    assert json.loads((ck / "config.json").read_text()) == json.loads((tmp_path / "export/config.json").read_text())
    manifest = json.loads((ck / C.MANIFEST).read_text())
    assert set(manifest["files"]) == set(C.FILES)
    assert manifest["files"]["model.safetensors"]["bytes"] == (ck / "model.safetensors").stat().st_size
    assert C.verify(ck) is None
    # the one loader: shape from config.json (stand-in head on meta), weights equal
    back = C.load_drafter(ck)
    assert back.cfg == d.cfg
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    # resume restores weights, optimizer and scheduler in place
    d2, opt2, sched2 = trained(seed=1)
    state = C.load(ck, d2, opt2, sched2)
    assert (state.step, state.data_index, state.result_hash, state.metrics) == (4, 8, "c1", [])
    for k, v in d.state_dict().items():
        assert torch.equal(d2.state_dict()[k], v)
    for (a, b) in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])
    assert sched2.state_dict() == sched.state_dict()


def test_init_from_a_checkpoint_and_refuses_another_shape(tmp_path):
    from dflash.train.step import build_drafter
    setup = fake_setup(tmp_path)
    d, _, _ = saved(setup, (4,))
    ck = at(setup, 4)
    from dflash.config import from_dict
    s = SimpleNamespace(cfg=from_dict({"drafter": {"init_from": str(ck)}}).cfg, drafter_config=tiny_cfg(),
                        compile=False)
    dr = build_drafter(s, d.embed_weight, d.lm_head_weight, torch.device("cpu"))
    assert dr.training and all(torch.equal(v, d.state_dict()[k]) for k, v in dr.state_dict().items())
    s.drafter_config = tiny_cfg(block_size=8)
    with pytest.raises(UserError, match="block_size 4 there vs 8 here"):
        build_drafter(s, d.embed_weight, d.lm_head_weight, torch.device("cpu"))


def _truncate(f: Path):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _random_bytes(f: Path):
    f.write_bytes(os.urandom(f.stat().st_size))   # same size: only the hash can tell


@pytest.mark.parametrize("name,damage,why", [
    ("model.safetensors", _truncate, "truncated"),
    ("trainer.json", _truncate, "truncated"),
    ("optimizer.pt", _random_bytes, "corrupted"),
])
def test_resume_skips_a_damaged_checkpoint_in_one_line(tmp_path, caplog, name, damage, why):
    setup = fake_setup(tmp_path)
    saved(setup)
    damage(at(setup, 8) / name)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert R.resumable(setup) == at(setup, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "step-000008" in lines[0] and name in lines[0] and why in lines[0]
    # none left: a clear error naming the folder, never torch's advice to load unsafely
    damage(at(setup, 4) / name)
    with pytest.raises(UserError, match="no intact checkpoint") as e:
        R.resumable(setup)
    assert str(home(setup)) in str(e.value)


def test_unreadable_optimizer_state_never_advises_unsafe_loading(tmp_path):
    setup = fake_setup(tmp_path)
    saved(setup, (4,))
    f = at(setup, 4) / "optimizer.pt"
    good = f.read_bytes()
    rng = random.Random(0)
    # random bytes (the unpickler fails with UnpicklingError, EOFError, even IndexError: CI once drew the last),
    # then the real file cut short and with a byte flipped inside
    damaged = [rng.randbytes(4096) for _ in range(40)] + [good[: len(good) // 2], good[:-7]]
    damaged += [good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:] for i in range(0, len(good), max(1, len(good) // 16))]
    refused = 0
    for k, blob in enumerate(damaged):
        f.write_bytes(blob)
        try:
            C.load(f.parent, *trained())   # any error but UserError fails the test
        except UserError as e:
            assert str(f) in str(e) and "weights_only" not in str(e), (k, str(e))
            refused += 1
        else:
            assert k >= 42, f"damaged file {k} (random or cut short) was loaded"   # a flip inside tensor data may load
    assert refused >= 42


def test_full_disk_names_the_path_and_leaves_no_half_checkpoint(tmp_path, monkeypatch):
    setup = fake_setup(tmp_path)
    d, opt, sched = saved(setup, (4,))

    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(C.torch, "save", full)
    with pytest.raises(UserError, match="no space left on device") as e:
        C.save(home(setup), 8, 16, d, opt, sched, R.identity(setup))
    assert str(at(setup, 8)) in str(e.value)
    assert [p.name for p in home(setup).iterdir()] == ["step-000004"]   # no temp folder either
    assert C.verify(at(setup, 4)) is None


def test_interrupted_run_resumes_finished_or_changed_run_starts_anew(tmp_path, caplog):
    """Issue 47 item 4: another identity trains into its own folder and moves nothing; a finished run trained anew
    (not restored) and train.resume false set this identity's folder aside (`<identity>.N/`), one line each: kept."""
    setup = fake_setup(tmp_path, steps=12)
    saved(setup)
    assert R.resumable(setup) == at(setup, 8)                            # interrupted at 8 of 12
    other = fake_setup(tmp_path, result_hash="c2")
    assert R.resumable(other) is None and not home(other).exists()      # another config: its own folder, none yet
    assert R.resumable(setup) == at(setup, 8)                            # nothing of this one moved
    for n, (changed, word) in enumerate(((fake_setup(tmp_path, steps=8), "finished at step 8"),
                                         (fake_setup(tmp_path, resume=False), "train.resume is false")), 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING, "dflash.train"):
            assert R.resumable(changed) is None
        assert len(caplog.records) == 1 and word in caplog.records[0].getMessage()
        aside = home(setup).with_name(f"{home(setup).name}.{n}")
        assert not home(setup).exists() and str(aside) in caplog.records[0].getMessage()
        assert sorted(p.name for p in aside.iterdir()) == ["step-000004", "step-000008"]   # kept, never replaced
        saved(setup)
    assert sorted(p.name for p in (setup.run_dir / "checkpoints").iterdir()) == \
        sorted([home(setup).name, home(setup).name + ".1", home(setup).name + ".2"])


def test_a_run_finished_by_its_time_budget_is_not_resumed(tmp_path, caplog):
    """A checkpoint before train.steps whose trainer state says the run finished (its time budget) ends the run: a
    rerun that does not restore it trains a new one, as after a run that reached train.steps."""
    setup = fake_setup(tmp_path, steps=12)
    saved(setup, (8,), finished_by="time_budget")
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert R.resumable(setup) is None
    assert [r.getMessage() for r in caplog.records if "finished at step 8" in r.getMessage()]
    assert not home(setup).exists()


def _reseal(ck: Path, name: str):
    """Make checkpoint `ck`'s manifest agree with file `name` as it is now (an edit its hash cannot tell)."""
    manifest = json.loads((ck / C.MANIFEST).read_text())
    manifest["files"][name] = C._describe(ck / name)
    (ck / C.MANIFEST).write_text(json.dumps(manifest))


def test_trainer_json_is_exactly_the_model_and_the_bytes_it_always_was(tmp_path):
    """trainer.json is the writer's record (records.checkpoint.TrainerState), its bytes as before the model (the
    manifest hashes them; a resume reads them); a key the model does not describe is refused before anything is
    written."""
    setup = fake_setup(tmp_path, steps=12)
    d, opt, sched = trained()
    rows = [{"step": 4, "loss": 2.5, "acc_per_position": [0.5, None], "smoothed_stats": [1.0, 2.0]}]
    ck = C.save(home(setup), 4, 8, d, opt, sched, R.identity(setup), rows, "time_budget")
    text = (ck / C.TRAINER).read_text()
    version, state, gauss = random.getstate()
    assert text == json.dumps({"step": 4, "data_index": 8, "scheduler": sched.state_dict(),
                               "python_random": [version, list(state), gauss], "result_hash": "c1", "data_hash": "d1",
                               "inputs_hash": None, "metrics": rows, "finished": True, "finished_by": "time_budget", "summary": None},
                              indent=2) + "\n"
    state = TrainerState.model_validate_json(text)
    assert (state.step, state.data_index, state.metrics, state.finished) == (4, 8, rows, True)
    with pytest.raises(ValidationError, match="surprise"):
        C.save(home(setup), 8, 16, d, opt, sched, {**R.identity(setup), "surprise": 1})
    with pytest.raises(ValidationError, match="result_hash"):
        C.save(home(setup), 8, 16, d, opt, sched, {"result_hash": 3, "data_hash": None, "inputs_hash": None})
    assert [p.name for p in home(setup).iterdir()] == ["step-000004"]


def test_a_malformed_trainer_json_makes_its_checkpoint_not_intact(tmp_path, caplog):
    """A trainer.json that its manifest agrees with but that is no trainer state (edited, or a bug): resume skips that
    checkpoint in one line naming the key, as a damaged file (it used to stop on a traceback: "8" >= 12), and `load`
    refuses it naming the file and the key. One of an older version, without `metrics` or `finished`, still resumes."""
    setup = fake_setup(tmp_path, steps=12)
    saved(setup)
    ck = at(setup, 8)
    f = ck / C.TRAINER
    good = json.loads(f.read_text())
    f.write_text(json.dumps({**good, "step": "8"}))
    _reseal(ck, C.TRAINER)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert R.resumable(setup) == at(setup, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "step-000008 skipped: trainer.json is not a trainer state (key 'step': " in lines[0]
    with pytest.raises(UserError, match=re.escape(f"{f}: not a trainer state (key 'step': Input should be a valid "
                                                  f"integer, got '8')")):
        C.load(ck, *trained())
    f.write_text(json.dumps({k: v for k, v in good.items() if k not in ("metrics", "finished", "finished_by")}))
    _reseal(ck, C.TRAINER)
    assert R.resumable(setup) == ck
    state = C.load(ck, *trained())
    assert (state.step, state.metrics, state.finished) == (8, None, False) and not R.finished(state, setup)


def test_finished_json_is_exactly_the_model_and_a_malformed_one_is_named(tmp_path, caplog):
    """finished.json is the writer's record (records.checkpoint.Finished), in the identity's folder; restore reads it
    through FinishedCore: one whose outputs are not text is named in one line (file and key) and nothing is restored
    from it; where neither the run folder's outputs nor the final checkpoint (one without a summary: written before
    checkpoints kept it) can rebuild them, that is said too, and a new run trains, the finished one set aside."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    finish(setup, 8)
    f = home(setup) / R.FINISHED
    record = Finished.model_validate_json(f.read_text())
    assert record.checkpoint == CheckpointRef(**C.describe(setup.run_dir, at(setup, 8)))
    assert record.outputs == {"summary.json": "summary of the finished run\n", "metrics.jsonl": '{"step": 1}\n'}
    with pytest.raises(ValidationError, match="checkpoint.extra"):
        R.record_finished(setup.run_dir, {**C.describe(setup.run_dir, at(setup, 8)), "extra": 1})
    assert Finished.model_validate_json(f.read_text()) == record          # refused before anything was written
    f.write_text(json.dumps({**json.loads(f.read_text()), "outputs": {"summary.json": 1, "metrics.jsonl": ""}}))
    (setup.run_dir / "summary.json").unlink()
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert R.restore(setup) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{f}: key 'outputs.summary.json': Input should be a valid string, got 1, and {at(setup, 8)} keeps no summary "
        f"(written before checkpoints did): the finished run cannot be restored"]
    assert not (setup.run_dir / "summary.json").exists()
    assert R.resumable(setup) is None and (home(setup).with_name(home(setup).name + ".1") / "step-000008").is_dir()


def finish(setup, step, text="summary of the finished run\n"):
    """What summary.write does when a run completes: the outputs, and their record in the identity's folder."""
    (setup.run_dir / "summary.json").write_text(text)
    (setup.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    R.record_finished(setup.run_dir, C.describe(setup.run_dir, at(setup, step)))


def test_a_finished_run_is_restored_never_retrained(tmp_path):
    """Rule 2: Snakemake deletes a finished run's outputs before a rerun it forces for a timestamp, an identical
    fingerprint or an incomplete marker; the same result-changing config and data restore them, byte for byte,
    and the checkpoints stay where they are. Another identity, a newer checkpoint, a damaged final one or
    train.resume false restore nothing."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    finish(setup, 8)
    for name in ("summary.json", "metrics.jsonl"):
        (setup.run_dir / name).unlink()
    assert R.restore(setup).checkpoint.path == f"checkpoints/{home(setup).name}/step-000008"
    assert (setup.run_dir / "summary.json").read_text() == "summary of the finished run\n"
    assert (setup.run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in home(setup).iterdir()) == [R.FINISHED, "step-000004", "step-000008"]
    for other in ({"result_hash": "c2"}, {"data_hash": "d2"}, {"steps": 12}, {"resume": False}):
        (setup.run_dir / "summary.json").unlink()
        assert R.restore(fake_setup(tmp_path, **{"steps": 8, **other})) is None, other
        assert not (setup.run_dir / "summary.json").exists()
        finish(fake_setup(tmp_path, steps=8), 8)
    assert R.restore(setup, retrain=True) is None                        # --retrain restores nothing
    weights = at(setup, 8) / C.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    assert R.restore(fake_setup(tmp_path, steps=8)) is None


def test_configs_back_and_forth_keep_every_identity(tmp_path):
    """Issue 47 item 4: each config trains into its identity's folder, so going back and forth restores a finished
    run and resumes an interrupted one, whichever came between; nothing is moved or deleted (it held one other run:
    trying two more by hand deleted the first)."""
    runs = [fake_setup(tmp_path, steps=8, result_hash=h) for h in ("c1", "c2", "c3")]
    for k, setup in enumerate(runs):
        saved(setup)
        finish(setup, 8, f"run {k}\n")
    interrupted = fake_setup(tmp_path, steps=8, result_hash="c4")
    saved(interrupted, (4,))
    for k in (0, 2, 1, 0):
        (runs[k].run_dir / "summary.json").unlink()
        assert R.restore(runs[k]).checkpoint.path == f"checkpoints/{home(runs[k]).name}/step-000008"
        assert (runs[k].run_dir / "summary.json").read_text() == f"run {k}\n"
    assert R.restore(interrupted) is None and R.resumable(interrupted) == at(interrupted, 4)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == \
        sorted(home(s).name for s in runs + [interrupted])


def test_a_forced_retrain_keeps_the_finished_run_and_resumes_when_interrupted(tmp_path, caplog):
    """Issue 47 item 4: `snakemake -R train` (--retrain) on a finished run moves its folder aside (kept) and trains
    anew; interrupted, the retrain resumes on the next rerun, forced or not (`--rerun-incomplete`), instead of the
    old run being restored in its place (it was: the interrupted retrain was moved aside and lost)."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    finish(setup, 8)
    assert R.restore(setup, retrain=True) is None and R.resumable(setup) is None
    aside = home(setup).with_name(home(setup).name + ".1")
    assert sorted(p.name for p in aside.iterdir()) == [R.FINISHED, "step-000004", "step-000008"]
    saved(setup, (2, 4))                                                # the retrain, interrupted at step 4
    for retrain in (False, True):
        assert R.restore(setup, retrain=retrain) is None
        assert R.resumable(setup) == at(setup, 4)
    assert sorted(p.name for p in aside.iterdir()) == [R.FINISHED, "step-000004", "step-000008"]


def test_old_identities_are_pruned_only_by_train_keep_runs(tmp_path, caplog):
    """Issue 47 item 4: the run folder keeps every identity unless train.keep_runs says how many others to keep; the
    oldest are then deleted when a run finishes or is restored, each named in one log line."""
    runs = [fake_setup(tmp_path, steps=8, result_hash=h) for h in ("c1", "c2", "c3")]
    for k, setup in enumerate(runs):
        saved(setup)
        finish(setup, 8)
        os.utime(at(setup, 8) / C.MANIFEST, (1000 + k, 1000 + k))
    R.prune(tmp_path / "run", None, home(runs[2]))
    assert all(home(s).is_dir() for s in runs)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        R.prune(tmp_path / "run", 1, home(runs[2]))
    assert [home(s).is_dir() for s in runs] == [False, True, True]
    assert [r.getMessage() for r in caplog.records] == [
        f"train.keep_runs is 1: deleted {home(runs[0])} (checkpoints up to step 8)"]


def test_the_layout_before_issue_47_is_read_into_identity_folders(tmp_path, caplog):
    """checkpoints/step-N/ (+ finished.json) and checkpoints.previous/ of a run folder made before issue 47 move into
    their identities' folders, the identity's result hash recomputed from the finished run's recorded config (the
    hash's rules changed), finished.json and summary.json pointed at the same checkpoints' new place; the finished
    run is then restored, nothing trained."""
    from dflash import config as CF
    setup = fake_setup(tmp_path, steps=8, result_hash=CF.from_dict({}).result_hash)
    legacy = fake_setup(tmp_path, steps=8, result_hash="old-rules-hash")
    d, opt, sched = trained()
    for step in (4, 8):
        C.save(setup.run_dir / "checkpoints", step, step * 2, d, opt, sched, R.identity(legacy))
    C.save(setup.run_dir / "checkpoints.previous", 4, 8, d, opt, sched, {**R.identity(legacy), "result_hash": "zz"})
    ref = C.describe(setup.run_dir, setup.run_dir / "checkpoints" / "step-000008")
    summary = json.dumps({"status": "completed", "config": CF.from_dict({}).raw, "checkpoint": ref})
    (setup.run_dir / "summary.json").write_text(summary)
    (setup.run_dir / "metrics.jsonl").write_text("{}\n")
    R.record_finished(setup.run_dir, ref)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        record = R.restore(setup)
    assert record is not None and record.checkpoint.path == f"checkpoints/{home(setup).name}/step-000008"
    assert json.loads((setup.run_dir / "summary.json").read_text())["checkpoint"]["path"] == record.checkpoint.path
    assert sorted(p.name for p in (setup.run_dir / "checkpoints").iterdir()) == sorted([home(setup).name, "zz-d1"])
    assert not (setup.run_dir / "checkpoints.previous").exists()
    assert sum("layout before issue 47" in r.getMessage() for r in caplog.records) == 2
    assert C.ended_with(setup.run_dir) == at(setup, 8)


def test_evaluate_and_export_read_exactly_the_checkpoint_the_run_ended_with(tmp_path):
    """Rule 3: the consumer of a run's output uses that output or stops naming what is missing, never a stand-in:
    summary.json names the final checkpoint (and its manifest's hash); gone, damaged or replaced, it is refused."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    final = C.describe(setup.run_dir, at(setup, 8))
    (setup.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "checkpoint": final}))
    assert C.ended_with(setup.run_dir) == at(setup, 8)
    weights = at(setup, 8) / C.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match=r"step-000008: model\.safetensors is 100 bytes.*final drafter is damaged"):
        C.ended_with(setup.run_dir)             # not step 4 instead
    C.save(home(setup), 8, 99, *trained(seed=1), R.identity(setup))   # another checkpoint under the same name
    with pytest.raises(UserError, match=r"step-000008: not the checkpoint the run ended with"):
        C.ended_with(setup.run_dir)
    (setup.run_dir / "summary.json").write_text(json.dumps({"status": "failed", "checkpoint": None}))
    with pytest.raises(UserError, match=r"summary\.json: names no final checkpoint"):
        C.ended_with(setup.run_dir)


@pytest.mark.slow   # out of make test-fast: its heavy check runs in make test
def test_checkpoint_loads_into_the_reference_package(tmp_path):
    """A checkpoint folder, as is, is a drafter for `DFlashDraftModel.from_pretrained` (dflash 0.1.0)."""
    if not SIDE.exists():
        pytest.skip("side venv .venv-interop not built (`make interop` builds it)")
    setup = fake_setup(tmp_path)
    saved(setup, (4,))
    ck = at(setup, 4)
    script = ("import sys, json, torch; from dflash import DFlashDraftModel\n"
              "m, info = DFlashDraftModel.from_pretrained(sys.argv[1], dtype=torch.float32, output_loading_info=True)\n"
              "from safetensors.torch import save_file\n"
              "save_file({k: v.contiguous() for k, v in m.state_dict().items()}, sys.argv[2])\n"
              "print(json.dumps({k: sorted(map(str, v)) for k, v in info.items()} | "
              "{'block_size': m.block_size, 'mask_token_id': m.mask_token_id}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # `dflash` there is the reference
    r = subprocess.run([str(SIDE), "-c", script, str(ck), str(tmp_path / "ref.safetensors")], cwd="/", env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named" in r.stderr:
        pytest.skip(f".venv-interop cannot import the reference package: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    assert info["block_size"] == 4 and info["mask_token_id"] == 96
    ours, ref = load_file(str(ck / "model.safetensors")), load_file(str(tmp_path / "ref.safetensors"))
    for k, v in ours.items():
        assert torch.equal(ref[k], v), k
