"""The report stage end to end: history store, skipped inputs, outputs, exit code through `python -m dflash`."""
import json
import logging
import subprocess
import sys

from dflash.report import build
from dflash.report.regress import Settings
from test_report_factory import summary, with_pkg, write_run

PNGS = ("ktok_history.png", "devices_latest.png", "time_split.png", "training_latest.png")


def test_corrupt_and_missing_summaries_are_skipped_with_a_warning_naming_the_file(tmp_path, caplog):
    runs = tmp_path / "runs"
    write_run(runs, summary(1, 12.0))
    (runs / "badjson").mkdir()
    (runs / "badjson" / "summary.json").write_text('{"run_id": ')
    nokey = summary(2, 12.0)
    del nokey["throughput"]
    write_run(runs, nokey, folder="nokey", metrics=False)
    (runs / "nosummary").mkdir()
    with caplog.at_level(logging.WARNING, logger="dflash.report"):
        result = build(runs, tmp_path / "report", Settings())
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(runs / "badjson" / "summary.json") in warnings and "not valid JSON" in warnings
    assert str(runs / "nokey" / "summary.json") in warnings and "missing key 'throughput'" in warnings
    assert str(runs / "nosummary" / "summary.json") in warnings and "missing" in warnings
    assert [r["run_id"] for r in result.records] == [summary(1)["run_id"]]
    assert len(result.skipped) == 3
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Skipped inputs" in md and "badjson/summary.json" in md


def test_history_is_append_only(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs, summary(1, 12.0), folder="demo", metrics=False)
    write_run(runs, summary(2, 11.9), folder="other", metrics=False)
    build(runs, out, Settings())
    first_csv = (out / "history.csv").read_bytes()
    snaps = {p.name: p.read_bytes() for p in (out / "history").iterdir()}
    # same runs again: nothing appended, nothing rewritten
    build(runs, out, Settings())
    assert (out / "history.csv").read_bytes() == first_csv
    # the folder of run 1 is overwritten by a new run; run 2's summary is edited in place (same run_id)
    write_run(runs, summary(3, 4.0, env=with_pkg("torch", "2.13.0")), folder="demo", metrics=False)
    edited = summary(2, 99.0)
    write_run(runs, edited, folder="other", metrics=False)
    result = build(runs, out, Settings())
    after = (out / "history.csv").read_bytes()
    assert after.startswith(first_csv)                                   # earlier rows byte-identical
    assert len(after.decode().splitlines()) == 1 + 3
    assert result.appended == [summary(3)["run_id"]]
    for name, data in snaps.items():                                    # snapshots are write-once
        assert (out / "history" / name).read_bytes() == data
    assert result.records[-1]["verdict"] == "regression"
    assert result.records[-1]["what_changed"] == "environment (torch 2.11.0 -> 2.13.0)"


def test_outputs_exist_and_report_names_the_cause(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs, summary(1, 12.0), tau=6.4)
    write_run(runs, summary(2, 12.2), tau=6.5)
    write_run(runs, summary(3, 3.9, env=with_pkg("torch", "2.13.0"), mems=(40.0, 72.0, 77.0)), tau=6.3)
    build(runs, out, Settings())
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name
    md = (out / "report.md").read_text()
    assert "Ktok/s fell 3.1x vs run demo-20261102T100000Z" in md
    assert "what changed: environment (torch 2.11.0 -> 2.13.0)" in md
    assert "cuda:5" in md                                                 # the anomaly is named
    for name in PNGS:
        assert f"]({name})" in md                                         # relative links
    assert "| 6.30 |" in md                                               # tau beside Ktok/s
    reg = json.loads((out / "regressions.json").read_text())
    assert reg["latest_verdict"] == "regression"
    assert reg["runs"][-1]["changed"]["environment"] == [{"key": "torch", "old": "2.11.0", "new": "2.13.0"}]
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert {"run_id", "ktok_per_s", "tau", "mfu", "env_hash", "data_hash", "config_hash", "git_commit"} <= set(header)


def test_missing_metrics_and_empty_history_do_not_fail(tmp_path):
    out = tmp_path / "report"
    result = build(tmp_path / "no-runs", out, Settings())
    assert result.records == [] and (out / "history.csv").read_text().startswith("run_id,")
    assert all((out / n).stat().st_size > 0 for n in PNGS)
    write_run(tmp_path / "runs", summary(1, 12.0), metrics=False, tau=None)
    result = build(tmp_path / "runs", out, Settings())
    assert result.records[0]["verdict"] == "first run"
    assert (out / "training_latest.png").stat().st_size > 0


def _config(tmp_path, fail):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path}/results\nreport:\n  fail_on_regression: {str(fail).lower()}\n")
    runs = tmp_path / "results" / "runs"
    write_run(runs, summary(1, 12.0), metrics=False)
    write_run(runs, summary(2, 4.0, commit="b" * 40), metrics=False)
    return cfg


def test_fail_on_regression_gives_a_nonzero_exit_with_a_one_line_reason(tmp_path, repo):
    cfg = _config(tmp_path, True)
    r = subprocess.run([sys.executable, "-m", "dflash", "report", "--config", str(cfg)], cwd=repo,
                       capture_output=True, text=True, env={"MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0
    assert (tmp_path / "results" / "report" / "report.md").is_file(), r.stderr
    reason = [line for line in r.stderr.splitlines() if line.startswith("dflash report: regression:")]
    assert len(reason) == 1 and "code (commit aaaaaaaaaaaa -> bbbbbbbbbbbb)" in reason[0]


def test_regression_without_fail_on_regression_exits_zero(tmp_path):
    from dflash.cli import main
    cfg = _config(tmp_path, False)
    out = tmp_path / "elsewhere"
    assert main(["report", "--config", str(cfg), "--runs-dir", str(tmp_path / "results" / "runs"), "--out", str(out)]) == 0
    assert json.loads((out / "regressions.json").read_text())["latest_verdict"] == "regression"


def test_rule_file_declares_every_plot_and_ends_all(repo):
    from dflash.report.plots import PLOTS
    smk = (repo / "workflow" / "rules" / "report.smk").read_text()
    for name in PLOTS.values():
        assert f'{{REPORT_DIR}}/{name}"' in smk, name
    assert 'REPORT_EXTRA_INPUTS = globals().get("REPORT_EXTRA_INPUTS", [])' in smk
    assert "update(" in smk                                               # history.csv is not deleted before the job
    assert '\nALL_TARGETS.append(f"{REPORT_DIR}/report.md")' in smk                  # the report ends `all`
    for caption in ("report_md", "history", "regressions", "ktok_history", "time_split", "devices_latest", "training_latest"):
        assert (repo / "workflow" / "report" / f"{caption}.rst").is_file()


def test_tau_that_arrives_after_the_run_was_recorded(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    s = summary(1, 12.0)
    write_run(runs, s, tau=None, metrics=False)
    build(runs, out, Settings())
    before = (out / "history.csv").read_bytes()
    (runs / s["run_id"] / "acceptance.json").write_text(json.dumps({"tau": {"gsm8k": 6.0, "mt-bench": 5.0}}))
    result = build(runs, out, Settings())
    assert (out / "history.csv").read_bytes() == before            # the row is not rewritten ...
    assert result.records[0]["tau"] == 5.5                           # ... tau comes from history/late_tau.csv
    (runs / s["run_id"]).rename(tmp_path / "gone")
    assert build(runs, out, Settings()).records[0]["tau"] == 5.5     # and outlives the run folder
