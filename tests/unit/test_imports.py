"""No import circle in the package: every `import` / `from ... import` (module level and inside functions, relative
and absolute; `from x import y` counts as importing the module x.y when y is one) is an edge, and the graph of the
package's modules must have no cycle. A circle hidden behind a function-level import is still a circle: neither
module can be read, tested or moved without the other."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_names(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module of `package` under `root` (a package is its __init__)."""
    out = {}
    for f in sorted((root / package).rglob("*.py")):
        parts = f.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The package's modules that module `name` (file `path`) imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                               # relative: `from ..x import y` inside package a.b -> a.x
                up = package.split(".")
                base = ".".join(up[:len(up) - node.level + 1] + ([base] if base else []))
            for a in node.names:                          # `from x import y`: the submodule x.y if there is one
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    # importing a.b.c runs the __init__ of a and a.b first: an edge to each package the importer is not inside
    out |= {p for m in out for p in _parents(m) if not (name == p or name.startswith(p + "."))}
    return {m for m in out if m in modules}


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    modules = module_names(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a, b, ..., a) through each strongly connected component that has one (Tarjan's algorithm)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph, comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(comp)
    prev, frontier = {}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]                            # v, its predecessor, ..., start
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle in {comp}")


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(REPO, "dflash"))
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_the_walk_finds_hidden_cycles(tmp_path):
    """The walker sees function-level, relative and `from package import submodule` imports (else the test above
    could pass on a package full of circles)."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")             # function-level, relative
    (pkg / "sub" / "b.py").write_text("from p import c\n")                       # `from package import module`
    (pkg / "c.py").write_text("import os\nif True:\n    import p.a as a\n")      # absolute, nested
    (pkg / "d.py").write_text("from . import c\nfrom p.sub.b import x\n")        # into the circle, not part of it
    graph = import_graph(tmp_path, "p")
    # importing p.sub.b from outside p.sub runs p/sub/__init__.py first: an edge to p.sub too (and to p, the top
    # package, from nowhere: every module is inside it)
    assert graph["p.a"] == {"p.sub", "p.sub.b"} and graph["p.sub.b"] == {"p.c"}
    assert graph["p.d"] == {"p.c", "p.sub", "p.sub.b"}
    assert cycles(graph) == [["p.a", "p.sub.b", "p.c", "p.a"]]
    (pkg / "c.py").write_text("import os\n")
    assert cycles(import_graph(tmp_path, "p")) == []
    (pkg / "sub" / "__init__.py").write_text("from p import a\n")   # a package __init__ that imports its importer
    assert cycles(import_graph(tmp_path, "p")) == [["p.a", "p.sub", "p.a"]]


def folder_graph(graph: dict[str, set[str]], package: str = "dflash") -> dict[str, set[str]]:
    """The import graph between the package's folders (dflash.train, dflash.evaluate, ...): module a.x importing a.y.z
    is an edge a.x -> a.y between folders; top-level modules (dflash.paths, ...) are their own nodes."""
    def folder(m):
        parts = m.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else m
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(folder(m), set()).update(folder(d) for d in deps if folder(d) != folder(m) and d != package)
    return {k: v - {package} for k, v in out.items()}


def test_the_package_folders_have_no_import_cycle():
    """Folders are layers too: train and evaluate each import the shared pieces below them (paths, the model, the
    target), never each other both ways (issue 41: train.run imported evaluate.live while evaluate.loading imported
    train.checkpoint)."""
    found = cycles(folder_graph(import_graph(REPO, "dflash")))
    assert not found, "folder import cycles: " + "; ".join(" -> ".join(c) for c in found)
