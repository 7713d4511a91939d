"""The gate through Snakemake (the venv's binary): a regression fails the run while report.md, the plots and the
history (with the regressed run) stay; without fail_on_regression the same tree passes."""
import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash.report import build
from support.report_factory import BASE_CONFIG, BASE_DATA, settings, summary, write_run
SNAKEMAKE = Path(sys.executable).with_name("snakemake")
pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment")
PNGS = ("ktok_history.png", "tau_history.png", "devices_latest.png", "time_split.png", "training_latest.png")


def snakemake(work, *args):
    # the venv's binary; its bin/ leads PATH only for rules that still call a bare `python`
    env = dict(os.environ, PATH=f"{SNAKEMAKE.parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([str(SNAKEMAKE), *args], cwd=work, capture_output=True, text=True, timeout=300, env=env)


def expanded(n, ktok):
    """The seed's story: longer samples, more of them (another data hash), through the config (another config hash)."""
    data = copy.deepcopy(BASE_DATA)
    data.update(num_samples=3000, total_tokens=5_100_000, content_hash="beef000000000000")
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg["data"] = {"max_length": 4096}
    return summary(n, ktok, data=data, config=cfg)


def test_failing_gate_keeps_the_report_and_the_history(tmp_path, repo):
    work = tmp_path / "wf"
    shutil.copytree(repo, work, ignore=shutil.ignore_patterns(".venv*", ".git", "results", ".snakemake", "__pycache__",
                                                               "bench", "tests", "docs"))
    report = work / "results" / "report"
    old = tmp_path / "old-runs"                        # three earlier runs, recorded; their folders long gone
    for n, k in ((1, 12.0), (2, 11.7), (3, 12.2)):
        write_run(old, summary(n, k), folder="demo", metrics=False)
        build(old, report, settings())
    for p in report.iterdir():
        if p.is_file():
            p.unlink()                                 # only history/ is left: history.csv is rebuilt from it
    regressed = expanded(4, 7.0)
    write_run(work / "results" / "runs", regressed, folder="demo")
    drafter = work / "results" / "runs" / "demo" / "drafter"     # the report rule reads after the export: its folder
    drafter.mkdir()                                              # (made after the run's files, so it is up to date)
    (drafter / "config.json").write_text("{}\n")
    (drafter / "export.json").write_text('{"files": ["config.json"]}\n')    # the export's record: its folder
    cfg = yaml.safe_load((work / "config" / "config.yaml").read_text())
    cfg["report"] = {"fail_on_regression": True}
    (work / "config" / "gate.yaml").write_text(yaml.safe_dump(cfg))
    # only report and gate may run: the prepared summary.json and acceptance.json are taken as they are
    args = ("results/report/gate.json", "--cores", "1", "--configfile", "config/gate.yaml",
            "--allowed-rules", "report", "gate")

    r = snakemake(work, *args)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "dflash gate: regression: Run " + regressed["run_id"] in out      # the reason on the console
    for name in ("report.md", "regressions.json", *PNGS):
        assert (report / name).stat().st_size > 0, name                       # kept by Snakemake
    rows = (report / "history.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows[1:]] == [summary(n)["run_id"] for n in (1, 2, 3)] + [regressed["run_id"]]
    latest = json.loads((report / "regressions.json").read_text())["runs"][-1]
    assert latest["verdict"] == "regression" and latest["baseline"]["ktok_per_s"] == 12.0
    assert {c for c, items in latest["changed"].items() if items} == {"data", "config"}
    assert "fell 1.7x" in (report / "report.md").read_text()
    assert not (report / "gate.json").exists()

    cfg["report"] = {"fail_on_regression": False}      # the same tree without the gate's flag passes
    (work / "config" / "gate.yaml").write_text(yaml.safe_dump(cfg))
    r = snakemake(work, *args)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert json.loads((report / "gate.json").read_text())["verdict"] == "regression"
