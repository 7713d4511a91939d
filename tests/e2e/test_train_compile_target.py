"""train.compile_target: the threads runtime compiles the target's captured layers for every bucket in the warm-up
(its record in summary.json's compile section), trains with 0 recompiles after it, and the compiled capture equals
the eager one: through the final norm (last layer captured) and stopped before an uncompiled layer."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from dflash.records.compile import CompileRecord
from dflash.config_model import TargetSection
from dflash.target import load_target
from dflash.train.features import LayerCapture
from support.train import dflash, prepared, run_dir, train_ok

pytestmark = pytest.mark.slow


def check(tmp_path, device: str, tol: float, **train):
    cfg = prepared(tmp_path, targets=[device], drafters=[device], compile_target=True, steps=4, checkpoint_every=0,
                   log_every=1, warmup_steps_excluded=1, **train)
    train_ok(cfg)
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 4, s.get("failure")
    compiled_target_record(s["compile"])
    capture_equals_eager(cfg, device, tol)


def compiled_target_record(comp: dict) -> None:
    """A summary's compile section with train.compile_target: the target's layers compiled for every bucket."""
    target = [w for w in comp["per_device"] if w.get("role") == "target"]
    assert len(target) == 1 and target[0]["compiled"] is True and target[0]["modules"] == 3  # 2 layers + final norm
    drafter = [w for w in comp["per_device"] if w.get("role") != "target"]
    assert target[0]["shapes"] and [x["length"] for x in target[0]["shapes"]] == \
        [x["length"] for x in drafter[0]["shapes"]]                                       # every bucket
    assert target[0]["graphs"] <= 2 * len(target[0]["shapes"])   # per shape: one layer graph (shared) + the norm's
    assert comp["graphs"] == sum(w["graphs"] for w in comp["per_device"])
    assert comp["recompiles_after_warmup"] == 0 and comp["eager_fallbacks"] == 0


def capture_equals_eager(cfg, device: str, tol: float) -> None:
    """The compiled capture equals the eager one: through the final norm (last layer captured) and stopped before an
    uncompiled layer."""
    section = TargetSection.model_validate(yaml.safe_load(cfg.read_text())["target"])
    dev = torch.device(device)
    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(3)).to(dev)
    for layer_ids, modules in (([0, 1], 3), ([0], 1)):   # [0]: a pre-hook on the uncompiled layer 1 stops the forward
        eager = LayerCapture(load_target(section, device=dev), layer_ids)
        compiled = LayerCapture(load_target(section, device=dev), layer_ids)
        compiled.compile()
        rec = compiled.warm_up(dev, [(2, 64)], 300)
        assert rec["compiled"] is True and rec["modules"] == modules
        ran = []
        compiled.decoder.layers[1].register_forward_hook(lambda *a: ran.append(1))
        want, got = eager(ids), compiled.guarded(ids)
        assert ran == ([1] if modules == 3 else [])
        assert got.shape == (2, 64, 32 * len(layer_ids)) and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert ((got.float() - want.float()).norm() / want.float().norm()) < tol / 2


def test_compiled_target_on_cpu(tmp_path):
    """The capture alone: a compiled train run's record is held by the warm-up stage's test below (one train run)."""
    capture_equals_eager(prepared(tmp_path, targets=["cpu"], drafters=["cpu"], compile_target=True), "cpu", 1e-5)


@pytest.mark.gpu
def test_compiled_target_on_cuda_bf16(tmp_path):
    # the compiled drafter (flex) beside it in the same process, as on the H200; bf16: a few ulps apart where fused
    check(tmp_path, "cuda:0", 4e-2, attention="flex", compile=True)


def test_warmup_stage_compiles_the_target_for_every_bucket(tmp_path):
    """`python -m dflash warmup` with train.compile_target: on a device running a target and a drafter, the record
    holds the drafter's part and the target's (role 'target': graphs, seconds, every bucket shape) as train's
    summary does; the graphs land in the run's Inductor cache folder."""
    cfg = prepared(tmp_path, targets=["cpu"], drafters=["cpu"], compile_target=True)
    r = dflash("warmup", "--config", str(cfg), "--device", "cpu", timeout=600)   # a fresh process, as the rule runs it
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "results" / "compile" / "cpu.json").read_text())
    CompileRecord.model_validate(rec)                                          # exactly dflash/records/compile.py's
    drafter, target = rec["per_role"]
    assert drafter["role"] == "drafter" and drafter["compiled"] is False       # train.compile off: eager drafter
    assert target["role"] == "target" and target["compiled"] is True and target["modules"] == 3
    lengths = [x["length"] for x in target["shapes"]]
    assert len(lengths) >= 2 and lengths == [x["length"] for x in drafter["shapes"]]    # every bucket
    assert len(lengths) <= target["graphs"] <= 2 * len(lengths) and target["seconds"] > 0
    assert rec["graphs"] == target["graphs"] + drafter["graphs"] and rec["device"] == "cpu"
    assert rec["cache_dir"].startswith(str(tmp_path)) and any(p.is_file() for p in Path(rec["cache_dir"]).rglob("*"))
    # the train stage's first start (a fresh process) then finds the target's graphs in that cache
    r = dflash("train", "--config", str(cfg), "--no-progress", "--set", "train.steps=2", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 2, s.get("failure")
    warm = next(w for w in s["compile"]["per_device"] if w.get("role") == "target")
    assert warm["cache_hits"] >= len(lengths) and warm["cache_misses"] == 0, warm
    compiled_target_record(s["compile"])             # what test_compiled_target_on_cpu's own train run checked
