"""The Snakemake workflow as a user drives it: the venv's `snakemake` with the venv not activated, on a copy of the
repository. Lint-clean; dry runs list every stage; the rerun triggers rerun exactly the stages a change affects;
config values reach the stages quoted; config mistakes are one short message."""
import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from support.data import good_rows, write_jsonl
from support.workflow import REPO, SNAKEMAKE, bare_env, copy_repo, snakemake

STAGES = ("env", "target", "data", "warmup", "train", "evaluate", "export", "report", "gate")

pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment")


def planned(r) -> dict:
    """{rule: count} from a dry run's job table."""
    table = r.out.split("Job stats:")[1].split("total")[0]
    rows = [line.split() for line in table.splitlines()[3:] if line.strip()]
    return {name: int(n) for name, n in rows}


@pytest.fixture
def wf(tmp_path):
    return copy_repo(tmp_path / "wf")


def tiny_config(work: Path, **over) -> dict:
    """config/tiny.yaml (the whole pipeline in about a minute on 2 cores) plus one local source file, with `over`:
    {"train__lr": 1e-3} sets train.lr, {"evaluate": {...}} a whole section."""
    cfg = yaml.safe_load((REPO / "config" / "tiny.yaml").read_text())
    cfg["data"]["sources"] = [{"name": "mine", "path": "sources/mine.jsonl"}]
    for key, value in over.items():
        section, _, leaf = key.partition("__")
        if leaf:
            cfg[section][leaf] = value
        else:
            cfg[section] = value
    return cfg


def write_config(work: Path, name: str, cfg: dict) -> str:
    (work / "config" / name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return f"config/{name}"


@pytest.fixture(scope="module", autouse=True)
def pipeline_started(request, tmp_path_factory):
    """The whole pipeline on the tiny config, started in the background as this module's first test starts (where a
    selected test needs `done`): its jobs and the dry runs of the tests before `done` each take a core of two."""
    if not any(getattr(item, "module", None) is request.module and "done" in item.fixturenames
               for item in request.session.items):
        yield None
        return
    work = copy_repo(tmp_path_factory.mktemp("done") / "wf")
    (work / "sources").mkdir()
    write_jsonl(work / "sources" / "mine.jsonl", good_rows(12))
    write_config(work, "tiny.yaml", tiny_config(work))
    with open(work.parent / "snakemake.out", "w") as out:
        proc = subprocess.Popen([str(SNAKEMAKE), "--cores", "2", "--configfile", "config/tiny.yaml"], cwd=work,
                                stdout=out, stderr=subprocess.STDOUT, text=True, env=bare_env())
    try:
        yield work, proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def done(pipeline_started):
    """A copy of the repository where the whole pipeline ran once on the tiny config (r.out: its console)."""
    work, proc = pipeline_started
    r = SimpleNamespace(returncode=proc.wait(timeout=600), out=(work.parent / "snakemake.out").read_text())
    assert r.returncode == 0, r.out[-5000:]
    return work, r


@pytest.fixture
def after(done, tmp_path):
    """A private copy of the finished pipeline (mtimes and Snakemake's metadata kept) to change things in."""
    work = tmp_path / "wf"
    shutil.copytree(done[0], work, symlinks=True)
    return work


def dry(work: Path, *args, config="config/tiny.yaml"):
    r = snakemake(work, "-n", "--configfile", config, *args)
    assert r.returncode == 0, r.out[-3000:]
    return r


# ---- static checks and dry runs ------------------------------------------------------------------------------
def test_lint_clean(wf):
    r = snakemake(wf, "--lint")
    assert r.returncode == 0, r.out[-3000:]
    assert "Congratulations" in r.out


def test_default_dry_run_lists_every_stage_with_the_venv_interpreter(wf):
    r = snakemake(wf, "-n", "-p", "--cores", "2")
    assert r.returncode == 0, r.out[-3000:]
    assert set(planned(r)) == set(STAGES) | {"all"}
    assert "python -m dflash train --config config/config.yaml --data results/data/default" in r.out
    assert "--run-dir results/runs/demo --log results/logs/train/demo.log" in r.out


def test_slurm_profile_plans_the_8gpu_job(wf):
    """The README's cluster command, as a dry run: one warm-up job per drafter GPU (every GPU with
    train.compile_target), train asks for 8 GPUs."""
    r = snakemake(wf, "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile", "config/seed-8gpu.yaml")
    assert r.returncode == 0, r.out[-3000:]
    assert r.out.count("rule warmup:") == 3                      # cuda5, cuda6, cuda7
    warm = r.out[r.out.index("rule warmup:"):].split("Shell command")[0]   # the train job's GPUs, numbered as train
    assert "gres=gpu:8" in warm                                  # numbers them (the cache key holds the index)
    train = r.out[r.out.index("rule train:"):]
    head = train.split("Shell command")[0]
    assert "gpu=8" in head and "gres=gpu:8" in head
    assert "python -m dflash train --config config/seed-8gpu.yaml" in train
    # train.compile_target: the target GPUs are warmed up too (their compiled layers), one job per GPU
    cfg = yaml.safe_load((wf / "config" / "seed-8gpu.yaml").read_text())
    cfg["train"]["compile_target"] = True
    r = snakemake(wf, "-n", "-p", "--workflow-profile", "workflow/profiles/slurm", "--configfile",
                  write_config(wf, "ct.yaml", cfg))
    assert r.returncode == 0, r.out[-3000:]
    assert r.out.count("rule warmup:") == 8 and all(f"--device cuda{i}" in r.out for i in range(8))


def test_two_configfiles_refused(wf):
    """Several YAMLs are refused, never silently reduced to one: `--configfile a b`, and `--configfile a
    --configfile b` (argparse keeps only b: it ran on b alone), naming both files."""
    for args in (["config/config.yaml", "config/h200.yaml"],
                 ["config/config.yaml", "--configfile", "config/h200.yaml"]):
        r = snakemake(wf, "-n", "--configfile", *args)
        assert r.returncode != 0 and "give one --configfile (got config/config.yaml config/h200.yaml)" in r.out, r.out


def fake_model(folder: Path) -> dict:
    """A user's model folder (what target.path points at with build none): its files and their bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "model.safetensors").write_bytes(b"weights that took a week")
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_model_folder_target_path_points_at_is_never_deleted(wf, tmp_path):
    """Rule 1: with the default build tiny, target.path at an existing model folder was the target rule's output:
    `--forceall --until target` / `-R target` deleted it and built a tiny model there (outside the repository it was
    deleted, then refused). Refused in one line before Snakemake removes anything; the folder stays as it was."""
    outside = tmp_path / "elsewhere" / "my-model"
    for folder, extra in ((wf / "results" / "target" / "tiny", []),
                          (outside, ["--config", f"target={{path: {outside}}}"])):
        files = fake_model(folder)
        for force in (["--forceall", "--until", "target"], ["-R", "target", "--until", "target"]):
            r = snakemake(wf, "--cores", "1", *force, *extra)
            assert r.returncode != 0, r.out[-2000:]
            assert f"target.path: {os.path.relpath(folder, wf) if folder.is_relative_to(wf) else folder}: exists and " \
                   f"was not made by this pipeline (no build.json in it)" in r.out, r.out[-2000:]
            assert "set target.build: none" in r.out and "rule target:" not in r.out
            assert {p.name: p.read_bytes() for p in folder.iterdir()} == files


# ---- config mistakes: one short message ----------------------------------------------------------------------
def error_lines(r) -> list[str]:
    return [line for line in r.out.splitlines() if line.strip()]


def test_yaml_syntax_error_names_line_and_column(wf):
    (wf / "config" / "config.yaml").write_text("run_name: demo\ntrain:\n  steps: [1\n")
    r = snakemake(wf, "-n")
    assert r.returncode != 0
    assert "config/config.yaml:4:1: not valid YAML: expected ',' or ']'" in r.out, r.out
    assert len(error_lines(r)) <= 4, r.out


def test_duplicate_key_refused(wf):
    (wf / "config" / "dup.yaml").write_text("run_name: demo\ntrain:\n  steps: 3\n  steps: 5\n")
    r = snakemake(wf, "-n", "--configfile", "config/dup.yaml")
    assert r.returncode != 0
    assert "config/dup.yaml:4:3: not valid YAML: duplicate key 'steps' (first at line 3)" in r.out, r.out


def test_schema_error_is_short(wf):
    (wf / "config" / "bad.yaml").write_text("train:\n  stepz: 3\n")
    r = snakemake(wf, "-n", "--configfile", "config/bad.yaml")
    assert r.returncode != 0
    assert "config/bad.yaml: unknown key 'train.stepz'" in r.out
    assert len(error_lines(r)) <= 4, r.out                     # was a 240-1255-line schema dump


def test_config_values_are_passed_quoted(wf):
    """A value holding `; touch X` and spaces reaches the stage intact and runs nothing."""
    cfg = {"results_dir": "res x; touch PWNED; echo ", "target": {"path": "res x; touch PWNED; echo /my target"}}
    write_config(wf, "evil.yaml", cfg)
    r = snakemake(wf, "env", "--cores", "1", "--configfile", "config/evil.yaml")
    assert r.returncode == 0, r.out[-3000:]
    assert not list(wf.rglob("PWNED")) and not (Path("/tmp") / "PWNED").exists()
    fp = json.loads((wf / "res x; touch PWNED; echo " / "env" / "fingerprint.json").read_text())
    assert Path(fp["executable"]).parent.resolve() == SNAKEMAKE.parent.resolve()  # the venv's interpreter ran it
    r = snakemake(wf, "-n", "-p", "--configfile", "config/evil.yaml")
    assert "--out 'res x; touch PWNED; echo /my target'" in r.out     # the target path: one quoted argument


# ---- issue 40 rules 5 and 6, issue 41 item 1: bad values refused by `snakemake -n`; roles decide the reruns -------
@pytest.mark.parametrize("bad,named", [
    ({"data__max_length": 256, "data__bucket_edges": [64, 128]}, "data.max_length (256) exceeds the largest "
                                                                 "data.bucket_edges entry (128)"),
    ({"train__gamma": 0}, "key 'train.gamma': Input should be greater than 0"),
    ({"drafter__num_target_layers": 3}, "drafter.num_target_layers (3) disagrees with drafter.target_layer_ids"),
], ids=["bucket_edges", "gamma", "num_target_layers"])
def test_dry_run_refuses_what_a_stage_would(wf, bad, named):
    """A value only a stage refused (or nothing did) is refused by `snakemake -n`, in one message line naming the
    key and the file."""
    r = snakemake(wf, "-n", "--configfile", write_config(wf, "bad.yaml", tiny_config(wf, **bad)))
    assert r.returncode != 0 and f"config error: config/bad.yaml: {named}" in r.out, r.out[-2000:]
    assert len(error_lines(r)) <= 4, r.out


def test_dry_run_refuses_a_path_like_name(wf):
    r = snakemake(wf, "-n", "--config", "dataset_name=..")
    assert r.returncode != 0 and "config/config.yaml: key 'dataset_name' must be a folder name" in r.out, r.out[-2000:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA GPU")
def test_a_dry_run_lists_the_whole_sweep_and_a_run_refuses_cuda_devices_the_machine_lacks(wf):
    """Issue 48 item 2: `snakemake -n --configfile config/quality.yaml` on a machine without CUDA lists every job of its
    sweep (a note says a run here is refused). The run itself is refused in one line (config/quality.yaml on a machine
    without CUDA built the corpus and the tokenizer for minutes, then died in "Torch not compiled with CUDA enabled");
    planned for a cluster (the slurm profile: the jobs run on its GPU nodes, which check themselves), it plans."""
    r = snakemake(wf, "-n", "--configfile", "config/quality.yaml")
    assert r.returncode == 0, r.out[-2000:]
    jobs = planned(r)
    assert jobs["train"] == 21 and jobs["data"] == 3 and jobs["sweep_table"] == 1, jobs     # >= 4 train jobs
    assert (jobs["evaluate"], jobs["evaluate_at"], jobs["export"]) == (1, 1, 1)    # `quality` decoded at T=0 and T=1
    assert "note: config/quality.yaml: target.pretrain.device names cuda:0 but this machine has no CUDA GPU" in r.out
    r = snakemake(wf, "--cores", "1", "--configfile", "config/quality.yaml")
    assert r.returncode != 0, r.out[-2000:]
    assert ("config error: config/quality.yaml: target.pretrain.device names cuda:0 but this machine has no CUDA GPU"
            in r.out), r.out[-2000:]
    assert len(error_lines(r)) <= 4, r.out
    r = snakemake(wf, "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile", "config/quality.yaml")
    assert r.returncode == 0, r.out[-2000:]


def test_a_bad_runs_sheet_row_is_refused_by_the_dry_run(wf):
    (wf / "config" / "runs.tsv").write_text("run\ttrain.lr\nfast\t1e-3\nslow\tquick\n")
    r = snakemake(wf, "-n", "--config", "sweep={runs: config/runs.tsv}")
    assert r.returncode != 0
    assert "config error: config/runs.tsv:3 (slow): key 'train.lr' must be number, got str 'quick'" in r.out, r.out
    assert len(error_lines(r)) <= 4, r.out


# ---- the pipeline, then what reruns -------------------------------------------------------------------------
pipeline = pytest.mark.slow


@pipeline
def test_pipeline_runs_with_progress_on_the_console_and_logs_kept(done):
    work, r = done
    assert "INFO dflash.train: step 3/3 loss" in r.out               # the stage's periodic line, on the console
    assert "INFO dflash.data: dataset tiny:" in r.out
    log = (work / "results" / "logs" / "train" / "tiny.log").read_text()
    assert "step 3/3 loss" in log and "completed: 3 steps" in log
    for stage in STAGES:
        assert f"(Rule: {stage})" in r.out, stage
    assert "Nothing to be done" in dry(work).out


@pipeline
def test_copied_config_with_same_content_reruns_nothing(done):
    work = done[0]
    shutil.copy(work / "config" / "tiny.yaml", work / "config" / "tiny-copy.yaml")
    r = snakemake(work, "-n", "--configfile", "config/tiny-copy.yaml")
    assert r.returncode == 0 and "Nothing to be done" in r.out, r.out[-3000:]


@pipeline
@pytest.mark.parametrize("change", [{"train__lr": 1e-3}, {"train__runtime": "distributed"},
                                    {"train__optimizer": "muon", "train__muon_lr": 2e-3}, {"train__time_budget_s": 60},
                                    {"train__loss_weighting": "decay"}],   # dpace is the default (issue 48)
                         ids=["lr", "runtime", "muon", "time_budget", "loss_weighting"])
def test_train_key_change_reruns_train_to_report_only(done, change):
    work = done[0]
    write_config(work, "tiny-lr.yaml", tiny_config(work, **change))
    r = snakemake(work, "-n", "--configfile", "config/tiny-lr.yaml")
    assert planned(r) == {"train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1, "all": 1}, r.out[-3000:]
    assert "reason: Updated input files: results/stamps/plan/train/tiny.json" in r.out   # its key stamp (dry run)


@pipeline
@pytest.mark.parametrize("change", [{"drafter__sliding_window": 8}, {"train__objective": "kl"}],
                         ids=["sliding_window", "objective"])
def test_compiled_graph_key_change_reruns_the_warmup_too(done, change):
    """drafter.sliding_window changes the compiled masks; train.objective widens the features and changes the compiled
    loss kernel: the warm-up reruns with train."""
    work = done[0]
    write_config(work, "tiny-graph.yaml", tiny_config(work, **change))
    r = snakemake(work, "-n", "--configfile", "config/tiny-graph.yaml")
    assert planned(r) == {"warmup": 1, "train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1, "all": 1}, \
        r.out[-3000:]


@pipeline
def test_changed_source_reruns_data_onward_and_a_touch_does_not(after):
    src = after / "sources" / "mine.jsonl"
    os.utime(src)                                                    # newer, same content: nothing to do
    assert "Nothing to be done" in dry(after).out
    write_jsonl(src, good_rows(13))
    assert planned(dry(after)) == {"data": 1, "warmup": 1, "train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1,
                                   "all": 1}


@pipeline
def test_changed_pins_rerun_env_onward(after):
    """The environment fingerprint is an input of warm-up and train (it names the compile cache, it decides
    throughput); a package change is seen through the env rule's params, a pins change through its input."""
    with open(after / "envs" / "requirements.txt", "a") as f:
        f.write("# a comment changes the lock hash\n")
    assert planned(dry(after)) == {"env": 1, "warmup": 1, "train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1,
                                   "all": 1}


@pipeline
def test_config_run_name_trains_a_new_run(after):
    r = snakemake(after, "results/runs/other/summary.json", "--cores", "2", "--configfile", "config/tiny.yaml",
                  "--config", "run_name=other")
    assert r.returncode == 0, r.out[-3000:]
    assert planned(r) == {"train": 1}
    assert json.loads((after / "results/runs/other/summary.json").read_text())["run_name"] == "other"


@pipeline
def test_forced_rerun_of_train_trains(after):
    before = json.loads((after / "results/runs/tiny/summary.json").read_text())["run_id"]
    r = snakemake(after, "--cores", "2", "--configfile", "config/tiny.yaml", "-R", "train")
    assert r.returncode == 0, r.out[-3000:]
    assert "nothing to train" not in r.out and "INFO dflash.train: step 3/3" in r.out
    assert json.loads((after / "results/runs/tiny/summary.json").read_text())["run_id"] != before


@pipeline
def test_finished_run_is_restored_when_snakemake_reruns_it_for_unchanged_inputs(after):
    """Rule 2: `rm fingerprint.json` (regenerated byte-identical) and `-R data` with unchanged data make Snakemake
    rerun train (each alone, planned): the finished run is restored (same run_id, same metrics), never trained again.
    One real run holds both (each input regenerated: the restore checks them all), a train job fewer."""
    run = after / "results" / "runs" / "tiny"
    before = {n: (run / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}
    assert planned(dry(after, "-R", "data"))["train"] == 1
    (after / "results" / "env" / "fingerprint.json").unlink()
    targets = ("results/env/fingerprint.json", "results/runs/tiny/summary.json")
    r = snakemake(after, *targets, "-n", "--configfile", "config/tiny.yaml")
    assert r.returncode == 0 and planned(r)["env"] == planned(r)["train"] == 1, r.out[-3000:]
    r = snakemake(after, *targets, "--cores", "2", "--configfile", "config/tiny.yaml", "-R", "data")
    assert r.returncode == 0, r.out[-3000:]
    assert "(Rule: env)" in r.out and "(Rule: data)" in r.out, r.out[-3000:]
    assert "(Rule: train)" in r.out and "restored, nothing trained" in r.out, r.out[-3000:]
    assert "step 1/3" not in r.out and "step 3/3" not in r.out
    assert {n: (run / n).read_bytes() for n in before} == before
    assert len(list((run / "checkpoints").iterdir())) == 1           # one identity, nothing set aside


@pipeline
def test_an_edited_holdout_reruns_evaluate_which_refuses_it(after):
    """Rule 3: holdout.jsonl is hashed in the manifest and an input of evaluate: prompts swapped reruns evaluate,
    which refuses the file by name (it was read as it was: tau from other prompts, no word)."""
    hold = after / "results" / "data" / "tiny" / "holdout.jsonl"
    lines = hold.read_text().splitlines(keepends=True)
    hold.write_text("".join(reversed(lines)))
    assert "evaluate" in planned(dry(after))
    r = snakemake(after, "results/runs/tiny/acceptance.json", "--cores", "1", "--configfile", "config/tiny.yaml")
    assert r.returncode != 0
    assert "holdout.jsonl: changed after the data stage" in r.out and "rerun the data stage" in r.out


@pipeline
def test_run_by_hand_with_other_settings_is_not_taken_for_the_pipelines(after, monkeypatch):
    """`python -m dflash train --set train.steps=2` into the pipeline's run folder (in this process: the same CLI, no
    launch), then the pipeline: the 2-step run is refused by name, never evaluated and reported as the pipeline's run."""
    from dflash.cli import main
    monkeypatch.chdir(after)
    assert main(["train", "--config", "config/tiny.yaml", "--set", "train.steps=2", "--no-progress"]) == 0
    assert json.loads((after / "results/runs/tiny/summary.json").read_text())["steps"] == 2
    r = snakemake(after, "--cores", "2", "--configfile", "config/tiny.yaml")
    assert r.returncode != 0
    assert "results/runs/tiny/summary.json was trained with another config" in r.out
    acceptance = after / "results/runs/tiny/acceptance.json"
    assert not acceptance.exists() or json.loads(acceptance.read_text())["checkpoint_step"] == 3


@pipeline
def test_a_key_that_cannot_change_the_result_reruns_nothing(done):
    """data.num_proc (how many processes tokenise) and train.log_every (how often a row is logged) rerun no rule:
    data.num_proc reran the data stage, and the train stage then trained the finished run again."""
    work = done[0]
    write_config(work, "tiny-ops.yaml", tiny_config(work, data__num_proc=2, train__log_every=2))
    r = snakemake(work, "-n", "--configfile", "config/tiny-ops.yaml")
    assert r.returncode == 0 and "Nothing to be done" in r.out, r.out[-3000:]


# ---- issue 47 items 1-3: "Nothing to be done" only when nothing changed -------------------------------------------
ONWARD = {"train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1, "all": 1}   # what a train key reruns


@pipeline
@pytest.mark.parametrize("key,given,closest", [
    ("evaluate.prompt_files[0]", "config/my-prompts.jsonl", "config/prompts.jsonl"),
    ("data.sources[0].path", "sources/mine.json", "sources/mine.jsonl"),
    ("drafter.init_from", "results/runs/tiny/drafer", "results/runs/tiny/drafter"),
    ("target.path", "results/target/tinny", "results/target/tiny"),
], ids=["prompt_files", "source", "init_from", "target_none"])
def test_a_missing_file_the_config_names_is_refused_before_any_job(done, key, given, closest):
    """A file or folder the config names that is not there (a typo): `evaluate.prompt_files: [config/my-prompts.jsonl]`
    answered "Nothing to be done" (rc 0) and the new prompt set was never evaluated. Every key that names an input
    (marked `Reads` in dflash/config_model.py) is checked when the workflow reads the config: one line naming the key,
    the path and the closest existing name."""
    work = done[0]
    (work / "config" / "prompts.jsonl").write_text('{"prompt": "def add(a, b):"}\n')
    cfg = tiny_config(work)
    if key.startswith("evaluate"):
        cfg["evaluate"]["prompt_files"] = [given]
    elif key.startswith("data"):
        cfg["data"]["sources"][0]["path"] = given
    elif key.startswith("drafter"):
        cfg["drafter"]["init_from"] = given
    else:
        cfg["target"].update(path=given, build="none")
    r = snakemake(work, "-n", "--configfile", write_config(work, "typo.yaml", cfg))
    assert r.returncode != 0, r.out[-2000:]
    assert (f"config error: config/typo.yaml: {key} names {given}, which does not exist; the closest existing name is "
            f"{closest}") in r.out, r.out[-2000:]
    assert len(error_lines(r)) <= 4, r.out


@pipeline
def test_a_model_folder_changed_in_place_reruns_the_stages_that_read_it(after):
    """A user's model (target.build: none) whose weights change in place (one byte, size and mtimes kept, so the
    folder's mtime does not move): Snakemake saw only the folder's mtime and answered "Nothing to be done". Its content
    is in the stamp of every rule that loads it: they rerun, and what follows them."""
    mine = after / "models" / "mine"
    shutil.copytree(after / "results" / "target" / "tiny", mine)
    (mine / "build.json").unlink()                                    # not the pipeline's: the user's folder
    cfg = tiny_config(after)
    cfg["target"].update(path="models/mine", build="none")
    config = write_config(after, "mine.yaml", cfg)
    r = snakemake(after, "--touch", "--cores", "1", "--configfile", config)   # the pipeline's outputs, as of this model
    assert r.returncode == 0, r.out[-3000:]
    assert "Nothing to be done" in dry(after, config=config).out
    weights, folder = mine / "model.safetensors", os.stat(mine).st_mtime_ns
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(mine).st_mtime_ns == folder
    r = dry(after, config=config)
    assert planned(r) == {"data": 1, "warmup": 1, "train": 1, "evaluate": 1, "export": 1, "report": 1, "gate": 1,
                          "all": 1}, r.out[-3000:]


@pipeline
def test_without_snakemakes_metadata_nothing_changed_reruns_nothing(after):
    """`.snakemake/` gone and every file of the repository newer than the results (a results folder copied into a fresh
    clone): the pins and the source file, inputs by their mtime, reran env and data onward. Their content is in the
    stamps: nothing to do."""
    shutil.rmtree(after / ".snakemake")
    for f in after.rglob("*"):
        if f.is_file() and not f.is_relative_to(after / "results"):
            os.utime(f)                                              # a fresh clone's checkout
    assert "Nothing to be done" in dry(after).out


@pipeline
def test_without_snakemakes_metadata_a_changed_key_reruns_what_it_affects(after):
    """`.snakemake/` gone, then `train.lr` changed: nothing reran (Snakemake's only word: "missing provenance/
    metadata"). The key stamps rerun train onward; a dry run of the change moves no stamp a run relies on (back to the old config:
    nothing to do); after the change ran (--touch: outputs and stamps as a run leaves them), going back reruns train
    onward again."""
    shutil.rmtree(after / ".snakemake")
    lr = write_config(after, "tiny-lr.yaml", tiny_config(after, train__lr=1e-3))
    assert planned(dry(after, config=lr)) == ONWARD
    assert "Nothing to be done" in dry(after).out                  # the dry run of the change changed nothing
    r = snakemake(after, "--touch", "--cores", "1", "--configfile", lr)
    assert r.returncode == 0, r.out[-3000:]
    assert "Nothing to be done" in dry(after, config=lr).out
    assert planned(dry(after)) == ONWARD


@pipeline
def test_a_built_target_changed_in_place_is_refused_by_the_plan(after):
    """A target the pipeline built, edited in place: every stage that loads it refuses it, but Snakemake (the folder's
    mtime unmoved) answered "Nothing to be done". The plan says it in the stages' line; `-R target` rebuilds it."""
    tok = after / "results" / "target" / "tiny" / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace('"model_max_length"', '"model_max_length" '))
    r = snakemake(after, "-n", "--configfile", "config/tiny.yaml")
    assert r.returncode != 0, r.out[-2000:]
    assert (f"results/target/tiny/tokenizer_config.json: {tok.stat().st_size} bytes, {tok.stat().st_size - 1} when "
            "recorded, since the target stage built results/target/tiny") in r.out, r.out[-2000:]
    assert "rerun the target stage (snakemake -R target)" in r.out and len(error_lines(r)) <= 4, r.out
    assert planned(dry(after, "-R", "target"))["target"] == 1


@pipeline
def test_a_target_rebuilt_to_the_same_weights_is_evaluated(after):
    """The stages' remedy for a changed target is a rebuild (`snakemake -R target`); a rebuild that wrote the same
    weights was refused by evaluate because build.json (the build's log: seconds, its files' mtimes) differed. A target
    is its weights, config and tokenizer. Data, warm-up and train are marked done with --touch (the same weights give
    them the same outputs; a real rerun of train restores: test_finished_run_is_restored_...)."""
    target = after / "results" / "target" / "tiny"
    before = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    r = snakemake(after, "-R", "target", "--until", "target", "--cores", "1", "--configfile", "config/tiny.yaml")
    assert r.returncode == 0, r.out[-3000:]
    now = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
    assert now["build.json"] != before["build.json"]                  # another build: its timing differs
    assert {k: v for k, v in now.items() if k != "build.json"} == {k: v for k, v in before.items() if k != "build.json"}
    r = snakemake(after, "--touch", "results/runs/tiny/summary.json", "--cores", "1", "--configfile",
                  "config/tiny.yaml")
    assert r.returncode == 0, r.out[-3000:]
    acceptance = after / "results" / "runs" / "tiny" / "acceptance.json"
    r = snakemake(after, str(acceptance.relative_to(after)), "--cores", "1", "--configfile", "config/tiny.yaml")
    assert r.returncode == 0, r.out[-3000:]
    assert "(Rule: evaluate)" in r.out and json.loads(acceptance.read_text())["tau"] >= 1


# ---- issue 47 items 3 and 4: a run's identity is its content; no finished run redone or lost -------------------------
@pipeline
@pytest.mark.parametrize("change", [{"target__path": "./results/target/tiny/"},
                                    {"data__code_completion": {"enabled": False, "files": "all"}},
                                    {"train__muon_lr": 0.01},
                                    {"data__regenerate": {"enabled": False, "concurrency": 3, "engine": "hf"}}],
                         ids=["target_path_spelling", "code_completion_off", "muon_lr_with_adamw",
                              "regenerate_off_concurrency"])
def test_a_spelling_or_a_switched_off_key_reruns_nothing(done, change):
    """Issue 47 item 3: `target.path` written with `./` and a trailing slash, and keys of features the config switches
    off (code_completion.files with that source off, train.muon_lr with AdamW, data.regenerate.* with regeneration
    off), rerun nothing: each changed a rerun trigger (and the result hash) on eb0a841, so Snakemake rebuilt the data
    and retrained the finished run."""
    work = done[0]
    write_config(work, "tiny-same.yaml", tiny_config(work, **change))
    r = snakemake(work, "-n", "--configfile", "config/tiny-same.yaml")
    assert r.returncode == 0 and "Nothing to be done" in r.out, r.out[-3000:]


@pipeline
def test_the_same_data_under_another_dataset_name_restores_the_finished_run(after):
    """Issue 47 item 3: the dataset copied under another `dataset_name` (identical content hash): train reruns (its
    input is another file) and restores the finished run, nothing trained. It trained anew on eb0a841: dataset_name
    was in the result hash, so the run's identity changed and its checkpoints were set aside."""
    shutil.copytree(after / "results" / "data" / "tiny", after / "results" / "data" / "renamed")
    run = after / "results" / "runs" / "tiny"
    before = (run / "summary.json").read_bytes()
    write_config(after, "tiny-renamed.yaml", tiny_config(after, dataset_name="renamed"))
    r = snakemake(after, "results/runs/tiny/summary.json", "--cores", "2", "--configfile", "config/tiny-renamed.yaml")
    assert r.returncode == 0, r.out[-3000:]
    assert "(Rule: train)" in r.out and "restored, nothing trained" in r.out, r.out[-3000:]
    assert "step 1/3" not in r.out and (run / "summary.json").read_bytes() == before


@pipeline
def test_an_interrupted_forced_retrain_resumes_with_rerun_incomplete(after):
    """Issue 47 item 4: `snakemake -R train` on the finished run, stopped at step 3 (here by the train.fail_at_step
    hook, an operational key), then `snakemake --rerun-incomplete` with the pipeline's config: the retrain resumes from
    its step-2 checkpoint. On eb0a841 the old run was restored in its place and the retrain's checkpoints set aside
    (and lost at the next set-aside); the finished run is kept here too (`checkpoints/<identity>.1/`)."""
    write_config(after, "tiny-cut.yaml", tiny_config(after, train__fail_at_step={"worker": "drafter-0", "step": 3},
                                                     train__checkpoint_every=1))
    r = snakemake(after, "results/runs/tiny/summary.json", "--cores", "2", "--configfile", "config/tiny-cut.yaml",
                  "-R", "train")
    assert r.returncode != 0 and "injected failure at step 3" in r.out, r.out[-3000:]
    r = snakemake(after, "results/runs/tiny/summary.json", "--cores", "2", "--configfile", "config/tiny.yaml",
                  "--rerun-incomplete")
    assert r.returncode == 0, r.out[-3000:]
    assert "resuming from" in r.out and "restored, nothing trained" not in r.out, r.out[-3000:]
    s = json.loads((after / "results" / "runs" / "tiny" / "summary.json").read_text())
    assert (s["resumed_from_step"], s["steps"], s["status"]) == (2, 3, "completed")
    kept = [p for p in (after / "results" / "runs" / "tiny" / "checkpoints").iterdir() if p.name.endswith(".1")]
    assert len(kept) == 1 and (kept[0] / "finished.json").is_file()


# ---- issue 48 item 2: a sweep is rules ------------------------------------------------------------------------------
@pipeline
def test_a_sweep_trains_its_runs_and_writes_the_table_from_their_outputs(after):
    """The tiny pipeline's config with a sweep of two more runs (a runs sheet): `tiny-s1`, another seed on the config's
    dataset, and `tiny-h3`, another data key and so its own dataset; their tau at T=0 is their last in-training
    evaluation (sweep.evaluate own), the config's own run is evaluated at T=1 too. The finished own run is kept (its
    stamps did not move); each new run has its own stamps, so a changed row reruns its run alone; the table's figures
    are the runs' own."""
    cfg = tiny_config(after)
    cfg["sweep"] = {"runs": "config/tiny-runs.tsv", "evaluate": "own", "temperatures": [1.0]}
    (after / "config" / "tiny-runs.tsv").write_text("run\tseed\tdata.holdout\tdataset_name\ttrain.eval_every\n"
                                                    "tiny-s1\t1\t\t\t3\ntiny-h3\t\t3\ttiny-h3\t3\n")
    write_config(after, "tiny.yaml", cfg)
    r = dry(after, "-p")
    assert planned(r) == {"data": 1, "train": 2, "evaluate_at": 1, "sweep_table": 1, "all": 1}
    assert ("train --config config/tiny.yaml --set seed=1 --set train.eval_every=3 --set 'run_name=\"tiny-s1\"' --set "
            "'dataset_name=\"tiny\"' --data results/data/tiny --run-dir results/runs/tiny-s1") in r.out   # its keys
    r = snakemake(after, "--cores", "2", "--configfile", "config/tiny.yaml")
    assert r.returncode == 0, r.out[-3000:]
    res = after / "results"
    for stamp in ("train/tiny-s1.json", "train/tiny-h3.json", "data/tiny-h3.json", "evaluate/tiny.json"):
        assert (res / "stamps" / stamp).is_file(), stamp
    runs = {n: json.loads((res / "runs" / n / "summary.json").read_text()) for n in ("tiny", "tiny-s1", "tiny-h3")}
    assert runs["tiny-s1"]["config"]["seed"] == 1 and runs["tiny-s1"]["data_hash"] == runs["tiny"]["data_hash"]
    assert runs["tiny-h3"]["data_hash"] != runs["tiny"]["data_hash"]
    assert len((res / "data" / "tiny-h3" / "holdout.jsonl").read_text().splitlines()) == 3
    own = json.loads((res / "runs" / "tiny" / "acceptance.json").read_text())
    hot = json.loads((res / "runs" / "tiny" / "acceptance-t1.json").read_text())
    assert hot["temperature"] == 1.0 and set(hot["by_proposal"]) == {"argmax", "sample"}
    rec = json.loads((res / "report" / "sweep.json").read_text())
    rows = {r["run"]: r for r in rec["runs"]}
    assert list(rows) == ["tiny", "tiny-s1", "tiny-h3"] and rec["x_unit"] == "train_s" and rec["devices"] == []
    assert (rows["tiny"]["tau"], rows["tiny"]["tau_by"]) == (own["tau"], "evaluate")
    assert rows["tiny"]["hot"] == {"1": {p: f["tau"] for p, f in hot["by_proposal"].items()}}
    for name in ("tiny-s1", "tiny-h3"):
        assert (rows[name]["tau"], rows[name]["tau_by"]) == (runs[name]["eval"]["tau"], "in-training replay")
        assert rows[name]["curve"][-1]["tau"] == runs[name]["eval"]["tau"] and rows[name]["steps"] == 3
    assert (rows["tiny-h3"]["dataset"], rows["tiny-s1"]["dataset"]) == ("tiny-h3", "tiny")
    groups = {g["group"]: g for g in rec["groups"]}
    taus = [own["tau"], runs["tiny-s1"]["eval"]["tau"]]
    assert groups["tiny"]["runs"] == ["tiny", "tiny-s1"] and groups["tiny"]["mean"] == pytest.approx(sum(taus) / 2)
    assert groups["tiny"]["spread"] == pytest.approx(max(taus) - min(taus))
    assert (groups["tiny-h3"]["overrides"], groups["tiny-h3"]["beats_spread"]) == ({"data.holdout": 3}, None)
    md = (res / "report" / "sweep.md").read_text()
    assert f"| tiny (own) | (the config's) | 0 | tiny ({rows['tiny']['samples']}) | 3 |" in md
    assert "| T=1 argmax | T=1 sample |" in md
    assert (res / "report" / "sweep_tau_gpu_seconds.png").read_bytes()[:4] == b"\x89PNG"
    assert "Nothing to be done" in dry(after).out
    (after / "config" / "tiny-runs.tsv").write_text("run\tseed\tdata.holdout\tdataset_name\ttrain.eval_every\n"
                                                    "tiny-s1\t2\t\t\t3\ntiny-h3\t\t3\ttiny-h3\t3\n")
    r = dry(after)
    assert planned(r) == {"train": 1, "sweep_table": 1, "all": 1}, r.out[-3000:]      # tiny-s1 alone, and the table
    assert "results/stamps/plan/train/tiny-s1.json" in r.out
