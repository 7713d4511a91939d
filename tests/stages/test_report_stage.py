"""The report stage end to end: history store, history.csv faults, skipped inputs, outputs, the gate's exit code."""
import json
import logging
import subprocess
import sys

import pytest

from dflash.report import build
from dflash.report.history import COLUMNS
from support.report_factory import acceptance, settings, summary, with_pkg, write_run

PNGS = ("ktok_history.png", "tau_history.png", "devices_latest.png", "time_split.png", "training_latest.png")


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
        result = build(runs, tmp_path / "report", settings())
    warnings = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(runs / "badjson" / "summary.json") in warnings and "not valid JSON" in warnings
    assert str(runs / "nokey" / "summary.json") in warnings and "missing key 'throughput'" in warnings
    assert str(runs / "nosummary" / "summary.json") in warnings and "missing" in warnings
    assert [r["run_id"] for r in result.records] == [summary(1)["run_id"]]
    assert len(result.skipped) == 3
    md = (tmp_path / "report" / "report.md").read_text()
    assert "Skipped inputs" in md and "badjson/summary.json" in md


def test_history_rows_stay_and_snapshots_are_write_once(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs, summary(1, 12.0), folder="demo", metrics=False)
    write_run(runs, summary(2, 11.9), folder="other", metrics=False)
    build(runs, out, settings())
    first_csv = (out / "history.csv").read_bytes()
    snaps = {p.name: p.read_bytes() for p in (out / "history").iterdir()}
    # same runs again: nothing recorded, nothing rewritten
    build(runs, out, settings())
    assert (out / "history.csv").read_bytes() == first_csv
    # the folder of run 1 is overwritten by a new run; run 2's summary is edited in place (same run_id)
    write_run(runs, summary(3, 4.0, env=with_pkg("torch", "2.13.0")), folder="demo", metrics=False)
    edited = summary(2, 99.0)
    write_run(runs, edited, folder="other", metrics=False)
    result = build(runs, out, settings())
    after = (out / "history.csv").read_bytes()
    assert after.startswith(first_csv)                                   # earlier rows byte-identical
    assert len(after.decode().splitlines()) == 1 + 3
    assert result.appended == [summary(3)["run_id"]]
    for name, data in snaps.items():                                    # snapshots are write-once
        assert (out / "history" / name).read_bytes() == data
    assert result.records[-1]["verdict"] == "regression"
    assert result.records[-1]["what_changed"] == "environment (torch 2.11.0 -> 2.13.0)"


def _three_runs(tmp_path):
    """Two runs recorded, their folders gone (overwritten long ago), then a third, slower one."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    for n, k in ((1, 12.0), (2, 12.2)):
        write_run(runs, summary(n, k), folder="demo", metrics=False)
        build(runs, out, settings())
    write_run(runs, summary(3, 4.0, commit="b" * 40), folder="demo", metrics=False)
    return runs, out, (out / "history.csv").read_text()


def _garbage_row(csv_text):
    return csv_text + "garbage,,not a date\n"


def _bad_number(csv_text):
    header, *rows = csv_text.splitlines()
    cols = header.split(",")
    fields = rows[0].split(",")
    fields[cols.index("ktok_per_s")] = "fast"
    return "\n".join([header, ",".join(fields), *rows[1:]]) + "\n"


FAULTS = {
    "garbage row": (_garbage_row, ":4", "field(s), the header has"),
    "not a number": (_bad_number, ":2", "ktok_per_s='fast'"),
    "renamed column": (lambda t: t.replace("ktok_per_s", "ktoks", 1), ":1", "lacks column(s) ktok_per_s"),
    "emptied": (lambda t: "", None, None),
    "deleted": (None, None, None),
    "binary junk": (lambda t: bytes(range(256)) * 8, "", "not UTF-8 text"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_history_csv_faults_lose_no_run_and_are_named(tmp_path, fault, caplog):
    runs, out, good = _three_runs(tmp_path)
    damage, where, reason = FAULTS[fault]
    if damage is None:
        (out / "history.csv").unlink()
    else:
        bad = damage(good)
        (out / "history.csv").write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    with caplog.at_level(logging.WARNING, logger="dflash.report"):
        result = build(runs, out, settings())
    ids = [summary(n)["run_id"] for n in (1, 2, 3)]
    assert [r["run_id"] for r in result.records] == ids                  # earlier runs rebuilt from history/
    latest = result.records[-1]
    assert latest["verdict"] == "regression" and latest["ktok_per_s"] == 4.0
    assert "fell 3.0x" in latest["sentence"] and "code (commit" in latest["sentence"]
    lines = (out / "history.csv").read_text().splitlines()                # the view is whole again
    assert lines[0].split(",") == list(COLUMNS) and [line.split(",")[0] for line in lines[1:]] == ids
    named = [s for s in result.skipped if "history.csv" in s["file"]]
    if where is None:
        assert named == []
    else:
        assert len(named) == 1 and named[0]["file"] == f"{out / 'history.csv'}{where}" and reason in named[0]["reason"]
        assert reason in caplog.text
        md = (out / "report.md").read_text()
        assert "Skipped inputs" in md and f"history.csv{where}" in md
        table = [line for line in md.splitlines() if line.startswith("| ") and "Ktok/s" not in line and "---" not in line]
        assert [line.split(" | ")[0] for line in table] == [f"| {i}" for i in reversed(ids)]   # no run of a bad row


def test_a_damaged_snapshot_is_named_and_restored_from_its_row_then_from_its_run_folder(tmp_path):
    runs, out, _ = _three_runs(tmp_path)
    snap = out / "history" / f"{summary(1)['run_id']}.json"
    snap.write_text("{not json")
    result = build(runs, out, settings())
    assert [s["file"] for s in result.skipped] == [str(snap)]
    assert len(result.records) == 3                                       # its folder is gone: its csv row restores it
    assert result.records[0]["restored_from"] == "history.csv:2" and result.records[0]["ktok_per_s"] == 12.0
    restored = json.loads(snap.read_text())
    assert restored["restored_from"] == "history.csv:2" and restored["row"]["ktok_per_s"] == "12.0"
    assert "Restored from `history.csv`" in (out / "report.md").read_text()
    write_run(runs, summary(1, 12.0), metrics=False)                      # the folder is back: recorded whole again
    result = build(runs, out, settings())
    assert len(result.records) == 3 and result.records[0]["restored_from"] is None
    assert json.loads(snap.read_text())["env"]["packages"]["torch"] == "2.11.0"


def test_outputs_exist_and_report_names_the_cause(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs, summary(1, 12.0), tau=6.4)
    write_run(runs, summary(2, 12.2), tau=6.5)
    write_run(runs, summary(3, 3.9, env=with_pkg("torch", "2.13.0"), mems=(40.0, 72.0, 77.0)), tau=6.3)
    build(runs, out, settings())
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name
    md = (out / "report.md").read_text()
    assert "Ktok/s fell 3.1x vs the median of 2 identical runs up to demo-20261102T100000Z (12.10 -> 3.90" in md
    assert "what changed: environment (torch 2.11.0 -> 2.13.0)" in md
    assert "cuda:5" in md                                                 # the anomaly is named
    for name in PNGS:
        assert f"]({name})" in md                                         # relative links
    assert "| 6.300 | 2.500 |" in md                                      # tau and the final loss beside Ktok/s
    reg = json.loads((out / "regressions.json").read_text())
    assert reg["latest_verdict"] == "regression"
    assert reg["runs"][-1]["changed"]["environment"] == [{"key": "torch", "old": "2.11.0", "new": "2.13.0"}]
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert {"run_id", "ktok_per_s", "tau", "mfu", "env_hash", "data_hash", "config_hash", "git_commit"} <= set(header)


def test_report_gives_the_latest_runs_tau_against_training_gpu_seconds(tmp_path):
    """metrics.jsonl rows with an in-training tau (train.eval_every): report.md lists tau against the training
    GPU-seconds it took, and the training plot's right panel draws it on that axis."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    d = write_run(runs, summary(1, 12.0), tau=3.4)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r.update(train_s=10.0 * (i + 1), gpu_s=10.0 * (i + 1))
        if i in (3, 7, 11):
            r.update(tau=1.5 + i / 10, tau_step=r["step"], tau_train_s=r["train_s"], tau_gpu_s=r["gpu_s"])
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    build(runs, out, settings())
    md = (out / "report.md").read_text()
    assert "tau while training, latest run `demo-20261101T100000Z`" in md
    assert "1.80 at 40 GPU-s, 2.20 at 80 GPU-s, 2.60 at 120 GPU-s" in md
    from dflash.report.plots import _acceptance, read_metrics
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    _acceptance(ax, read_metrics(d / "metrics.jsonl"))
    assert list(ax.get_lines()[1].get_xdata()) == [40.0, 80.0, 120.0]
    assert ax.get_xlabel() == "training GPU-seconds (evaluations left out)"
    plt.close(fig)


def test_missing_metrics_and_empty_history_do_not_fail(tmp_path):
    out = tmp_path / "report"
    result = build(tmp_path / "no-runs", out, settings())
    assert result.records == [] and (out / "history.csv").read_text().startswith("run_id,")
    assert all((out / n).stat().st_size > 0 for n in PNGS)
    write_run(tmp_path / "runs", summary(1, 12.0), metrics=False, tau=None)
    result = build(tmp_path / "runs", out, settings())
    assert result.records[0]["verdict"] == "first run"
    assert (out / "training_latest.png").stat().st_size > 0


def _config(tmp_path, fail):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path}/results\nreport:\n  fail_on_regression: {str(fail).lower()}\n")
    runs = tmp_path / "results" / "runs"
    write_run(runs, summary(1, 12.0), metrics=False)
    write_run(runs, summary(2, 4.0, commit="b" * 40), metrics=False)
    return cfg


def _dflash(repo, *args):
    return subprocess.run([sys.executable, "-m", "dflash", *args], cwd=repo, capture_output=True, text=True,
                          env={"MPLBACKEND": "Agg", "PATH": "/usr/bin:/bin"})


def test_report_exits_zero_and_the_gate_fails_on_regression_with_a_one_line_reason(tmp_path, repo):
    cfg = _config(tmp_path, True)
    r = _dflash(repo, "report", "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    g = _dflash(repo, "gate", "--config", str(cfg))
    assert g.returncode == 3
    report = tmp_path / "results" / "report"
    assert (report / "report.md").is_file() and not (report / "gate.json").exists()
    reason = [line for line in g.stderr.splitlines() if line.startswith("dflash gate: regression:")]
    assert len(reason) == 1 and "code (commit aaaaaaaaaaaa -> bbbbbbbbbbbb)" in reason[0]


def test_gate_passes_without_fail_on_regression_and_names_a_missing_report(tmp_path):
    from dflash.cli import main
    cfg = _config(tmp_path, False)
    out = tmp_path / "elsewhere"
    assert main(["gate", "--config", str(cfg), "--regressions", str(out / "regressions.json")]) == 1   # no report yet
    assert main(["report", "--config", str(cfg), "--runs-dir", str(tmp_path / "results" / "runs"), "--out", str(out)]) == 0
    assert json.loads((out / "regressions.json").read_text())["latest_verdict"] == "regression"
    assert main(["gate", "--config", str(cfg), "--regressions", str(out / "regressions.json"),
                 "--out", str(out / "gate.json")]) == 0
    gate = json.loads((out / "gate.json").read_text())
    assert gate == {"run_id": summary(2)["run_id"], "verdict": "regression", "quality_verdict": "ok",
                    "regressed": ["throughput"], "fail_on_regression": False, "passed": True}


def test_rule_file_declares_every_plot_and_ends_all(repo):
    from dflash.report.plots import PLOTS
    smk = (repo / "workflow" / "rules" / "report.smk").read_text()
    for name in PLOTS.values():
        assert f'{{REPORT_DIR}}/{name}"' in smk, name
    assert "update(" in smk                                               # history.csv is not deleted before the job
    snakefile = (repo / "Snakefile").read_text()
    assert "rules.report.output," in snakefile and "rules.gate.output," in snakefile  # the report and its gate end `all`
    report = smk[smk.index("rule report:"):smk.index("rule gate:")]
    for read in ("summary=run_file(RUN, RUN_FOLDER.SUMMARY)", "metrics=run_file(RUN, RUN_FOLDER.METRICS)",
                 "acceptance=run_file(RUN, RUN_FOLDER.ACCEPTANCE)"):
        assert read in report.split("output:")[0], read                   # what the report reads is its input
    gate = smk[smk.index("rule gate:"):]
    assert "regressions=rules.report.output.regressions" in gate and "dflash gate" in gate
    for caption in ("report_md", "history", "regressions", "ktok_history", "tau_history", "time_split", "devices_latest",
                    "training_latest"):
        assert (repo / "workflow" / "report" / f"{caption}.rst").is_file()


def test_tau_that_arrives_after_the_run_was_recorded(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    s = summary(1, 12.0)
    write_run(runs, s, tau=None, metrics=False)
    build(runs, out, settings())
    (runs / s["run_id"] / "acceptance.json").write_text(json.dumps({"tau": {"gsm8k": 6.0, "mt-bench": 5.0}}))
    result = build(runs, out, settings())
    assert result.records[0]["tau"] == 5.5                           # the mean over prompt sets, filled in once
    assert ",5.5," in (out / "history.csv").read_text()
    (runs / s["run_id"]).rename(tmp_path / "gone")
    assert build(runs, out, settings()).records[0]["tau"] == 5.5     # and outlives the run folder


def test_devices_plot_without_gpu_telemetry_says_so(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from dflash.report import plots
    from dflash.report.history import Run
    s = summary(1, 2.5)
    s["devices"] = [{"device": "cpu", "roles": ["target", "drafter"], "peak_memory_gb": None, "util_mean": None}]
    texts, bars = [], []
    real_text, real_bar = Figure.text, plots.plt.Axes.bar
    monkeypatch.setattr(Figure, "text", lambda self, x, y, t, *a, **k: texts.append(t) or real_text(self, x, y, t, *a, **k))
    monkeypatch.setattr(plots.plt.Axes, "bar", lambda self, x, h, *a, **k: bars.append(list(h)) or real_bar(self, x, h, *a, **k))
    path = plots.devices_latest(Run(row={"run_id": s["run_id"]}, snapshot=s), 30.0, tmp_path / "d.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any("No GPU telemetry" in t and "cpu (target/drafter)" in t for t in texts)
    assert bars == [[120.0] * 8]                                          # steps per worker, not empty memory bars


def test_report_lists_diverged_replicas_and_a_failed_run_as_anomalies(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    forced = summary(1, 12.0)
    forced.update(replicas_identical=False, diverged={"step": 40, "replicas": [0, 1]})
    write_run(runs, forced, metrics=False)
    write_run(runs, summary(2, 12.0, status="failed"), metrics=False)
    build(runs, out, settings())
    anomalies = (out / "report.md").read_text().split("## Anomalies")[1].split("##")[0]
    assert f"**{forced['run_id']}**" in anomalies and "replicas_diverged: drafter replicas diverged at step 40" in anomalies
    assert f"**{summary(2)['run_id']}**" in anomalies and "status: run ended with status 'failed'" in anomalies


def test_report_writes_the_placement_of_the_newest_run(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    write_run(runs, summary(1, 12.0), metrics=False)
    slow = summary(2, 10.0)                                               # the seed 5 : 3 with a drafter 2x the target
    slow["time_split_s"] = {"queue_wait": 0.01, "target": 0.2, "drafter": 0.35, "optimizer": 0.05}
    write_run(runs, slow, metrics=False)
    build(runs, out, settings())
    placement = json.loads((out / "regressions.json").read_text())["placement"]
    assert placement["run_id"] == slow["run_id"] and placement["suggested"] == {"targets": 3, "drafters": 5}
    md = (out / "report.md").read_text()
    section = md.split("## Placement")[1].split("##")[0]
    assert f"Run {slow['run_id']}: target 0.20 s vs drafter 0.40 s per micro-batch: on 8 GPUs run 3 targets : " \
           "5 drafters (now 5 : 3, the target GPUs wait 70% of the time)" in section
    cpu = summary(3, 2.5)                                                 # a CPU-only newest run: one line
    cpu["devices"] = [{"device": "cpu", "roles": ["target", "drafter"], "peak_memory_gb": None, "util_mean": None}]
    cpu["config"]["train"].update(targets=["cpu"], drafters=["cpu", "cpu"])
    write_run(runs, cpu, metrics=False)
    build(runs, out, settings())
    assert json.loads((out / "regressions.json").read_text())["placement"] is None
    section = (out / "report.md").read_text().split("## Placement")[1].split("##")[0]
    assert section.strip() == "A target:drafter split is suggested for GPU runs only (the newest run used no GPU)."
    unmeasured = summary(4, 12.0)                                         # GPUs but no measured split: no section
    unmeasured["time_split_s"] = {"queue_wait": None, "target": None, "drafter": None, "optimizer": None}
    write_run(runs, unmeasured, metrics=False)
    build(runs, out, settings())
    assert "## Placement" not in (out / "report.md").read_text()


# ---- issue 24, rule 4: a figure shown is the figure on disk; the history never shrinks ----------------------------
def _judge(runs, out):
    """What build() records and judges, without its plots (fast): (records, skipped)."""
    from dflash.report import history, regress
    found, skipped = history.scan_runs(runs)
    recorded, _, bad = history.History(out).update(found)
    return regress.evaluate(recorded, settings()), skipped + bad


def _table_row(md: str, run_id: str) -> list[str]:
    return next(line for line in md.splitlines() if line.startswith(f"| {run_id} |")).split(" | ")


def test_a_re_evaluation_updates_the_history_and_keeps_the_earlier_one(tmp_path):
    """Issue 24: evaluate.num_prompts changed, evaluate reran (tau 2.186 on disk): report.md kept showing 1.84."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    s = summary(1, 12.0)
    write_run(runs, s, metrics=False, evaluation=acceptance(s, 1.84))
    _judge(runs, out)
    snap_path = out / "history" / f"{s['run_id']}.json"
    first = json.loads(snap_path.read_text())
    write_run(runs, s, metrics=False, evaluation=acceptance(s, 2.186, minutes=30, num_prompts=32))
    result = build(runs, out, settings())
    assert result.records[0]["tau"] == 2.186 and result.records[0]["quality"]["tau_earlier"] == [1.84]
    md = (out / "report.md").read_text()
    assert _table_row(md, s["run_id"])[3] == "2.186 (earlier 1.840)"
    assert f"- **{s['run_id']}**: tau 2.186, earlier 1.840" in md
    row = (out / "history.csv").read_text().splitlines()[1].split(",")
    header = (out / "history.csv").read_text().splitlines()[0].split(",")
    assert row[header.index("tau")] == "2.186" and row[header.index("tau_earlier")] == "1.84"
    snap = json.loads(snap_path.read_text())
    assert snap["acceptance"]["tau"] == 2.186 and [a["tau"] for a in snap["earlier_evaluations"]] == [1.84]
    summary_part = lambda d: {k: v for k, v in d.items() if k not in ("acceptance", "earlier_evaluations")}  # noqa: E731
    assert summary_part(snap) == summary_part(first)                     # the run's summary is never rewritten
    # the same evaluation again: nothing recorded; a third one: the earlier ones stay, oldest first
    _judge(runs, out)
    assert [a["tau"] for a in json.loads(snap_path.read_text())["earlier_evaluations"]] == [1.84]
    write_run(runs, s, metrics=False, evaluation=acceptance(s, 1.9, minutes=45))
    assert _judge(runs, out)[0][0]["quality"]["tau_earlier"] == [1.84, 2.186]


def test_an_evaluation_older_than_its_run_is_not_shown_as_its_tau(tmp_path):
    """Rule 4, another case: a run folder retrained by hand still holds the previous run's acceptance.json."""
    runs, out = tmp_path / "runs", tmp_path / "report"
    old = summary(1, 12.0)
    write_run(runs, old, folder="demo", metrics=False, evaluation=acceptance(old, 1.84))
    _judge(runs, out)
    new = summary(2, 12.0)
    write_run(runs, new, folder="demo", metrics=False, tau=None)     # acceptance.json is still run 1's
    result = build(runs, out, settings())
    assert [r["tau"] for r in result.records] == [1.84, None]
    named = [s for s in result.skipped if s["file"] == str(runs / "demo" / "acceptance.json")]
    assert len(named) == 1 and f"before run {new['run_id']} finished" in named[0]["reason"]
    assert "rerun evaluate" in (out / "report.md").read_text()
    other = dict(acceptance(new, 1.7, minutes=10), run_id=old["run_id"])   # an evaluation naming another run
    write_run(runs, new, folder="demo", metrics=False, evaluation=other)
    assert _judge(runs, out)[0][-1]["tau"] is None
    write_run(runs, new, folder="demo", metrics=False, evaluation=acceptance(new, 1.7, minutes=10))
    assert _judge(runs, out)[0][-1]["tau"] == 1.7


def _eight_runs(tmp_path):
    """Seven runs through one folder (overwritten each time, recorded each time) and an eighth in another."""
    from dflash.report.history import History, scan_runs
    runs, out = tmp_path / "runs", tmp_path / "report"
    for n in range(1, 8):
        write_run(runs, summary(n, 12.0 + 0.1 * (n % 3)), folder="demo", metrics=False)
        History(out).update(scan_runs(runs)[0])                         # what each report records (no plots: fast)
    write_run(runs, summary(8, 4.0, commit="b" * 40), folder="other", metrics=False)
    History(out).update(scan_runs(runs)[0])
    return runs, out


def test_a_deleted_history_folder_loses_no_run_that_history_csv_holds(tmp_path):
    """Issue 24: `rm -rf results/report/history`, then `-R report`: 8 runs became 2 and the csv was cut to 2."""
    import shutil
    runs, out = _eight_runs(tmp_path)
    ids = [summary(n)["run_id"] for n in range(1, 9)]
    shutil.rmtree(out / "history")
    result = build(runs, out, settings())
    assert [r["run_id"] for r in result.records] == ids
    assert [line.split(",")[0] for line in (out / "history.csv").read_text().splitlines()[1:]] == ids
    assert [r["restored_from"] for r in result.records] == [f"history.csv:{n + 1}" for n in range(1, 7)] + [None, None]
    latest = result.records[-1]                                           # restored runs still are baselines
    assert latest["verdict"] == "regression" and len(latest["baseline"]["runs"]) == 7
    assert "code (commit aaaaaaaaaaaa -> bbbbbbbbbbbb)" in latest["sentence"]
    assert len(list((out / "history").glob("*.json"))) == 8              # the record is whole again ...
    (out / "history.csv").unlink()
    assert [r["run_id"] for r in build(runs, out, settings()).records] == ids   # ... so the csv may go next


def test_an_old_history_csv_restores_its_runs_too(tmp_path):
    """Rule 4, another case: a history.csv written before the hardware/placement/eval columns existed."""
    import shutil
    runs, out = _eight_runs(tmp_path)
    lines = (out / "history.csv").read_text().splitlines()
    header = lines[0].split(",")
    keep = [i for i, c in enumerate(header) if c not in ("eval_hash", "tau_earlier", "evaluated_at", "hardware",
                                                        "placement")]
    import csv
    import io
    rows = list(csv.reader(io.StringIO((out / "history.csv").read_text())))
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows([[r[i] for i in keep] for r in rows])
    (out / "history.csv").write_text(buf.getvalue())
    shutil.rmtree(out / "history")
    result = build(runs, out, settings())
    assert len(result.records) == 8 and result.skipped == []
    assert len((out / "history.csv").read_text().splitlines()) == 9
