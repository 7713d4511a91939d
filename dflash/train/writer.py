"""The writer of a run folder: one at a time, and able to write there before anything is trained.

`hold(run_dir)` takes an exclusive OS lock (flock) on `<run>/train.lock` for the life of the `train` process and
writes its record there (pid, host, start, command). A second `train` on the folder is refused in one line naming
that live process, however either was started and whatever happened meanwhile: kill -9 of Snakemake, its `--unlock`
and `--rerun-incomplete` leave the first process running, and the lock is that process, not a file anyone deletes
(the file is no stage's output and stays; the kernel drops the lock when the process ends, however it ends, so a
stale record never blocks). The distributed runtime has one writer: its launcher holds the lock for the ranks it
starts (they find HELD in their environment); with several nodes (a launcher on each) the launchers take it in turn to
restore a finished run, and the writer rank holds it for the run, as where torchrun started the ranks itself.
`check_writable(run_dir)`: every folder train writes into is writable, or one line names it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from dflash.errors import UserError
from dflash.paths import RunFolder

log = logging.getLogger("dflash.train")
HELD = "DFLASH_TRAIN_LOCK"   # "<pid>:<run folder>" while that process holds the lock, inherited by what it starts
_held: dict[str, int] = {}   # run folder -> this process's lock fd (closed, never unlocked, in a forked child)


@contextlib.contextmanager
def hold(run_dir, wait_s: float = 0):
    """This process is the one writer of `run_dir` while the block runs: UserError naming the live writer otherwise
    (after waiting up to `wait_s` for it to let go)."""
    run_dir = Path(run_dir).resolve()
    key = str(run_dir)
    if os.environ.get(HELD) == f"{os.getppid()}:{key}":   # a rank the launcher started: it holds the lock for us
        yield
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = _acquire(RunFolder(run_dir).lock, time.monotonic() + wait_s)
    before = os.environ.get(HELD)
    os.environ[HELD] = f"{os.getpid()}:{key}"
    if fd is not None:
        _held[key] = fd
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HELD, None)
        else:
            os.environ[HELD] = before
        if _held.pop(key, None) is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def _acquire(path: Path, deadline: float) -> int | None:
    """The locked fd of `path` with this process's record in it; None where the file system has no locks."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            os.close(fd)
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            raise UserError(_refusal(path, record)) from None
        except OSError as e:   # ENOLCK, EOPNOTSUPP: a file system without locks
            os.close(fd)
            log.warning("%s: cannot be locked (%s): a second train on this run folder will not be refused", path,
                        e.strerror)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)   # removed or replaced between open and lock: lock the file that is there now
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "started_at": datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": shlex.join(getattr(sys, "orig_argv", sys.argv))}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def _read(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0) or b"{}")
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def _refusal(path: Path, record: dict) -> str:
    pid, host = record.get("pid"), record.get("host")
    if pid is None:
        who = f"a live process (its record in {path} is still being written)"
        stop = "wait for it to end"
    else:
        command = " ".join(str(record.get("command", "?")).split())   # one line
        who = (f"pid {pid} on {host}, started {record.get('started_at', '?')} "
               f"({command[:200]}{'...' if len(command) > 200 else ''})")
        stop = f"wait for it to end, or stop it (`kill {pid}` on {host}: it checkpoints first)"
    return f"{path.parent}: another train is writing this run folder: {who}; {stop}, then rerun"


def _close_in_child():
    for fd in _held.values():   # closing drops the child's reference; the parent keeps its lock
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def check_writable(run_dir) -> None:
    """Before anything is loaded or trained: the run folder and every folder train writes into or replaces there
    (checkpoints/, its identity folders, checkpoints.previous/ of the old layout, ranks/) take a new file, and the lock
    file opens for writing; else UserError naming the first that does not (a write-protected folder, a read-only file system)."""
    run_dir, folder = Path(run_dir), RunFolder(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        subs = (folder.checkpoints, run_dir / "checkpoints.previous", folder.ranks)
        for d in [run_dir] + [d for sub in subs if sub.is_dir()
                              for d in (sub, *sorted(p for p in sub.iterdir() if p.is_dir()))]:
            fd, tmp = tempfile.mkstemp(prefix=".writable.", dir=d)
            os.close(fd)
            os.unlink(tmp)
        if folder.lock.is_file():
            open(folder.lock, "a").close()
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        where = Path(e.filename) if e.filename else run_dir
        where = where.parent if where.name.startswith(".writable.") else where
        where = next(p for p in (where, *where.parents) if p.exists())   # a folder it could not make: its parent
        raise UserError(f"{where}: not writable ({e.strerror}); train writes its checkpoints and outputs there: make "
                        f"it writable (chmod -R u+w {where}) or train into another run folder (run_name or "
                        f"--run-dir)") from None
