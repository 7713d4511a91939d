"""What every bench script shares: the timer, the time budget, the record envelope and the section registry.

- `median_ms(fn)`: median milliseconds of fn() (CUDA events on a GPU, the wall clock on the CPU); `peak_gb(fn)`;
  `Stopwatch`: wall seconds since it started.
- `Budget(seconds, reserve)`: the seconds a bounded call has left, less a reserve, capped.
- `envelope()`: what every JSON a bench writes carries: the exact command (with the BENCH_* and CUDA_VISIBLE_DEVICES
  variables it ran under), date, device, Python/torch/CUDA/triton/transformers versions and the tree it ran
  (`tree_state`). `Record(path)`: a JSON document that starts with the envelope and is saved whole (atomically).
- `tree_state()`: the tree as a content hash of its source files (TREE: dflash/, bench/ less its results, config/,
  workflow/, envs/, Snakefile, pyproject.toml), computed from the files on disk, so it holds where `.git` is stale or
  absent (the lent GPU machine); the commit only where git's HEAD holds exactly these files. `python bench/common.py
  tree [REV]` prints the hash of the working tree or of a commit; `--find HASH` names the commit(s) with that tree.
- `portable(x)`: x (a string, or every string in a list or dict) without the paths of the machine that ran it: the
  repository's own relative to it, a virtual environment `<venv>`, a site-packages folder `<site>`, the temporary
  folder `<tmp>`, the home folder `~`. `Record.save()`, the commands, the summaries a bench copies out and the text
  files it archives (`add_portable`) pass through it: a committed result names no machine
  (tests/unit/test_results_paths.py).
- `Option`, `Section`, `Registry`: sections registered by name, each with its options (`--opt SECTION.NAME=VALUE`,
  else the environment variable it replaces, else its default).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import shlex
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
TREE = ("dflash", "bench", "config", "workflow", "envs", "Snakefile", "pyproject.toml")
NOT_TREE = ("bench/results/", "bench/out/")          # results and outputs are not code
RECORDED_ENV = ("CUDA_VISIBLE_DEVICES",)             # besides every BENCH_* variable


# ---- timing ---------------------------------------------------------------------------------------------------
def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def median_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup`: CUDA events on a GPU, the wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if not _cuda():
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]
    import torch
    torch.cuda.synchronize()
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def peak_gb(fn) -> float | None:
    """Peak GB allocated by fn() above what was allocated before it (None on the CPU)."""
    if not _cuda():
        return None
    import torch
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


class Stopwatch:
    """Wall seconds since it was made (monotonic)."""

    def __init__(self):
        self.t0 = time.monotonic()

    @property
    def s(self) -> float:
        return time.monotonic() - self.t0


class Budget:
    """The seconds left of a bounded call: `left(cap)` is min(cap, seconds left - reserve), never below 0."""

    def __init__(self, seconds: float, reserve: float = 0.0):
        self.end, self.reserve = time.monotonic() + seconds, reserve

    def left(self, cap: float = math.inf) -> float:
        return max(0.0, min(cap, self.end - time.monotonic() - self.reserve))


# ---- the tree -------------------------------------------------------------------------------------------------
def counted(path: str) -> bool:
    """Whether a repository path (posix, relative) is part of the tree a bench records."""
    top = path.split("/", 1)[0]
    return (top in TREE and not path.startswith(NOT_TREE) and "/__pycache__/" not in f"/{path}"
            and not path.endswith((".pyc", ".pyo")) and ".egg-info/" not in path)


def blob_sha(data: bytes) -> str:
    """git's object id of a file's content (a blob), so a working tree and a commit hash alike."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def tree_hash(blobs: dict[str, str]) -> str:
    """16 hex of {path: blob id}, path-sorted."""
    text = "".join(f"{p} {b}\n" for p, b in sorted(blobs.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def working_blobs(root: Path = REPO) -> dict[str, str]:
    """{path: blob id} of the tree's files on disk (git or not; symbolic links and ignored outputs left out)."""
    out = {}
    for top in TREE:
        base = root / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() \
            else []
        for f in files:
            rel = f.relative_to(root).as_posix()
            if counted(rel) and not f.is_symlink():
                out[rel] = blob_sha(f.read_bytes())
    return out


def git(*args, root: Path = REPO) -> str | None:
    """git's output, or None where git or the repository is missing or the command fails."""
    try:
        r = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def commit_blobs(rev: str, root: Path = REPO) -> dict[str, str] | None:
    """{path: blob id} of the tree's files in commit `rev` (None where git cannot read it)."""
    text = git("ls-tree", "-r", "--full-tree", rev, "--", *TREE, root=root)
    if text is None:
        return None
    out = {}
    for line in text.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind == "blob" and mode != "120000" and counted(path):
            out[path] = sha
    return out


def tree_state(root: Path = REPO) -> dict:
    """The tree a bench runs: `hash` of its files on disk, `files`, and `commit` (git's HEAD) only where HEAD holds
    exactly these files; otherwise `head` (what git says, possibly stale) and `differs` (a count, up to 10 paths)."""
    blobs = working_blobs(root)
    out = {"hash": tree_hash(blobs), "files": len(blobs), "commit": None}
    head = (git("rev-parse", "HEAD", root=root) or "").strip() or None
    if head is None:
        return out
    theirs = commit_blobs(head, root) or {}
    diff = sorted(p for p in set(blobs) | set(theirs) if blobs.get(p) != theirs.get(p))
    if not diff:
        out["commit"] = head
    else:
        out.update(head=head, differs={"count": len(diff), "paths": diff[:10]})
    return out


def tree_label(tree: dict | None) -> str:
    """A tree record in a few words: the short commit, or the content hash and how it differs from git's HEAD."""
    if not tree:
        return "unknown"
    if tree.get("commit"):
        return tree["commit"][:7]
    head = f"; HEAD {tree['head'][:7]} differs in {tree['differs']['count']} file(s)" if tree.get("head") else ""
    return f"content {tree['hash']} (not a commit{head})"


def find_commits(hash_: str, revs: int = 200, root: Path = REPO) -> list[str]:
    """The commits (of the last `revs` of every branch) whose tree hashes to `hash_`."""
    found = []
    for rev in (git("rev-list", "-n", str(revs), "--all", root=root) or "").split():
        blobs = commit_blobs(rev, root)
        if blobs is not None and tree_hash(blobs) == hash_:
            found.append(rev)
    return found


# ---- the record -----------------------------------------------------------------------------------------------
def machine_prefixes(root: Path = REPO) -> list[tuple[str, str]]:
    """(absolute folder, what a record writes for it), the longest first: the repository ('' : relative to it), the
    site-packages folders and PYTHONPATH's, a virtual environment's prefix, the temporary folder, the home folder."""
    pairs = [(str(root), "")]
    sites = [*site.getsitepackages(), site.getusersitepackages(), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    pairs += [(s, "<site>") for s in sites if s and os.path.isabs(s)]
    pairs += [(sys.prefix, "<venv>")] if sys.prefix != sys.base_prefix else []      # a system Python's is no machine's
    pairs += [(tempfile.gettempdir(), "<tmp>"), (str(Path.home()), "~")]
    pairs = [(str(Path(a)), b) for a, b in pairs if a and a != "/"]
    return sorted(set(pairs), key=lambda p: -len(p[0]))


def portable(x, root: Path = REPO):
    """x with the machine's paths written as machine_prefixes() says (a string, or every string inside a list, tuple
    or dict): a result that names no machine. A prefix counts only where a path starts (not inside a word or another
    path) and ends at a `/` or where the path does: `/work/main/dflash/x.py` is `dflash/x.py`, `/work/main` alone
    `.`."""
    if isinstance(x, dict):
        return {k: portable(v, root) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(portable(v, root) for v in x)
    if not isinstance(x, str):
        return x
    for prefix, label in machine_prefixes(root):
        start, end = r"(?<![\w.~/-])" + re.escape(prefix), r"(?![\w.-])"
        if label:
            x = re.sub(start + end, lambda _: label, x)
        else:
            x = re.sub(start + "/" + r"(?=[\w.])", "", x)
            x = re.sub(start + end + r"(?!/)", ".", x)
    return x


PORTABLE_TEXT = (".json", ".jsonl", ".log", ".txt", ".md", ".yaml", ".yml", ".csv")


def add_portable(tar, path: Path, arcname: str) -> None:
    """path into an open tarfile as arcname; a text file (PORTABLE_TEXT) with its machine paths written portably."""
    import io
    if path.suffix not in PORTABLE_TEXT:
        tar.add(path, arcname=arcname)
        return
    data = portable(path.read_text(errors="surrogateescape")).encode(errors="surrogateescape")
    info = tar.gettarinfo(str(path), arcname=arcname)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def command(argv: list[str] | None = None) -> str:
    """The command as it can be typed again: the recorded environment variables, the interpreter, the arguments (the
    machine's paths written portably: `portable`)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith("BENCH_") or k in RECORDED_ENV]
    return portable(" ".join([*env, shlex.join([Path(sys.executable).name, *(sys.argv if argv is None else argv)])]))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def devices() -> list[str]:
    import torch
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []


def envelope(argv: list[str] | None = None) -> dict:
    """command, date, device (the first GPU's name, or cpu), devices, versions (torch, cuda, triton, transformers,
    python) and tree: the head of every JSON a bench writes."""
    import torch
    gpus = devices()
    return {"command": command(argv), "date": datetime.now(timezone.utc).isoformat(),
            "device": gpus[0] if gpus else "cpu", "devices": gpus, **versions(), "cuda": torch.version.cuda,
            "tree": tree_state()}


class Record(dict):
    """A bench's JSON: the envelope, then what the bench adds; `save()` writes it whole (temp file + rename)."""

    def __init__(self, path: str | Path, argv: list[str] | None = None):
        super().__init__(envelope(argv))
        self.path = Path(path)

    def save(self) -> Path:
        from dflash.atomic import atomic_write_json
        return atomic_write_json(self.path, portable(dict(self)))


# ---- sections by name -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    name: str
    default: str
    help: str
    env: str | None = None          # the variable that set it before --opt (still read)


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable                   # run(job) -> dict
    help: str
    default: bool = False           # in the default selection
    options: tuple[Option, ...] = ()


@dataclass
class Job:
    """What a section runs with: its output folder, its options (Registry.options), the bench's arguments."""
    out: Path
    opts: dict = field(default_factory=dict)
    steps: int = 0
    shapes: object = None            # bench.shapes.Shapes of the bench's config
    record: dict = field(default_factory=dict)   # the envelope, for what a section writes beside the JSON


@dataclass
class Registry:
    sections: list[Section]
    by_name: dict[str, Section] = field(init=False)

    def __post_init__(self):
        self.by_name = {s.name: s for s in self.sections}

    def select(self, names: list[str]) -> list[Section]:
        unknown = [n for n in names if n not in self.by_name]
        if unknown:
            raise ValueError(f"unknown section(s) {', '.join(unknown)}; known: {', '.join(self.by_name)}")
        return [self.by_name[n] for n in names]

    def defaults(self) -> list[str]:
        return [s.name for s in self.sections if s.default]

    def parse_opts(self, items: list[str]) -> dict[tuple[str, str], str]:
        """`SECTION.NAME=VALUE` items -> {(section, name): value}, each naming an option that exists."""
        out = {}
        for item in items:
            key, eq, value = item.partition("=")
            sec, _, name = key.partition(".")
            if not eq or sec not in self.by_name or name not in {o.name for o in self.by_name[sec].options}:
                known = [f"{s.name}.{o.name}" for s in self.sections for o in s.options]
                raise ValueError(f"--opt {item!r}: give SECTION.NAME=VALUE with one of {', '.join(known)}")
            out[(sec, name)] = value
        return out

    def options(self, section: Section, given: dict[tuple[str, str], str]) -> dict[str, str]:
        """Each option of `section`: --opt, else its environment variable, else its default."""
        return {o.name: given.get((section.name, o.name), os.environ.get(o.env or "", o.default) if o.env
                                  else o.default) for o in section.options}

    def describe(self) -> str:
        lines = []
        for s in self.sections:
            lines.append(f"{s.name}{' (default)' if s.default else ''}: {s.help}")
            lines += [f"    --opt {s.name}.{o.name}=...  {o.help} (default {o.default!r}"
                      f"{f'; env {o.env}' if o.env else ''})" for o in s.options]
        return "\n".join(lines)


def archive(out: Path, paths: list[str]) -> int:
    """out (.tar.gz) of the files and folders named (relative paths kept), text files written portably."""
    import tarfile
    with tarfile.open(out, "w:gz") as tar:
        for name in paths:
            top = Path(name)
            for f in sorted([top] if top.is_file() else top.rglob("*") if top.is_dir() else []):
                if f.is_file():
                    add_portable(tar, f, f.as_posix())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The tree a bench records: python bench/common.py tree [REV] [--find H]; "
                                            "an archive without machine paths: python bench/common.py archive OUT "
                                            "PATH...")
    p.add_argument("what", choices=["tree", "archive"])
    p.add_argument("rev", nargs="?", help="a commit (default: the files on disk); archive: the .tar.gz to write")
    p.add_argument("paths", nargs="*", help="archive: the files and folders it holds")
    p.add_argument("--find", metavar="HASH", help="name the commits whose tree hashes to HASH")
    args = p.parse_args(argv)
    if args.what == "archive":
        return archive(Path(args.rev), args.paths)
    if args.find:
        found = find_commits(args.find)
        print("\n".join(found) or f"no commit of the last 200 has tree {args.find}")
        return 0 if found else 1
    if args.rev:
        blobs = commit_blobs(args.rev)
        if blobs is None:
            print(f"{args.rev}: not a commit git can read here", file=sys.stderr)
            return 2
        print(tree_hash(blobs))
        return 0
    print(tree_state())
    return 0


if __name__ == "__main__":
    sys.exit(main())
