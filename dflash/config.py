"""Config: one YAML, validated by workflow/schemas/config.schema.yaml, loaded into typed, frozen objects.

The schema is the single source of truth: defaults and types come from it, and the dataclasses are built from it,
so a key exists in exactly one place. Errors are one line naming the config file and the key.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

REPO = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO / "workflow" / "schemas" / "config.schema.yaml"
# Keys that name or place a run but do not change what it computes: left out of the config hash.
UNHASHED = ("run_name", "results_dir", "report", "evaluate", "strict_env")


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file and the key."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def apply_defaults(data: Any, schema: dict) -> Any:
    """Fill missing keys from schema defaults, recursing into objects and arrays of objects."""
    if isinstance(data, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in data and "default" in sub:
                data[key] = copy.deepcopy(sub["default"])
            if key in data:
                data[key] = apply_defaults(data[key], sub)
    elif isinstance(data, list) and isinstance(schema.get("items"), dict):
        data = [apply_defaults(x, schema["items"]) for x in data]
    return data


def _key(path) -> str:
    return ".".join(str(p) for p in path) or "<top level>"


def validate(data: dict, source: str = "<config>", schema: dict | None = None) -> dict:
    """Apply defaults and validate; return the resolved dict or raise ConfigError naming the key."""
    schema = schema or load_schema()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, got {type(data).__name__}")
    data = apply_defaults(copy.deepcopy(data), schema)
    errors = sorted(Draft202012Validator(schema).iter_errors(data), key=lambda e: (len(e.absolute_path), str(e.absolute_path)))
    if errors:
        e = errors[0]
        if e.validator == "additionalProperties":
            allowed = sorted(e.schema.get("properties", {}))
            extra = sorted(set(e.instance) - set(allowed))
            where = _key(list(e.absolute_path) + [extra[0]]) if extra else _key(e.absolute_path)
            raise ConfigError(f"{source}: unknown key '{where}' (allowed here: {', '.join(allowed)})")
        if e.validator == "type":
            raise ConfigError(f"{source}: key '{_key(e.absolute_path)}' must be {e.validator_value}, "
                              f"got {type(e.instance).__name__} {e.instance!r}")
        raise ConfigError(f"{source}: key '{_key(e.absolute_path)}': {e.message}")
    return data


# ---- typed objects built from the schema -------------------------------------------------------------------
_PY = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list, "object": dict, "null": type(None)}


def _annotation(sub: dict):
    types = sub.get("type", "object")
    types = types if isinstance(types, list) else [types]
    out = None
    for t in types:
        out = _PY[t] if out is None else out | _PY[t]
    return out


def _class_for(name: str, schema: dict):
    fields = []
    for key, sub in schema["properties"].items():
        ann = _class_for(key, sub) if "properties" in sub else _annotation(sub)
        fields.append((key, ann))
    cls = dataclasses.make_dataclass(name.title().replace("_", "") + "Config", fields, frozen=True)
    cls._schema = schema
    return cls


def _build(cls, data: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        sub = cls._schema["properties"][f.name]
        value = data.get(f.name)
        if "properties" in sub and isinstance(value, dict):
            value = _build(f.type, value)
        elif isinstance(sub.get("items"), dict) and "properties" in sub["items"] and isinstance(value, list):
            item_cls = _class_for(f.name, sub["items"])
            value = tuple(_build(item_cls, v) for v in value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A resolved config: the typed view (`cfg`), the plain dict (`raw`) and where it came from."""
    cfg: Any
    raw: dict
    source: str

    @property
    def hash(self) -> str:
        return config_hash(self.raw)


def from_dict(data: dict, source: str = "<config>") -> Loaded:
    schema = load_schema()
    raw = validate(data, source, schema)
    return Loaded(_build(_class_for("dflash", schema), raw), raw, source)


def load(path: str | Path, overrides: dict | None = None) -> Loaded:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    data = data or {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(data, str(path))


def config_hash(raw: dict) -> str:
    """Stable hash of what the config computes (names and report settings excluded)."""
    kept = {k: v for k, v in raw.items() if k not in UNHASHED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def results_path(loaded: Loaded, *parts: str) -> Path:
    """A path inside results_dir (relative to the working directory, as Snakemake runs)."""
    return Path(loaded.cfg.results_dir, *parts)


def inside(path: str | Path, *roots: str | Path) -> Path:
    """Resolve `path` and insist it lies under one of `roots` (paths from config stay in declared folders)."""
    p = Path(path).resolve()
    for r in roots:
        r = Path(r).resolve()
        if p == r or r in p.parents:
            return p
    raise ConfigError(f"path {path} is outside the allowed folders ({', '.join(str(r) for r in roots)})")
