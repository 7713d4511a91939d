import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The repository (the package) and tests/ (the helper package `support`, never a test module) are importable.
sys.path[:0] = [str(REPO), str(REPO / "tests")]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# On a machine of a few cores (CI has 2) Inductor compiles faster in-process than through its worker pool:
# tests/e2e/test_train_compiled.py's zero-recompile test took 57.6 s against 67.0 (user time 53 s against 73). Set before
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


@pytest.fixture(scope="module")
def one_thread():
    """One torch CPU thread while a module's tests run (several times faster on a shared 2-core machine)."""
    from dflash.data.tiny_target import cpu_threads
    with cpu_threads(1):
        yield


@pytest.fixture(scope="session")
def tiny_target():
    """The tiny target (tests/support/data.py), built once per session."""
    from support.data import build_tiny_target
    return build_tiny_target()


@pytest.fixture(scope="session")
def talking_target():
    from support.data import build_talking_target
    return build_talking_target()


@pytest.fixture(scope="session")
def family_targets(tmp_path_factory):
    """`family_targets(family)`: the folder of a tiny random-weight target of that family (support.families.build),
    built on first use and shared by the session (the family matrix, the split and the quantized-target tests)."""
    from dflash.data.tiny_target import cpu_threads
    from support.families import build
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in built:
            with cpu_threads(1):
                built[family] = build(family, root)
        return built[family]
    return get


@pytest.fixture
def data_cfg(tmp_path, tiny_target):
    """`data_cfg(sources, **data)`: a loaded config over the tiny target (support.data.make_loaded)."""
    from support.data import make_loaded

    def make(sources=(), **data):
        return make_loaded(tmp_path, tiny_target, sources, **data)
    return make
