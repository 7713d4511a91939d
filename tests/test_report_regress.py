"""Regressions, attribution and anomalies on synthetic histories (no plots: fast)."""
import copy

import pytest

from dflash.report import history, regress
from test_report_factory import BASE_CONFIG, BASE_DATA, summary, with_pkg, write_run


def evaluate(tmp_path, summaries, **settings):
    runs_dir = tmp_path / "runs"
    for s in summaries:
        write_run(runs_dir, s, metrics=False)
    found, _ = history.scan_runs(runs_dir)
    runs, _ = history.History(tmp_path / "report").append(found)
    return regress.evaluate(runs, regress.Settings(**settings))


def changed_categories(rec):
    return {cat for cat, items in rec["changed"].items() if items}


def more_data():
    data = copy.deepcopy(BASE_DATA)
    data.update(num_samples=3000, total_tokens=5_100_000, content_hash="beef000000000000")
    data["buckets"] = {"1024": 300, "2048": 1200, "3072": 1500}
    return data


def unhashed_config_change():
    # with the default baseline (same config hash) a config change means no baseline; pin one to compare
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg["train"]["batch_size"] = 16
    return cfg


CASES = {
    "environment": (dict(env=with_pkg("torch", "2.13.0")), "torch 2.11.0 -> 2.13.0"),
    "data": (dict(data=more_data()), "num_samples 1000 -> 3000"),
    "config": (dict(config=unhashed_config_change()), "train.batch_size 8 -> 16"),
    "code": (dict(commit="b" * 40), "commit aaaaaaaaaaaa -> bbbbbbbbbbbb"),
}


@pytest.mark.parametrize("category", list(CASES))
def test_3x_drop_flagged_and_attributed_to_exactly_what_changed(tmp_path, category):
    change, text = CASES[category]
    first = summary(1, 12.0)
    slow = summary(2, 4.0, **change)
    recs = evaluate(tmp_path, [first, slow], baseline_run=first["run_id"])
    rec = recs[-1]
    assert rec["verdict"] == "regression"
    assert rec["baseline"]["run_id"] == first["run_id"]
    assert rec["ratio"] == pytest.approx(1 / 3, rel=1e-3)
    assert changed_categories(rec) == {category}
    assert text in rec["what_changed"]
    assert "fell 3.0x" in rec["sentence"] and category in rec["sentence"]


def test_environment_change_lists_each_package_and_gpu_driver(tmp_path):
    env = with_pkg("torch", "2.13.0")
    env["packages"]["triton"] = "3.6.0"
    env["gpu"]["driver"] = "590.10"
    recs = evaluate(tmp_path, [summary(1, 12.0), summary(2, 4.3, env=env)])
    keys = [c["key"] for c in recs[-1]["changed"]["environment"]]
    assert keys == ["torch", "triton", "GPU driver"]
    assert changed_categories(recs[-1]) == {"environment"}


def test_data_change_names_counts_lengths_and_buckets(tmp_path):
    recs = evaluate(tmp_path, [summary(1, 12.0), summary(2, 4.0, data=more_data())])
    keys = {c["key"] for c in recs[-1]["changed"]["data"]}
    assert {"num_samples", "total_tokens", "mean length", "bucket 1024", "bucket 2048", "bucket 3072"} <= keys
    assert "created_at" not in keys


def test_dirty_tree_is_a_code_change(tmp_path):
    recs = evaluate(tmp_path, [summary(1, 12.0), summary(2, 4.0, dirty=True)])
    assert changed_categories(recs[-1]) == {"code"}
    assert "dirty False -> True" in recs[-1]["what_changed"]


def test_3_percent_drift_is_not_a_regression(tmp_path):
    recs = evaluate(tmp_path, [summary(1, 12.0), summary(2, 12.0 * 0.97)])
    assert recs[-1]["verdict"] == "ok"
    assert recs[-1]["what_changed"] == ""
    assert "within the threshold" in recs[-1]["sentence"]


def test_first_run_has_no_baseline(tmp_path):
    recs = evaluate(tmp_path, [summary(1, 12.0)])
    assert recs[0]["verdict"] == "first run" and recs[0]["baseline"] is None
    assert "first run" in recs[0]["sentence"]


def test_default_baseline_is_best_of_window_with_same_config(tmp_path):
    cfg = unhashed_config_change()
    runs = [summary(1, 11.0), summary(2, 12.5), summary(3, 12.0), summary(4, 20.0, config=cfg), summary(5, 11.9)]
    recs = evaluate(tmp_path, runs, baseline_window=2)
    assert recs[3]["verdict"] == "no baseline"                      # new config: no like-for-like baseline
    assert recs[3]["previous"]["run_id"] == runs[2]["run_id"]       # ... but compared with the run before it
    assert "train.batch_size 8 -> 16" in recs[3]["sentence"]
    assert recs[4]["baseline"]["run_id"] == runs[1]["run_id"]       # best of the last 2 with the same config
    assert recs[4]["verdict"] == "ok"


def test_failed_runs_are_not_baselines(tmp_path):
    recs = evaluate(tmp_path, [summary(1, 30.0, status="failed"), summary(2, 12.0)])
    assert recs[1]["verdict"] == "no baseline"
    assert any(a["kind"] == "status" for a in recs[0]["anomalies"])


def test_anomalies_memory_imbalance_recompiles_silent_worker_low_util(tmp_path):
    s = summary(1, 4.3, mems=(40.0, 72.0, 77.0), recompiles=37, eager=2, drafter_steps=(0, 120, 120), util=9.0)
    rec = evaluate(tmp_path, [s])[0]
    kinds = [a["kind"] for a in rec["anomalies"]]
    assert kinds.count("memory_imbalance") == 1
    mem = next(a for a in rec["anomalies"] if a["kind"] == "memory_imbalance")
    assert mem["device"] == "cuda:5"
    assert "recompiles" in kinds and "eager_fallbacks" in kinds
    silent = [a for a in rec["anomalies"] if a["kind"] == "silent_worker"]
    assert [a["worker"] for a in silent] == ["drafter-0"]
    assert kinds.count("low_utilisation") == 8
    assert "37 recompile(s)" in rec["sentence"]


def test_a_healthy_run_has_no_anomalies(tmp_path):
    assert evaluate(tmp_path, [summary(1, 12.0)])[0]["anomalies"] == []


def test_improvement(tmp_path):
    assert evaluate(tmp_path, [summary(1, 12.0), summary(2, 15.0)])[-1]["verdict"] == "improvement"


def test_attribution_works_from_history_alone(tmp_path):
    """Old run folders get overwritten: the snapshots in the history still say what changed."""
    runs_dir = tmp_path / "runs"
    write_run(runs_dir, summary(1, 12.0), folder="demo", metrics=False)
    store = history.History(tmp_path / "report")
    store.append(history.scan_runs(runs_dir)[0])
    write_run(runs_dir, summary(2, 4.0, env=with_pkg("torch", "2.13.0")), folder="demo", metrics=False)  # same folder
    runs, appended = store.append(history.scan_runs(runs_dir)[0])
    assert len(runs) == 2 and len(appended) == 1
    rec = regress.evaluate(runs, regress.Settings())[-1]
    assert rec["verdict"] == "regression"
    assert rec["what_changed"] == "environment (torch 2.11.0 -> 2.13.0)"


def test_a_run_without_measured_throughput_is_kept_and_flagged(tmp_path):
    s = summary(2, 12.0, status="failed")
    s["throughput"] = {"ktok_per_s": None, "samples_per_s": None, "draft_positions_per_s": None, "mfu": None}
    s["data_hash"] = None
    recs = evaluate(tmp_path, [summary(1, 12.0), s])
    assert recs[-1]["verdict"] == "not measured"
    assert {a["kind"] for a in recs[-1]["anomalies"]} == {"status", "not_measured"}


def test_the_pinned_baseline_itself(tmp_path):
    first = summary(1, 12.0)
    recs = evaluate(tmp_path, [first, summary(2, 12.1)], baseline_run=first["run_id"])
    assert [r["verdict"] for r in recs] == ["baseline", "ok"]
