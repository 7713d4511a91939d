import copy
import json
import subprocess
import sys

import pytest
import yaml

from dflash import config as C


def write(tmp_path, data):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_defaults_applied(tmp_path):
    loaded = C.load(write(tmp_path, {"train": {"steps": 7}}))
    cfg = loaded.cfg
    assert cfg.train.steps == 7
    assert cfg.train.lr == pytest.approx(6e-4)          # schema default
    assert cfg.drafter.block_size == 16
    assert cfg.train.drafters == ("cpu", "cpu")          # arrays become tuples
    assert cfg.train.rendezvous.nnodes == 1              # nested defaults
    assert loaded.raw["report"]["threshold"] == pytest.approx(-0.10)


def test_every_schema_key_has_default_and_description():
    def walk(schema, path):
        for key, sub in schema.get("properties", {}).items():
            assert "description" in sub, f"{path}{key} has no description"
            assert "default" in sub, f"{path}{key} has no default"
            walk(sub, f"{path}{key}.")
            if isinstance(sub.get("items"), dict):
                for k, s in sub["items"].get("properties", {}).items():
                    assert "description" in s, f"{path}{key}[].{k} has no description"
    walk(C.load_schema(), "")


def test_unknown_key_named(tmp_path):
    p = write(tmp_path, {"train": {"stepz": 3}})
    with pytest.raises(C.ConfigError, match=r"c\.yaml: unknown key 'train\.stepz'"):
        C.load(p)


def test_wrong_type_named(tmp_path):
    p = write(tmp_path, {"drafter": {"block_size": "sixteen"}})
    with pytest.raises(C.ConfigError, match=r"c\.yaml: key 'drafter\.block_size' must be integer"):
        C.load(p)


def test_missing_file_named(tmp_path):
    with pytest.raises(C.ConfigError, match="nope.yaml: config file not found"):
        C.load(tmp_path / "nope.yaml")


def test_source_items_validated(tmp_path):
    p = write(tmp_path, {"data": {"sources": [{"name": "x", "path": "a.jsonl", "colour": "red"}]}})
    with pytest.raises(C.ConfigError, match=r"unknown key 'data\.sources\.0\.colour'"):
        C.load(p)
    ok = C.load(write(tmp_path, {"data": {"sources": [{"name": "x", "path": "a.jsonl"}]}}))
    assert ok.cfg.data.sources[0].kind == "auto" and ok.cfg.data.sources[0].weight == 1.0


def test_config_hash_ignores_names_but_not_settings(tmp_path):
    a = C.from_dict({"run_name": "a"})
    b = C.from_dict({"run_name": "b", "report": {"threshold": -0.2}})
    c = C.from_dict({"run_name": "a", "train": {"lr": 1e-3}})
    assert a.hash == b.hash
    assert a.hash != c.hash


def test_shipped_configs_validate(repo):
    for name in ("config.yaml", "h200.yaml", "h200-long.yaml", "h200-32k.yaml", "seed-8gpu.yaml", "seed-2gpu.yaml", "8gpu.yaml",
                 "2gpu.yaml"):
        C.load(repo / "config" / name)


@pytest.mark.parametrize("stage", ["env", "train"])
def test_cli_reports_config_error_in_one_line(tmp_path, repo, stage):
    p = write(tmp_path, {"bogus": 1})
    r = subprocess.run([sys.executable, "-m", "dflash", stage, "--config", str(p)], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "unknown key 'bogus'" in lines[0] and str(p) in lines[0]


def test_cli_help_lists_stages(repo):
    r = subprocess.run([sys.executable, "-m", "dflash", "--help"], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0
    for stage in ("env", "data", "warmup", "train", "evaluate", "export", "report"):
        assert stage in r.stdout


def test_yaml_syntax_error_names_line_and_column(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("run_name: demo\ntrain:\n  steps: [1, 2\n  lr: 0.1\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml:4:5: not valid YAML: expected ',' or '\]'"):
        C.load(p)


def test_duplicate_key_refused_at_any_depth(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  steps: 3\n  lr: 0.1\n  steps: 5\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml:4:3: not valid YAML: duplicate key 'steps' \(first at line 2\)"):
        C.load(p)
    p.write_text("run_name: a\nseed: 1\nrun_name: b\n")
    with pytest.raises(C.ConfigError, match="duplicate key 'run_name'"):
        C.read_yaml(p)
    p.write_text("base: &b {x: 1}\nother:\n  <<: *b\n  y: 2\n")   # merge keys still work
    assert C.read_yaml(p)["other"] == {"x": 1, "y": 2}


def test_for_workflow_applies_snakemake_config_values(tmp_path):
    """What Snakemake's --config gives (nested values as strings, from YAML's base loader) is typed as in the file,
    validated, and handed to the stages as --set arguments that rebuild the same config."""
    p = write(tmp_path, {"run_name": "demo", "train": {"steps": 7, "lr": 0.001}})
    loaded, sets = C.for_workflow(p, {"run_name": "x", "train": {"steps": "5"}})
    resolved = loaded.raw
    assert loaded.cfg.run_name == "x" and loaded.source == str(p)
    assert resolved["run_name"] == "x" and resolved["train"]["steps"] == 5 and resolved["train"]["lr"] == 0.001
    assert sets == ['run_name="x"', "train.steps=5"]
    again = C.load(p, {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets)})
    assert again.raw == resolved
    with pytest.raises(C.ConfigError, match="unknown key 'bogus'"):
        C.for_workflow(p, {"bogus": 1})


def test_cli_log_file_gets_the_log_and_the_one_line_error(tmp_path, repo):
    good, log = write(tmp_path, {"results_dir": str(tmp_path / "r")}), tmp_path / "logs" / "env.log"
    r = subprocess.run([sys.executable, "-m", "dflash", "env", "--config", str(good), "--log", str(log)], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "INFO dflash.env: environment" in log.read_text() and "INFO dflash.env: environment" in r.stderr
    bad = write(tmp_path, {"bogus": 1})
    r = subprocess.run([sys.executable, "-m", "dflash", "env", "--config", str(bad), "--log", str(log)], cwd=repo,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown key 'bogus'" in log.read_text() and "unknown key 'bogus'" in r.stderr


def test_run_trained_with_another_config_refused(tmp_path):
    """Only keys that change the trained drafter refuse a run: names, evaluate settings and operational train keys
    (a finished run restored under another train.log_every) do not."""
    import json

    from dflash.errors import UserError
    from dflash.stages import check_run_config
    loaded = C.from_dict({"train": {"steps": 7}})
    (tmp_path / "summary.json").write_text(json.dumps({"config_hash": loaded.hash, "config": loaded.raw}))
    check_run_config(loaded, tmp_path)                                       # same config: fine
    check_run_config(C.from_dict({"train": {"steps": 7}, "run_name": "x", "evaluate": {"num_prompts": 2}}), tmp_path)
    check_run_config(C.from_dict({"train": {"steps": 7, "log_every": 3, "stall_timeout_s": 5}}), tmp_path)
    with pytest.raises(UserError, match="summary.json was trained with another config"):
        check_run_config(C.from_dict({"train": {"steps": 50}}), tmp_path)


def test_result_hash_ignores_only_the_operational_train_keys():
    """Rule 2: resumption follows what changes the result. Every operational key is a train key (their roles say so);
    changing one keeps the result hash, changing any other train key (lr, steps, ... and any key not listed, e.g. one
    added later) changes it."""
    assert C.OPERATIONAL and all(k.startswith("train.") for k in C.OPERATIONAL)
    base = C.from_dict({})
    assert C.from_dict({"train": {"log_every": 3, "checkpoint_every": 7, "stall_timeout_s": 9, "check_every": 0,
                                  "fail_at_step": {"worker": "drafter-0", "step": 2}}}).result_hash == base.result_hash
    for changed in ({"lr": 1e-3}, {"steps": 5}, {"num_anchors": 3}, {"runtime": "threads"}, {"seed_like_new": 1}):
        raw = copy.deepcopy(base.raw)
        raw["train"].update(changed)            # a key the schema does not know yet counts too
        assert C.result_hash(raw) != base.result_hash, changed
    assert C.from_dict({"run_name": "x", "report": {"threshold": -0.2}}).result_hash == base.result_hash


def test_configfile_flags_are_read_from_the_command_line():
    argv = ["-n", "--configfile", "a.yaml", "--cores", "2", "--configfile=b.yaml", "all", "--configfiles", "c", "d"]
    assert C.configfile_flags(argv) == ["a.yaml", "b.yaml", "c", "d"]
    assert C.configfile_flags(["results/x", "--configfile", "a.yaml"]) == ["a.yaml"]


def test_schema_file_is_generated_from_the_models(repo):
    """workflow/schemas/config.schema.yaml is what `python -m dflash schema --write` makes of dflash/config_model.py;
    it reads back as the models' schema, and its defaults are the typed config's defaults."""
    assert (repo / "workflow" / "schemas" / "config.schema.yaml").read_text() == C.schema_text(), \
        "run `python -m dflash schema --write`"
    schema = yaml.safe_load(C.schema_text())
    assert schema == C.json_schema()
    train = schema["properties"]["train"]["properties"]
    assert train["steps"] == {"type": "integer", "minimum": 1, "default": 120, "description": "Optimizer steps.",
                              "reruns": ["train"], "hashed": "result"}          # its role, for readers
    assert train["log_every"]["reruns"] == [] and train["log_every"]["hashed"] == "run"
    assert train["gamma"]["type"] == ["number", "null"] and "$ref" not in json.dumps(schema)
    assert schema["properties"]["drafter"]["properties"]["num_layers"]["default"] == \
        C.from_dict({}).cfg.drafter.num_layers == 2


def test_snakemake_validate_takes_the_generated_schema(repo):
    """Snakemake's validate() reads the generated file as a schema: it passes a resolved config, refuses a bad one."""
    from snakemake.exceptions import WorkflowError
    from snakemake.utils import validate
    path = str(repo / "workflow" / "schemas" / "config.schema.yaml")
    validate(C.from_dict({"train": {"steps": 3}}).raw, path, set_default=False)
    with pytest.raises(WorkflowError):
        validate({"train": {"stepz": 3}}, path, set_default=False)


def test_hashes_of_todays_configs_unchanged(repo):
    """The config and result hashes of the shipped configs and of a config with integers in number keys are pinned.
    The typed models reproduced the schema-built config's hashes of commit 311df5a exactly (checked when they came in);
    a key added since with a default changes every hash by design (the resolved config holds it), so the pins are
    updated in the commit that adds one (data.regenerate.cpu_batch_size, train.eval_*, train.precision and fp8_*,
    data.regenerate.attention and compile_prefill, data.code_completion.files and per_file). The keys' roles (issue 41)
    took data.num_proc, data.shards and data.regenerate.timeout_s, retries and backoff_s out of both hashes (they change
    how fast the data stage runs, never the dataset: issue 40 rule 5), and drafter.num_target_layers defaults to null
    (as many as target_layer_ids lists, else 5); the hashes reproduced the earlier ones without those keys exactly.
    train.rendezvous.node_rank, never read, was removed: the config hashes changed, the result hashes did not.
    config/quality.yaml took train.loss_weighting dpace (issue 39): its hashes changed. Issue 47 took the keys of
    switched-off features (each key's `When`: code_completion.* with that source off, muon_lr with AdamW, the other
    engine's regeneration keys, ...) and dataset_name out of both hashes, and spells paths one way, and added
    train.keep_runs (operational: the config hashes only): every pin changed
    (on eb0a841: config.yaml 0167efcd7b22eea4 / 08111ef1191481ae, h200.yaml 7ffc7d3c3af0f26b / ef55569b45be0b66, 8gpu.yaml
    6dc63caa0a4c700d / ffdbd87e9f5b171a, quality.yaml c09f45c19716ee94 / c420025dec8fa74f, inline 334fcddb7d082029 /
    64c64f4dac94bb62). Issue 48 made train.loss_weighting dpace the default (train.gamma then out, dpace_alpha in):
    the configs that do not set it changed (on b637148: config.yaml 5d0d8b3d10a18b70 / 6e458efa167a8114, 8gpu.yaml
    4a4b0c935241431e / 304bf9a9a6094000, inline 5ad4de83d5430705 / 0424a02cda2230b6); quality.yaml dropped its
    `dpace` line and h200.yaml says `decay`, so theirs did not (the `sweep` section is in no hash).
    Issue 49 added target.arch.family (and its num_experts, experts_per_token, sliding_window) and
    train.target_split (operational: the config hashes only): every pin changed again (after issue 48 alone: config.yaml
    9991b7cfa553632c / 9d1b30fb55ed9649, h200.yaml b359bf380a590ca9 / e541cb3404d3714e, 8gpu.yaml 22435069ff1d9856 /
    ddc63b05d9b376c2, quality.yaml 06f84878937117bd / 71ca52a0125abe83, inline 01d9ae0efa9d97bd / 5a5de1b41bd6701e)."""
    pins = {"config.yaml": ("f8b51d0dd8ec7479", "e353d11c980e9e37"),
            "h200.yaml": ("77dd16c62b480849", "1979160b9e61ac6e"),
            "8gpu.yaml": ("408c2dc54fdc1922", "569690937a256357"),
            "quality.yaml": ("f8e036d2ce5d757f", "82648bef516c3fbd")}
    for name, (h, rh) in pins.items():
        loaded = C.load(repo / "config" / name)
        assert (loaded.hash, loaded.result_hash) == (h, rh), name
    inline = C.from_dict({"train": {"steps": 5, "lr": 1, "time_budget_s": 600, "targets": ["cpu"], "betas": [0, 0.95]},
                          "data": {"sources": [{"name": "x", "path": "a.jsonl", "weight": 2}],
                                   "regenerate": {"timeout_s": 30}},
                          "report": {"min_utilisation": 50}, "drafter": {"target_layer_ids": [0, 2]}})
    assert (inline.hash, inline.result_hash) == ("1766a8dd885d3a4d", "428f73db9c15db08")
    assert json.dumps(inline.raw["train"]["betas"]) == "[0, 0.95]" and inline.cfg.train.betas == (0, 0.95)
    assert type(inline.cfg.train.time_budget_s) is int and type(inline.cfg.train.stall_timeout_s) is int   # as written
    assert type(C.from_dict({"train": {"lr": 0.001}}).cfg.train.lr) is float


def test_gpu_configs_write_the_qwen3_8b_target_once(repo):
    """The GPU configs share config/h200.yaml's random Qwen3-8B-shaped target and drafter through `base:` (directly or
    through another) and keep only their differences: the target's `arch` is written in one file (issue 50)."""
    gpu = ("h200.yaml", "h200-long.yaml", "h200-32k.yaml", "2gpu.yaml", "seed-2gpu.yaml", "8gpu.yaml", "seed-8gpu.yaml")
    written = [n for n in gpu if "arch" in (yaml.safe_load((repo / "config" / n).read_text()).get("target") or {})]
    assert written == ["h200.yaml"], written
    arch = C.load(repo / "config" / "h200.yaml").raw["target"]["arch"]
    assert all(C.load(repo / "config" / n).raw["target"]["arch"] == arch for n in gpu)


def test_typed_config_is_frozen_and_refuses_what_the_schema_refuses(tmp_path):
    cfg = C.from_dict({}).cfg
    with pytest.raises(Exception, match="frozen"):
        cfg.train.steps = 3
    for data, message in (
            ({"train": {"drafters": [0]}}, r"key 'train\.drafters\.0' must be string, got int 0"),
            ({"train": {"steps": 0}}, r"key 'train\.steps': Input should be greater than or equal to 1, got 0"),
            ({"train": {"steps": "5"}}, r"key 'train\.steps' must be integer, got str '5'"),
            ({"train": {"profile": 3}}, r"key 'train\.profile' must be \['object', 'null'\], got int 3"),
            ({"train": {"profile": {"stepz": 1}}}, r"unknown key 'train\.profile\.stepz' \(allowed here: out, "),
            ({"drafter": {"layer_types": ["full"]}},
             r"key 'drafter\.layer_types\.0': Input should be 'full_attention'"),
            ({"data": {"sources": [{"name": "x"}]}}, r"key 'data\.sources\.0\.path': Field required$"),
            ({"strict_env": 1}, r"key 'strict_env' must be boolean, got int 1"),
            ({"train": 5}, r"key 'train' must be object, got int 5")):
        with pytest.raises(C.ConfigError, match=message):
            C.from_dict(data, str(tmp_path / "c.yaml"))


def test_schema_command_writes_and_checks(tmp_path, repo, monkeypatch):
    from dflash import cli
    monkeypatch.setattr(C, "SCHEMA_PATH", tmp_path / "schema.yaml")
    assert cli.main(["schema", "--check"]) == 1
    assert cli.main(["schema", "--write"]) == 0 and (tmp_path / "schema.yaml").read_text() == C.schema_text()
    assert cli.main(["schema", "--check"]) == 0


def test_a_config_names_a_base_and_keeps_only_its_differences(tmp_path, repo):
    """`base: FILE` (relative to the naming file's folder, bases of bases too): the merged keys are the config, hashed
    as if written out in full; mappings merge key by key, lists and values replace. A missing base, a circle of bases
    and a base that is not a mapping are one line naming the file."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "h200.yaml").write_text((repo / "config" / "h200.yaml").read_text())
    long = write(tmp_path, {"base": "gpu/h200.yaml", "run_name": "long", "data": {"bucket_edges": [4096],
                                                                                "max_length": 4096}})
    loaded = C.load(long)
    full = C.load(repo / "config" / "h200.yaml", {"run_name": "long", "data.bucket_edges": [4096],
                                                  "data.max_length": 4096})
    assert loaded.raw == full.raw and loaded.hash == full.hash and "base" not in loaded.raw
    assert loaded.cfg.data.regenerate == full.cfg.data.regenerate                    # merged, not replaced
    (tmp_path / "longer.yaml").write_text("base: c.yaml\ntrain: {steps: 7}\n")
    assert C.load(tmp_path / "longer.yaml").raw == C.load(long, {"train.steps": 7}).raw
    assert C.for_workflow(tmp_path / "longer.yaml", {})[0].raw == C.load(tmp_path / "longer.yaml").raw
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(C.ConfigError, match=r"b\.yaml: base a\.yaml names a config that names this one"):
        C.load(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml: base nope\.yaml: no such config file"):
        C.load(tmp_path / "c.yaml")
    (tmp_path / "c.yaml").write_text("base: [x]\n")
    with pytest.raises(C.ConfigError, match=r"c\.yaml: key 'base' must be the path of a config file"):
        C.load(tmp_path / "c.yaml")
