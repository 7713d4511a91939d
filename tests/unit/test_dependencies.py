"""pyproject.toml lists what the package imports: every third-party module `dflash/` imports (read with `ast`, at
any depth: function-level imports too) is the import name of a declared dependency, and every declared dependency is
imported (issue 50 item 5: `pandas` and `rich` were declared and unused; `xxhash`, `psutil`, `httpx` used and not)."""
import ast
import re
import sys
import tomllib

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# import name -> distribution name, where they differ
DIST = {"yaml": "pyyaml", "pynvml": "nvidia-ml-py"}


def imported() -> set[str]:
    out = set()
    for path in (REPO / "dflash").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
    return {m for m in out if m not in sys.stdlib_module_names and m not in ("dflash", "__future__")}


def declared() -> set[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps}


def test_pyproject_declares_exactly_what_the_package_imports():
    wanted = {DIST.get(m, m).lower() for m in imported()}
    assert wanted - declared() == set(), "imported, not in pyproject.toml's dependencies"
    assert declared() - wanted == set(), "in pyproject.toml's dependencies, never imported"


def test_every_declared_dependency_is_pinned_in_envs():
    pins = {re.split(r"==", line)[0].strip().lower() for line in (REPO / "envs" / "requirements.txt").read_text()
            .splitlines() if line.strip() and not line.startswith("#")}
    assert declared() - pins == set()
