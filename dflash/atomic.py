"""Atomic outputs: a stage either leaves a complete file (or folder) or none at all."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(path: str | Path, obj) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def check_ours(path: str | Path, record: str, remedy: str = "move it away, or give another output folder") -> None:
    """A stage never deletes what it did not make: an existing `path` that is not an empty folder and holds no
    `record` (the file the stage writes into every folder it makes, e.g. build.json) is refused, naming both."""
    path = Path(path)
    if path.exists() and not (path / record).is_file() and not (path.is_dir() and not any(path.iterdir())):
        from dflash.errors import UserError
        raise UserError(f"{path}: exists and was not made by this pipeline (no {record} in it), so it is never "
                        f"replaced: {remedy}")


@contextlib.contextmanager
def atomic_dir(path: str | Path, record: str | None = None):
    """Yield a temporary sibling folder; on success it replaces `path` in one rename. With `record`, an existing
    `path` without that file is refused first (`check_ours`)."""
    path = Path(path)
    if record is not None:
        check_ours(path, record)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_json(path: str | Path):
    return json.loads(Path(path).read_text())
