"""Issue 50's measurable done-means, kept from coming back: no function of the package over 60 lines (ast, over all of
dflash/); no record model outside dflash/records/ (a pydantic model of a file, defined anywhere else, is a second
door); a run folder's file names spelled in one place (`"summary.json"` on at most 2 lines of dflash/)."""
import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dflash"
LIMIT = 60
# The one module outside records/ allowed pydantic models: the config's keys (an input read, not a file between
# stages; workflow/schemas/config.schema.yaml is generated from it).
MODELS_ALLOWED = {"config_model.py"}


def py_files(root: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def long_functions(path: Path, limit: int = LIMIT) -> list[str]:
    """`file:line name (N lines)` of every function or method in `path` over `limit` lines (end_lineno - lineno + 1,
    decorators not counted)."""
    return [f"{path.name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def model_classes(path: Path) -> list[str]:
    """The classes `path` defines that are pydantic models: a base that is a name imported from pydantic or from
    dflash.records (BaseModel, RootModel, records.Read, a record's view), reached through a module alias
    (`pydantic.BaseModel`, `records.Read`), or a class of the same file that is one."""
    tree = ast.parse(path.read_text(), str(path))
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "pydantic" or node.module.startswith("dflash.records")):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == "dflash":
            modules |= {a.asname or a.name for a in node.names if a.name == "records"}
        elif isinstance(node, ast.Import):         # `import dflash.records`: its classes are dflash.records.X
            modules |= {a.asname or a.name for a in node.names if a.name.split(".")[0] == "pydantic"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ClassDef):
            continue
        for base in node.bases:
            dotted = ast.unparse(base)
            if ((isinstance(base, ast.Name) and base.id in names | set(found)) or (isinstance(base, ast.Attribute) and (
                    dotted.split(".")[0] in modules or dotted.startswith("dflash.records.")))):
                found.append(node.name)
                break
    return found


def quoted_lines(text: str, name: str = "summary.json") -> int:
    """Lines holding `"name"` (what `git grep -c '"name"'` counts per file)."""
    return sum(f'"{name}"' in line for line in text.splitlines())


def test_no_package_function_is_over_60_lines():
    assert [f for p in py_files() for f in long_functions(p)] == []


def test_no_record_model_outside_records():
    outside = {str(p.relative_to(PACKAGE)): model_classes(p) for p in py_files()
               if p.relative_to(PACKAGE).parts[0] != "records" and p.name not in MODELS_ALLOWED}
    assert {k: v for k, v in outside.items() if v} == {}


def test_records_and_config_are_where_the_models_are():
    """The check sees the models it lets through: a record module in records/, the config's sections."""
    assert "Manifest" in model_classes(PACKAGE / "records" / "manifest.py")
    assert "RunSummary" in model_classes(PACKAGE / "records" / "summary.py")
    assert "Section" in model_classes(PACKAGE / "config_model.py")


@pytest.mark.parametrize("source", [
    "from pydantic import BaseModel\nclass A(BaseModel):\n    x: int\n",
    "import pydantic\nclass A(pydantic.BaseModel):\n    x: int\n",
    "from pydantic import BaseModel as B\nclass Base(B):\n    pass\nclass A(Base):\n    x: int\n",
    "from dflash.records import Read\nclass A(Read):\n    x: int\n",
    "from dflash.records.summary import SummaryCore\nclass A(SummaryCore):\n    pass\n",
    "from dflash import records\nclass A(records.Read):\n    x: int\n",
    "import dflash.records\nclass A(dflash.records.Read):\n    x: int\n",
    "def f():\n    from pydantic import BaseModel\n    class A(BaseModel):\n        x: int\n    return A\n",
])
def test_the_check_sees_a_model_defined_outside(tmp_path, source):
    (tmp_path / "m.py").write_text(source)
    assert "A" in model_classes(tmp_path / "m.py")


def test_the_check_lets_other_classes_be(tmp_path):
    (tmp_path / "m.py").write_text("import dataclasses\nfrom pydantic import ValidationError\n"
                                   "@dataclasses.dataclass\nclass A:\n    x: int\nclass E(ValueError):\n    pass\n")
    assert model_classes(tmp_path / "m.py") == []


def test_the_length_check_counts_lines_as_ast_does(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(LIMIT - 1))
    (tmp_path / "m.py").write_text(f"def ok():\n{body}\ndef long():\n{body}    return 0\n")
    assert long_functions(tmp_path / "m.py") == [f"m.py:{LIMIT + 2} long ({LIMIT + 1} lines)"]


def test_summary_json_is_spelled_at_most_twice():
    counts = {str(p.relative_to(PACKAGE)): quoted_lines(p.read_text(errors="replace"))
              for p in sorted(PACKAGE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
    assert sum(counts.values()) <= 2, {k: v for k, v in counts.items() if v}
    assert quoted_lines('a = "summary.json"\nb = "summary.json.tmp"\nc = "x/summary.json"') == 1


def test_the_module_map_names_every_module():
    """docs/architecture.md's Layout names every module of the package (a stage by its name in the stages' list)."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    layout = text[text.index("## Layout"):text.index("## Tensors")]
    stages = layout[layout.index("stages/<stage>.py"):layout.index("  target.py")]
    missing = [str(p.relative_to(PACKAGE)) for p in py_files() if p.name != "__init__.py" and not (
        p.name in layout or (p.parent.name == "stages" and re.search(rf"\b{p.stem}\b", stages)))]
    assert missing == []
    assert "data/README.md" in layout


def test_the_report_spells_no_draft_policy():
    """The draft-policy vocabulary lives beside the acceptance model (records/acceptance.py: ENGINES, WORDS): the
    report's tables and plots take the policies' names and words from there, spelling none as a string of their own."""
    from dflash.records.acceptance import ENGINES
    spelled = [f"{p.name}:{n.lineno} {n.value!r}" for p in py_files(PACKAGE / "report")
               for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Constant) and n.value in ENGINES]
    assert spelled == []
