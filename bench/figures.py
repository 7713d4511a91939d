"""The figures typed in prose against the JSON they cite. Every decimal figure of a paragraph or table row that names
a results folder (`bench/results/<date>-<machine>[-<what>]/` or a file in it; a results README names its own folder;
a table row without a source reads the paragraph before the table, one whose source is "same" the row above's) must
be a value of that folder's JSON (archived records included) rounded as written: also as a percentage of a fraction,
in thousands (`12.33K` tokens/s, `5.29 s` of a figure kept in ms) or millions and billions (`4.55M`, `1.05 B`). A log
the text names (and, for a results README, any log beside it) counts too, where the JSON holds no such quantity.
Ratios (`1.58x`), signed differences (`+0.7%`), bounds (`>= 8.9`), versions and text in backticks (commands, keys)
are not figures.

    python bench/figures.py                  # every disagreement: file:line: figure (the folders it was looked up in)

tests/unit/test_docs_figures.py runs it over README.md, docs/*.md (but the generated benchmarks.md and config-keys.md),
the comments of config/*.yaml and bench/results/*/README.md: a figure retyped wrong fails there, naming its line.
Prefer citing the generated table (docs/benchmarks.md) or the file to retyping a figure.
"""
from __future__ import annotations

import json
import re
import sys
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
FOLDER = re.compile(r"(?<![\w-])(\d{4}-\d{2}-\d{2}-[A-Za-z0-9_.-]*[A-Za-z0-9_])(?=/|`|\b)")
SHORT = re.compile(r"`(-[A-Za-z0-9_]+)/`")                 # `-r3/` after `2026-11-29-h200-r4/`: that date's r3
VERSION = re.compile(r"(?:transformers|torch|Python|python|triton|CUDA|cuda|vLLM|SGLang|specforge|SpecForge|"
                     r"version|v)\s?$")
BOUND = re.compile(r"(?:>=|<=|≥|≤|[<>])\s?$")
FIGURE = re.compile(r"(?<![\w.+\-−±/])(\d+\.\d+)(?![\d.]*\d|e[-+]?\d)(\s?[%x×](?![\w])|[KMB](?![\w]))?")
CODE = re.compile(r"`[^`]*`")


@dataclass(frozen=True)
class Miss:
    file: str
    line: int
    figure: str
    folders: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.figure} (not in {', '.join(self.folders)})"


def numbers(x, out: list[float]) -> list[float]:
    if isinstance(x, bool):
        return out
    if isinstance(x, (int, float)):
        out.append(float(x))
    elif isinstance(x, dict):
        for v in x.values():
            numbers(v, out)
    elif isinstance(x, list):
        for v in x:
            numbers(v, out)
    return out


def _json_texts(text: str):
    try:
        yield json.loads(text)
    except ValueError:
        for line in text.splitlines():           # JSON lines (metrics.jsonl)
            try:
                yield json.loads(line)
            except ValueError:
                pass


@lru_cache(maxsize=None)
def text_values(path: Path) -> tuple[float, ...]:
    """Every number written in a text file (a log a unit names, or any log beside a results README)."""
    return tuple(sorted({float(x) for x in re.findall(r"(?<![\w.])\d+(?:\.\d+)?", path.read_text(errors="replace"))}))


@lru_cache(maxsize=None)
def folder_values(folder: Path) -> tuple[float, ...]:
    """Every number of every JSON (and JSON-lines) file in a results folder, archived members included."""
    out: list[float] = []
    for p in sorted(folder.rglob("*")):
        if p.suffix in (".json", ".jsonl"):
            for doc in _json_texts(p.read_text(errors="replace")):
                numbers(doc, out)
        elif p.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(p) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith((".json", ".jsonl")):
                        for doc in _json_texts(tar.extractfile(m).read().decode(errors="replace")):
                            if m.name.endswith(".jsonl") and isinstance(doc, dict):   # metrics: its evaluations
                                doc = {k: v for k, v in doc.items() if "tau" in k or "eval" in k}   # alone (the
                            numbers(doc, out)                           # per-step rest would match anything)
    return tuple(sorted(set(out)))


def agrees(figure: str, unit: str, values, logged=()) -> bool:
    """figure (as written, with its unit mark) is one of values rounded; else one of the logged values, unless a value
    of the JSON lies within one unit of its last digit: the JSON holds that quantity, and a log's rounder copy (11.945
    read as 11.95 where the JSON has 11.9449) does not speak for it."""
    d = len(figure.split(".")[1])
    f = float(figure)
    scales = {"%": (1, 100), "M": (1e-6,), "B": (1e-9,)}.get(unit, (1, 1e-3, 1e3))   # K, s as ms, ms as s
    half = 0.5 * 10 ** -d + 1e-9                 # rounded half up or half to even, as a person or Python rounds

    def within(vals, by, scales=scales):
        return any(abs(v * s - f) <= by for v in vals for s in scales)
    if within(values, half):
        return True
    return not within(values, 2 * half, scales[:1]) and within(logged, half)


def units(text: str):
    """(first line number, text) of each table row and each paragraph (a list item is its own)."""
    block, start = [], 0
    for n, line in enumerate(text.splitlines() + [""], 1):
        s = line.strip()
        new = not s or s.startswith("|") or s.startswith(("- ", "* ", "#")) or re.match(r"\d+\. ", s)
        if new and block:
            yield start, "\n".join(block)
            block = []
        if s:
            if not block:
                start = n
            block.append(line)
            if s.startswith("|") or s.startswith("#"):
                yield start, "\n".join(block)
                block = []


def cited(unit: str, results: Path) -> list[str]:
    """The results folders a unit names (`bench/results/F/`, `F/file`, `-r3/` after a folder of the same date)."""
    out: list[str] = []
    for m in re.finditer(FOLDER.pattern + "|" + SHORT.pattern, unit):
        if m.group(1):
            out.append(m.group(1))
        elif out:
            out.append(re.sub(r"-[A-Za-z0-9_]+$", "", out[-1]) + m.group(2))
    return [f for f in dict.fromkeys(out) if (results / f).is_dir()]


def cited_logs(unit: str, folders: list[str], results: Path) -> list[Path]:
    """The logs (and text records) a unit names by file name in one of its folders: their figures count as cited."""
    names = set(re.findall(r"([\w.+-]+\.(?:log|txt))\b", unit))
    return [results / f / n for f in folders for n in names if (results / f / n).is_file()]


def check(path: Path, results: Path = RESULTS, own: str | None = None) -> list[Miss]:
    """The figures of `path` that no cited folder's JSON holds."""
    misses, before, intro = [], [], []
    name = path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path)
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):         # a config's comments: a line's comment, or an empty line
        text = "\n".join(x.split("#", 1)[1] if "#" in x else "" for x in text.splitlines())
    for line, unit in units(text):
        folders = cited(unit, results)
        row = unit.lstrip().startswith("|")
        if row and re.search(r"\|\s*same\b", unit):
            folders = before + folders
        elif row and not folders:
            folders = intro                      # a table without sources: the paragraph that introduces it
        if row:
            before = folders
        elif unit.lstrip().startswith("#"):
            intro = []
        else:
            intro = folders
        if own:
            folders = [own] + folders
        if not folders:
            continue
        values = [v for f in folders for v in folder_values(results / f)]
        logs = cited_logs(unit, folders, results)
        if own:                                  # a session's README reads its own logs
            logs += sorted(p for p in (results / own).glob("*") if p.suffix in (".log", ".txt"))
        logged = [v for p in logs for v in text_values(p)]
        prose = CODE.sub(" ", unit)
        for n, text in enumerate(prose.splitlines()):
            for m in FIGURE.finditer(text):
                mark = (m.group(2) or "").strip()
                if mark in ("x", "×") or VERSION.search(text[:m.start()]) or BOUND.search(text[:m.start()]):
                    continue                     # a ratio of two figures; a version; a bound (`>= 8.9`)
                if not agrees(m.group(1), mark, values, logged):
                    misses.append(Miss(name, line + n, m.group(1) + mark, tuple(folders)))
    return misses


def documents(repo: Path = REPO) -> list[tuple[Path, str | None]]:
    docs = [(repo / "README.md", None)]
    docs += [(p, None) for p in sorted((repo / "docs").glob("*.md")) if p.name not in ("benchmarks.md",
                                                                                        "config-keys.md")]
    docs += [(p, None) for p in sorted((repo / "config").glob("*.yaml"))]
    docs += [(p, p.parent.name) for p in sorted((repo / "bench" / "results").glob("*/README.md"))]
    return docs


def main(argv=None) -> int:
    misses = [m for p, own in documents(REPO) for m in check(p, RESULTS, own=own)]
    for m in misses:
        print(m)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
