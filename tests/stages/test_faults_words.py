"""Issue 47 item 6: one line for every bad value or I/O error, at the right place. Numbers in scientific notation are
numbers; command-line values with broken YAML, errors inside a `base:` file, unreadable files, names too long for a
folder, seeds, mask token ids and heads a target cannot take, non-finite numbers, a damaged acceptance.json under
export, Ctrl-C and the temporaries of a killed writer each end in one line naming the file or key (or in nothing
left behind), never a traceback or wrong words. Each test failed on eb0a841. The Snakemake side: tests/e2e/
test_workflow_words.py."""
import builtins
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash import config as C
from dflash.cli import main
from support.runs import evaluable_run

REPO = Path(__file__).resolve().parents[2]


def write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def one_line(capsys, code: int, got: int) -> str:
    """The stage's console: exactly one line, and the exit code."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and " INFO " not in line]
    assert got == code and len(lines) == 1 and "Traceback" not in err, (got, err)
    return lines[0]


def captured(monkeypatch) -> list:
    """What `dflash env` is run with: the loaded config (the stage itself does nothing)."""
    seen = []
    monkeypatch.setattr("dflash.stages.env.run", lambda loaded, args: seen.append(loaded) or 0)
    return seen


# ---- numbers in scientific notation are numbers, in files, --set and Snakemake's --config --------------------------
def test_scientific_notation_is_a_number_everywhere_the_config_is_read(tmp_path, monkeypatch, capsys):
    """`train.lr: 1e-4` was the string '1e-4' (YAML 1.1 wants a dot) and refused with no hint; in a file, a `base:`
    file, `--set` and Snakemake's `--config` (the Snakefile's loader) it is the number, as YAML 1.2 reads it. An
    integer stays an integer."""
    (tmp_path / "base.yaml").write_text("target: {pretrain: {lr: 6E-4}}\ntrain: {time_budget_s: 1e5}\n")
    cfg = write(tmp_path / "c.yaml", "base: base.yaml\ntrain: {lr: 1e-4, steps: 5}\nseed: 3\n")
    loaded = C.load(cfg)
    t = loaded.cfg
    assert (t.train.lr, t.target.pretrain.lr, t.train.time_budget_s, t.train.steps, t.seed) == (1e-4, 6e-4, 1e5, 5, 3)
    assert type(t.train.lr) is float and type(t.train.steps) is int
    seen = captured(monkeypatch)
    assert main(["env", "--config", str(cfg), "--set", "train.lr=2.5e-4", "--set", "train.betas=[0.9, 95e-2]"]) == 0
    assert (seen[0].cfg.train.lr, seen[0].cfg.train.betas) == (2.5e-4, (0.9, 0.95))
    # Snakemake's --config reaches the Snakefile as text (its base loader): train="{lr: 3e-4}"
    flow, sets = C.for_workflow(cfg, {"train": {"lr": "3e-4"}})
    assert flow.cfg.train.lr == 3e-4 and sets == ["train.lr=0.0003"]


# ---- command-line values -----------------------------------------------------------------------------------------
def test_a_set_value_with_broken_yaml_is_one_line(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", {"run_name": "x"})
    line = one_line(capsys, 2, main(["env", "--config", str(cfg), "--set", "train.betas=[0.9, 0.95"]))
    assert line.startswith("dflash env: config error: --set train.betas=[0.9, 0.95: not valid YAML: expected ',' or "
                           "']'"), line


def test_a_snakemake_section_with_broken_yaml_is_one_line(tmp_path):
    """`--config train="{lr: [1}"`: Snakemake leaves the text as it is; it was refused as "must be object"."""
    cfg = write(tmp_path / "c.yaml", {"run_name": "x"})
    with pytest.raises(C.ConfigError, match=r"^--config train=\{lr: \[1\}: not valid YAML: expected ',' or ']'"):
        C.for_workflow(cfg, {"train": "{lr: [1}"})


# ---- errors in a base: file name that file ------------------------------------------------------------------------
def test_an_error_in_a_base_file_names_that_file(tmp_path, capsys):
    """A typo in the base was reported against the file that names it (which has no such key)."""
    base = write(tmp_path / "common.yaml", {"train": {"stepz": 3}, "evaluate": {"num_prompts": 4}})
    cfg = write(tmp_path / "c.yaml", {"base": "common.yaml", "run_name": "x"})
    line = one_line(capsys, 2, main(["env", "--config", str(cfg)]))
    assert line.startswith(f"dflash env: config error: {base} (a base of {cfg}): unknown key 'train.stepz'"), line
    write(base, {"train": {"steps": "five"}})
    with pytest.raises(C.ConfigError, match=f"^{base} \\(a base of {cfg}\\): key 'train.steps' must be integer"):
        C.load(cfg)
    write(base, {"train": {"steps": 5}})                           # the top file's own error names the top file
    write(cfg, {"base": "common.yaml", "train": {"lr": "fast"}})
    with pytest.raises(C.ConfigError, match=f"^{cfg}: key 'train.lr' must be number"):
        C.load(cfg)
    write(cfg, {"base": "common.yaml"})                           # a --set value replaces the base's key: not its
    with pytest.raises(C.ConfigError, match=f"^{cfg}: key 'train.steps' must be integer"):
        C.load(cfg, {"train.steps": "x"})


# ---- read errors say "read" ---------------------------------------------------------------------------------------
@pytest.fixture
def unreadable(monkeypatch):
    """`unreadable(path)`: reading `path` is refused (EACCES): chmod 000 for a user; root reads anyway, so there its
    opening for reading fails."""
    if os.geteuid() != 0:
        made = []
        yield lambda path: (made.append(path), path.chmod(0))
        for p in made:
            p.chmod(0o644)
        return
    denied = set()
    real = io.open

    def guarded(file, mode="r", *a, **k):
        if isinstance(file, (str, Path)) and "r" in mode and "+" not in mode and Path(file).absolute() in denied:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, mode, *a, **k)
    monkeypatch.setattr(io, "open", guarded)
    monkeypatch.setattr(builtins, "open", guarded)
    yield lambda path: denied.add(Path(path).absolute())


def test_an_unreadable_config_says_it_cannot_be_read(tmp_path, capsys, unreadable):
    """It said "cannot write it"; the Snakefile's loader raised a traceback."""
    cfg = write(tmp_path / "c.yaml", {"run_name": "x"})
    unreadable(cfg)
    line = one_line(capsys, 2, main(["env", "--config", str(cfg)]))
    assert line == (f"dflash env: config error: {cfg}: cannot read it: permission denied; make it readable for this "
                    f"user, or give another path"), line
    with pytest.raises(C.ConfigError, match="cannot read it: permission denied"):
        C.for_workflow(cfg, {})


@pytest.fixture
def run(tmp_path, tiny_target):
    """A run folder as train leaves it (two checkpoints, summary.json naming the second) and its config file."""
    cfg, run_dir, _ = evaluable_run(tmp_path, tiny_target, ["What is a list?"], [2, 4], {"num_prompts": 1})
    return cfg, run_dir


def test_an_unreadable_checkpoint_or_summary_says_it_cannot_be_read(run, capsys, unreadable):
    """The run's final checkpoint: "cannot write it"; its summary.json: "unreadable (PermissionError); retrain the
    run" (nothing is wrong with the run: the file's permissions are)."""
    cfg, run_dir = run
    final = json.loads((run_dir / "summary.json").read_text())["checkpoint"]["path"]   # checkpoints/<identity>/step-N
    weights = run_dir / final / "model.safetensors"
    unreadable(weights)
    line = one_line(capsys, 1, main(["export", "--config", str(cfg)]))
    assert line == (f"dflash export: error: {weights}: cannot read it: permission denied; make it readable for this "
                    f"user, or give another path"), line
    unreadable(run_dir / "summary.json")
    line = one_line(capsys, 1, main(["export", "--config", str(cfg)]))
    assert line == (f"dflash export: error: {run_dir / 'summary.json'}: cannot read it: permission denied; make it "
                    f"readable for this user, or give another path"), line
    assert not (run_dir / "drafter").exists()


def test_a_damaged_summary_still_says_retrain(run, capsys):
    cfg, run_dir = run
    (run_dir / "summary.json").write_text("{")
    line = one_line(capsys, 1, main(["export", "--config", str(cfg)]))
    assert f"{run_dir / 'summary.json'}: damaged (not a JSON object); retrain the run" in line, line


# ---- export over a damaged acceptance.json ------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["{\"tau\": 2.", ""])
def test_export_over_a_damaged_acceptance_is_refused_in_one_line(run, capsys, text):
    """It wrote a model card saying "not evaluated" without a word; now refused like one whose keys have other types,
    naming the file and the two ways on; nothing is written. No acceptance.json at all: the card says not evaluated."""
    cfg, run_dir = run
    (run_dir / "acceptance.json").write_text(text)
    line = one_line(capsys, 1, main(["export", "--config", str(cfg)]))
    assert line == (f"dflash export: error: {run_dir / 'acceptance.json'}: damaged (not JSON), so the model card "
                    f"cannot state it: rerun evaluate (snakemake -R evaluate), or move it away to export without "
                    f"it"), line
    assert not (run_dir / "drafter").exists()
    (run_dir / "acceptance.json").unlink()
    assert main(["export", "--config", str(cfg)]) == 0
    assert "not evaluated" in (run_dir / "drafter" / "README.md").read_text()


# ---- values a folder, a generator or a target cannot take: refused at config load --------------------------------
@pytest.mark.parametrize("data,named", [
    ({"run_name": "r" * 240}, "key 'run_name' must be at most 128 characters (it names folders and files"),
    ({"dataset_name": "d" * 129}, "key 'dataset_name' must be at most 128 characters"),
    ({"data": {"sources": [{"name": "s" * 200, "path": "a.jsonl"}]}}, "key 'data.sources.0.name' must be at most 128"),
    ({"seed": 2**64}, "key 'seed': Input should be less than or equal to 4294967295"),
    ({"drafter": {"mask_token_id": 2048}}, "drafter.mask_token_id (2048) is past the vocabulary of target.arch (2048 "
                                           "tokens, ids 0-2047)"),
    ({"drafter": {"num_attention_heads": 3}}, "drafter.num_attention_heads (3) is not a multiple of "
                                              "drafter.num_key_value_heads (2, null: from target.arch)"),
    ({"drafter": {"num_key_value_heads": 3}}, "drafter.num_attention_heads (4, null: from target.arch) is not a "
                                              "multiple of drafter.num_key_value_heads (3)"),
    ({"evaluate": {"temperature": float("inf")}}, "key 'evaluate.temperature' must be a finite number, got inf"),
    ({"train": {"lr": float("nan")}}, "key 'train.lr' must be a finite number, got nan"),
    ({"train": {"betas": [0.9, float("-inf")]}}, "key 'train.betas.1' must be a finite number"),
    ({"report": {"threshold": float("-inf")}}, "key 'report.threshold' must be a finite number"),
], ids=["run_name", "dataset_name", "source", "seed", "mask", "heads", "kv", "inf", "nan", "betas", "report"])
def test_a_value_no_stage_can_use_is_refused_at_config_load(tmp_path, data, named):
    """A 240-character run name trained, then the report died writing its history file; seed 2^64, a mask token past
    the vocabulary and heads that do not divide died in tracebacks; evaluate.temperature .inf reported tau 15."""
    p = write(tmp_path / "c.yaml", data)
    with pytest.raises(C.ConfigError) as e:
        C.load(p)
    assert str(e.value).startswith(f"{p}: ") and named in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_longest_name_and_seed_still_load(tmp_path):
    cfg = C.from_dict({"run_name": "r" * 128, "seed": 2**32 - 1, "drafter": {"mask_token_id": 2047,
                                                                           "num_attention_heads": 2}}).cfg
    assert len(cfg.run_name) == 128 and cfg.seed == 2**32 - 1


def test_inf_from_the_command_line_is_one_line(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", {"run_name": "x"})
    line = one_line(capsys, 2, main(["env", "--config", str(cfg), "--set", "evaluate.temperature=.inf"]))
    assert line == f"dflash env: config error: {cfg}: key 'evaluate.temperature' must be a finite number, got inf"


def test_a_target_folder_bounds_the_mask_token_and_the_heads(tmp_path):
    """build none: the folder's config.json gives the vocabulary and the heads, checked where the config meets the
    files (check_here: the Snakefile and every stage that reads the drafter keys) and where the drafter meets the
    target (DrafterConfig.from_target)."""
    from transformers import Qwen3Config

    from dflash.model import DrafterConfig
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 4, "vocab_size": 384,
                                                    "num_attention_heads": 4, "num_key_value_heads": 2}))
    target = {"build": "none", "path": str(folder)}
    for drafter, named in [({"mask_token_id": 384}, f"drafter.mask_token_id (384) is past the vocabulary of the "
                                                    f"target {folder / 'config.json'} (384 tokens, ids 0-383)"),
                           ({"num_attention_heads": 5}, "drafter.num_attention_heads (5) is not a multiple of "
                                                        "drafter.num_key_value_heads (2, null: from the target")]:
        loaded = C.load(write(tmp_path / "c.yaml", {"target": target, "drafter": drafter}))
        for stage in (None, "train", "evaluate", "export", "warmup"):
            with pytest.raises(C.ConfigError, match="^" + str(tmp_path / "c.yaml").replace(".", r"\.")) as e:
                C.check_here(loaded, stage)
            assert named in str(e.value), str(e.value)
        C.check_here(loaded, "report")
    C.check_here(C.load(write(tmp_path / "c.yaml", {"target": target, "drafter": {"mask_token_id": 383}})))
    hf = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=64)
    with pytest.raises(C.ConfigError, match=r"drafter\.mask_token_id \(64\) is past the vocabulary of the target"):
        DrafterConfig.from_target(hf, {"mask_token_id": 64})
    with pytest.raises(C.ConfigError, match=r"drafter\.num_attention_heads \(4, null: from the target\) is not a "
                                            r"multiple of drafter\.num_key_value_heads \(3\)"):
        DrafterConfig.from_target(hf, {"num_key_value_heads": 3}, mask_token_id=1)


# ---- Ctrl-C outside train -----------------------------------------------------------------------------------------
def test_ctrl_c_in_any_stage_is_one_line_exit_130_and_nothing_half_written(tmp_path, monkeypatch, capsys, request):
    """It printed a KeyboardInterrupt traceback. A stage interrupted mid-write (here env, inside its atomic folder)
    exits 130 with one line; the temporary folder is gone."""
    from dflash.atomic import atomic_dir
    out = tmp_path / "out"
    # Ctrl-C as a stage's own process meets it: Python's default handler (an earlier test in this process may have
    # left another one installed: a server or a launcher it ran in-process)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))

    def interrupted(loaded, args):
        with atomic_dir(out) as tmp:
            (tmp / "half").write_text("x")
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
    monkeypatch.setattr("dflash.stages.env.run", interrupted)
    cfg = write(tmp_path / "c.yaml", {"run_name": "x"})
    try:
        code = main(["env", "--config", str(cfg), "--log", str(tmp_path / "env.log")])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped the stage")
    line = one_line(capsys, 130, code)
    assert line.startswith("dflash env: interrupted (Ctrl-C); every output is written whole or not at all"), line
    assert line in (tmp_path / "env.log").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml", "env.log"]


# ---- temporaries of a killed writer -------------------------------------------------------------------------------
KILLED = """
import os, signal, sys
from pathlib import Path
from dflash.atomic import atomic_dir, atomic_write_text
out = Path(sys.argv[1])
if sys.argv[2] == "dir":
    with atomic_dir(out) as tmp:
        (tmp / "half").write_text("x")
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
atomic_write_text(out, "half")
"""


def killed_writing(out: Path, kind: str) -> int:
    """A process killed (SIGKILL) while it writes `out` (`kind` file or dir) through dflash.atomic; its pid."""
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(out), kind], cwd=REPO, stderr=subprocess.PIPE, text=True)
    assert p.wait(timeout=60) == -signal.SIGKILL, p.stderr.read()
    return p.pid


def test_a_rerun_removes_the_temporaries_a_killed_writer_left(tmp_path, capsys):
    """kill -9 (or a lost node) mid-write left `.fingerprint.json.XXXX` or a `.drafter.XXXX/` folder that no rerun
    removed. The rerun of a writer of the same output removes those of dead processes of this host; a temporary of a
    live process, of another host, or of another form is never touched."""
    out = tmp_path / "results" / "env" / "fingerprint.json"
    out.parent.mkdir(parents=True)
    cfg = write(tmp_path / "c.yaml", {"results_dir": str(tmp_path / "results")})
    dead = killed_writing(out, "file")
    assert [p.name[:18] for p in out.parent.iterdir()] == [".fingerprint.json."]
    assert main(["env", "--config", str(cfg)]) == 0
    assert [p.name for p in out.parent.iterdir()] == ["fingerprint.json"]          # the rerun removed it

    from dflash.atomic import atomic_dir, sweep, temp_prefix
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [out.parent / (temp_prefix(out).replace(f".{os.getpid()}-", f".{live.pid}-") + "abcdefgh"),
                out.parent / f".fingerprint.json.{dead}-zzzzzz.abcdefgh",   # another host's
                out.parent / ".fingerprint.json.x1y2z3w4"]                  # a name of another form (older writers)
        for p in kept:
            p.write_text("")
        killed_writing(out, "file")
        assert main(["env", "--config", str(cfg)]) == 0
        names = sorted(p.name for p in out.parent.iterdir())
        assert names == sorted(["fingerprint.json"] + [p.name for p in kept]), names
    finally:
        live.kill()
        live.wait()
    folder = tmp_path / "runs" / "t" / "drafter"
    folder.parent.mkdir(parents=True)
    killed_writing(folder, "dir")
    assert len([p for p in folder.parent.iterdir() if p.name.startswith(".drafter.")]) == 1
    assert sweep(folder) and not list(folder.parent.iterdir())
    killed_writing(folder, "dir")
    with atomic_dir(folder) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["drafter"]
