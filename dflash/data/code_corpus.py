"""The code corpus: the Python source files every machine has, split by file, and "complete this function"
conversations made from them.

Files: every `.py` file of the standard library, then of the running interpreter's site-packages (`purelib`,
then `platlib` when it differs), each root walked in sorted order of the path relative to it (the stdlib's own
`site-packages`/`dist-packages` folders and any other root are left out of the stdlib), taken in that order
until the next file would pass `cap_bytes`. A file that is empty, over `MAX_FILE_BYTES`, not UTF-8, or
byte-identical to an earlier one is skipped.

Split: a file is held out when a hash of its path relative to its root falls under `heldout_fraction`
(`is_heldout`, the one place that decides it), so the split of a file is the same on any machine that has it.
The target pre-trains on the other files. The `code` data source (`completion_source`) makes conversations from the
held-out files (`data.code_completion.files: heldout`) or from all files (`all`); each says whether its file is held
out, and the data stage draws its evaluation prompts only from held-out files.

Conversations: for a top-level function or method of 6-60 lines, the user asks to complete it given its
decorators, signature and docstring (a function without a docstring: its signature and first statement), the
assistant answers with the rest of the function; {"id": "code-<root>/<path>:<qualname>:<line>", "file",
"messages"}. `conversations(files, ...)` visits files in a seeded hash order, at most `per_file` per file;
with `processes` > 1 spawned workers parse the files (a script calling it so needs an `if __name__ == "__main__":`
guard, as spawn re-imports the main module; `python -m dflash` is safe).
"""
from __future__ import annotations

import ast
import collections
import dataclasses
import hashlib
import itertools
import multiprocessing
import os
import random
import sysconfig
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from dflash.config_model import CodeCompletionSection, PretrainSection

MAX_FILE_BYTES = 512 * 1024        # larger .py files are mostly generated tables, not code a person wrote
SKIP_IN_STDLIB = ("site-packages", "dist-packages")
MIN_LINES, MAX_LINES = 6, 60       # function sizes worth a prompt (decorators and signature included)
MIN_REST_LINES = 3                 # lines left for the assistant after the prompt
MAX_PER_FILE = 8                   # conversations per file of the target's chat text (the data source: per_file)
PARSE_CHUNK = 16                   # files per task of a parsing worker
PROMPT = "Complete this Python function:\n```python\n{head}\n```"
ANSWER = "```python\n{rest}\n```"


@dataclasses.dataclass(frozen=True)
class CodeFile:
    root: str        # stdlib | purelib | platlib
    rel: str         # path relative to its root, '/'-separated
    text: str
    digest: str      # sha256 of the bytes

    @property
    def name(self) -> str:
        return f"{self.root}/{self.rel}"


def roots() -> list[tuple[str, Path]]:
    """(name, folder) of the corpus roots in their fixed order: stdlib, purelib, platlib (distinct folders)."""
    paths = sysconfig.get_paths()
    out: list[tuple[str, Path]] = []
    for name in ("stdlib", "purelib", "platlib"):
        p = Path(paths[name]).resolve()
        if p.is_dir() and all(p != q for _, q in out):
            out.append((name, p))
    return out


def _walk(root: Path, skip: set[Path]) -> list[tuple[str, int]]:
    """(relative path, size) of the root's .py files, sorted by relative path."""
    found = []
    for d, dirs, files in os.walk(root):
        here = Path(d)
        dirs[:] = [x for x in dirs if (here / x).resolve() not in skip]
        for f in files:
            if f.endswith(".py"):
                p = here / f
                try:
                    size = p.stat().st_size
                except OSError:
                    continue
                found.append((p.relative_to(root).as_posix(), size))
    return sorted(found)


def list_files(cap_bytes: int) -> list[tuple[str, Path, str, int]]:
    """(root name, root, relative path, size) of the files under the cap, in corpus order (no contents read)."""
    rts = roots()
    out, total = [], 0
    for name, root in rts:
        skip = {q for _, q in rts if q != root}
        if name == "stdlib":
            skip |= {(root / s).resolve() for s in SKIP_IN_STDLIB}
        for rel, size in _walk(root, skip):
            if not 0 < size <= MAX_FILE_BYTES:
                continue
            if total + size > cap_bytes:
                return out
            out.append((name, root, rel, size))
            total += size
    return out


def read_files(cap_bytes: int) -> tuple[list[CodeFile], dict]:
    """The corpus files (contents read, duplicates and non-UTF-8 files dropped) and counts of what was skipped."""
    files, seen = [], set()
    skipped = {"not_utf8": 0, "duplicate": 0}
    for name, root, rel, _ in list_files(cap_bytes):
        try:
            raw = (root / rel).read_bytes()
        except OSError:
            continue
        digest = hashlib.sha256(raw).hexdigest()
        if digest in seen:
            skipped["duplicate"] += 1
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if "\x00" in text:
            skipped["not_utf8"] += 1
            continue
        seen.add(digest)
        files.append(CodeFile(name, rel, text, digest))
    return files, skipped


def is_heldout(rel: str, fraction: float) -> bool:
    """Whether the file at `rel` (relative to its root) is held out of pre-training: the split's one rule."""
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) < fraction * 0x100000000


def split(files: list[CodeFile], fraction: float) -> tuple[list[CodeFile], list[CodeFile]]:
    """(pre-training files, held-out files), each in corpus order."""
    held = [is_heldout(f.rel, fraction) for f in files]
    return [f for f, h in zip(files, held) if not h], [f for f, h in zip(files, held) if h]


def files_hash(files: list[CodeFile]) -> str:
    """Hash of the file list and contents (root, path, content hash of each, in order)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.root}/{f.rel}\0{f.digest}\n".encode())
    return h.hexdigest()[:16]


# ---- "complete this function" conversations --------------------------------------------------------------------

def _functions(tree: ast.Module):
    """(qualname, node) of the module's top-level functions and of methods of (nested) classes."""
    stack = [("", tree.body)]
    while stack:
        prefix, body = stack.pop()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + node.name, node
            elif isinstance(node, ast.ClassDef):
                stack.append((f"{prefix}{node.name}.", node.body))


def file_completions(f: CodeFile) -> list[dict]:
    """Every "complete this function" conversation of one file, in source order ([] if it does not parse)."""
    try:
        tree = ast.parse(f.text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    lines = f.text.splitlines()
    out = []
    for qualname, node in _functions(tree):
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.end_lineno
        if not MIN_LINES <= end - start + 1 <= MAX_LINES or len(node.body) < 2:
            continue
        cut = node.body[0].end_lineno                           # docstring, or the first statement
        text = textwrap.dedent("\n".join(lines[start - 1:end]))
        body = text.split("\n")
        head, rest = "\n".join(body[:cut - start + 1]).rstrip(), "\n".join(body[cut - start + 1:]).rstrip()
        if sum(1 for x in rest.split("\n") if x.strip()) < MIN_REST_LINES or not head.strip():
            continue
        out.append({"id": f"code-{f.name}:{qualname}:{node.lineno}", "file": f.name,
                    "messages": [{"role": "user", "content": PROMPT.format(head=head)},
                                 {"role": "assistant", "content": ANSWER.format(rest=rest.strip("\n"))}]})
    return out


def _order(key: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()


def _parse_chunk(files: list[CodeFile]) -> list[list[dict]]:
    return [file_completions(f) for f in files]


def _parsed(files: list[CodeFile], processes: int):
    """file_completions of each file, in order; parsed by `processes` spawned workers (0: every core), at most two
    chunks per worker ahead of the reader, who may stop early. concurrent.futures, not multiprocessing.Pool: a Pool
    ended while its workers still write results (the reader stopped early) could deadlock in terminate(), and it
    never notices a worker that died; an executor's shutdown reads the running chunks to their end, and a dead
    worker raises BrokenProcessPool."""
    processes = processes or os.cpu_count() or 1
    if processes <= 1 or len(files) < 4 * PARSE_CHUNK:
        yield from map(file_completions, files)
        return
    chunks = iter([files[i:i + PARSE_CHUNK] for i in range(0, len(files), PARSE_CHUNK)])
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        ahead = collections.deque(pool.submit(_parse_chunk, c) for c in itertools.islice(chunks, 2 * processes))
        try:
            while ahead:
                done = ahead.popleft().result()
                ahead.extend(pool.submit(_parse_chunk, c) for c in itertools.islice(chunks, 1))
                yield from done
        finally:
            for future in ahead:
                future.cancel()


def conversations(files: list[CodeFile], seed: int = 0, max_count: int | None = None,
                  max_chars: int | None = None, processes: int = 1, per_file: int = MAX_PER_FILE) -> list[dict]:
    """Conversations of `files`: files in a seeded hash order, at most `per_file` each (a seeded choice), until
    `max_count` conversations or `max_chars` characters of message text; deterministic for any `processes`."""
    out, chars = [], 0
    ordered = sorted(files, key=lambda f: _order(f.name, seed))
    for f, convs in zip(ordered, _parsed(ordered, processes)):
        random.Random(_order(f.name, seed)).shuffle(convs)
        for c in convs[:per_file]:
            if (max_count is not None and len(out) >= max_count) or (max_chars is not None and chars >= max_chars):
                return out
            out.append(c)
            chars += sum(len(m["content"]) for m in c["messages"])
    return out


def completion_source(pretrain_cfg: PretrainSection, cc: CodeCompletionSection, seed: int = 0,
                      processes: int = 1) -> list[dict]:
    """The `code` data source: `conversations` of the corpus of `target.pretrain`, of its held-out files only
    (`cc.files` heldout) or of every file (all), `cc.max_conversations` at most, `cc.per_file` a file; each with
    "heldout": whether its file is held out of pre-training."""
    files, _ = read_files(cap_bytes(pretrain_cfg))
    held = {f.name for f in split(files, pretrain_cfg.heldout_fraction)[1]}
    convs = conversations(files if cc.files == "all" else [f for f in files if f.name in held], seed=seed,
                          max_count=cc.max_conversations, processes=processes, per_file=cc.per_file)
    return [{**c, "heldout": c["file"] in held} for c in convs]


def cap_bytes(pretrain_cfg: PretrainSection) -> int:
    """`target.pretrain.corpus_mb` in bytes."""
    return int(pretrain_cfg.corpus_mb * (1 << 20))
