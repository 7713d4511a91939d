"""The Snakemake workflow: lint-clean, dry runs list every stage, the README's cluster command plans the 8-GPU job."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = Path(sys.executable).with_name("snakemake")

pytestmark = pytest.mark.skipif(not SNAKEMAKE.exists(), reason="snakemake is not installed in this environment")


def snakemake(tmp_path, *args):
    """Run snakemake on a copy of the workflow (no results, no .snakemake state of the checkout)."""
    work = tmp_path / "wf"
    if not work.exists():
        shutil.copytree(REPO, work, ignore=shutil.ignore_patterns(".venv*", ".git", "results", ".snakemake",
                                                                   "__pycache__", ".whl", "bench"))
    env = dict(os.environ, PATH=f"{SNAKEMAKE.parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run([str(SNAKEMAKE), *args], cwd=work, capture_output=True, text=True, timeout=300, env=env)


def test_lint_clean(tmp_path):
    r = snakemake(tmp_path, "--lint")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Congratulations" in r.stdout + r.stderr


def test_default_dry_run_lists_every_stage(tmp_path):
    r = snakemake(tmp_path, "-n", "-p", "--cores", "2")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for rule in ("env", "target", "data", "warmup", "train", "export", "evaluate", "report", "all"):
        assert f"rule {rule}:" in out or f"localrule {rule}:" in out, rule
    assert "--config config/config.yaml" in out


def test_slurm_profile_plans_the_8gpu_job(tmp_path):
    """The README's cluster command, as a dry run: one warm-up job per drafter GPU, train asks for 8 GPUs."""
    r = snakemake(tmp_path, "-n", "--workflow-profile", "workflow/profiles/slurm", "--configfile",
                  "config/seed-8gpu.yaml")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "Config file(s): [PosixPath(" in out and "config/config.yaml" not in out.split("Config file(s):")[1].split("\n")[0]
    assert out.count("rule warmup:") == 3                      # cuda5, cuda6, cuda7
    train = out[out.index("rule train:"):]
    assert "gpu=8" in train.split("Shell command")[0] and "gres=gpu:8" in train.split("Shell command")[0]
    assert "python -m dflash train --config" in train and "seed-8gpu.yaml" in train


def test_two_configfiles_refused(tmp_path):
    r = snakemake(tmp_path, "-n", "--configfile", "config/config.yaml", "config/h200.yaml")
    assert r.returncode != 0 and "give one --configfile" in r.stdout + r.stderr
