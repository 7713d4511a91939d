"""bench/quality.py's own logic (the device run is the lead's): the config it hands every call, the recipes' commands,
and the table over a set of finished runs: the seed spread, which lever beats it, the pipeline's own evaluation counted
for its temperature; at equal steps (issue 28), whether each FP8 recipe stays within the bf16 seeds' spread, and the
FP8 target's feature error (skipped with its reason where it cannot run). The CPU dry run of the equal-steps mode end
to end on a tiny target: the bf16 seeds train and are evaluated, the FP8 recipes are refused by the train stage (FP8
needs an FP8 GPU), the feature error is measured with torch's CPU FP8 matmul."""
import importlib.util
import json
import os
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("quality_bench", REPO / "bench" / "quality.py")
qb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qb)


def bench(tmp_path, **kw):
    args = dict(out=str(tmp_path / "out"), config="config/quality.yaml", parts="table", until=None,
                recipes="baseline,baseline-seed1,dpace,muon", seconds=150.0, temps="0,1", parallel=4, budget=600.0,
                results_dir=str(tmp_path / "results"), cpu=False, steps=None, solo=False)
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
    assert sets == {"train.loss_weighting": "decay", "train.optimizer": "muon", "run_name": "q-muon",
                    "train.time_budget_s": 150.0}
    assert b.sets(sets) == ["--set", 'train.loss_weighting="decay"', "--set", 'train.optimizer="muon"',
                            "--set", 'run_name="q-muon"', "--set", "train.time_budget_s=150.0"]
    # every recipe names its weighting and optimizer: none moves with the schema's defaults (issue 39 moved one)
    assert all({"train.loss_weighting", "train.optimizer"} <= set(r) for r in qb.RECIPES.values())
    assert [r for r in qb.RECIPES if qb.bf16_seed(r)] == ["baseline", "baseline-seed1", "baseline-seed2"]


def fake_run(results: Path, run: str, taus: dict, steps=400, ktok=7.0, pipeline_temp=None, finished=True,
             time_budget_s=150, failure=None):
    rd = results / "runs" / run
    rd.mkdir(parents=True)
    rd.joinpath("summary.json").write_text(json.dumps({
        "status": "failed" if failure else "completed",
        "failure": failure and {"kind": "non_finite", "message": failure},
        "steps": steps, "train_seconds": 150.0, "time_budget_s": time_budget_s,
        "finished": finished, "finished_by": ("time_budget" if time_budget_s else "steps") if finished else None,
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
    assert ("| dpace | `{\"train.loss_weighting\": \"dpace\"}` | 400 | 150.0 | 7.0 | 3.000 | 2.340 | evaluate | "
            "1.100 (sample) | True |") in md
    assert "| baseline | `{\"train.loss_weighting\": \"decay\", \"train.optimizer\": \"adamw\"}` | 400 |" in md                # an acceptance.json from before the policies: sampled
    assert "4 at once on the one GPU" in md and "seed spread 0.040" in md
    assert (b.out / "quality.png").stat().st_size > 0 and (b.out / "runs.tar.gz").stat().st_size > 0
    assert qb.pipeline_eval(res / "runs" / "quality", 0.0) and not qb.pipeline_eval(res / "runs" / "quality", 1.0)


def test_solo_recipes_run_at_the_configs_budget_resume_and_take_their_final_in_training_tau(tmp_path):
    """--solo: run qs-<recipe>, the config's own time budget (no override), resumable (an unfinished run is trained
    again, from its checkpoint); the T=0 tau of a finished run is its last in-training evaluation when that is the
    evaluate stage's measure (evaluate.num_prompts x max_new_tokens, at the last step), so no evaluate job is made
    for it; the table says where each tau came from and plots tau against training GPU-seconds."""
    b = bench(tmp_path, solo=True, parallel=1, recipes=None, temps="0,1")
    assert b.recipes == qb.SOLO_RECIPES.split(",") and "dpace+muon" in b.recipes
    assert b.recipe_sets("dpace+muon") == {"train.loss_weighting": "dpace", "train.optimizer": "muon",
                                           "run_name": "qs-dpace_and_muon"}
    from dflash.config import from_dict
    for mode in ({"solo": True}, {"steps": 800}, {}):    # every recipe's run name is a name the config takes
        for recipe in qb.RECIPES:
            from_dict({"run_name": bench(tmp_path / "n", **{"solo": False, "steps": None, **mode}).run_name(recipe)})
    res, ev = tmp_path / "results", b.cfg.evaluate

    def solo_run(run, tau, prompts=ev.num_prompts, at_last=True, finished=True):
        fake_run(res, run, {}, steps=2000, ktok=45.0, finished=finished, time_budget_s=120)
        f = res / "runs" / run / "summary.json"
        s = json.loads(f.read_text())
        s["eval"] = {"tau": tau, "step": 2000 if at_last else 1000, "prompts": prompts, "method": "replay",
                     "max_new_tokens": ev.max_new_tokens}
        f.write_text(json.dumps(s))
        (res / "runs" / run / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": k * 1000, "train_s": 60.0 * k, "gpu_s": 60.0 * k, "tau": tau * k / 2, "tau_step": k * 1000,
             "tau_train_s": 60.0 * k, "tau_gpu_s": 60.0 * k, "acceptance_estimate": 1.0}) + "\n" for k in (1, 2)))
    solo_run("qs-baseline", 3.40)
    solo_run("qs-baseline-seed1", 3.50)
    solo_run("qs-baseline-seed2", 3.45)
    solo_run("qs-dpace", 4.10)
    solo_run("qs-muon", 3.60, prompts=8)                 # an in-training tau of fewer prompts: not the stage's measure
    solo_run("qs-dpace_and_muon", 4.30, finished=False)      # cut by a call's end: trained again, resumed
    fake_run(res, "quality", {0.0: 3.4}, steps=2000, pipeline_temp=0.0)
    (res / "runs" / "quality" / "acceptance-t1.json").write_text(json.dumps({   # both draft policies, named
        "temperature": 1.0, "tau": 2.9, "proposal": "argmax", "by_proposal": {"argmax": {"tau": 2.9},
                                                                               "sample": {"tau": 1.6}}}))
    assert not b.trained("qs-dpace_and_muon") and b.trained("qs-dpace")
    jobs = []
    b.pool = lambda j, cap: jobs.extend(j)
    b.eval()
    assert sorted(k for k, _, _ in jobs) == ["evaluate qs-muon T=0"]   # recipes: T=0 only; the pipeline's T=1 is there
    b.table()
    doc = json.loads((b.out / "quality.json").read_text())
    rows = {r["recipe"]: r for r in doc["rows"]}
    assert doc["mode"] == "solo" and doc["bf16_seeds"] == ["baseline", "baseline-seed1", "baseline-seed2"]
    assert abs(doc["baseline_seed_spread_t0"] - 0.10) < 1e-9 and abs(doc["baseline_tau_t0_mean"] - 3.45) < 1e-9
    assert (rows["dpace"]["tau_t0"], rows["dpace"]["tau_t0_by"]) == (4.10, "in-training replay")
    assert rows["dpace"]["beats_spread"] is True and rows["muon"].get("tau_t0") is None
    assert rows["pipeline"]["tau_t0_by"] == "evaluate"
    # solo: the pipeline's run (the config's recipe, alone at the same budget) is compared with the baseline too
    assert abs(rows["pipeline"]["tau_t0_vs_baseline"] - (3.4 - 3.45)) < 1e-9 and rows["pipeline"]["beats_spread"] is False
    assert rows["pipeline"]["overrides"] == {"train.loss_weighting": "dpace", "train.optimizer": "adamw"}
    assert (rows["pipeline"]["tau_t1_argmax"], rows["pipeline"]["tau_t1_sample"]) == (2.9, 1.6)
    assert [c["tau_gpu_s"] for c in rows["dpace"]["curve"]] == [60.0, 120.0]
    md = (b.out / "quality.md").read_text()
    assert "alone on the GPU" in md and "in-training replay" in md and "over 3 seeds" in md
    assert "| argmax 2.900 / sample 1.600 |" in md
    assert (b.out / "tau-gpu-seconds.png").stat().st_size > 0


def test_equal_steps_trains_every_recipe_n_steps_into_its_own_run(tmp_path):
    b = bench(tmp_path, steps=800, recipes=None)
    assert b.recipes == ["baseline", "baseline-seed1", "baseline-seed2", "fp8", "fp8head", "fp8target"]
    assert b.recipe_sets("baseline-seed2") == {**qb.BASELINE, "seed": 2, "run_name": "q-s800-baseline-seed2",
                                               "train.time_budget_s": 0, "train.steps": 800, "train.eval_every": 0}
    assert b.recipe_sets("fp8target") == {**qb.BASELINE, "train.precision": "fp8", "train.fp8_lm_head": True,
                                          "train.fp8_target": True, "train.eval_every": 0,
                                          "run_name": "q-s800-fp8target", "train.time_budget_s": 0, "train.steps": 800}
    assert b.runs()[1:3] == [("baseline", "q-s800-baseline"), ("baseline-seed1", "q-s800-baseline-seed1")]
    assert bench(tmp_path, recipes=None).recipes == qb.DEFAULT_RECIPES.split(",")     # equal time: the levers
    with pytest.raises(SystemExit, match="--recipes: unknown fp9"):
        bench(tmp_path, steps=800, recipes="baseline,fp9")


def test_a_run_stopped_short_of_its_steps_is_trained_again(tmp_path):
    """At equal steps a run the budget stopped (summary.json, finished false) resumes on the next call; at equal time
    any summary counts, as before."""
    res = tmp_path / "results"
    fake_run(res, "q-s800-baseline", {}, steps=500, finished=False, time_budget_s=None)
    fake_run(res, "q-s800-fp8", {}, steps=800, time_budget_s=None)
    b = bench(tmp_path, steps=800)
    assert (b.trained("q-s800-baseline"), b.trained("q-s800-fp8"), b.trained("q-s800-fp8head")) == (False, True, False)
    assert bench(tmp_path).trained("q-s800-baseline") is True


def test_the_equal_steps_table_says_whether_each_fp8_recipe_is_within_the_bf16_spread(tmp_path):
    b = bench(tmp_path, steps=800, recipes="baseline,baseline-seed1,baseline-seed2,fp8,fp8head,fp8target")
    res = tmp_path / "results"
    for name, tau in (("baseline", 1.80), ("baseline-seed1", 1.86), ("baseline-seed2", 1.83), ("fp8", 1.85),
                      ("fp8head", 1.70), ("fp8target", 1.78)):
        fake_run(res, f"q-s800-{name}", {0.0: tau}, steps=800, time_budget_s=None)
    b.state["commands"]["train q-s800-fp8"] = {"parallel": 6}
    b.state["fp8_features"] = {"rel_err": 0.0312, "rel_err_per_layer": {"1": 0.02, "9": 0.041}, "layers": [1, 9],
                               "conversations": 32, "tokens": 20000, "target": "results/target/code",
                               "device": "cuda:0", "dtype": "bfloat16", "quantize_s": 0.1}
    b.table()
    doc = json.loads((b.out / "quality.json").read_text())
    rows = {r["recipe"]: r for r in doc["rows"]}
    assert (doc["mode"], doc["steps"], doc["seconds"], doc["parallel"]) == ("steps", 800, None, 6)
    assert doc["bf16_seeds"] == ["baseline", "baseline-seed1", "baseline-seed2"]
    assert doc["baseline_seed_spread_t0"] == pytest.approx(0.06) and doc["baseline_tau_t0_mean"] == pytest.approx(1.83)
    assert {n: r.get("within_spread") for n, r in rows.items()} == {
        "baseline": None, "baseline-seed1": None, "baseline-seed2": None,      # the seeds are the spread
        "fp8": True, "fp8head": False, "fp8target": True}                      # +0.02, -0.13, -0.05 against 0.06
    assert doc["fp8_features"]["rel_err"] == 0.0312
    md = (b.out / "quality.md").read_text()
    assert "exactly 800 optimizer steps" in md and "seed spread (max - min) 0.060" in md
    assert "| tau - bf16 mean | within bf16 seed spread |" in md
    assert '| fp8head | `{"train.precision": "fp8", "train.fp8_lm_head": true}` | 800 | 150.0 | 7.0 | 3.000 | 1.700 |' \
           ' evaluate |  | True | -0.130 | False |' in md
    assert "| baseline-seed2 | `{\"seed\": 2}` | 800 |" in md and md.count("| True |\n") == 2   # fp8, fp8target
    assert "relative error **0.0312** (per layer 1: 0.0200, 9: 0.0410)" in md and "on `results/target/code`" in md


def test_the_table_names_a_run_that_failed_and_why(tmp_path):
    """The H200's fp8target run ended in NaN at step 10: the table says so, with the train stage's message, and keeps
    it out of the comparison (no tau, no verdict)."""
    b = bench(tmp_path, steps=800, recipes="baseline,baseline-seed1,fp8target")
    res = tmp_path / "results"
    fake_run(res, "q-s800-baseline", {0.0: 1.80}, steps=800, time_budget_s=None)
    fake_run(res, "q-s800-baseline-seed1", {0.0: 1.86}, steps=800, time_budget_s=None)
    fake_run(res, "q-s800-fp8target", {0.0: 1.0}, steps=10, time_budget_s=None, finished=False,   # a stale tau
             failure="step 10: loss nan, gradient norm nan is not finite; stopping\n  a second line")
    b.table()
    rows = {r["recipe"]: r for r in json.loads((b.out / "quality.json").read_text())["rows"]}
    assert rows["fp8target"]["status"] == "failed" and "within_spread" not in rows["fp8target"]
    assert "tau_t0_vs_baseline" not in rows["fp8target"]
    assert rows["baseline"]["failure"] is None
    md = (b.out / "quality.md").read_text()
    assert "Runs that did not complete" in md
    assert "- fp8target: run failed at step 10: step 10: loss nan, gradient norm nan is not finite; stopping" in md
    assert "\n- baseline" not in md and "a second line" not in md


def test_training_curves_follow_steps_or_seconds_over_a_resume():
    """A run resumed at step 30 (its elapsed_s starts from 0 again, as on the H200): against seconds the curve goes
    on from where it stopped; against steps (equal steps) it is the steps."""
    curve = [{"step": 10, "elapsed_s": 5.0, "acceptance_estimate": 0.1},
             {"step": 30, "elapsed_s": 20.0, "acceptance_estimate": 0.3},
             {"step": 40, "elapsed_s": 1.5, "acceptance_estimate": 0.4},
             {"step": 50, "elapsed_s": 9.0, "acceptance_estimate": None},
             {"step": 60, "elapsed_s": 12.0, "acceptance_estimate": 0.6}]
    assert qb.curve_points(curve, by_step=False) == [(5.0, 0.1), (20.0, 0.3), (21.5, 0.4), (32.0, 0.6)]
    assert qb.curve_points(curve, by_step=True) == [(10, 0.1), (30, 0.3), (40, 0.4), (60, 0.6)]


def target_and_holdout(tmp_path) -> str:
    """config/quality.yaml with its target under tmp_path, that target's config.json and one held-out conversation."""
    cfg = tmp_path / "q.yaml"
    qb.write_config("config/quality.yaml", {"target.path": str(tmp_path / "target")}, str(cfg))
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    data = tmp_path / "results" / "data" / "code-completion"
    data.mkdir(parents=True)
    data.joinpath("holdout.jsonl").write_text(json.dumps({"id": "a", "prompt_ids": [1, 2], "reference_ids": [3]}) + "\n")
    return str(cfg)


def test_fp8_features_say_why_they_were_not_measured(tmp_path, monkeypatch, fake_gpus):
    b = bench(tmp_path, steps=800)
    b.fp8_features()
    assert "no target or no held-out conversations" in b.state["fp8_features"]["skipped"]
    b = bench(tmp_path, steps=800, config=target_and_holdout(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    b.fp8_features()
    assert b.state["fp8_features"]["skipped"] == "train placement: 'cuda:0' asks for a GPU but CUDA is not available here"
    fake_gpus(1)                                                     # an A100: no FP8 tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    b.fp8_features()                                                 # not measured yet: tried again
    why = json.loads((b.out / "quality-state.json").read_text())["fp8_features"]["skipped"]
    assert why.startswith("train.fp8_target=true: cuda:0 (NVIDIA A100) has compute capability 8.0")
    b.table()
    assert f"train.fp8_target's features against bf16: not measured ({why})." in (b.out / "quality.md").read_text()


def test_stop_signals_every_job_before_waiting_on_any(tmp_path):
    """The budget's end stops every running job at once: each gets its grace, together (one at a time, six train runs
    that take their grace to checkpoint would overrun the device call by minutes)."""
    deaf = [subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 30"], start_new_session=True) for _ in range(2)]
    time.sleep(0.3)                                                  # the traps are set
    waits = []                                                       # the timeout of every wait on a job
    for p in deaf:
        p.wait = lambda timeout=None, wait=p.wait: (waits.append(timeout), wait(timeout))[1]
    qb.stop(*deaf, grace=1.5)
    graced = [w for w in waits if w is not None]                     # the waits before the kills
    assert len(graced) == 2 and sum(graced) <= 1.5 + 0.1              # one grace shared, not one each
    assert [p.returncode for p in deaf] == [-9, -9]                  # SIGTERM ignored: killed after the grace


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_stop_asks_the_dflash_stages_for_their_stacks_first(tmp_path):
    """A part cut by the budget leaves in each stage's log where it was: its `python -m dflash` processes (found in
    the job's process group, a shell's child here) get SIGUSR2 before the SIGTERM; the shell around them does not."""
    import sys
    log = tmp_path / "stage.log"
    hang = ("import faulthandler, signal, sys, time; faulthandler.register(signal.SIGUSR2, all_threads=True); "
            "print('up', flush=True); time.sleep(60)")
    stage = f"{sys.executable} -c {json.dumps(hang)} -m dflash target"      # argv: ... -m dflash target
    job = subprocess.Popen(["sh", "-c", f"{stage} 2>{log} >{log}.out; echo shell-left >{tmp_path / 'shell'}"],
                           start_new_session=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "stage.log.out").exists() or "up" not in (tmp_path / "stage.log.out").read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert len(qb.dflash_stages(job.pid)) == 1
    qb.stop(job, grace=5)
    text = log.read_text()
    assert "most recent call first" in text and "<string>" in text
    deadline = time.monotonic() + 10                                 # the stage ends on the SIGTERM that followed
    while qb.dflash_stages(job.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert qb.dflash_stages(os.getpgid(0)) == []                     # this test's own group holds no stage


def test_cpu_dry_run_at_equal_steps_end_to_end(tmp_path):
    """The CPU dry run of the FP8 check on a tiny target built here (config/quality.yaml shrunk by --cpu; the data from
    the built-in corpus): two bf16 seeds train 2 steps and are evaluated, the FP8 recipe is refused by the train stage
    naming the key, the feature error is measured on the CPU, the table is that of equal steps."""
    from dflash import config as C
    from dflash.cli import main
    from dflash.data.tiny_target import build_target
    res, out = tmp_path / "results", tmp_path / "out"
    args = ["--out", str(out), "--cpu", "--results-dir", str(res), "--steps", "2", "--temps", "0", "--parallel", "3",
            "--recipes", "baseline,baseline-seed1,fp8", "--budget", "300"]
    assert qb.main([*args, "--parts", "table"]) == 0                  # writes the --cpu config: nothing trained yet
    cfg = str(out / "config.yaml")
    build_target(C.load(cfg, {"target.build": "tiny"}).cfg.target, res / "target" / "code", corpus_size=200,
                 progress=False, threads=1)
    qb.write_config(cfg, {"data.builtin_corpus": {"enabled": True, "max_conversations": 60}, "data.holdout": 4,
                          "data.code_completion": {"enabled": False}, "data.regenerate": {"enabled": False}},
                    str(tmp_path / "data.yaml"))
    assert main(["data", "--config", str(tmp_path / "data.yaml"), "--no-progress"]) == 0
    assert qb.main([*args, "--parts", "fp8_features,train,eval,table"]) == 0
    state = json.loads((out / "quality-state.json").read_text())
    assert {k: v["exit"] for k, v in state["commands"].items()} == {
        "train q-s2-baseline": 0, "train q-s2-baseline-seed1": 0, "train q-s2-fp8": 1,
        "evaluate q-s2-baseline T=0": 0, "evaluate q-s2-baseline-seed1 T=0": 0}
    assert "train.precision=fp8: FP8 matmuls need a CUDA GPU" in (out / "logs" / "train-q-s2-fp8.log").read_text()
    doc = json.loads((out / "quality.json").read_text())
    assert (doc["mode"], doc["steps"], doc["bf16_seeds"]) == ("steps", 2, ["baseline", "baseline-seed1"])
    assert [(r["recipe"], r["steps"], r["finished_by"], r["time_budget_s"]) for r in doc["rows"]] == [
        ("baseline", 2, "steps", None), ("baseline-seed1", 2, "steps", None)]
    taus = [r["tau_t0"] for r in doc["rows"]]
    assert all(t >= 1 for t in taus) and doc["baseline_seed_spread_t0"] == max(taus) - min(taus)
    f = doc["fp8_features"]
    assert (f["device"], f["dtype"], f["layers"], f["conversations"]) == ("cpu", "float32", [0, 2], 4)
    assert 1e-3 < f["rel_err"] < 0.1 and set(f["rel_err_per_layer"]) == {"0", "2"}   # e4m3 rounding, not bf16's
    md = (out / "quality.md").read_text()
    assert "# Quality at equal steps" in md and "exactly 2 optimizer steps" in md and "| fp8 |" not in md
    from bench.common import tree_label   # the envelope's tree (files hashed), not git's word; named in the title
    assert "git" not in doc and len(doc["tree"]["hash"]) == 16 and md.splitlines()[0].endswith(
        f"tree {tree_label(doc['tree'])}")
    assert doc["command"].endswith("--parts fp8_features,train,eval,table") and "--cpu" in doc["command"]


def test_a_part_that_raises_leaves_the_later_parts_their_turn(tmp_path, monkeypatch):
    """The in-process fp8_features part (GPU code first run on the device) raising must not cost the call its later
    parts: the error is recorded (and tried again next call), the table still written, the exit code 1."""
    cfg = target_and_holdout(tmp_path)
    out = tmp_path / "out"

    def boom(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(qb.Bench, "measure_fp8_features", boom)
    args = ["--out", str(out), "--config", cfg, "--results-dir", str(tmp_path / "results"), "--steps", "800",
            "--budget", "600"]
    assert qb.main([*args, "--parts", "fp8_features,table"]) == 1
    state = json.loads((out / "quality-state.json").read_text())
    assert state["fp8_features"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert state["failed"] == {}                                     # fp8_features records its own error
    md = (out / "quality.md").read_text()
    assert "train.fp8_target's features against bf16: not measured (RuntimeError: CUDA error" in md
    measured = {"rel_err": 0.03, "rel_err_per_layer": {"1": 0.03}, "layers": [1], "conversations": 1, "tokens": 3,
                "target": "t", "device": "cuda:0", "dtype": "bfloat16", "quantize_s": 0.1}
    monkeypatch.setattr(qb.Bench, "measure_fp8_features", lambda self: dict(measured))
    assert qb.main([*args, "--parts", "fp8_features"]) == 0         # an error is not a measurement: tried again
    assert json.loads((out / "quality-state.json").read_text())["fp8_features"]["rel_err"] == 0.03
    monkeypatch.setattr(qb.Bench, "eval", boom)                       # any other part: recorded, the next one runs
    assert qb.main([*args, "--parts", "eval,table"]) == 1
    state = json.loads((out / "quality-state.json").read_text())
    assert state["failed"]["eval"].startswith("RuntimeError: CUDA error") and (out / "quality.json").exists()
    monkeypatch.setattr(qb.Bench, "eval", lambda self: None)
    assert qb.main([*args, "--parts", "eval"]) == 0
    assert json.loads((out / "quality-state.json").read_text())["failed"] == {}


def test_fp8_features_is_not_started_near_the_budgets_end(tmp_path, monkeypatch):
    """It runs in the bench process with no timeout of its own: with less than FP8_FEATURES_S left it waits for the
    next call (nothing recorded) rather than run past the device call's limit."""
    b = bench(tmp_path, steps=800, config=target_and_holdout(tmp_path), budget=qb.FP8_FEATURES_S - 5)
    monkeypatch.setattr(qb.Bench, "measure_fp8_features", lambda self: pytest.fail("started"))
    b.fp8_features()
    assert "fp8_features" not in b.state


def test_solo_pipeline_starts_its_hot_evaluations_once_its_run_has_trained(tmp_path):
    """--solo to the end: while snakemake still runs (evaluate at T=0, export, report), the pipeline run's T>0
    evaluations start as soon as its training has finished, and only those (the recipes' are the eval part's)."""
    b = bench(tmp_path, solo=True, parallel=1, recipes="baseline", temps="0,1", parts="pipeline")
    res, started = tmp_path / "results", {}

    def snakemake(cmd, log, timeout):   # trains the pipeline run, then goes on with its own T=0 evaluate
        if "--until" in cmd:
            return 0
        fake_run(res, "quality", {}, steps=2000, time_budget_s=120)
        for _ in range(200):
            if started:
                break
            time.sleep(0.05)
        started["pipeline_running"] = True   # the evaluations were started before snakemake ended
        return 0
    b.sh = snakemake
    b.pool = lambda jobs, cap: started.update(jobs=[k for k, _, _ in jobs], at=dict(started))
    b.pipeline()
    assert started["jobs"] == ["evaluate quality T=1"] and "pipeline_running" not in started["at"]
    assert b.state["commands"]["pipeline"]["exit"] == 0
    started.clear()
    b.args.until = "warmup"          # to the warm-up only: nothing trains, nothing is evaluated
    b.pipeline()
    assert "jobs" not in started and b.state["commands"]["pipeline --until warmup"]["exit"] == 0
