"""tests/e2e is the slow tier by folder: Snakemake, subprocesses, torchrun launches, servers, torch.compile.
Every test here is marked `slow`, so `pytest -m "not slow"` (make test-fast) runs tests/unit and tests/stages."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.fspath).resolve().parents:
            item.add_marker(pytest.mark.slow)
