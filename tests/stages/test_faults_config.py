"""Issue 40 rules 5 and 6, issue 41 item 1: every config key declares its role on itself (what its change reruns, which
hash holds it), and what derives from the roles; a key that cannot change the result is out of the result hash; a bad
value (impossible, contradicting another, a path-like name, hardware the machine lacks) is refused when the config is
read, in one line naming the key and the file. The Snakemake side (`snakemake -n` refusing them) is in
tests/test_workflow.py."""
import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import Field

from support.data import good_rows, make_loaded, write_jsonl
from dflash import config as C
from dflash import config_model as M

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path, data, name="c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def refused(tmp_path, data, *named) -> str:
    """Loading `data` from a file is refused in one line that starts with the file and names each of `named`."""
    p = write(tmp_path, data)
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{p}: "), msg
    for part in named:
        assert part in msg, (part, msg)
    return msg


# ---- issue 41 item 1: each key's role, declared on its field -------------------------------------------------
def test_every_key_declares_exactly_one_role():
    """A leaf field without a Role (or with two) fails; a section carries none (its keys do). Every leaf of the
    config is in roles(), and the roles name only rules of the workflow."""
    keys = C.roles()
    leaves = [k for k, _, sub in C._fields(M.DflashConfig) if sub is None]
    assert sorted(keys) == sorted(leaves) and len(keys) > 150
    rules = {"env", "target", "data", "warmup", "train", "evaluate", "export", "report", "gate"}
    assert all(set(r.reruns) <= rules and r.hashed in ("result", "run", None) for r in keys.values())

    class Untagged(M.Section):
        tagged: typing.Annotated[int, M.TRAIN] = Field(1, description="has a role")
        new_key: int = Field(1, description="forgot its role")
    with pytest.raises(TypeError, match="config key new_key declares 0 roles"):
        C.roles(Untagged)

    class Twice(M.Section):
        twice: typing.Annotated[int, M.TRAIN, M.DATA] = Field(1, description="two roles")
    with pytest.raises(TypeError, match="config key twice declares 2 roles"):
        C.roles(Twice)


def test_hash_lists_and_rule_triggers_derive_from_the_roles(repo):
    """OPERATIONAL and UNHASHED are the roles' (no hand list left in the package or the workflow); each rule's rerun
    trigger holds exactly the keys whose role names it: train.lr reruns train, not the warm-up; train.num_anchors
    both; data.num_proc nothing; drafter.block_size the data stage too."""
    assert set(C.OPERATIONAL) == {k for k, r in C.roles().items() if r.hashed == "run"}
    assert {"train.log_every", "train.eval_every", "train.rendezvous.nnodes", "train.profile.out"} <= set(C.OPERATIONAL)
    assert set(C.UNHASHED) == {"run_name", "dataset_name", "results_dir", "strict_env", "evaluate", "report", "sweep"}
    raw = C.from_dict({}).raw
    trig = {rule: json.loads(C.trigger(raw, rule)) for rule in ("target", "data", "warmup", "train", "evaluate",
                                                                 "export", "report", "gate")}
    assert "lr" in trig["train"]["train"] and "lr" not in trig["warmup"]["train"]
    assert "num_anchors" in trig["warmup"]["train"] and "num_anchors" in trig["train"]["train"]
    assert "num_proc" not in trig["data"]["data"] and "max_length" in trig["data"]["data"]
    assert trig["data"]["drafter"] == {"block_size": 16} and "seed" in trig["data"]
    assert trig["target"]["data"] == {"builtin_corpus": {"max_conversations": 1500}}
    assert set(trig["report"]) == set(trig["gate"]) == {"report"} and set(trig["evaluate"]) >= {"evaluate", "drafter"}
    assert "log_every" not in trig["train"]["train"]                        # an operational key reruns nothing
    smk = "".join(p.read_text() for p in sorted((repo / "workflow" / "rules").glob("*.smk")))
    for gone in ("TRAIN_ONLY", "section(", '.get("'):
        assert gone not in smk, gone
    assert "OPERATIONAL = (" not in (repo / "dflash" / "config.py").read_text()


# keys whose other value needs another key with it (each change still of one role)
_WITH = {"data.regenerate.engine": {"data.regenerate.servers": ["http://127.0.0.1:8000/v1"]}}
# a key whose other values need another key in the base config too (two target devices to split a worker over)
_BASE = {"train.target_split": {"train.targets": ["cpu", "cpu"]}}


def _other_values(key: str, value) -> list:
    """Valid-looking values of `key` other than `value`, by its type (the first the models take is used)."""
    node = C.json_schema()
    for part in key.split("."):
        node = node["properties"][part] if "properties" in node else node["items"]["properties"][part]
    if "enum" in node:
        out = list(node["enum"])
    elif isinstance(value, bool):
        out = [not value]
    elif isinstance(value, int):
        out = [value + 1, value + 2, value - 1]
    elif isinstance(value, float):
        out = [value / 2 if value else 0.5, value - 0.05, value + 0.5]
    elif isinstance(value, str):
        out = ["other", "cuda:1", "cpu", "host:29500"]
    elif isinstance(value, (list, tuple)):
        out = [list(value) + list(value[:1]), list(value) + [max(value or [1]) * 2], [0.8, 0.9],
               ["http://127.0.0.1:8000/v1"]]
    else:                                                       # null: a value of the key's type
        out = [128, 64, 8, 1, 0.5, "other", True, [0, 1], ["full_attention", "full_attention"],
               {"worker": "drafter-0", "step": 2}]
    same = list(value) if isinstance(value, (list, tuple)) else value
    return [v for v in out if v != same]


# a switch's value that needs another key with it
_SWITCH_WITH = {("data.regenerate.engine", "openai"): {"data.regenerate.servers": ["http://127.0.0.1:8000/v1"]}}


def _read_by(key: str) -> dict:
    """The switch values under which `key` is read (the first case of each `When` of it and of its sections, and those
    of the switches in turn): {} for a key no switch gates."""
    out, parts = {}, key.split(".")
    for k in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
        for w in C.gates().get(k, ()):
            switch, values = w.cases[0]
            out = {**out, **_read_by(switch), switch: values[0], **_SWITCH_WITH.get((switch, values[0]), {})}
    return out


def _changed(key: str):
    """The default config (a null section of `key` given, e.g. train.profile; its switches set so that it is read),
    and the same with `key` changed to another valid value."""
    parent = key.rpartition(".")[0]
    base = C.from_dict(C.set_dotted(C.set_dotted({}, {parent: {}}) if parent and "." in parent else {},
                                    {**_read_by(key), **_BASE.get(key, {})}))
    value = base.raw
    for part in key.split("."):
        value = value[part]
    for other in _other_values(key, value):
        try:
            raw = C.set_dotted(json.loads(json.dumps(base.raw)), {key: other, **_WITH.get(key, {})})
            return base, C.from_dict(raw)
        except C.ConfigError:
            continue
    raise AssertionError(f"no other valid value found for {key}")


OUT_OF_RESULT = sorted(k for k, r in C.roles().items() if r.hashed != "result" and ".sources." not in k)
IN_RESULT = sorted(k for k, r in C.roles().items() if r.hashed == "result" and ".sources." not in k)


@pytest.mark.parametrize("key", OUT_OF_RESULT)
def test_a_key_that_cannot_change_the_result_is_out_of_the_result_hash(key):
    """Rule 5: each key whose role is not "result" is proved out: changing it keeps the result hash (a finished run is
    restored, an interrupted one resumes); one in no hash keeps the config hash too."""
    base, other = _changed(key)
    assert other.result_hash == base.result_hash, key
    if C.roles()[key].hashed is None:
        assert other.hash == base.hash, key


@pytest.mark.parametrize("key", IN_RESULT)
def test_every_other_key_changes_the_result_hash(key):
    """... where it is read: with the switches that gate it set (code_completion.files with that source on)."""
    base, other = _changed(key)
    assert other.result_hash != base.result_hash and other.hash != base.hash, key


GATED = sorted(k for k in C.roles() if not C.is_read(C.from_dict({}).raw, k) and ".sources." not in k)


@pytest.mark.parametrize("key", GATED)
def test_a_key_its_switch_turns_off_is_out_of_every_hash_and_trigger(key):
    """Issue 47 item 3: a key of a switched-off feature (its `When` in dflash/config_model.py: code_completion.files
    with that source off on the demo, train.muon_lr with AdamW, data.regenerate.concurrency with engine hf, ...) changes
    neither hash nor any rule's rerun trigger, derived from the one declaration (`dflash.config.pick`). Each was in the
    result hash on eb0a841 (a finished run trained again)."""
    base = C.from_dict({})
    value = base.raw
    for part in key.split("."):
        value = value[part]
    for other in _other_values(key, value):
        try:
            changed = C.from_dict(C.set_dotted(json.loads(json.dumps(base.raw)), {key: other}))
        except C.ConfigError:
            continue
        assert (changed.hash, changed.result_hash) == (base.hash, base.result_hash), key
        assert all(C.trigger(changed.raw, r) == C.trigger(base.raw, r) for r in ("target", "data", "warmup", "train",
                                                                                  "evaluate", "export")), key
        return
    raise AssertionError(f"no other valid value found for {key}")


def test_the_switches_gate_the_cases_of_issue_47():
    """The examples of the issue are among the keys the defaults switch off, and the gates are declared on the model
    (read_when in the schema), each switch a key: none hand-listed in config.py."""
    assert {"data.code_completion.files", "train.muon_lr", "data.regenerate.concurrency", "train.gamma",
            "data.synthetic.lengths", "target.pretrain.tokenizer_mb"} <= set(GATED)    # gamma: dpace is the default
    assert {"data.regenerate.max_new_tokens", "train.lr", "target.pretrain.steps", "train.dpace_alpha"}.isdisjoint(GATED)
    hf = C.from_dict({"data": {"regenerate": {"enabled": False}}})      # a switch off turns off what it gates
    assert not C.is_read(hf.raw, "data.regenerate.batch_size") and not C.is_read(hf.raw, "data.regenerate.engine")
    muon = C.json_schema()["properties"]["train"]["properties"]["muon_lr"]
    assert muon["read_when"] == 'train.optimizer = "muon"'
    assert "muon_lr" not in (REPO / "dflash" / "config.py").read_text()


@pytest.mark.parametrize("spelling", ["results/target/tiny/", "./results/target/tiny", "results//target/./tiny/"])
def test_a_path_in_another_spelling_is_the_same_config(spelling):
    """Issue 47 item 3: `target.path` with a trailing slash or `./` is the same path: one spelling in the resolved
    config (what the stages and Snakemake read), in both hashes and in every rerun trigger (it retrained a finished run
    and rebuilt its data on eb0a841)."""
    base, other = C.from_dict({}), C.from_dict({"target": {"path": spelling}})
    assert other.cfg.target.path == other.raw["target"]["path"] == "results/target/tiny"
    assert (other.hash, other.result_hash) == (base.hash, base.result_hash)
    assert all(C.trigger(other.raw, r) == C.trigger(base.raw, r) for r in ("target", "data", "train", "evaluate"))
    old = json.loads(json.dumps(base.raw))          # an older run's recorded config, spelled as it was written
    old["target"]["path"] = spelling
    assert C.result_hash(old) == base.result_hash


def test_the_same_data_under_another_dataset_name_is_the_same_run():
    """Issue 47 item 3: a run knows its data by the manifest's content hash (train/checkpoint.py `identity`), not by
    dataset_name, which only names the folder: out of both hashes."""
    base, other = C.from_dict({}), C.from_dict({"dataset_name": "renamed"})
    assert (other.hash, other.result_hash) == (base.hash, base.result_hash)
    assert C.roles()["dataset_name"].hashed is None


def test_data_num_proc_is_out_of_both_hashes_and_the_dataset_is_the_same(tmp_path, tiny_target):  # noqa: F811
    """The case of issue 40: data.num_proc only sets how many processes tokenise. Its content hash is the same, and
    so are the config and result hashes (it trained a finished run again)."""
    from dflash.data.expand import expand
    src = write_jsonl(tmp_path / "a.jsonl", good_rows(12))
    made = {}
    for n in (1, 2):
        loaded = make_loaded(tmp_path / f"p{n}", tiny_target, [{"name": "a", "path": src}], num_proc=n)
        made[n] = (loaded, expand(loaded, tmp_path / f"p{n}" / "out", progress=False, threads=1))
    (one, m1), (two, m2) = made[1], made[2]
    assert m1["content_hash"] == m2["content_hash"] and m1["num_samples"] == m2["num_samples"] > 0
    assert one.result_hash == two.result_hash and one.hash == two.hash
    assert C.from_dict({"data": {"shards": 4}}).result_hash == C.from_dict({}).result_hash


# ---- issue 40 rule 6: every bad value refused up front, one line naming the key and the file --------------------
@pytest.mark.parametrize("data,named", [
    ({"train": {"gamma": 0}}, ["'train.gamma'", "greater than 0"]),                 # was a NaN loss
    ({"train": {"gamma": -7}}, ["'train.gamma'"]),
    ({"train": {"betas": [0.9, 1]}}, ["'train.betas.1'", "less than 1"]),
    ({"seed": -1}, ["'seed'"]),
    ({"train": {"matmul_tflops": 0}}, ["'train.matmul_tflops'"]),
    ({"target": {"arch": {"rope_theta": 0}}}, ["'target.arch.rope_theta'"]),
    ({"data": {"bucket_edges": []}}, ["'data.bucket_edges'"]),
    ({"data": {"synthetic": {"lengths": []}}}, ["'data.synthetic.lengths'"]),
    ({"drafter": {"target_layer_ids": []}}, ["'drafter.target_layer_ids'"]),
    ({"evaluate": {"device": "gpu"}}, ["'evaluate.device' must be a device", "'gpu'"]),
    ({"train": {"drafters": ["cpu", "auto"]}}, ["'train.drafters.1' must be a device"]),
    ({"train": {"profile": {"out": "../../elsewhere.json"}}}, ["'train.profile.out'", "inside the run folder"]),
    ({"target": {"arch": {"num_attention_heads": 4, "num_key_value_heads": 3}}},
     ["target.arch.num_attention_heads (4)", "target.arch.num_key_value_heads (3)"]),
], ids=lambda x: json.dumps(x) if isinstance(x, dict) else "")
def test_an_impossible_value_is_refused_naming_the_key_and_the_file(tmp_path, data, named):
    refused(tmp_path, data, *named)


@pytest.mark.parametrize("data,named", [
    ({"drafter": {"num_target_layers": 3, "target_layer_ids": [0, 1]}},           # was silently ignored
     ["drafter.num_target_layers (3)", "drafter.target_layer_ids [0, 1]"]),
    ({"drafter": {"target_layer_ids": [0, 4]}}, ["drafter.target_layer_ids has id 4", "target.arch.num_hidden_layers"]),
    ({"drafter": {"hidden_size": 64}}, ["drafter.hidden_size (64)", "target.arch.hidden_size (128)"]),
    ({"data": {"max_length": 1024}}, ["data.max_length (1024)", "data.bucket_edges", "(512)"]),
    ({"data": {"bucket_edges": [128, 256, 256, 512]}}, ["data.bucket_edges lists 256 twice"]),
    ({"data": {"sources": [{"name": "a", "path": "x.jsonl"}, {"name": "a", "path": "y.jsonl"}]}},
     ["data.sources: duplicate source name(s) a"]),
    ({"data": {"regenerate": {"engine": "openai"}}}, ["data.regenerate.servers is empty", "engine is openai"]),
    ({"drafter": {"layer_types": ["full_attention"]}}, ["drafter.layer_types has 1 entries", "num_layers 2"]),
    ({"drafter": {"layer_types": ["sliding_attention", "full_attention"]}}, ["drafter.sliding_window is null"]),
    ({"drafter": {"sliding_window": 8, "layer_types": ["full_attention", "full_attention"]}},
     ["drafter.sliding_window (8) is unused"]),
    ({"drafter": {"num_attention_heads": 6, "num_key_value_heads": 4}}, ["drafter.num_attention_heads (6)"]),
    ({"report": {"threshold": -0.3}}, ["report.threshold_cap (-0.25) is narrower than report.threshold (-0.3)"]),
    ({"train": {"fp8_lm_head": True, "loss_kernel": "checkpointed"}}, ["train.fp8_lm_head", "train.loss_kernel"]),
    ({"train": {"eval_every": 5, "fp8_target": True}}, ["train.eval_every with train.fp8_target"]),
], ids=lambda x: json.dumps(x) if isinstance(x, dict) else "")
def test_values_that_contradict_each_other_are_refused(tmp_path, data, named):
    refused(tmp_path, data, *named)


def test_what_agrees_still_loads():
    """The other side of the contradictions: ids with their count or none, a layout with its window, a target used as
    it is (build none: its layers are read from its folder), the shipped configs."""
    d = C.from_dict({"drafter": {"target_layer_ids": [0, 2]}}).cfg.drafter
    assert d.num_target_layers == 2 and C.from_dict({}).cfg.drafter.num_target_layers == M.DEFAULT_CONTEXT_LAYERS
    assert C.from_dict({"drafter": {"num_target_layers": 2, "target_layer_ids": [0, 2]}}).cfg.drafter == d
    C.from_dict({"drafter": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}})
    C.from_dict({"target": {"build": "none"}, "drafter": {"target_layer_ids": [0, 30]}})
    C.from_dict({"data": {"max_length": 512, "bucket_edges": [512, 128]}})
    for name in ("config", "h200", "h200-long", "h200-32k", "quality", "2gpu", "8gpu", "seed-2gpu", "seed-8gpu"):
        C.load(REPO / "config" / f"{name}.yaml")


@pytest.mark.parametrize("key", ["run_name", "dataset_name"])
@pytest.mark.parametrize("name", ["..", ".", ".hidden", "-x", "a/b"])
def test_a_path_like_name_is_refused(tmp_path, key, name):
    """`dataset_name: ..` passed the schema and then tried to rename results/."""
    refused(tmp_path, {key: name}, f"'{key}' must be a folder name", repr(name))


def test_a_path_like_source_name_is_refused(tmp_path):
    refused(tmp_path, {"data": {"sources": [{"name": "..", "path": "a.jsonl"}]}}, "'data.sources.0.name'")


def test_a_target_layer_past_the_targets_is_one_line_naming_the_key():
    """Where the drafter meets the target (every stage builds it there), ids past its layers were a ValueError
    traceback; the default spread over a target too small for it too."""
    from transformers import Qwen3Config

    from dflash.model import DrafterConfig
    target = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, intermediate_size=64)
    with pytest.raises(C.ConfigError, match=r"drafter\.target_layer_ids has id 7, past the 4 layers of the target"):
        DrafterConfig.from_target(target, {"target_layer_ids": [0, 7]}, mask_token_id=1)
    target.num_hidden_layers = 2
    with pytest.raises(C.ConfigError, match=r"drafter\.num_target_layers \(5\) spreads the ids"):
        DrafterConfig.from_target(target, {}, mask_token_id=1)


def test_a_target_folder_with_fewer_layers_is_refused_before_work(tmp_path):
    """build none: the target folder's config.json tells its layers; a config whose ids pass them is refused when it
    is checked against what is on disk (the Snakefile, and a stage for the keys it reads)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 3}))
    loaded = C.load(write(tmp_path, {"target": {"build": "none", "path": str(folder)},
                                     "drafter": {"target_layer_ids": [0, 3]}}))
    for stage in (None, "train", "evaluate", "export", "warmup"):
        with pytest.raises(C.ConfigError, match=rf"c\.yaml: drafter\.target_layer_ids has id 3, past the 3 layers of "
                                                rf"the target {folder}/config\.json"):
            C.check_here(loaded, stage)
    C.check_here(loaded, "report")                                   # a stage that reads no drafter
    C.check_here(C.load(write(tmp_path, {"target": {"build": "none", "path": str(folder)},
                                         "drafter": {"target_layer_ids": [0, 2]}})))


def test_cuda_devices_the_machine_lacks_are_refused_naming_key_and_file(tmp_path, repo, monkeypatch, fake_gpus):
    """config/quality.yaml on a machine without CUDA built the corpus and the tokenizer for minutes, then died in
    "Torch not compiled with CUDA enabled". Each stage is checked for the keys it reads (its devices), the Snakefile
    for all; a device past the GPUs there is refused too; the same config with its devices on the CPU passes."""
    import torch
    fake_gpus(0)
    quality = C.load(repo / "config" / "quality.yaml")
    expect = {None: "target.pretrain.device", "target": "target.pretrain.device", "data": "data.regenerate.device",
              "warmup": "train.targets", "train": "train.targets", "evaluate": "evaluate.device"}
    for stage, key in expect.items():
        with pytest.raises(C.ConfigError) as e:
            C.check_here(quality, stage)
        assert str(e.value).startswith(f"{repo / 'config' / 'quality.yaml'}: {key} names cuda:0 but this machine has "
                                       "no CUDA GPU"), str(e.value)
    for stage in ("export", "report", "gate", "env"):
        C.check_here(quality, stage)
    C.check_here(quality, devices=False)
    on_cpu = {k: ["cpu"] if k.startswith("train.") else "cpu" for k in C.device_keys()}
    C.check_here(C.load(repo / "config" / "quality.yaml", on_cpu))            # what a --cpu dry run writes
    fake_gpus(1)
    C.check_here(quality)
    with pytest.raises(C.ConfigError, match=r"train\.drafters names 1 but this machine has 1 CUDA GPU\(s\)"):
        C.check_here(C.from_dict({"train": {"targets": ["0"], "drafters": ["1"]}}), "train")
    assert torch.cuda.device_count() == 1


def test_the_data_stage_refuses_a_bucket_misfit_at_config_load(tmp_path, repo):
    """data.max_length above the largest bucket edge was refused by the data stage itself, after `snakemake -n`
    passed it; now when the config is read, in one line (exit 2), before any target is loaded."""
    p = write(tmp_path, {"data": {"max_length": 600}, "target": {"build": "none", "path": str(tmp_path / "none")}})
    r = subprocess.run([sys.executable, "-m", "dflash", "data", "--config", str(p), "--out", str(tmp_path / "d")],
                       cwd=repo, capture_output=True, text=True)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert f"{p}: data.max_length (600) exceeds the largest data.bucket_edges entry (512)" in lines[0]


def test_a_misspelt_make_demo_config_is_one_line(repo):
    """`make demo CONFIG=config/qualty.yaml` showed Snakemake's 26-line traceback (after building the venv)."""
    if subprocess.run(["make", "--version"], capture_output=True).returncode != 0:
        pytest.skip("no make")
    # as a user types it: not as a sub-make of `make test` (which would add "Entering directory" lines)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    r = subprocess.run(["make", "-n", "demo", "CONFIG=config/qualty.yaml"], cwd=repo, capture_output=True, text=True,
                       env=env)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode != 0 and len(lines) == 1, r.stdout + r.stderr
    assert "CONFIG=config/qualty.yaml: no such file" in lines[0] and "config/quality.yaml" in lines[0]
    r = subprocess.run(["make", "-n", "demo", "CONFIG=config/quality.yaml"], cwd=repo, capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0 and "--configfile config/quality.yaml" in r.stdout
