import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a machine of a few cores (CI has 2) Inductor compiles faster in-process than through its worker pool:
# tests/test_train_compiled.py's zero-recompile test took 57.6 s against 67.0 (user time 53 s against 73). Set before
# torch is imported; inherited by the stages the tests launch. A GPU host (the H200 has 16 cores) keeps the pool.
if (os.cpu_count() or 1) <= 4:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def repo():
    return REPO


@pytest.fixture
def fake_gpus(monkeypatch):
    """`fake_gpus(n)`: torch reports n CUDA devices (placement checks only; nothing runs on them)."""
    import torch

    def fake(n: int = 8):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake
