"""Content records: a file or folder by what it holds (every file's size and sha256), never by its mtime, so that a
copy, a `touch` or a folder's mtime changes nothing and an edit in place is seen. Digests are cached by each file's
(size, mtime_ns, ctime_ns) in one JSON file: a many-GB model folder is read once, then costs a stat per file.

Public:
- `Digests(cache_file=None)`: `.sha256(path)` through the cache; `.save()` writes the cache (atomically) when it changed
- `record(path, digests)` -> {"size", "sha256"} of a file, {"files": {name: [size, sha256]}} of a folder (hidden names
  left out, as loaders and Snakemake's `.snakemake_timestamp` are), {"missing": true} when there is nothing
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dflash.atomic import atomic_write_json, files_in, sha256


class Digests:
    """sha256 of files, cached by path and (size, mtime_ns, ctime_ns): a write moves the ctime even when the mtime is
    set back, so a cached digest is only reused for the bytes it was taken of."""

    def __init__(self, cache_file: str | Path | None = None):
        self.file, self.changed = (Path(cache_file) if cache_file else None), False
        try:
            self.cache = json.loads(self.file.read_text()) if self.file else {}
        except (OSError, ValueError):
            self.cache = {}
        if not isinstance(self.cache, dict):
            self.cache = {}

    def sha256(self, path: str | Path) -> str:
        path = Path(path).resolve()
        st = path.stat()
        key, stat = str(path), [st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        hit = self.cache.get(key)
        if isinstance(hit, list) and hit[:3] == stat and len(hit) == 4:
            return hit[3]
        digest = sha256(path)
        self.cache[key], self.changed = stat + [digest], True
        return digest

    def save(self) -> None:
        """Write the cache when it changed, dropping the entries of files that are gone."""
        if self.file is None or not self.changed:
            return
        self.cache = {k: v for k, v in self.cache.items() if os.path.exists(k)}
        atomic_write_json(self.file, self.cache)
        self.changed = False


def _hidden(name: str) -> bool:
    return any(part.startswith(".") for part in name.split("/"))


def record(path: str | Path, digests: Digests) -> dict:
    """What `path` holds: a file's size and sha256, or a folder's files (hidden ones left out) each with its size and
    sha256; {"missing": True} when it does not exist."""
    path = Path(path)
    if path.is_dir():
        return {"files": {name: [(path / name).stat().st_size, digests.sha256(path / name)]
                          for name in files_in(path) if not _hidden(name) and (path / name).is_file()}}
    if path.is_file():
        return {"size": path.stat().st_size, "sha256": digests.sha256(path)}
    return {"missing": True}
