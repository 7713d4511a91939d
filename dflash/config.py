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
# train keys that change how a run is carried out, never the drafter it trains (logging, checkpoint cadence, timeouts,
# stall and divergence checks, queue depth, allocator, launch, profiling, test hooks): left out of the result hash,
# so changing one resumes (or restores) a run instead of training it anew. Every other key changes the result,
# a new one too: keep this list short and explicit.
OPERATIONAL = ("log_every", "checkpoint_every", "resume", "warmup_steps_excluded", "matmul_tflops",
               "ready_timeout_s", "stall_timeout_s", "stop_timeout_s", "check_every", "queue_size",
               "expandable_segments", "rendezvous", "profile", "fail_at_step", "diverge_at_step",
               "eval_every", "eval_prompts", "eval_max_new_tokens")


class ConfigError(ValueError):
    """A bad config: the message is one line naming the file and the key."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


class StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a duplicate key (PyYAML silently keeps the last value)."""


def _mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.MarkedYAMLError(problem=f"duplicate key '{key}' (first at line {seen[key] + 1})",
                                       problem_mark=key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path: str | Path):
    """A config file's YAML; a syntax error or a duplicate key is one line: `file:line:column: what`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        return yaml.load(path.read_text(), Loader=StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(x for x in (e.problem, f"({e.context})" if e.context else None) if x)
        raise ConfigError(f"{where}: not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None


def set_dotted(data: dict, overrides: dict) -> dict:
    """Apply {"train.steps": 5, "run_name": "x"} to a nested dict, in place; returns it."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = str(dotted).split(".")
        for p in parents:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[leaf] = value
    return data


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

    @property
    def result_hash(self) -> str:
        return result_hash(self.raw)


def from_dict(data: dict, source: str = "<config>") -> Loaded:
    schema = load_schema()
    raw = validate(data, source, schema)
    return Loaded(_build(_class_for("dflash", schema), raw), raw, source)


def load(path: str | Path, overrides: dict | None = None) -> Loaded:
    data = read_yaml(path) or {}
    if isinstance(data, dict):
        set_dotted(data, overrides or {})
    return from_dict(data, str(path))


def config_hash(raw: dict) -> str:
    """Stable hash of what the config computes (names and report settings excluded)."""
    kept = {k: v for k, v in raw.items() if k not in UNHASHED}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def result_hash(raw: dict) -> str:
    """Stable hash of what decides the trained drafter: the config hash without the OPERATIONAL train keys. A
    checkpoint resumes, and a finished run is restored, only under the same result hash."""
    kept = {k: v for k, v in raw.items() if k != "train"}
    kept["train"] = {k: v for k, v in (raw.get("train") or {}).items() if k not in OPERATIONAL}
    return config_hash(kept)


def inside(path: str | Path, *roots: str | Path) -> Path:
    """Resolve `path` and insist it lies under one of `roots` (paths from config stay in declared folders)."""
    p = Path(path).resolve()
    for r in roots:
        r = Path(r).resolve()
        if p == r or r in p.parents:
            return p
    raise ConfigError(f"path {path} is outside the allowed folders ({', '.join(str(r) for r in roots)})")


def _leaves(data, prefix=""):
    """{"train": {"steps": 5}} -> [("train.steps", 5)]: the dotted keys of every leaf value."""
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def configfile_flags(argv: list[str]) -> list[str]:
    """The files named after each `--configfile`/`--configfiles` flag of a Snakemake command line, in order (argparse
    keeps only the last flag's: the Snakefile refuses more than one file)."""
    files, taking = [], False
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if flag in ("--configfile", "--configfiles"):
            taking = not eq
            files += [value] if eq else []
        elif taking and not arg.startswith("-"):
            files.append(arg)
        else:
            taking = False
    return files


def for_workflow(path: str | Path, cli: dict) -> tuple[dict, list[str]]:
    """The Snakefile's config: the YAML at `path` (read strictly) with Snakemake's `--config` values applied and
    validated as the stages validate it, and the `--set KEY=VALUE` arguments that give every stage the same config.

    Snakemake reads `--config train="{steps: 5}"` with YAML's base loader (every scalar a string): nested values
    are read again as YAML, so 5 is an integer as it would be in the file."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {type(data).__name__}")
    overrides = {}
    for key, value in _leaves(dict(cli)):
        if isinstance(value, str) and "." in key:
            value = yaml.safe_load(value)
        overrides[key] = value
    resolved = validate(set_dotted(data, overrides), str(path))
    return resolved, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
