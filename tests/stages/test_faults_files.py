"""Issue 40, the files a stage writes or reads (rules 1, 4, 7, 9 and a line of 10), each case on a CPU:
- rule 1: no `--out` replaces a path its stage did not make, and a file a user added to a folder the pipeline made
  is named, never removed;
- rule 4: a target changed after the pipeline built or fingerprinted it is named before it is used;
- rule 7: a torn, truncated, unwritable file, or a folder where a file belongs (or the reverse), is one line naming
  the path and what to do;
- rule 9: what the pipeline writes has the modes the umask gives (safetensors alone writes 0600);
- rule 10: CPU regeneration claims no GPU."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from support.data import small_data_config, target_section
from support.runs import evaluable_run
from dflash import config as C
from dflash.cli import main
from dflash.errors import UserError

pytestmark = pytest.mark.usefixtures("one_thread")


def only_line(capsys) -> str:
    """The one error line a stage printed (no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1, err
    return lines[0]


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy_target(src, dst, keep_record=True) -> Path:
    shutil.copytree(src, dst)             # copy2: the files keep their mtimes
    if not keep_record:
        (dst / "build.json").unlink()     # a model folder of the user's own
    return dst


def flip_byte(path: Path, at: int = -5) -> None:
    """Change one byte, keeping the file's size and mtime (what a size+mtime check alone misses)."""
    st = path.stat()
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def data_cfg(tmp_path, tiny_target):  # noqa: F811
    """A config file: the tiny target, one small source, no regeneration."""
    return small_data_config(tmp_path, tiny_target)


@pytest.fixture
def run(tmp_path, tiny_target):  # noqa: F811
    """A run folder as train leaves it (a checkpoint of a random one-layer drafter, summary.json naming it), a dataset
    folder with a hand-made holdout, and the config file."""
    cfg_file, run_dir, _ = evaluable_run(tmp_path, tiny_target, ["What does os.path.join do?", "Explain list.sort."],
                                         (10,), {"num_prompts": 2, "max_new_tokens": 6})
    return cfg_file, run_dir


# ---- rule 1: never replace or delete what this project did not make ---------------------------------------------

def test_data_out_at_a_folder_it_did_not_make_is_refused_and_left_as_it_was(tmp_path, data_cfg, capsys):
    """`data --out results` replaced the whole results folder with one dataset (and `--out .` would the repository):
    a folder without the stage's manifest.json is refused, naming it, before any work."""
    results = tmp_path / "results"
    (results / "runs" / "t").mkdir(parents=True)
    (results / "runs" / "t" / "summary.json").write_text("{}")
    (results / "notes.md").write_text("mine")
    before = snapshot(results)
    assert main(["data", "--config", str(data_cfg), "--no-progress", "--out", str(results)]) == 1
    line = only_line(capsys)
    assert f"{results}: exists and was not made by this pipeline (no manifest.json in it)" in line, line
    assert snapshot(results) == before
    # a file where the folder goes is refused too (it was renamed away and deleted)
    (results / "data").mkdir()
    (results / "data" / "default").write_text("a file of mine")
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 1
    assert f"{results / 'data' / 'default'}: a file, where a folder is to be written" in only_line(capsys)
    assert (results / "data" / "default").read_text() == "a file of mine"


def test_a_file_added_to_the_dataset_folder_is_named_and_kept(tmp_path, data_cfg, capsys):
    """Train names a stray file in the dataset folder and says to rerun the data stage; that rerun deleted the file
    without a word. Now the rerun refuses and names it; the dataset folder as Snakemake leaves it before a rerun (its
    declared outputs manifest.json and holdout.jsonl removed) is still the stage's own."""
    from dflash.data.shards import MANIFEST, verify_dataset
    out = tmp_path / "results" / "data" / "default"
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 0
    m = verify_dataset(out)
    before = snapshot(out)
    (out / "notes.txt").write_text("my notes")
    (out / "train" / "mine.json").write_text("{}")
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 1
    line = only_line(capsys)
    assert f"{out}: notes.txt, train/mine.json in it were not written by the stage" in line, line
    assert "move them out of the folder" in line
    assert snapshot(out) == {**before, "notes.txt": b"my notes", "train/mine.json": b"{}"}
    (out / "train" / "mine.json").unlink()
    (out / MANIFEST).unlink()                                  # what Snakemake removes before the job
    (out / "holdout.jsonl").unlink()
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 1     # notes.txt is still named
    assert "notes.txt in it was not written by the stage" in only_line(capsys)
    (out / "notes.txt").unlink()
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 0
    assert verify_dataset(out)["content_hash"] == m["content_hash"]


def test_a_data_part_folder_keeps_what_it_did_not_write(tmp_path, data_cfg, capsys):
    part = tmp_path / "results" / "data" / "default.parts" / "p0"
    args = ["data", "--config", str(data_cfg), "--no-progress", "--shard", "0/2", "--out", str(part)]
    assert main(args) == 0
    (part / "samples" / "extra.arrow").write_bytes(b"mine")
    assert main(args) == 1
    assert "samples/extra.arrow in it was not written by the stage" in only_line(capsys)
    assert (part / "samples" / "extra.arrow").read_bytes() == b"mine"


def test_export_out_at_a_folder_or_file_it_did_not_make_is_refused(tmp_path, run, capsys):
    """`export --out DIR` replaced DIR wholesale: here a drafter downloaded by the user (config.json and
    model.safetensors, as ours) and a file."""
    cfg_file, run_dir = run
    theirs = tmp_path / "z-lab-drafter"
    theirs.mkdir()
    (theirs / "config.json").write_text('{"dflash_config": {}}')
    (theirs / "model.safetensors").write_bytes(b"weights")
    before = snapshot(theirs)
    assert main(["export", "--config", str(cfg_file), "--out", str(theirs)]) == 1
    line = only_line(capsys)
    assert f"{theirs}: exists and was not made by this pipeline (no export.json in it)" in line, line
    assert snapshot(theirs) == before
    afile = tmp_path / "drafter.txt"
    afile.write_text("mine")
    assert main(["export", "--config", str(cfg_file), "--out", str(afile)]) == 1
    assert f"{afile}: a file, where a folder is to be written" in only_line(capsys)
    assert afile.read_text() == "mine"


def test_a_file_added_to_the_export_folder_is_named_and_kept(run, capsys):
    cfg_file, run_dir = run
    assert main(["export", "--config", str(cfg_file)]) == 0
    out = run_dir / "drafter"
    assert main(["export", "--config", str(cfg_file)]) == 0             # the stage's own folder: replaced
    (out / "generation_config.json").write_text("{}")
    assert main(["export", "--config", str(cfg_file)]) == 1
    line = only_line(capsys)
    assert f"{out}: generation_config.json in it was not written by the stage that made it" in line, line
    assert (out / "generation_config.json").read_text() == "{}"
    record = json.loads((out / "export.json").read_text())             # the stage's record: what it wrote
    assert sorted(record["files"]) == ["README.md", "config.json", "model.safetensors"]


def test_a_file_added_to_a_built_target_is_named_and_kept(tmp_path, capsys):
    """The target folder the stage built: a rerun (`-R target`, or `target --out`) removed a file the user put there.
    The stage refuses and names it, and so does the check the Snakefile runs before Snakemake removes the folder."""
    from dflash.stages.target import check_out
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"results_dir": str(tmp_path), "target": target_section(tmp_path / "t", "random"),
                                   "data": {"builtin_corpus": {"max_conversations": 60}}}))
    assert main(["target", "--config", str(cfg), "--no-progress"]) == 0
    (tmp_path / "t" / ".snakemake_timestamp").write_text("")               # what Snakemake adds to a directory()
    assert main(["target", "--config", str(cfg), "--no-progress"]) == 0     # its own folder: rebuilt
    (tmp_path / "t" / "NOTES.md").write_text("mine")
    assert main(["target", "--config", str(cfg), "--no-progress"]) == 1
    assert "NOTES.md in it was not written by the stage that made it" in only_line(capsys)
    assert (tmp_path / "t" / "NOTES.md").read_text() == "mine"
    with pytest.raises(UserError, match="target.path: .*NOTES.md in it was not written"):
        check_out(tmp_path / "t", tmp_path)
    build = json.loads((tmp_path / "t" / "build.json").read_text())     # build.json lists what the build wrote
    assert "config.json" in build["files"] and "tokenizer.json" in build["files"] and "NOTES.md" not in build["files"]


def test_evaluate_and_warmup_out_at_a_file_they_did_not_write_are_refused(tmp_path, run, capsys):
    """`evaluate --out` / `warmup --out` at a user's file replaced it (after minutes of work): refused first."""
    cfg_file, run_dir = run
    mine = tmp_path / "mine.yaml"
    mine.write_text("keep: me\n")
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress", "--out", str(mine)]) == 1
    assert f"{mine}: exists and was not written by the evaluate stage" in only_line(capsys)
    assert main(["warmup", "--config", str(cfg_file), "--device", "cpu", "--out", str(mine)]) == 1
    assert f"{mine}: exists and was not written by the warmup stage" in only_line(capsys)
    assert mine.read_text() == "keep: me\n"


# ---- rule 4: trust nothing checkable, the target included --------------------------------------------------------

def test_a_built_target_changed_after_its_build_is_named_before_use(tmp_path, tiny_target):  # noqa: F811
    """One byte of model.safetensors changed (same size, same mtime): the target loaded silently and a drafter was
    trained on, evaluated with and reported against another model. Now every load names the file, in one line."""
    from dflash.target import load_target, load_tokenizer
    path = copy_target(tiny_target, tmp_path / "t")
    cfg = C.from_dict({"target": target_section(path)}).cfg.target
    load_target(cfg)                                             # intact: loads
    flip_byte(path / "model.safetensors")
    for load in (load_target, load_tokenizer):
        with pytest.raises(UserError, match=r"model.safetensors: its content differs from the one recorded \(sha256\), "
                                            r"since the target stage built .*rerun the target stage"):
            load(cfg)
    # build none: the folder is the user's input, used as it is
    load_tokenizer(C.from_dict({"target": target_section(path, "none")}).cfg.target)
    # a copy with new mtimes is the same model; a README beside it loads; a weight file added does not
    fresh = tmp_path / "copy"
    shutil.copytree(tiny_target, fresh, copy_function=shutil.copyfile)
    cfg = C.from_dict({"target": target_section(fresh)}).cfg.target
    (fresh / "README.md").write_text("notes")
    load_target(cfg)
    (fresh / "extra.safetensors").write_bytes((fresh / "model.safetensors").read_bytes())
    with pytest.raises(UserError, match=r"extra.safetensors: added, since the target stage built"):
        load_tokenizer(cfg)
    (fresh / "extra.safetensors").unlink()
    (fresh / "tokenizer.json").unlink()
    with pytest.raises(UserError, match=r"tokenizer.json: missing, since the target stage built"):
        load_tokenizer(cfg)


def test_train_refuses_a_target_changed_after_its_build(tmp_path, tiny_target):  # noqa: F811
    """Train reads the target through load_tokenizer / load_target: it stops before a drafter is trained."""
    from dflash.train.context import prepare
    path = copy_target(tiny_target, tmp_path / "t")
    raw = {"results_dir": str(tmp_path / "results"), "target": target_section(path),
           "drafter": {"block_size": 4, "target_layer_ids": [0, 1]}}
    config = path / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length"', '"model_max_length" '))
    with pytest.raises(UserError, match=r"tokenizer_config.json: \d+ bytes, \d+ when recorded, since the target stage"):
        prepare(C.from_dict(raw), need_data=False)


def fingerprint(folder: Path) -> dict:
    """What dflash.target.target_files records, computed here: every file's size, mtime and sha256."""
    import hashlib
    return {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns,
                                               "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_evaluate_refuses_a_target_changed_since_training(tmp_path, run, capsys):
    """A target the user points at (build none) is fingerprinted where a drafter is trained on it (summary.json's
    target_files); evaluate measured tau with whatever the folder held by then."""
    cfg_file, run_dir = run
    raw = yaml.safe_load(cfg_file.read_text())
    theirs = copy_target(raw["target"]["path"], tmp_path / "theirs", keep_record=False)
    raw["target"] = {"path": str(theirs), "build": "none"}
    cfg_file.write_text(yaml.safe_dump(raw))
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "target_files": fingerprint(theirs)}))
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 0
    flip_byte(theirs / "model.safetensors")
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 1
    line = only_line(capsys)
    assert f"{theirs / 'model.safetensors'}: its content differs" in line and "since the run was trained on it" in line
    acc = json.loads((run_dir / "acceptance.json").read_text())   # the first one: it records the target it measured
    assert acc["target_files"] == json.loads((run_dir / "summary.json").read_text())["target_files"]


# ---- rule 7: every I/O failure is one line naming the path and what to do ----------------------------------------

def test_a_truncated_target_weight_file_is_named(tmp_path, tiny_target):  # noqa: F811
    """A cut model.safetensors gave safetensors' 'incomplete metadata, file not fully covered', naming no file."""
    from dflash.target import load_target
    for build, record in (("none", False), ("tiny", True)):
        path = copy_target(tiny_target, tmp_path / build, keep_record=record)
        w = path / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
        with pytest.raises(UserError) as e:
            load_target(C.from_dict({"target": target_section(path, build)}).cfg.target)
        msg = str(e.value)
        assert str(w) in msg and "\n" not in msg, msg
        assert ("cut short or damaged; copy it again" in msg) if build == "none" else ("when recorded" in msg), msg


def test_a_folder_where_a_target_file_belongs_is_named(tmp_path, tiny_target):  # noqa: F811
    from dflash.target import load_target
    path = copy_target(tiny_target, tmp_path / "t", keep_record=False)
    (path / "model.safetensors").unlink()
    (path / "model.safetensors").mkdir()
    with pytest.raises(UserError, match=f"{path / 'model.safetensors'}: cannot read it: a folder, where a file is "
                                        "expected"):
        load_target(C.from_dict({"target": target_section(path, "none")}).cfg.target)


def test_a_torn_regeneration_chunk_is_named_set_aside_and_regenerated(tmp_path, talking_target, caplog):  # noqa: F811
    """A cut cache chunk (a copy of the cache stopped half-way) gave a JSONDecodeError naming no file. Now one warning
    names it, it is set aside, its conversations are regenerated, and the dataset is the same."""
    from dflash.data.shards import verify_dataset
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "results_dir": str(tmp_path / "results"), "target": target_section(talking_target),
        "data": {"builtin_corpus": {"max_conversations": 6}, "holdout": 0, "min_supervised_blocks": 1,
                 "max_length": 256, "bucket_edges": [256],
                 "regenerate": {"enabled": True, "max_new_tokens": 6, "chunk_size": 3, "device": "cpu"}},
        "drafter": {"block_size": 4}}))
    assert main(["data", "--config", str(cfg), "--no-progress"]) == 0
    out = tmp_path / "results" / "data" / "default"
    first = verify_dataset(out)
    chunks = sorted((tmp_path / "results" / "data").glob("default.regen/*/chunk-*.jsonl"))
    assert len(chunks) == 2
    chunks[0].write_bytes(chunks[0].read_bytes()[:-20])           # cut inside its last line
    assert main(["data", "--config", str(cfg), "--no-progress"]) == 0
    assert any(f"{chunks[0]}: a torn regeneration cache chunk" in m and "set aside" in m for m in caplog.messages)
    assert chunks[0].with_name(chunks[0].name + ".torn").is_file() and chunks[0].is_file()   # written anew
    again = verify_dataset(out)
    assert again["content_hash"] == first["content_hash"]
    assert again["regeneration"]["cached"] == 3 and again["regeneration"]["conversations"] == 6


def test_evaluate_out_at_a_folder_is_one_line_before_decoding(run, capsys):
    """`evaluate --out DIR` decoded every prompt, then ended in IsADirectoryError."""
    cfg_file, run_dir = run
    folder = run_dir / "eval"
    folder.mkdir()
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress", "--out", str(folder)]) == 1
    line = only_line(capsys)
    assert f"{folder}: a folder, where the evaluate stage writes a file: give the path of a file" in line, line
    assert not any(folder.iterdir())


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux sysfs (a file system no one may write)")
def test_an_unwritable_output_is_one_line(tmp_path, data_cfg, run, capsys):
    """Outputs where nothing may be written (sysfs: refused to root as well) and a file in the way of a folder:
    a PermissionError / NotADirectoryError traceback before; now one line naming the path."""
    from dflash.atomic import atomic_write_json
    cfg_file, run_dir = run
    raw = yaml.safe_load(data_cfg.read_text())
    raw["results_dir"] = "/sys/kernel/dflash-results"
    data_cfg.write_text(yaml.safe_dump(raw))
    assert main(["data", "--config", str(data_cfg), "--no-progress"]) == 1
    line = only_line(capsys)
    assert "/sys/kernel/dflash-results/data: cannot write it: " in line and "give another path" in line, line
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress", "--out", "/sys/kernel/x/acc.json"]) == 1
    assert "/sys/kernel/x: cannot write it: " in only_line(capsys)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=f"{tmp_path / 'afile' / 'sub' / 'out.json'}: cannot write it: a file, where "
                                        "a folder is expected"):
        atomic_write_json(tmp_path / "afile" / "sub" / "out.json", {})


# ---- rule 9: what we export is what servers can load ---------------------------------------------------------------

@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_exported_checkpointed_and_built_files_follow_the_umask(tmp_path, run, mask):
    """The exported model.safetensors was 0600 (safetensors' own mode) beside a 0644 config.json: a server under
    another account could not read it. The checkpoint's and the built target's weights were 0600 too."""
    from dflash.atomic import atomic_dir
    from dflash.data.tiny_target import build_target
    from dflash.train import checkpoint
    cfg_file, run_dir = run
    old = os.umask(mask)
    try:
        assert main(["export", "--config", str(cfg_file)]) == 0
        raw = C.from_dict({"target": {**target_section(tmp_path / "t"), "pretrain": {"steps": 1, "batch_size": 2,
                                                                                       "seq_len": 16}}})
        with atomic_dir(tmp_path / "t", "build.json") as tmp:
            build_target(raw.cfg.target, tmp, corpus_size=60, progress=False)
        d = checkpoint.load_drafter(run_dir / "drafter")
        opt = torch.optim.AdamW(d.parameters())
        ckpt = checkpoint.save(run_dir, 20, 20, d, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                              {"result_hash": raw.result_hash, "data_hash": None, "inputs_hash": None})
    finally:
        os.umask(old)
    for folder in (run_dir / "drafter", tmp_path / "t", ckpt):
        assert (folder.stat().st_mode & 0o777) == 0o777 & ~mask, folder
        for f in folder.iterdir():
            assert (f.stat().st_mode & 0o777) == 0o666 & ~mask, f
    assert (run_dir / "drafter" / "model.safetensors").is_file() and (tmp_path / "t" / "model.safetensors").is_file()


# ---- rule 10: no log line claims a GPU where there is none --------------------------------------------------------

def test_cpu_regeneration_claims_no_gpu(tiny_target, caplog):  # noqa: F811
    """'regeneration batch size 32 (from free GPU memory)' was logged on a CPU."""
    import logging

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.data.generate import regenerate
    tok = AutoTokenizer.from_pretrained(str(tiny_target))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target)).eval()
    with caplog.at_level(logging.INFO, logger="dflash.data"):
        out, _ = regenerate(model, tok, [[5, 6, 7], [8, 9]], 3, batch_size=0, cpu_batch_size=4, progress=False)
    assert len(out) == 2
    lines = [m for m in caplog.messages if "regeneration batch size" in m]
    assert lines == ["regeneration batch size 4 (on the CPU: data.regenerate.cpu_batch_size)"], caplog.messages


def test_env_gate_and_report_out_at_what_they_did_not_write_are_refused(tmp_path, capsys):
    """Rule 1 for the last three stages: `env --out` / `gate --out` at a file that is not their JSON (a user's notes),
    `report --out` at a folder holding files but no report of its own: one line each, before any work, the file kept."""
    from dflash.cli import main
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"results_dir: {tmp_path / 'results'}\n")
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}\n')
    for stage in ("env", "gate"):
        assert main([stage, "--config", str(cfg), "--out", str(notes)]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{notes}: exists and was not written by the {stage} stage" in err[0], err
        assert notes.read_text() == '{"mine": 1}\n'
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "report.md").write_text("my own report\n")
    assert main(["report", "--config", str(cfg), "--out", str(mine)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{mine}: exists and was not made by the report stage" in err[0], err
    assert (mine / "report.md").read_text() == "my own report\n" and sorted(p.name for p in mine.iterdir()) == ["report.md"]
    assert main(["env", "--config", str(cfg)]) == 0                      # its own file: written, then rewritten
    assert main(["env", "--config", str(cfg)]) == 0
