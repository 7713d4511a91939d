"""The suite's layout: no test module imports another (shared fixtures live in conftest.py files, plain helpers in
tests/support/), and tests/e2e is the slow tier by folder."""
import ast
import importlib.util
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported(path: Path) -> set[str]:
    """Top names of every module a file imports, at module level or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_no_test_module_imports_another():
    modules = sorted(TESTS.rglob("test_*.py"))
    names = {p.stem for p in modules} | {"conftest"}
    bad = {str(p.relative_to(TESTS)): sorted(imported(p) & names) for p in modules}
    assert {k: v for k, v in bad.items() if v} == {}
    assert not list(TESTS.glob("test_*.py")), "test modules live in tests/unit, tests/stages or tests/e2e"


def test_the_check_sees_an_import_of_a_test_module(tmp_path):
    (tmp_path / "test_a.py").write_text("def f():\n    from test_b import g\n")
    assert "test_b" in imported(tmp_path / "test_a.py")


def test_e2e_is_marked_slow_by_folder():
    """tests/e2e/conftest.py's hook marks its own folder's items slow and no other's."""
    spec = importlib.util.spec_from_file_location("e2e_conftest", TESTS / "e2e" / "conftest.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    class Item:
        def __init__(self, path):
            self.fspath, self.marks = path, []

        def add_marker(self, mark):
            self.marks.append(mark.name)
    items = [Item(TESTS / "e2e" / "test_workflow.py"), Item(TESTS / "unit" / "test_config.py")]
    hook.pytest_collection_modifyitems(None, items)
    assert [i.marks for i in items] == [["slow"], []]


def test_every_test_docs_faults_md_names_exists():
    """docs/faults.md stays the truth: each test a row names (`test_...`) is defined, each tests/ file it names is
    there (a renamed or removed test fails here, not silently in the docs)."""
    import re
    text = (TESTS.parent / "docs" / "faults.md").read_text()
    named = set(re.findall(r"`(test_\w+)`", text))
    defined = {name for p in TESTS.rglob("test_*.py") for name in re.findall(r"^def (test_\w+)", p.read_text(), re.M)}
    assert len(named) >= 10 and sorted(named - defined) == []
    files = set(re.findall(r"(tests/[\w/]+\.py)", text))
    assert files and sorted(f for f in files if not (TESTS.parent / f).is_file()) == []
