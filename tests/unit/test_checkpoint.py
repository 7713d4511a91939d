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
from dflash.train import checkpoint as C
from dflash.run_summary import CheckpointRef
from dflash.train.checkpoint_records import Finished, TrainerCore, TrainerState
from support.checkpoint import fake_setup, saved, trained
from support.model import tiny_cfg

REPO = Path(__file__).resolve().parents[2]
SIDE = REPO / ".venv-interop" / "bin" / "python"


def test_checkpoint_is_the_reference_format_and_restores_exactly(tmp_path):
    setup = fake_setup(tmp_path)
    d, opt, sched = saved(setup, (4,))
    ck = C.step_dir(setup.run_dir, 4)
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
    ck = C.step_dir(setup.run_dir, 4)
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
    damage(C.step_dir(setup.run_dir, 8) / name)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert C.resumable(setup) == C.step_dir(setup.run_dir, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "step-000008" in lines[0] and name in lines[0] and why in lines[0]
    # none left: a clear error naming the folder, never torch's advice to load unsafely
    damage(C.step_dir(setup.run_dir, 4) / name)
    with pytest.raises(UserError, match="no intact checkpoint") as e:
        C.resumable(setup)
    assert str(setup.run_dir / "checkpoints") in str(e.value)


def test_unreadable_optimizer_state_never_advises_unsafe_loading(tmp_path):
    setup = fake_setup(tmp_path)
    saved(setup, (4,))
    f = C.step_dir(setup.run_dir, 4) / "optimizer.pt"
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
        C.save(setup.run_dir, 8, 16, d, opt, sched, C.identity(setup))
    assert str(C.step_dir(setup.run_dir, 8)) in str(e.value)
    assert [p.name for p in (setup.run_dir / "checkpoints").iterdir()] == ["step-000004"]   # no temp folder either
    assert C.verify(C.step_dir(setup.run_dir, 4)) is None


def test_interrupted_run_resumes_finished_or_changed_run_starts_anew(tmp_path, caplog):
    setup = fake_setup(tmp_path, steps=12)
    saved(setup)
    assert C.resumable(setup) == C.step_dir(setup.run_dir, 8)          # interrupted at 8 of 12
    prev = setup.run_dir / C.PREVIOUS
    for changed, word in ((fake_setup(tmp_path, steps=8), "finished at step 8"),
                          (fake_setup(tmp_path, result_hash="c2"), "another config or data"),
                          (fake_setup(tmp_path, resume=False), "train.resume is false")):
        saved(setup)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "dflash.train"):
            assert C.resumable(changed) is None
        assert len(caplog.records) == 1 and word in caplog.records[0].getMessage()
        assert not (setup.run_dir / "checkpoints").exists()
        assert sorted(p.name for p in prev.iterdir()) == ["step-000004", "step-000008"]   # replaced, not piled up
    assert sorted(p.name for p in setup.run_dir.iterdir()) == [C.PREVIOUS]


def test_a_run_finished_by_its_time_budget_is_not_resumed(tmp_path, caplog):
    """A checkpoint before train.steps whose trainer state says the run finished (its time budget) ends the run: a
    rerun trains a new one, as after a run that reached train.steps."""
    setup = fake_setup(tmp_path, steps=12)
    d, opt, sched = trained()
    C.save(setup.run_dir, 8, 16, d, opt, sched, C.identity(setup), finished_by="time_budget")
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert C.resumable(setup) is None
    assert [r.getMessage() for r in caplog.records if "finished at step 8" in r.getMessage()]
    assert not (setup.run_dir / "checkpoints").exists()


def _reseal(ck: Path, name: str):
    """Make checkpoint `ck`'s manifest agree with file `name` as it is now (an edit its hash cannot tell)."""
    manifest = json.loads((ck / C.MANIFEST).read_text())
    manifest["files"][name] = C._describe(ck / name)
    (ck / C.MANIFEST).write_text(json.dumps(manifest))


def test_trainer_json_is_exactly_the_model_and_the_bytes_it_always_was(tmp_path):
    """trainer.json is the writer's record (checkpoint_records.TrainerState), its bytes as before the model (the
    manifest hashes them; a resume reads them); a key the model does not describe is refused before anything is
    written."""
    setup = fake_setup(tmp_path, steps=12)
    d, opt, sched = trained()
    rows = [{"step": 4, "loss": 2.5, "acc_per_position": [0.5, None], "smoothed_stats": [1.0, 2.0]}]
    ck = C.save(setup.run_dir, 4, 8, d, opt, sched, C.identity(setup), rows, "time_budget")
    text = (ck / C.TRAINER).read_text()
    version, state, gauss = random.getstate()
    assert text == json.dumps({"step": 4, "data_index": 8, "scheduler": sched.state_dict(),
                               "python_random": [version, list(state), gauss], "result_hash": "c1", "data_hash": "d1",
                               "metrics": rows, "finished": True, "finished_by": "time_budget"}, indent=2) + "\n"
    state = TrainerState.model_validate_json(text)
    assert (state.step, state.data_index, state.metrics, state.finished) == (4, 8, rows, True)
    with pytest.raises(ValidationError, match="surprise"):
        C.save(setup.run_dir, 8, 16, d, opt, sched, {**C.identity(setup), "surprise": 1})
    with pytest.raises(ValidationError, match="result_hash"):
        C.save(setup.run_dir, 8, 16, d, opt, sched, {"result_hash": 3, "data_hash": None})
    assert [p.name for p in (setup.run_dir / "checkpoints").iterdir()] == ["step-000004"]


def test_a_malformed_trainer_json_makes_its_checkpoint_not_intact(tmp_path, caplog):
    """A trainer.json that its manifest agrees with but that is no trainer state (edited, or a bug): resume skips that
    checkpoint in one line naming the key, as a damaged file (it used to stop on a traceback: "8" >= 12), and `load`
    refuses it naming the file and the key. One of an older version, without `metrics` or `finished`, still resumes."""
    setup = fake_setup(tmp_path, steps=12)
    saved(setup)
    ck = C.step_dir(setup.run_dir, 8)
    f = ck / C.TRAINER
    good = json.loads(f.read_text())
    f.write_text(json.dumps({**good, "step": "8"}))
    _reseal(ck, C.TRAINER)
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert C.resumable(setup) == C.step_dir(setup.run_dir, 4)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "step-000008 skipped: trainer.json is not a trainer state (key 'step': " in lines[0]
    with pytest.raises(UserError, match=re.escape(f"{f}: not a trainer state (key 'step': Input should be a valid "
                                                  f"integer, got '8')")):
        C.load(ck, *trained())
    f.write_text(json.dumps({k: v for k, v in good.items() if k not in ("metrics", "finished", "finished_by")}))
    _reseal(ck, C.TRAINER)
    assert C.resumable(setup) == ck
    state = C.load(ck, *trained())
    assert (state.step, state.metrics, state.finished) == (8, None, False) and not C.finished(state, setup)


def test_finished_json_is_exactly_the_model_and_a_malformed_one_is_named(tmp_path, caplog):
    """finished.json is the writer's record (checkpoint_records.Finished); restore reads it through FinishedCore: one
    whose outputs are not text is named in one line (file and key) and restores nothing (it used to be silent), so the
    finished run is set aside and a new one trains."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    finish(setup, 8)
    f = setup.run_dir / "checkpoints" / C.FINISHED
    record = Finished.model_validate_json(f.read_text())
    assert record.checkpoint == CheckpointRef(**C.describe(setup.run_dir, 8))
    assert record.outputs == {"summary.json": "summary of the finished run\n", "metrics.jsonl": '{"step": 1}\n'}
    with pytest.raises(ValidationError, match="checkpoint.extra"):
        C.record_finished(setup.run_dir, {**C.describe(setup.run_dir, 8), "extra": 1})
    assert Finished.model_validate_json(f.read_text()) == record          # refused before anything was written
    f.write_text(json.dumps({**json.loads(f.read_text()), "outputs": {"summary.json": 1, "metrics.jsonl": ""}}))
    (setup.run_dir / "summary.json").unlink()
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert C.restore(setup) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"{f}: key 'outputs.summary.json': Input should be a valid string, got 1; the finished run cannot be restored "
        f"from it"]
    assert not (setup.run_dir / "summary.json").exists()
    assert C.resumable(setup) is None and (setup.run_dir / C.PREVIOUS / "step-000008").is_dir()   # a new run trains


def finish(setup, step, text="summary of the finished run\n"):
    """What summary.write does when a run completes: the outputs, and their record beside the checkpoints."""
    (setup.run_dir / "summary.json").write_text(text)
    (setup.run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    C.record_finished(setup.run_dir, C.describe(setup.run_dir, step))


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
    assert C.restore(setup).checkpoint.path == "checkpoints/step-000008"
    assert (setup.run_dir / "summary.json").read_text() == "summary of the finished run\n"
    assert (setup.run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert sorted(p.name for p in (setup.run_dir / "checkpoints").iterdir()) == \
        [C.FINISHED, "step-000004", "step-000008"]
    for other in ({"result_hash": "c2"}, {"data_hash": "d2"}, {"steps": 12}, {"resume": False}):
        (setup.run_dir / "summary.json").unlink()
        assert C.restore(fake_setup(tmp_path, **{"steps": 8, **other})) is None, other
        assert not (setup.run_dir / "summary.json").exists()
        finish(fake_setup(tmp_path, steps=8), 8)
    weights = C.step_dir(setup.run_dir, 8) / C.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    assert C.restore(fake_setup(tmp_path, steps=8)) is None


def test_a_run_moved_aside_comes_back_when_its_config_does(tmp_path, caplog):
    """Rule 5 (issue 40): a run with other settings moved this config's run to checkpoints.previous/. Going back,
    a finished one is restored and an interrupted one resumed from there: the two folders swap, nothing is lost."""
    mine, other = fake_setup(tmp_path, steps=8), fake_setup(tmp_path, steps=8, result_hash="c2")
    saved(mine)
    finish(mine, 8)
    assert C.resumable(other) is None                                    # the other run sets mine aside
    saved(other, (4,))                                                   # and is interrupted at step 4
    assert C.restore(mine).checkpoint.path == "checkpoints/step-000008"
    assert (mine.run_dir / "summary.json").read_text() == "summary of the finished run\n"
    assert sorted(p.name for p in (mine.run_dir / "checkpoints").iterdir()) == [C.FINISHED, "step-000004",
                                                                               "step-000008"]
    assert [p.name for p in (mine.run_dir / C.PREVIOUS).iterdir()] == ["step-000004"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, "dflash.train"):
        assert C.resumable(other) == C.step_dir(mine.run_dir, 4)         # back again: the other run resumes
    assert any("interrupted run of this config and data (step-000004) is resumed" in r.getMessage()
               for r in caplog.records)
    assert (mine.run_dir / C.PREVIOUS / C.FINISHED).is_file()
    assert C.resumable(fake_setup(tmp_path, steps=8, result_hash="c3")) is None   # a third config: set aside
    assert [p.name for p in (mine.run_dir / C.PREVIOUS).iterdir()] == ["step-000004"]


def test_a_swap_cut_short_is_finished(tmp_path):
    """checkpoints/ and checkpoints.previous/ swap in three renames; a kill between them leaves checkpoints.swap/,
    which the next look puts where it belongs."""
    mine, other = fake_setup(tmp_path, steps=8), fake_setup(tmp_path, steps=8, result_hash="c2")
    saved(mine)
    finish(mine, 8)
    C.set_aside(mine.run_dir, "test")
    saved(other, (4,))
    os.replace(mine.run_dir / "checkpoints", mine.run_dir / C.SWAP)     # killed after the first rename
    assert C.restore(mine) is not None
    assert not (mine.run_dir / C.SWAP).exists()
    assert [p.name for p in (mine.run_dir / C.PREVIOUS).iterdir()] == ["step-000004"]
    C.set_aside(mine.run_dir, "test")
    saved(other, (4,))
    os.replace(mine.run_dir / C.PREVIOUS, mine.run_dir / C.SWAP)        # killed after the second rename
    assert C.resumable(other) == C.step_dir(mine.run_dir, 4)
    assert sorted(p.name for p in (mine.run_dir / C.PREVIOUS).iterdir()) == [C.FINISHED, "step-000004",
                                                                            "step-000008"]


def test_finished_is_one_predicate():
    """resumable and restore ask one question of a checkpoint's trainer state (extend it there)."""
    setup = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(steps=8)))
    def saved(**keys):   # a trainer.json as resuming reads it; without `finished` as one written before it existed
        state = {"data_index": 0, "scheduler": {}, "python_random": [3, [], None], **keys}
        return TrainerCore.model_validate_json(json.dumps(state))
    assert C.finished(saved(step=8), setup) and not C.finished(saved(step=7), setup)
    assert C.finished(saved(step=3, finished=True, finished_by="time_budget"), setup)


def test_evaluate_and_export_read_exactly_the_checkpoint_the_run_ended_with(tmp_path):
    """Rule 3: the consumer of a run's output uses that output or stops naming what is missing, never a stand-in:
    summary.json names the final checkpoint (and its manifest's hash); gone, damaged or replaced, it is refused."""
    setup = fake_setup(tmp_path, steps=8)
    saved(setup)
    final = C.describe(setup.run_dir, 8)
    (setup.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "checkpoint": final}))
    assert C.ended_with(setup.run_dir) == C.step_dir(setup.run_dir, 8)
    weights = C.step_dir(setup.run_dir, 8) / C.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UserError, match=r"step-000008: model\.safetensors is 100 bytes.*final drafter is damaged"):
        C.ended_with(setup.run_dir)             # not step 4 instead
    C.save(setup.run_dir, 8, 99, *trained(seed=1), C.identity(setup))   # another checkpoint under the same name
    with pytest.raises(UserError, match=r"step-000008: not the checkpoint the run ended with"):
        C.ended_with(setup.run_dir)
    (setup.run_dir / "summary.json").write_text(json.dumps({"status": "failed", "checkpoint": None}))
    with pytest.raises(UserError, match=r"summary\.json: names no final checkpoint"):
        C.ended_with(setup.run_dir)


def test_checkpoint_loads_into_the_reference_package(tmp_path):
    """A checkpoint folder, as is, is a drafter for `DFlashDraftModel.from_pretrained` (dflash 0.1.0)."""
    if not SIDE.exists():
        pytest.skip("side venv .venv-interop not built (`make interop` builds it)")
    setup = fake_setup(tmp_path)
    saved(setup, (4,))
    ck = C.step_dir(setup.run_dir, 4)
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
