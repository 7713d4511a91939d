"""Issue 48 item 2: a config's sweep (dflash/sweep.py) expanded into runs, each the config with its overrides and
validated as a config, a bad row named in one line; and the sweep table's groups (dflash/report/sweep.py). The workflow
running a sweep: tests/e2e/test_workflow.py."""
import json

import pytest

from dflash import config as C
from dflash import inputs
from dflash.sweep import expand

QUALITY = "config/quality.yaml"


def sheet(tmp_path, text: str, name="runs.tsv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def swept(runs, **sweep):
    return C.from_dict({"sweep": {"runs": runs, **sweep}}, "c.yaml")


def test_the_quality_sweep_expands_into_its_runs_and_datasets(repo, monkeypatch):
    monkeypatch.chdir(repo)
    loaded = C.load(QUALITY)
    s = expand(loaded)
    assert len(s.runs) == 21 and list(s.runs)[:4] == ["quality", "quality-s1", "quality-s2", "muon"]
    assert s.source == "config/quality-runs.tsv" and s.baseline == "quality" and s.declared
    assert list(s.datasets) == ["code-completion", "code-completion-5k", "code-completion-48k"]
    own, s1, big = s.runs["quality"], s.runs["quality-s1"], s.runs["data48k-s1"]
    assert (own.own, own.decoded, own.temperatures, own.sets) == (True, True, (1.0,), [])
    assert (s1.decoded, s1.temperatures, s1.dataset, s1.loaded.cfg.seed) == (False, (), "code-completion", 1)
    assert s1.sets == ["seed=1", 'run_name="quality-s1"', 'dataset_name="code-completion"']
    assert big.sets == ["seed=1", "data.code_completion.max_conversations=48000", 'run_name="data48k-s1"',
                        'dataset_name="code-completion-48k"']
    # the data stage of a variant: its data keys, never the row's training seed
    assert s.sets["code-completion-48k"] == ["data.code_completion.max_conversations=48000",
                                             'dataset_name="code-completion-48k"']
    assert s.datasets["code-completion-48k"].cfg.seed == 0
    assert s.runs["anchors1k"].loaded.cfg.train.num_anchors == 1024 and s.runs["muon-s2"].loaded.cfg.train.optimizer \
        == "muon"
    # a run's config hashes as the same config written out would: the sweep section itself is in no hash
    assert (own.loaded.hash, own.loaded.result_hash) == (loaded.hash, loaded.result_hash)
    assert C.from_dict({**loaded.raw, "sweep": {}}).hash == loaded.hash
    assert s1.loaded.result_hash != loaded.result_hash
    assert [n.key for n in inputs.named(loaded.cfg)] == ["sweep.runs"]          # the sheet: checked before any job
    part = expand(C.load(QUALITY, {"sweep.only": ["muon*", "quality-s1"]}))
    assert list(part.runs) == ["quality", "quality-s1", "muon", "muon-s1", "muon-s2"]
    assert list(part.datasets) == ["code-completion"]


def test_runs_share_a_dataset_by_their_data_keys():
    """A seed is a training seed (the config's dataset); a run whose data keys differ gets its own dataset, named by
    their hash, shared with every run of the same data keys; a row may name it."""
    s = expand(swept([{"run": "s1", "seed": 1}, {"run": "h3", "data.holdout": 3}, {"run": "h3-s1", "seed": 1,
                                                                                   "data.holdout": 3},
                      {"run": "h5", "data.holdout": 5, "dataset_name": "five"}, {"run": "lr", "train.lr": 0.001}]))
    ds = {n: r.dataset for n, r in s.runs.items()}
    assert ds["demo"] == ds["s1"] == ds["lr"] == "default" and ds["h5"] == "five"
    assert ds["h3"] == ds["h3-s1"] and ds["h3"].startswith("default-") and len(ds["h3"]) == len("default-") + 8
    assert list(s.datasets) == ["default", ds["h3"], "five"] and s.datasets["five"].cfg.data.holdout == 5
    assert s.runs["h3-s1"].loaded.cfg.data.holdout == 3 and s.runs["h3-s1"].loaded.cfg.seed == 1
    assert not swept(None).cfg.sweep.runs and not expand(swept(None)).declared


@pytest.mark.parametrize("text,message", [
    ("run\ttrain.lr\nfast\t1e-3\nslow\tabc\n", "runs.tsv:3 (slow): key 'train.lr' must be number, got str 'abc'"),
    ("run\ttrain.lossweighting\nx\tdecay\n", "runs.tsv:2 (x): unknown key 'train.lossweighting' (did you mean "
                                               "train.loss_weighting?)"),
    ("run\ttarget.arch.hidden_size\nx\t64\n", "runs.tsv:2 (x): key 'target.arch.hidden_size' cannot vary in a sweep: "
                                              "the runs share the config's target"),
    ("run\ttrain.drafters\nx\t[cpu]\n", "runs.tsv:2 (x): key 'train.drafters' cannot vary in a sweep: the runs share "
                                        "the config's placement"),
    ("run\tresults_dir\nx\tr\n", "runs.tsv:2 (x): key 'results_dir' cannot vary in a sweep"),
    ("run\tdata.sources.path\nx\ta.jsonl\n", "runs.tsv:2 (x): key 'data.sources.path' is inside a list"),
    ("run\tseed\nx\t1\nx\t2\n", "runs.tsv:3: run x is also another row"),
    ("run\tseed\ndemo\t1\n", "runs.tsv:2: run demo is also the config's own run (run_name)"),
    ("run\tseed\n../x\t1\n", "runs.tsv:2: run '../x' must be a folder name"),
    ("run\tseed\nx\t1\t2\n", "runs.tsv:2: 3 cells for the 2 columns of the header"),
    ("name\tseed\nx\t1\n", "runs.tsv:1: the first column of the runs sheet must be `run`, got 'name'"),
    ("run\tseed\tseed\nx\t1\t2\n", "runs.tsv:1: column seed given twice"),
    ("run\tdata.holdout\tdataset_name\nx\t3\tdefault\n", "runs.tsv:2 (x): dataset_name default is the dataset of "
                                                          "other data keys (the config)"),
    ("run\ttrain.steps\nx\t[1\n", "runs.tsv:2 train.steps: not valid YAML"),
    ("# only a comment\n", "runs.tsv: the runs sheet is empty"),
], ids=["value", "unknown", "target", "placement", "results_dir", "list", "twice", "own", "name", "cells", "header",
        "column", "dataset", "yaml", "empty"])
def test_a_bad_row_of_a_runs_sheet_is_one_line_naming_the_row_and_the_key(tmp_path, text, message):
    path = sheet(tmp_path, text)
    with pytest.raises(C.ConfigError) as e:
        expand(swept(path))
    assert message in str(e.value) and str(e.value).startswith(str(tmp_path)) and "\n" not in str(e.value)


def test_a_csv_sheet_and_a_missing_one(tmp_path, monkeypatch):
    s = expand(swept(sheet(tmp_path, "run,seed,train.lr\n# a note\na,1,\nb,,2e-3\n", "runs.csv")))
    assert {n: r.overrides for n, r in s.runs.items()} == {"demo": {}, "a": {"seed": 1}, "b": {"train.lr": 0.002}}
    monkeypatch.chdir(tmp_path)
    with pytest.raises(C.ConfigError, match=r"^c.yaml: sweep.runs names runs.tvs, which does not exist; the closest "
                                            r"existing name is runs.csv$"):
        inputs.check(swept("runs.tvs").cfg, "c.yaml")


def test_what_the_sweep_section_itself_refuses():
    with pytest.raises(C.ConfigError, match=r"sweep.runs\[0\] \(x\): key 'evaluate.temperature' asks for an "
                                            r"evaluation, but sweep.evaluate is own"):
        expand(swept([{"run": "x", "train.eval_every": 5, "evaluate.temperature": 1.0}], evaluate="own"))
    with pytest.raises(C.ConfigError, match=r"sweep.runs\[0\] \(x\): sweep.evaluate is own, so this run's tau is its "
                                            r"last in-training evaluation.*\(here 0, None, None, 0.0\)"):
        expand(swept([{"run": "x", "seed": 1}], evaluate="own"))
    with pytest.raises(C.ConfigError, match=r"^c.yaml: sweep.only: mu\* matches no run of the sweep \(runs: x\)$"):
        expand(swept([{"run": "x", "seed": 1}], only=["mu*"]))
    with pytest.raises(C.ConfigError, match=r"^c.yaml: sweep.baseline names run y, which is not a run of the sweep"):
        expand(swept([{"run": "x", "seed": 1}], baseline="y"))
    ok = expand(swept([{"run": "x", "seed": 1, "train.eval_every": 5}], evaluate="own", temperatures=[0.0, 1.0, 1.0]))
    assert (ok.runs["demo"].temperatures, ok.runs["x"].decoded) == ((1.0,), False)


def fake_run(runs, name, tau=None, replay=None, steps=10, hot=None, curve=((5, 1.5), (10, 2.0)), status="completed"):
    """A run folder as the train and evaluate stages leave it: summary.json (its last in-training evaluation made at
    the evaluate stage's measure when `replay`), metrics.jsonl with in-training tau, acceptance files."""
    from dflash.config import from_dict
    e = from_dict({}).cfg.evaluate
    d = runs / name
    d.mkdir(parents=True)
    ev = {"tau": replay, "step": steps, "prompts": e.num_prompts, "max_new_tokens": e.max_new_tokens} if replay else {}
    d.joinpath("summary.json").write_text(json.dumps({
        "status": status, "steps": steps, "finished": True, "train_seconds": 2.0, "eval": ev,
        "throughput": {"ktok_per_s": 1.5}, "env": {"gpu": {"models": []}}}))
    d.joinpath("metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_s": s / 5, "tau": t, "tau_step": s,
                                                               "tau_train_s": s / 5}) + "\n" for s, t in curve))
    if tau is not None:
        d.joinpath("acceptance.json").write_text(json.dumps({"temperature": 0.0, "tau": tau, "lossless": True}))
    for temp, taus in (hot or {}).items():
        d.joinpath(f"acceptance-t{temp:g}.json").write_text(json.dumps({
            "temperature": temp, "tau": taus["argmax"], "proposal": "argmax",
            "by_proposal": {p: {"tau": t} for p, t in taus.items()}}))


def test_the_sweep_table_groups_seeds_and_names_the_levers_beyond_the_spread(tmp_path, monkeypatch):
    """Seeds of one recipe are a group (mean, spread); a group beats the baseline's when its mean differs by more than
    the larger spread; a group of one seed is not judged; tau comes from the evaluate stage, else the replay."""
    from dflash.report import sweep as table
    monkeypatch.chdir(tmp_path)                                          # results/data/: no manifest here
    s = expand(swept([{"run": "s1", "seed": 1, "train.eval_every": 5}, {"run": "s2", "seed": 2, "train.eval_every": 5},
                      {"run": "lr", "train.lr": 0.001, "train.eval_every": 5},
                      {"run": "lr-s1", "train.lr": 0.001, "seed": 1, "train.eval_every": 5},
                      {"run": "kl", "train.objective": "kl", "train.eval_every": 5}], evaluate="own"))
    runs = tmp_path / "runs"
    fake_run(runs, "demo", tau=2.0, hot={1.0: {"argmax": 1.5, "sample": 1.25}})
    fake_run(runs, "s1", replay=2.25)
    fake_run(runs, "s2", replay=2.125)
    fake_run(runs, "lr", replay=3.0)
    fake_run(runs, "lr-s1", replay=2.5, steps=10)
    fake_run(runs, "kl", replay=9.0, steps=10)
    (runs / "kl" / "summary.json").write_text(json.dumps({**json.loads((runs / "kl" / "summary.json").read_text()),
                                                          "finished": False}))      # cut: its tau is no measure
    rec = table.build(s, runs, tmp_path / "out", "c.yaml")
    rows = {r.run: r for r in rec.runs}
    assert (rows["demo"].tau, rows["demo"].tau_by, rows["s1"].tau, rows["s1"].tau_by) == (2.0, "evaluate", 2.25,
                                                                                          "in-training replay")
    assert rows["kl"].tau is None and rows["demo"].hot == {"1": {"argmax": 1.5, "sample": 1.25}}
    assert [p.model_dump() for p in rows["s1"].curve] == [{"x": 1.0, "tau": 1.5}, {"x": 2.0, "tau": 2.0}]
    groups = {g.group: g for g in rec.groups}
    assert [g.group for g in rec.groups] == ["demo", "lr", "kl"] and rec.x_unit == "train_s"
    assert (groups["demo"].runs, groups["demo"].n, groups["demo"].spread) == (["demo", "s1", "s2"], 3, 0.25)
    assert groups["demo"].mean == pytest.approx(6.375 / 3) and groups["demo"].beats_spread is None
    assert (groups["lr"].mean, groups["lr"].spread, groups["lr"].beats_spread) == (2.75, 0.5, True)
    assert groups["lr"].vs_baseline == pytest.approx(2.75 - 6.375 / 3)           # 0.625 > max(0.25, 0.5)
    assert (groups["kl"].n, groups["kl"].beats_spread) == (0, None)
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert ("| demo (own) | (the config's) | 0 | default (-) | 10 | 2.0 | 1.50 | 2.000 | evaluate | 1.500 | 1.250 | "
            "True |") in md
    assert "| lr | `train.lr: 0.001` | lr, lr-s1 | 2 | 2.750 | 0.500 | 0.625 | yes |" in md
    assert ("| kl | `train.objective: \"kl\"`, `train.eval_every: 5` | 0 | default (-) | 10 | 2.0 | 1.50 |  | "
            "completed, no tau measure |") in md
    assert "Groups that beat the spread: lr." in md and "| T=1 argmax | T=1 sample |" in md
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["groups"][1]["beats_spread"] is True
    assert (tmp_path / "out" / "sweep_tau_gpu_seconds.png").read_bytes()[:4] == b"\x89PNG"
