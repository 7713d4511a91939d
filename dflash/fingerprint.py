"""The environment fingerprint: what the code ran on, hashed so that a change is named, not guessed.

Later stages name their compile-cache folder by `hash`; the report diffs fingerprints to say which package moved.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import re
import sys
from pathlib import Path

from dflash.config import REPO

PACKAGES = ("torch", "triton", "transformers", "tokenizers", "datasets", "safetensors", "snakemake", "numpy", "pyarrow",
            "torchao")
PINS = REPO / "envs" / "requirements.txt"
# Keys that identify the environment; hostname-like details are recorded but not hashed.
HASHED = ("python", "packages", "cuda", "cudnn", "gpu", "lock_hash")


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def read_pins(path: Path | None = None) -> dict[str, str]:
    pins = {}
    for line in Path(path or PINS).read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s#;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict:
    """GPU model, count and driver through NVML (nvidia-ml-py); `count: 0` when there is none."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        names = [x.decode() if isinstance(x, bytes) else x for x in names]
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return {"count": n, "models": sorted(set(names)), "driver": driver}
    except Exception:  # no NVML library or no GPU: that is a valid environment
        return {"count": 0, "models": [], "driver": None}


def collect() -> dict:
    import torch
    packages = {name: package_version(name) for name in PACKAGES}
    packages["torch"] = torch.__version__
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    fp = {
        "python": platform.python_version(),
        "packages": packages,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "gpu": gpu_info(),
        "cpu": cpu_model(),
        "platform": platform.platform(),
        "executable": sys.executable,
        "lock_hash": hashlib.sha256(PINS.read_bytes()).hexdigest()[:16] if PINS.exists() else None,
    }
    fp["hash"] = fingerprint_hash(fp)
    return fp


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps({k: fp.get(k) for k in HASHED}, sort_keys=True).encode()).hexdigest()[:16]


def pin_mismatches(fp: dict, pins: dict[str, str]) -> list[str]:
    """Pinned packages whose installed version differs ('torch: pinned 2.13.0, found 2.11.0+cu130')."""
    out = []
    for name, want in sorted(pins.items()):
        have = fp["packages"].get(name) or package_version(name)
        if have is None:
            out.append(f"{name}: pinned {want}, not installed")
        elif have.split("+")[0] != want:
            out.append(f"{name}: pinned {want}, found {have}")
    return out


def compile_cache_dir(results_dir: str | Path, env_hash: str) -> Path:
    """The persistent Inductor cache for one environment: a new environment never reads a stale cache."""
    return Path(results_dir, "compile", f"cache-{env_hash}").resolve()
