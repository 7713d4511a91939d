"""The files and folders a config names as inputs: every key marked `Reads` in dflash/config_model.py (target.path with
build none, data.sources' paths, drafter.init_from, evaluate.prompt_files), with the Snakemake rules that read it.

The workflow derives from them each rule's declared inputs and the content its key stamp records (dflash.stamps), and
refuses a missing one when it reads the config, before any job, in one line naming the key, the path and the closest
existing name.

Public:
- `Named(key, path, rules)`: one file or folder a key names (`key` with the index of a list item:
  `data.sources[0].path`, `evaluate.prompt_files[1]`)
- `named(cfg, rule=None)` -> [Named] the config reads (that `rule` reads)
- `check(cfg, source)`: ConfigError naming the first one missing
- `closest(path)` -> the existing path most like a missing one, or None
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path

from dflash.config import ConfigError
from dflash.config_model import DflashConfig, Reads, Section


@dataclasses.dataclass(frozen=True)
class Named:
    key: str
    path: str
    rules: tuple[str, ...]


def _walk(section: Section, cfg: DflashConfig, prefix: str = ""):
    for name, field in type(section).model_fields.items():
        value, key = getattr(section, name), prefix + name
        mark = next((m for m in field.metadata if isinstance(m, Reads)), None)
        if mark is not None:
            if value is not None and (mark.when is None or mark.when(cfg, section)):
                many = isinstance(value, tuple)
                for i, path in enumerate(value if many else (value,)):
                    yield Named(f"{key}[{i}]" if many else key, str(path), mark.rules)
        elif isinstance(value, Section):
            yield from _walk(value, cfg, key + ".")
        elif isinstance(value, tuple):
            for i, item in enumerate(value):
                if isinstance(item, Section):
                    yield from _walk(item, cfg, f"{key}[{i}].")


def named(cfg: DflashConfig, rule: str | None = None) -> list[Named]:
    """Every file or folder `cfg` names as an input (read by `rule`; None: by any rule), in the models' key order."""
    return [n for n in _walk(cfg, cfg) if rule is None or rule in n.rules]


def closest(path: str | Path) -> str | None:
    """The existing path most like the missing `path`: its nearest existing folder joined with the entry of that
    folder closest to the first missing part (difflib), or None when no entry is close."""
    path = Path(path)
    parts = path.parts
    base = Path(parts[0]) if path.is_absolute() else Path(".")
    for i, part in enumerate(parts[1:] if path.is_absolute() else parts):
        if not (base / part).exists():
            try:
                names = sorted(os.listdir(base))
            except OSError:
                return None
            names = [n for n in names if not n.startswith(".") or part.startswith(".")]
            match = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
            return os.path.normpath(base / match[0]) if match else None
        base = base / part
    return None


def check(cfg: DflashConfig, source: str) -> None:
    """Every file or folder the config names as an input exists, or a ConfigError naming the first missing one: the
    config file, the key, the path and the closest existing name."""
    for n in named(cfg):
        if not os.path.exists(n.path):
            near = closest(n.path)
            hint = f"; the closest existing name is {near}" if near else ""
            raise ConfigError(f"{source}: {n.key} names {n.path}, which does not exist{hint}")
