"""A run folder's layout is one object (dflash.paths.RunFolder): every name spelled there, a path wherever one is
taken."""
from pathlib import Path

from dflash.paths import RunFolder


def test_a_run_folder_names_its_files_and_is_a_path():
    f = RunFolder("results/runs/demo")
    assert (f.summary, f.metrics, f.checkpoints, f.lock, f.drafter) == tuple(
        Path("results/runs/demo", n) for n in ("summary.json", "metrics.jsonl", "checkpoints", "train.lock", "drafter"))
    assert f.acceptance() == Path("results/runs/demo/acceptance.json")
    assert f.acceptance(0.7) == Path("results/runs/demo/acceptance-t0.7.json")
    assert f.acceptance(1).name == "acceptance-t1.json"
    assert Path(f) == Path(str(f)) == f.root and RunFolder(f) == f
    assert RunFolder.OUTPUTS == ("summary.json", "metrics.jsonl")


def test_its_evaluations_leave_out_a_failed_ones_record(tmp_path):
    f = RunFolder(tmp_path)
    for name in ("acceptance.json", "acceptance-t0.7.json", "acceptance.failed.json", "summary.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in f.evaluations()] == ["acceptance-t0.7.json", "acceptance.json"]
