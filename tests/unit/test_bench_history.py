"""bench/history.py: the committed GPU runs become the pipeline's run history, which `python -m dflash report` reads,
each run with the code it really ran (not the lent machine's stale git record)."""
import csv
import json
import shutil
import subprocess
from pathlib import Path

from bench import history
from dflash.cli import main as dflash

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"


def rows(out: Path) -> dict[str, dict]:
    with open(out / "history.csv") as f:
        return {r["run_id"]: r for r in csv.DictReader(f)}


def test_every_committed_run_is_recorded_once_with_the_code_it_ran(tmp_path):
    found = history.collect(RESULTS)
    ids = [s["run_id"] for _, s in found]
    assert len(ids) == len(set(ids)) >= 47      # summaries, multi_gpu parts and archives; a run in several: once
    by_id = {s["run_id"]: s for _, s in found}
    r3 = by_id["h200-1t1d-20261129T211947Z"]    # summary-1t1d-7bbc115.json: its .git had said e80c2ac
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "7bbc115"], capture_output=True, text=True)
    assert r3["git"]["commit"] == (head.stdout.strip() or "7bbc115") and r3["git"]["source"] == "file name"
    assert r3["git"]["recorded"]["commit"].startswith("e80c2ac")
    assert r3["bench_source"] == "bench/results/2026-11-29-h200-r3/summary-1t1d-7bbc115.json"
    q = by_id["quality-20261201T164846Z"]       # in runs.tar.gz; the quality bench's table named its tree
    assert q["git"]["source"] == "quality.json beside it" and q["git"]["commit"].startswith("22b5284")
    assert q["_acceptance"]["temperature"] == 0.0 and abs(q["_acceptance"]["tau"] - 3.4167) < 1e-3


def test_the_report_reads_the_series(tmp_path):
    """Two sessions of the one-GPU run: the history holds both, the report compares the later with the earlier
    (same run name, hardware, placement) and names the code change between them."""
    res = tmp_path / "results"
    for folder, name in (("2026-12-01-h200-r6", "summary-1t1d-2fbfd61.json"),
                         ("2026-12-04-h200-r9", "summary-1t1d-c3-c95ad57.json")):
        (res / folder).mkdir(parents=True)
        shutil.copy(RESULTS / folder / name, res / folder / name)
    out = tmp_path / "history"
    history.write(res, out, report=False)
    assert set(rows(out)) == {"h200-1t1d-20261201T194847Z", "h200-1t1d-20261204T021705Z"}
    assert rows(out)["h200-1t1d-20261204T021705Z"]["git_commit"].startswith("c95ad57")
    assert dflash(["report", "--config", str(REPO / "config/h200.yaml"), "--runs-dir", str(tmp_path / "none"),
                   "--out", str(out)]) == 0
    reg = json.loads((out / "regressions.json").read_text())
    assert reg["latest"] == "h200-1t1d-20261204T021705Z" and reg["latest_verdict"] == "ok"   # 12.44 -> 12.58
    last = reg["runs"][-1]
    assert last["baseline"]["run_id"] == "h200-1t1d-20261201T194847Z"
    assert "code (commit 2fbfd619ba3d -> c95ad57a9fd8)" in last["sentence"]
    history.write(res, out, report=False)       # again: nothing new, nothing lost
    assert len(rows(out)) == 2
