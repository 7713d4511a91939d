"""Atomic outputs: a stage either leaves a complete file (or folder) or none at all; it never replaces what it did not
make, nor removes a file a user added to a folder it made; what it writes has the modes the umask gives.

Public:
- `atomic_write_text(path, text)`, `atomic_write_json(path, obj)`: a file, replaced in one rename
- `atomic_dir(path, record=None, layout=None)`: a folder, replaced in one rename (with `record`: `check_ours` first)
- `check_ours(path, record, remedy, layout)`: refuse a folder the stage did not make, or one holding files it did not
  write, naming them
- `check_file_ours(path, keys, stage)`: refuse a folder, or a file that is not the stage's JSON, where it writes a file
- `describe_files(folder, skip)`: {name: {size, mtime_ns, sha256}} of a folder's files (a record's `files`)
- `files_in(folder)`, `follow_umask(path)`, `read_json(path)`
- `temp_prefix(path)`, `sweep(path)`: the name of `path`'s temporary sibling (`.NAME.PID-HOST.XXXXXXXX`), and the
  removal of those a process of this host left when it died mid-write; every writer above sweeps first
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from dflash.errors import UserError, io_error


# This host, in the names of temporaries: on a disk several hosts share, a pid means something only on its own host.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def temp_prefix(path: Path) -> str:
    """The name of `path`'s temporary sibling up to its random part: its writer's pid and host, so that a later writer
    of `path` can tell one left by a dead process (`sweep`)."""
    return f".{path.name}.{os.getpid()}-{_HOST}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:            # another user's process
        return True
    return True


def sweep(path: str | Path) -> list[Path]:
    """Remove the temporaries of `path` (files or folders, named by `temp_prefix`) that a process of this host left
    when it died mid-write (kill -9, a lost node, a SIGTERM that ran no cleanup); never one of this process, of a
    process still running, or of another host, nor a name of another form. Returns what it removed."""
    path = Path(path)
    start, mine = f".{path.name}.", re.compile(rf"\.{re.escape(path.name)}\.([0-9]+)-{_HOST}\.[^/]+")
    gone = []
    try:
        with os.scandir(path.parent) as listing:
            entries = [e for e in listing if e.name.startswith(start)]
    except OSError:
        return gone
    for entry in entries:
        m = mine.fullmatch(entry.name)
        if m and int(m[1]) != os.getpid() and not _alive(int(m[1])):
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                gone.append(Path(entry.path))
    return gone


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: a folder, where a file is to be written: give the path of a file")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
    except OSError as e:
        raise io_error(e, path.parent if isinstance(e, PermissionError) else path, "write") or e
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and io_error(e):
            raise io_error(e, path, "write") from e
        raise
    return path


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (os.umask sets it for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give `path` and everything under it the modes the umask gives a new file or folder (0644 / 0755 under 022):
    safetensors writes its files 0600, which a server under another account cannot read."""
    mask = _umask()
    for root, dirs, files in os.walk(path):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, (0o777 if os.stat(p).st_mode & 0o111 else 0o666) & ~mask)


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def files_in(folder: str | Path) -> list[str]:
    """Every entry of `folder` that is not a folder (files, links), as sorted paths relative to it."""
    folder = Path(folder)
    out = []
    for root, dirs, files in os.walk(folder):
        out += [Path(root, n).relative_to(folder).as_posix() for n in files]
        out += [Path(root, n).relative_to(folder).as_posix() for n in dirs if os.path.islink(os.path.join(root, n))]
    return sorted(out)


def sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def describe_files(folder: str | Path, skip=(), hash_limit: int | None = None) -> dict[str, dict]:
    """{relative name: {size, mtime_ns, sha256}} of every file in `folder` but `skip` (the sha256 of files up to
    `hash_limit` bytes; None: of all): what a record (build.json, export.json) lists, so that a later change is found
    and a file added by hand is told from the stage's own."""
    folder = Path(folder)
    out = {}
    for name in files_in(folder):
        if name not in skip:
            st = (folder / name).stat()
            out[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            if hash_limit is None or st.st_size <= hash_limit:
                out[name]["sha256"] = sha256(folder / name)
    return out


SNAKEMAKE = {".snakemake_timestamp"}   # what Snakemake writes into a directory() output after its job


def _listed(record: Path) -> set[str] | None:
    """The names a record's `files` lists (a dict or a list), None when it lists none or cannot be read."""
    try:
        files = json.loads(record.read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(files) if isinstance(files, (dict, list)) else None


def _names(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_ours(path: str | Path, record: str, remedy: str = "move it away, or give another output folder",
               layout: str | None = None) -> None:
    """A stage never replaces what it did not make, nor removes a file a user added to a folder it made. `path` may
    be missing or hold no file. Otherwise it must be a folder holding `record` (the file the stage writes into every
    folder it makes: build.json, manifest.json, part.json, export.json) and nothing but what the stage wrote there:
    the names the record's `files` lists, or (`layout`, a regular expression of relative names) the names the stage
    writes. A folder without its record is the stage's when files in its subfolders fit `layout` (Snakemake removes a
    rule's declared output files, e.g. manifest.json and holdout.jsonl, before its job; the stage's subfolders stay).
    Anything else is refused, naming the path and the files."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: a file, where a folder is to be written: {remedy}")
    if not path.is_dir():
        return
    names = [n for n in files_in(path) if n not in SNAKEMAKE]
    if not names:
        return
    fits = re.compile(layout).fullmatch if layout else (lambda n: False)
    if (path / record).is_file():
        listed = _listed(path / record)
        if listed is None and layout is None:
            return   # a record that lists nothing (written by an older version): every file is the stage's
        extra = [n for n in names if n != record and n not in (listed or ()) and not fits(n)]
    elif any(fits(n) and "/" in n for n in names):
        extra = [n for n in names if not fits(n)]
    else:
        raise UserError(f"{path}: exists and was not made by this pipeline (no {record} in it), so it is never "
                        f"replaced: {remedy}")
    if extra:
        raise UserError(f"{path}: {_names(extra)} in it {'were' if len(extra) > 1 else 'was'} not written by the "
                        f"stage that made it ({record} does not list {'them' if len(extra) > 1 else 'it'}), and a "
                        f"rerun replaces the folder whole: move {'them' if len(extra) > 1 else 'it'} out of the "
                        f"folder, or give another output folder")


def check_file_ours(path: str | Path, keys: tuple[str, ...], stage: str) -> Path:
    """Where a stage writes a file: refused when it is a folder, or an existing file that is not the stage's JSON (an
    object with all of `keys`), or in a folder that cannot be written (made if missing). Checked before the work."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: a folder, where the {stage} stage writes a file: give the path of a file "
                        f"(e.g. {path / (stage + '.json')})")
    if path.exists():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            doc = None
        if not (isinstance(doc, dict) and all(k in doc for k in keys)):
            raise UserError(f"{path}: exists and was not written by the {stage} stage (no JSON object with "
                            f"{', '.join(keys)}), so it is never replaced: move it away, or give another path")
    try:   # a real probe (permissions, a read-only disk, a file in the way): os.access says yes to root everywhere
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise io_error(e, path.parent, "write") or e
    return path


@contextlib.contextmanager
def atomic_dir(path: str | Path, record: str | None = None, layout: str | None = None,
               remedy: str = "move it away, or give another output folder"):
    """Yield a temporary sibling folder; on success its modes follow the umask and it replaces `path` in one rename.
    With `record`, an existing `path` is checked first (`check_ours`): what the stage did not write is never removed."""
    path = Path(path)
    if record is not None:
        check_ours(path, record, remedy, layout)
    elif path.exists() and not path.is_dir():
        raise UserError(f"{path}: a file, where a folder is to be written: {remedy}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        sweep(path)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path), dir=path.parent))
    except OSError as e:
        raise io_error(e, path.parent, "write") or e
    try:
        yield tmp
        try:
            follow_umask(tmp)
            if path.exists():
                old = path.with_name(f".{path.name}.old")
                shutil.rmtree(old, ignore_errors=True)
                os.replace(path, old)
                os.replace(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, path)
        except OSError as e:
            raise io_error(e, path, "write") or e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())
