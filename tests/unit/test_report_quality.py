"""Quality in the history (issue 25, item 5): every run's tau (temperature 0) and final loss beside its Ktok/s; a tau
drop beyond the run-to-run spread is a quality regression with the same attribution, and the gate fails on it."""
import copy
import json

import pytest

from dflash.report import build, history, regress
from support.report_factory import BASE_DATA, acceptance, settings, summary, with_pkg, write_run


def evaluate(tmp_path, runs_taus, **report):
    """[(summary, tau or an acceptance mapping)] -> regressions records (no plots: fast)."""
    runs_dir = tmp_path / "runs"
    for s, tau in runs_taus:
        write_run(runs_dir, s, metrics=False, evaluation=tau if isinstance(tau, dict) else acceptance(s, tau))
    runs, _, _ = history.History(tmp_path / "report").update(history.scan_runs(runs_dir)[0])
    return regress.evaluate(runs, settings(**report))


def expanded():
    data = copy.deepcopy(BASE_DATA)
    data.update(num_samples=3000, total_tokens=5_100_000, content_hash="beef000000000000")
    return data


def test_a_data_change_that_lowers_tau_is_a_quality_regression_caused_by_the_data(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "report"
    for s, tau in ((summary(1, 12.0), 1.866), (summary(2, 12.1), 1.866), (summary(3, 12.0, data=expanded()), 1.70)):
        write_run(runs, s, metrics=False, evaluation=acceptance(s, tau))
    result = build(runs, out, settings())
    rec = result.records[-1]
    assert rec["verdict"] == "ok"                                         # Ktok/s did not move ...
    q = rec["quality"]
    assert q["verdict"] == "regression" and rec["regressed"] == ["quality"]   # ... tau did
    assert q["baseline"] == {"run_id": summary(2)["run_id"], "tau": 1.866,
                             "runs": [summary(1)["run_id"], summary(2)["run_id"]]}
    assert q["change"] == pytest.approx(-0.166) and q["threshold"] == -0.05      # identical CPU reruns: the floor
    assert {c for c, items in q["changed"].items() if items} == {"data"}
    assert "num_samples 1000 -> 3000" in q["what_changed"]
    assert "Quality regression: tau fell vs the median of 2 identical runs" in rec["sentence"]
    assert "(1.866 -> 1.700, -0.166; threshold -0.050); what changed: data (num_samples 1000 -> 3000" in rec["sentence"]
    reg = json.loads((out / "regressions.json").read_text())
    assert reg["latest_quality_verdict"] == "regression" and reg["latest_regressed"] == ["quality"]
    md = (out / "report.md").read_text()
    verdict = next(line for line in md.splitlines() if line.startswith("**Latest run"))   # after the three answers
    assert verdict.startswith("**Latest run — quality regression.**") and md.index(verdict) < md.index("## Runs")
    assert f"- **{summary(3)['run_id']}** (regression): Quality regression" in md.split("## Quality (tau)")[1]
    header, *rows = (out / "history.csv").read_text().splitlines()
    cols = header.split(",")
    assert [r.split(",")[cols.index("tau")] for r in rows] == ["1.866", "1.866", "1.7"]
    assert [r.split(",")[cols.index("loss")] for r in rows] == ["2.5"] * 3     # the final loss beside it
    assert (out / "tau_history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_identical_cpu_reruns_agree_exactly_so_the_floor_decides(tmp_path):
    same = [(summary(n, 12.0), 1.866) for n in (1, 2, 3)]
    recs = evaluate(tmp_path, same + [(summary(4, 12.0), 1.836), (summary(5, 12.0), 1.80), (summary(6, 12.0), 1.86)])
    assert recs[2]["quality"]["spread"] == 0.0 and recs[2]["quality"]["threshold"] == -0.05
    assert recs[3]["quality"]["verdict"] == "ok"                           # -0.03: inside the floor
    q = recs[4]["quality"]
    assert q["verdict"] == "regression" and q["outlier"]                   # -0.066 with nothing changed: an outlier ...
    assert "nothing recorded (same environment, data, config, code and evaluation)" in q["sentence"]
    assert str(summary(5)["run_id"]) not in recs[5]["quality"]["baseline"]["runs"]   # ... never a baseline after


def test_a_noisy_tau_widens_the_threshold_up_to_its_cap(tmp_path):
    taus = [3.0, 3.2, 2.85, 3.15, 2.9]                                     # a GPU's non-deterministic reruns
    recs = evaluate(tmp_path, [(summary(n + 1, 12.0), t) for n, t in enumerate(taus)] + [(summary(6, 12.0), 2.75)])
    q = recs[-1]["quality"]
    assert q["spread"] > 0.2 and q["threshold"] == -0.3                    # 3 spreads would be wider: capped
    assert q["verdict"] == "ok"                                            # -0.25 is noise here
    recs = evaluate(tmp_path / "quiet", [(summary(n + 1, 12.0), t) for n, t in enumerate(taus[:2])] +
                    [(summary(3, 12.0), 2.75)], tau_threshold=-0.1, tau_threshold_cap=-0.2)
    assert recs[-1]["quality"]["threshold"] == -0.2 and recs[-1]["quality"]["verdict"] == "regression"


def test_an_evaluation_setting_is_named_as_a_config_change(tmp_path):
    first, second = summary(1, 12.0), summary(2, 12.0)
    recs = evaluate(tmp_path, [(first, acceptance(first, 1.866)),
                               (second, acceptance(second, 1.70, num_prompts=32, max_new_tokens=128))])
    q = recs[-1]["quality"]
    assert q["verdict"] == "regression" and not q["outlier"]               # the evaluation changed: a new level
    assert q["changed"]["config"] == [{"key": "evaluate.max_new_tokens", "old": 64, "new": 128},
                                      {"key": "evaluate.num_prompts", "old": 16, "new": 32}]
    assert recs[-1]["verdict"] == "ok" and recs[-1]["what_changed"] == ""  # Ktok/s: the same training


def test_other_causes_are_attributed_like_a_throughput_drop(tmp_path):
    recs = evaluate(tmp_path, [(summary(1, 12.0), 1.866), (summary(2, 12.0, env=with_pkg("torch", "2.13.0")), 1.5)])
    assert recs[-1]["quality"]["what_changed"] == "environment (torch 2.11.0 -> 2.13.0)"


def test_only_the_temperature_0_figure_is_tracked(tmp_path, caplog):
    s = summary(1, 12.0)
    recs = evaluate(tmp_path, [(s, acceptance(s, 1.4, temperature=1.0))])
    assert recs[0]["tau"] is None and recs[0]["quality"]["verdict"] == "not measured"
    assert "evaluated at temperature 1.0 (T=1: sample 1.400)" in caplog.text   # before by_proposal: sampled drafts


def test_a_tau_at_temperature_above_0_is_shown_with_its_draft_policy(tmp_path, monkeypatch):
    """Issue 39, item 4: a tau at T > 0 depends on the draft policy (argmax: vLLM, SGLang, TensorRT-LLM; sample:
    DeepSpec, the reference package). The history's tau stays the T=0 one; the T>0 ones are recorded, shown in
    report.md and plotted in tau_history.png, each named by its policy; an evaluation made before `by_proposal`
    sampled its drafts."""
    import csv

    from dflash.report import plots
    runs, out = tmp_path / "runs", tmp_path / "report"
    s1, s2, s3 = summary(1, 12.0), summary(2, 12.0), summary(3, 12.0)
    hot = acceptance(s2, 2.96, temperature=0.7, proposal="argmax",
                     by_proposal={"argmax": {"tau": 2.96}, "sample": {"tau": 1.16}})
    for s, acc in ((s1, acceptance(s1, 1.866)), (s2, hot), (s3, acceptance(s3, 1.4, temperature=1.0))):
        write_run(runs, s, metrics=False, evaluation=acc)
    drawn, real = {}, plots._history

    def spy(*args, **kw):          # what each history plot is given, by file name (its last positional argument)
        drawn[args[-1].name] = (args, kw)
        return real(*args, **kw)
    monkeypatch.setattr(plots, "_history", spy)
    result = build(runs, out, settings())
    assert [r["tau"] for r in result.records] == [1.866, None, None]          # the history's tau: temperature 0
    rows = list(csv.DictReader((out / "history.csv").open()))
    assert [r["tau_by_proposal"] for r in rows] == ["", "T=0.7: argmax 2.960; sample 1.160", "T=1: sample 1.400"]
    md = (out / "report.md").read_text()
    assert f"| {s2['run_id']} | 2026-11-02 10:00 | 12.00 | (T=0.7: argmax 2.960; sample 1.160) |" in md
    quality = md.split("## Quality (tau)")[1].split("## Anomalies")[0]
    assert "argmax (argmax drafts verified against a one-hot proposal: vLLM (default), SGLang, TensorRT-LLM)" in quality
    assert ("sample (drafts sampled from the drafter: DeepSpec, dflash 0.1.0 (reference package), vLLM "
            "draft_sample_method: probabilistic (lossless from vLLM PR #54282))") in quality
    assert f"- **{s2['run_id']}**: T=0.7: argmax 2.960; sample 1.160" in quality
    assert f"- **{s3['run_id']}**: T=1: sample 1.400" in quality
    args, kw = drawn["tau_history.png"]
    assert args[1] == [1.866, None, None]                                   # the line: temperature 0 only
    assert [(pts, label) for pts, _, _, label in kw["extra"]] == [
        ([(1, 2.96)], "tau at T=0.7, argmax drafts (vLLM (default), SGLang, TensorRT-LLM)"),
        ([(1, 1.16), (2, 1.4)], "tau at T=0.7, 1, sampled drafts (DeepSpec, dflash 0.1.0 (reference package), vLLM "
                                "draft_sample_method: probabilistic (lossless from vLLM PR #54282))")]
    assert (out / "tau_history.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _gate_config(tmp_path, fail: bool):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path}/results\nreport:\n  fail_on_regression: {str(fail).lower()}\n")
    runs = tmp_path / "results" / "runs"
    for s, tau in ((summary(1, 12.0), 1.866), (summary(2, 12.0, data=expanded()), 1.70)):
        write_run(runs, s, metrics=False, evaluation=acceptance(s, tau))
    return cfg


@pytest.mark.parametrize("fail", [True, False])
def test_the_gate_treats_a_quality_regression_like_a_throughput_one(tmp_path, capsys, fail):
    from dflash.cli import main
    cfg = _gate_config(tmp_path, fail)
    assert main(["report", "--config", str(cfg)]) == 0
    gate = tmp_path / "results" / "report" / "gate.json"
    if fail:
        assert main(["gate", "--config", str(cfg)]) == 3 and not gate.exists()
        line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("dflash gate: regression:")]
        assert len(line) == 1 and "Quality regression: tau fell" in line[0] and "quality regressed" in line[0]
        assert "data (num_samples 1000 -> 3000" in line[0]
    else:
        assert main(["gate", "--config", str(cfg)]) == 0
        assert json.loads(gate.read_text())["regressed"] == ["quality"]
