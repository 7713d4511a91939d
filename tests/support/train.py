"""The threads-runtime test helpers: a tiny run's config, a prepared results folder (the data stage run once per
session and holdout), `dflash train` in process or as a subprocess, and a stop by a signal sent to this process."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dflash.cli import main
from support.data import build_tiny_target, target_section

REPO = Path(__file__).resolve().parents[2]
_DATA: dict = {}


def config(results: Path, target: Path, **train) -> dict:
    t = {"targets": ["cpu"], "drafters": ["cpu", "cpu"], "attention": "sdpa", "compile": False, "steps": 12, "batch_size": 2,
         "num_anchors": 8, "log_every": 2, "checkpoint_every": 4, "warmup_steps_excluded": 2}
    t.update(train)
    return {"results_dir": str(results), "run_name": "t", "seed": 0, "target": target_section(target),
            "data": {"builtin_corpus": {"enabled": True, "max_conversations": 150}, "regenerate": {"enabled": False},
                     "holdout": 0, "min_supervised_blocks": 1, "max_length": 256, "bucket_edges": [64, 128, 256]},
            "drafter": {"num_layers": 1, "block_size": 4, "num_target_layers": 2, "target_layer_ids": [0, 1]},
            "train": t}


def prepared(tmp_path: Path, holdout: int = 0, evaluate: dict | None = None, **train) -> Path:
    """A config file whose results folder already holds the expanded dataset (built once per session for each
    `holdout`); `evaluate`: the config's evaluate section (what the in-training evaluation reads too)."""
    target = build_tiny_target()
    raw = config(tmp_path / "results", target, **train)
    raw["data"]["holdout"] = holdout
    if evaluate is not None:
        raw["evaluate"] = dict(evaluate)
    if holdout not in _DATA:
        root = Path(os.environ.get("PYTEST_DATA_ROOT", tmp_path.parent)) / f"train-data-{holdout}"
        root.mkdir(parents=True, exist_ok=True)
        data = config(root / "results", target)
        data["data"]["holdout"] = holdout
        (root / "c.yaml").write_text(yaml.safe_dump(data))
        assert main(["data", "--config", str(root / "c.yaml"), "--no-progress"]) == 0
        _DATA[holdout] = root / "results" / "data"
    shutil.copytree(_DATA[holdout], tmp_path / "results" / "data")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


EVAL = {"num_prompts": 3, "max_new_tokens": 12, "device": "cpu"}


def prepared_eval(tmp_path: Path, **train) -> Path:
    """A prepared run whose dataset holds 4 held-out prompts, decoded on the CPU by evaluate and train.eval_every."""
    return prepared(tmp_path, holdout=4, evaluate=EVAL, **train)


def run_dir(cfg: Path) -> Path:
    return Path(yaml.safe_load(cfg.read_text())["results_dir"]) / "runs" / "t"


def home(cfg: Path) -> Path:
    """The folder of the run folder's one identity (checkpoints/<result hash>-<data hash>/; one there, none set
    aside)."""
    homes = [d for d in (run_dir(cfg) / "checkpoints").iterdir() if d.is_dir() and "." not in d.name]
    assert len(homes) == 1, homes
    return homes[0]


def ckpt(cfg: Path, step: int) -> Path:
    """Checkpoint `step` of the run folder's one identity."""
    return home(cfg) / f"step-{step:06d}"


def train_ok(cfg: Path, *args: str) -> None:
    """`dflash train` in this process; a non-zero exit fails naming the run's failure from summary.json (CI shows
    the assertion even when the captured log is cut)."""
    code = main(["train", "--config", str(cfg), "--no-progress", *args])
    summary = run_dir(cfg) / "summary.json"
    why = json.loads(summary.read_text()).get("failure") if summary.exists() else "no summary.json"
    assert code == 0, f"train exited {code}: {why}"


def dflash(*args, **kw):
    return subprocess.run([sys.executable, "-m", "dflash", *args], cwd=REPO, capture_output=True, text=True, **kw)


def stop_here(cfg, sig, *args):
    """`train` in this process, `sig` sent to this process after a few logged steps (as a terminal or a scheduler
    would send it to `python -m dflash train`; no launch): (exit code, the last logged step when the signal was sent,
    summary, newest checkpoint step)."""
    import threading
    metrics, done, sent = run_dir(cfg) / "metrics.jsonl", threading.Event(), {}

    def send():   # only while the run trains: its handlers are this process's then
        while not done.is_set() and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
            time.sleep(0.05)
        if not done.is_set():
            os.kill(os.getpid(), sig)
            sent["logged"] = json.loads(metrics.read_text().splitlines()[-1])["step"]   # at least this far

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        code = main(["train", "--config", str(cfg), "--no-progress", *args])
    finally:
        done.set()
        sender.join()
    assert "logged" in sent, f"train ended ({code}) before 3 rows were logged"
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    ckpts = sorted((run_dir(cfg) / "checkpoints").glob("*/step-*"))
    return code, sent["logged"], s, int(ckpts[-1].name.split("-")[1]) if ckpts else None
