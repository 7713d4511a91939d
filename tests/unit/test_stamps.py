"""Issue 47 items 1-2, in process: which keys name input files (dflash.inputs), what a content record sees
(dflash.content) and when a key stamp moves (dflash.stamps). The workflow's use of them: tests/e2e/test_workflow.py."""
import json
import os

import pytest

from dflash import config as C
from dflash import inputs, stamps
from dflash.config_model import DflashConfig, Reads
from dflash.content import Digests, record

# Every string-valued key that is not an input file, and what it is instead: a new key that names a file must be marked
# `Reads` (dflash/config_model.py) or listed here, so that the workflow's inputs are derived, never forgotten.
NOT_INPUTS = {
    "run_name": "a name", "dataset_name": "a name", "results_dir": "the outputs' folder", "data.sources.name": "a name",
    "data.sources.split": "a hub split", "data.regenerate.servers": "URLs", "data.regenerate.model": "a served name",
    "target.pretrain.device": "a device", "data.regenerate.device": "a device", "train.targets": "devices",
    "train.drafters": "devices", "evaluate.device": "a device", "train.fail_at_step": "a test hook",
    "train.diverge_at_step": "a test hook", "train.profile.out": "an output in the run folder",
    "train.rendezvous.endpoint": "host:port", "train.rendezvous.id": "a name", "report.baseline_run": "a run id",
    "sweep.only": "run names", "sweep.baseline": "a run name",
}


def test_every_key_that_names_a_file_is_an_input_or_said_not_to_be():
    strings = {key for key, field, sub in C._fields(DflashConfig)
               if sub is None and "str" in repr(field.annotation) and "Literal" not in repr(field.annotation)}
    marked = {key for key, field, sub in C._fields(DflashConfig) if any(isinstance(m, Reads) for m in field.metadata)}
    assert marked == {"target.path", "data.sources.path", "drafter.init_from", "evaluate.prompt_files", "sweep.runs"}
    assert strings - marked == set(NOT_INPUTS)


def test_the_inputs_a_config_names_follow_their_switches():
    """target.path is an input only with build none (else the target rule's output); a hub source is no file; synthetic
    data reads no source; each list item is named with its index."""
    cfg = C.from_dict({"target": {"build": "none", "path": "/m"}, "drafter": {"init_from": "d"},
                       "evaluate": {"prompt_files": ["a.jsonl", "b.jsonl"]},
                       "data": {"sources": [{"name": "x", "path": "x.jsonl"},
                                            {"name": "h", "path": "org/set", "kind": "hub"}]}}).cfg
    assert [(n.key, n.path) for n in inputs.named(cfg)] == [
        ("target.path", "/m"), ("data.sources[0].path", "x.jsonl"), ("drafter.init_from", "d"),
        ("evaluate.prompt_files[0]", "a.jsonl"), ("evaluate.prompt_files[1]", "b.jsonl")]
    assert [n.key for n in inputs.named(cfg, "train")] == ["target.path", "drafter.init_from"]
    assert [n.key for n in inputs.named(cfg, "evaluate")] == ["target.path", "evaluate.prompt_files[0]",
                                                              "evaluate.prompt_files[1]"]
    built = C.from_dict({"data": {"sources": [{"name": "x", "path": "x.jsonl"}], "synthetic": {"enabled": True}}}).cfg
    assert inputs.named(built) == []


def test_a_missing_input_is_named_with_the_closest_existing_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "prompts.jsonl").write_text("{}\n")
    cfg = C.from_dict({"evaluate": {"prompt_files": ["config/prompts.jsonl", "config/my-prompts.jsonl"]}}).cfg
    with pytest.raises(C.ConfigError) as e:
        inputs.check(cfg, "c.yaml")
    assert str(e.value) == ("c.yaml: evaluate.prompt_files[1] names config/my-prompts.jsonl, which does not exist; the "
                            "closest existing name is config/prompts.jsonl")
    assert inputs.closest("confg/prompts.jsonl") == "config"          # the first missing part, in its folder
    assert inputs.closest("config/zzzzzz") is None
    inputs.check(C.from_dict({"evaluate": {"prompt_files": ["config/prompts.jsonl"]}}).cfg, "c.yaml")


def test_a_content_record_sees_an_edit_in_place_and_nothing_else(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    digests = Digests(tmp_path / "digests.json")
    first = record(folder, digests)
    assert first == {"files": {"config.json": [2, first["files"]["config.json"][1]],
                               "model.safetensors": [7, first["files"]["model.safetensors"][1]]}}
    os.utime(folder / "model.safetensors")                              # touched: the same bytes
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("hidden")                     # a hidden file: no loader reads it
    assert record(folder, digests) == first
    st = (folder / "model.safetensors").stat()
    (folder / "model.safetensors").write_bytes(b"weighTs")               # same size, mtime set back: the ctime moves
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert record(folder, digests) != first
    digests.save()
    assert len(json.loads((tmp_path / "digests.json").read_text())) == 2
    assert record(tmp_path / "gone", digests) == {"missing": True}


def test_a_stamp_moves_only_when_what_it_holds_changes(tmp_path, monkeypatch):
    """Rewritten (mtime moved) on a changed key of its rule or a changed file the config names for it; untouched by
    any other key, by a touch, by a dry run (its stamp goes to stamps/plan/) and by a job reading the workflow."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')

    def stamp(mode="run", **over):
        raw = {"evaluate": {"prompt_files": ["p.jsonl"]}, **over}
        loaded = C.from_dict(raw)
        return stamps.Stamps("res", loaded.cfg, loaded.raw, mode).path("evaluate", "demo")

    path = stamp()
    assert path == "res/stamps/evaluate/demo.json"
    os.utime(path, ns=(1, 10**9))
    assert stamp() == path and os.stat(path).st_mtime_ns == 10**9
    assert stamp(train={"lr": 0.1}) == path and os.stat(path).st_mtime_ns == 10**9    # not an evaluate key
    os.utime("p.jsonl")
    assert stamp() == path and os.stat(path).st_mtime_ns == 10**9
    held = json.loads(open(path).read())
    assert held["config"]["evaluate"]["prompt_files"] == ["p.jsonl"] and held["inputs"]["evaluate.prompt_files[0]"]
    other = {"num_prompts": 3, "prompt_files": ["p.jsonl"]}
    assert stamp("plan", evaluate=other) == "res/stamps/plan/evaluate/demo.json"
    assert stamp("read", evaluate=other) == path
    assert os.stat(path).st_mtime_ns == 10**9
    (tmp_path / "p.jsonl").write_text('{"prompt": "b"}\n')
    assert stamp() == path and os.stat(path).st_mtime_ns > 10**9


def test_the_stamp_mode_follows_the_command_line():
    from snakemake.cli import parse_args
    mode = lambda *argv: stamps.mode_of(parse_args(list(argv))[1])  # noqa: E731
    assert mode("--cores", "1") == mode("--touch", "--cores", "1") == mode("-R", "train") == "run"
    assert mode("-n") == mode("--summary") == mode("-D") == mode("--list-changes", "params") == "plan"
    assert mode("--lint") == mode("--list-rules") == "read"
    assert stamps.mode_of(None) == "run" and stamps.mode_of(None, remote=True) == "read"
