"""bench/multi_gpu.py's own logic (the device run is the lead's): the seed split scaled to N GPUs, the snakemake
command it runs, and issue 18's checks over a run's figures."""
import importlib.util
import types
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("multi_gpu", REPO / "bench" / "multi_gpu.py")
mg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mg)


def test_the_seed_split_scales_with_the_gpus():
    assert [mg.split(n) for n in (2, 3, 4, 8, 16)] == [(1, 1), (2, 1), (2, 2), (5, 3), (10, 6)]


def test_the_snakemake_command_puts_targets_before_config_and_the_layout_in_train(tmp_path):
    args = types.SimpleNamespace(out=str(tmp_path), cpu=False, budget=60, config="config/seed-2gpu.yaml", gpus=4,
                                 results_dir="results", full="dist")
    d = mg.Driver(args)
    assert (d.targets, d.drafters) == (["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"])
    cmd = d.snakemake("r", d.train_keys("threads", 200), ["results/runs/r/summary.json"], extra=["-R", "train"])
    i = cmd.index("--config")
    assert cmd.index("results/runs/r/summary.json") < i and cmd[i + 1:i + 3] == ["run_name=r", "results_dir=results"]
    assert cmd[cmd.index("--resources") + 1] == "gpu=4"
    key, flow = cmd[-1].split("=", 1)      # what snakemake's --config reads as YAML
    assert key == "train" and yaml.safe_load(flow) == {"runtime": "threads", "steps": 200,
                                                       "targets": ["cuda:0", "cuda:1"], "drafters": ["cuda:2", "cuda:3"]}


def test_verdicts_hold_each_run_to_issue_18():
    ok = {"status": "completed", "steps": 200, "replicas_identical": True}
    parts = {"dist": {**ok, "ktok_per_s_per_gpu": 8.0},
             "threads": {**ok, "ktok_per_s_per_gpu": 10.5, "fx_tracing_error": False, "recompiles_after_warmup": 0,
                         "eager_fallbacks": 0},
             "kill": {"seconds_until_job_exit": 16.2, "names_the_rank": True, "status": "completed", "steps": 40,
                      "steps_wanted": 40}}
    v = mg.verdicts(parts, 11.17, 200)
    assert v["dist_completed"] and v["threads_completed"] and v["threads_no_fx_error"] and v["threads_zero_recompiles"]
    assert v["dist_per_gpu_vs_one_gpu"] == round(8.0 / 11.17, 4) and v["dist_per_gpu_within_10pct"] is False
    assert v["threads_per_gpu_vs_one_gpu"] == round(10.5 / 11.17, 4)
    assert v["kill_stops_within_15s"] is False and v["kill_names_the_rank"] and v["kill_resume_completed"]
    parts["threads"]["recompiles_after_warmup"] = 2
    parts["dist"]["steps"] = 150
    v = mg.verdicts(parts, None, 200)
    assert v["threads_zero_recompiles"] is False and v["dist_completed"] is False and "dist_per_gpu_vs_one_gpu" not in v
    # co-located: a target and a drafter replica on every GPU, held to 0.9 x the one-GPU figure per GPU
    parts["coloc"] = {**parts["threads"], "recompiles_after_warmup": 0, "replicas_identical": False,
                      "ktok_per_s_per_gpu": 10.1}
    v = mg.verdicts(parts, 11.17, 200)
    assert v["coloc_completed"] and v["coloc_zero_recompiles"] and v["coloc_replicas_identical"] is False
    assert v["coloc_per_gpu_vs_one_gpu"] == round(10.1 / 11.17, 4) and v["coloc_per_gpu_within_10pct"] is True
    parts["coloc"]["ktok_per_s_per_gpu"] = 9.9
    assert mg.verdicts(parts, 11.17, 200)["coloc_per_gpu_within_10pct"] is False
