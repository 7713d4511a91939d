"""bench/quality.py's own logic (the device run is the lead's; `--cpu` runs it end to end, minutes on 2 cores): the
config it hands every call, the recipes' commands, and the table over a set of finished runs: the seed spread, which
lever beats it, the pipeline's own evaluation counted for its temperature."""
import importlib.util
import json
import types
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("quality_bench", REPO / "bench" / "quality.py")
qb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qb)


def bench(tmp_path, **kw):
    args = dict(out=str(tmp_path / "out"), config="config/quality.yaml", parts="table", until=None,
                recipes="baseline,baseline-seed1,dpace,muon", seconds=150.0, temps="0,1", parallel=4, budget=60.0,
                results_dir=str(tmp_path / "results"), cpu=False)
    return qb.Bench(types.SimpleNamespace(**{**args, **kw}))


def test_write_config_applies_dotted_keys_over_the_yaml(tmp_path):
    out = tmp_path / "c.yaml"
    qb.write_config("config/quality.yaml", {"results_dir": "/r", "train.time_budget_s": 7, "data.holdout": 3,
                                            "target.arch.num_hidden_layers": 4}, str(out))
    doc, src = yaml.safe_load(out.read_text()), yaml.safe_load((REPO / "config/quality.yaml").read_text())
    assert (doc["results_dir"], doc["train"]["time_budget_s"], doc["data"]["holdout"]) == ("/r", 7, 3)
    assert doc["target"]["arch"]["num_hidden_layers"] == 4
    assert doc["target"]["arch"]["hidden_size"] == src["target"]["arch"]["hidden_size"]   # the rest kept
    assert doc["train"]["attention"] == src["train"]["attention"]


def test_a_recipe_is_its_overrides_the_budget_and_its_own_run(tmp_path):
    b = bench(tmp_path)
    assert b.cfg.results_dir == str(tmp_path / "results")          # every call reads the written config
    sets = b.recipe_sets("muon")
    assert sets == {"train.optimizer": "muon", "run_name": "q-muon", "train.time_budget_s": 150.0}
    assert b.sets(sets) == ["--set", 'train.optimizer="muon"', "--set", 'run_name="q-muon"',
                            "--set", "train.time_budget_s=150.0"]


def fake_run(results: Path, run: str, taus: dict, steps=400, ktok=7.0, pipeline_temp=None):
    rd = results / "runs" / run
    rd.mkdir(parents=True)
    rd.joinpath("summary.json").write_text(json.dumps({
        "status": "completed", "steps": steps, "train_seconds": 150.0, "time_budget_s": 150, "finished_by": "time_budget",
        "throughput": {"ktok_per_s": ktok}, "loss": 3.0, "acceptance_estimate": 1.0, "replicas_identical": True,
        "env": {"gpu": {"models": ["NVIDIA H200"]}, "packages": {"torch": "2.11.0+cu130"}}}))
    rd.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "elapsed_s": s / 2, "ce": 3.0,
                                                                "acceptance_estimate": s / 100}) + "\n"
                                                    for s in (10, 20)))
    for temp, tau in taus.items():
        name = "acceptance.json" if pipeline_temp == temp else f"acceptance-t{temp:g}.json"
        rd.joinpath(name).write_text(json.dumps({"temperature": temp, "tau": tau, "lossless": True, "speedup": 1.2}))


def test_the_table_names_the_seed_spread_and_the_levers_beyond_it(tmp_path):
    b = bench(tmp_path)
    res = tmp_path / "results"
    fake_run(res, "quality", {0.0: 3.4, 1.0: 1.5}, steps=2000, ktok=45.0, pipeline_temp=0.0)   # its own evaluate: T=0
    fake_run(res, "q-baseline", {0.0: 1.26})
    fake_run(res, "q-baseline-seed1", {0.0: 1.30})
    fake_run(res, "q-dpace", {0.0: 2.34, 1.0: 1.1})
    fake_run(res, "q-muon", {0.0: 1.29})
    b.state["commands"]["train q-dpace"] = {"parallel": 4}
    b.table()
    doc = json.loads((b.out / "quality.json").read_text())
    rows = {r["recipe"]: r for r in doc["rows"]}
    assert doc["baseline_seed_spread_t0"] == 1.30 - 1.26 and doc["baseline_tau_t0_mean"] == (1.26 + 1.30) / 2
    assert (rows["pipeline"]["tau_t0"], rows["pipeline"]["tau_t1"]) == (3.4, 1.5)   # acceptance.json counted as T=0
    assert rows["dpace"]["beats_spread"] is True and abs(rows["dpace"]["tau_t0_vs_baseline"] - 1.06) < 1e-9
    assert rows["muon"]["beats_spread"] is False                                     # +0.01 inside a 0.04 spread
    assert "tau_t0_vs_baseline" not in rows["pipeline"]
    assert (doc["device"], doc["torch"], doc["seconds"], doc["parallel"]) == ("NVIDIA H200", "2.11.0+cu130", 150, 4)
    md = (b.out / "quality.md").read_text()
    assert "| dpace | `{\"train.loss_weighting\": \"dpace\"}` | 400 | 150.0 | 7.0 | 3.000 | 2.340 | 1.100 | True |" in md
    assert "4 at once on the one GPU" in md and "seed spread 0.040" in md
    assert (b.out / "quality.png").stat().st_size > 0 and (b.out / "runs.tar.gz").stat().st_size > 0
    assert qb.pipeline_eval(res / "runs" / "quality", 0.0) and not qb.pipeline_eval(res / "runs" / "quality", 1.0)
