"""The Snakemake workflow as a user drives it: the venv's `snakemake`, the venv not activated, on a copy of the
repository."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SNAKEMAKE = Path(sys.executable).with_name("snakemake")


def copy_repo(dst: Path) -> Path:
    shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(".venv*", ".git", "results", ".snakemake", "__pycache__",
                                                             ".whl", "bench", ".pytest_cache"))
    return dst


def bare_env() -> dict:
    """The environment of a shell where the venv is not activated: no venv on PATH, no PYTHONPATH."""
    venv_bin = str(SNAKEMAKE.parent)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if p and Path(p).resolve() != Path(venv_bin).resolve())
    return env


def snakemake(work: Path, *args, timeout=600):
    r = subprocess.run([str(SNAKEMAKE), *args], cwd=work, capture_output=True, text=True, timeout=timeout,
                       env=bare_env())
    r.out = r.stdout + r.stderr
    return r
