"""Results made before the bench wrote them portably (bench/common.py `portable`), rewritten in place: the machine's
paths in their text files and in the text members of their archives, as the bench writes them now.

    python bench/portable.py --root /work/main bench/results/2026-12-08-h200-r11/    # ROOT: the repository's copy
                                                                                     # on the machine that ran it
The repository's paths become relative to it; a site-packages folder (and `--site`, default /tmp/site, where
bench/device_wheels.sh installs the carried wheels) `<site>`; a virtual environment `<venv>`; /tmp `<tmp>`; /root and
/home/USER `~`. Only strings change: every JSON (and JSON-lines) file is compared before and after, numbers and keys
equal, or nothing is written. tests/unit/test_results_paths.py fails on a committed result that still names a machine.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import sys
import tarfile
from pathlib import Path

START, END = r"(?<![\w.~/-])", r"(?![\w.-])"
TEXT = (".json", ".jsonl", ".log", ".txt", ".md", ".yaml", ".yml", ".csv")


def rules(root: str, sites: list[str]) -> list[tuple[re.Pattern, str]]:
    """(pattern, replacement) in the order they apply: the repository, site-packages, venvs, /tmp, the home folders."""
    root = re.escape(str(Path(root)))
    out = [(START + root + r"/(?=[\w.])", ""), (START + root + END + r"(?!/)", ".")]
    out += [(START + r"/[\w./-]*?/site-packages" + END, "<site>")]
    out += [(START + re.escape(str(Path(s))) + END, "<site>") for s in sites]
    out += [(START + r"/[\w./-]*?/\.?venv" + END, "<venv>"), (START + r"/tmp" + END, "<tmp>"),
            (START + r"/root" + END, "~"), (START + r"/home/[\w.-]+" + END, "~")]
    return [(re.compile(p), r) for p, r in out]


def rewrite(text: str, rs) -> str:
    for pattern, replacement in rs:
        text = pattern.sub(lambda _: replacement, text)
    return text


def same_but_strings(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same_but_strings(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same_but_strings(x, y) for x, y in zip(a, b))
    return isinstance(b, str) if isinstance(a, str) else (a == b and type(a) is type(b))


def checked(name: str, old: str, new: str) -> str:
    """new, after checking that a JSON (or JSON-lines) text changed in its strings alone."""
    docs = [(old, new)] if name.endswith(".json") else \
        list(zip(old.splitlines(), new.splitlines())) if name.endswith(".jsonl") else []
    for a, b in docs:
        if a.strip() and not same_but_strings(json.loads(a), json.loads(b)):
            raise ValueError(f"{name}: rewriting would change more than its strings")
    return new


def rewrite_archive(path: Path, rs) -> int:
    """The text members of a .tar.gz rewritten (the others as they are); the number changed."""
    out, changed = io.BytesIO(), 0
    with tarfile.open(path) as src, tarfile.open(fileobj=out, mode="w:gz", format=src.format) as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isfile() else None
            if data is not None and m.name.endswith(TEXT):
                old = data.decode("utf-8", errors="surrogateescape")
                new = checked(f"{path}!{m.name}", old, rewrite(old, rs))
                if new != old:
                    data, changed = new.encode("utf-8", errors="surrogateescape"), changed + 1
            if data is None:
                dst.addfile(m)
            else:
                m.size = len(data)
                dst.addfile(m, io.BytesIO(data))
    if changed:
        path.write_bytes(out.getvalue())
    return changed


def rewrite_paths(paths: list[Path], rs) -> list[str]:
    """Every text file and archive under paths rewritten; the names of those that changed."""
    done = []
    for top in paths:
        for p in sorted([top] if top.is_file() else (x for x in top.rglob("*") if x.is_file())):
            if p.name.endswith((".tar.gz", ".tgz")):
                if rewrite_archive(p, rs):
                    done.append(str(p))
            elif p.name.endswith(TEXT):
                old = p.read_text(errors="surrogateescape")
                new = checked(str(p), old, rewrite(old, rs))
                if new != old:
                    p.write_text(new, errors="surrogateescape")
                    done.append(str(p))
    return done


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="the repository's folder on the machine that made the files")
    p.add_argument("--site", action="append", default=None, help="a folder of installed packages (default /tmp/site)")
    p.add_argument("paths", nargs="+", type=Path)
    args = p.parse_args(argv)
    for name in rewrite_paths(args.paths, rules(args.root, args.site or ["/tmp/site"])):
        print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
