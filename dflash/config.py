"""Config: one YAML, resolved against the typed models of dflash/config_model.py into a frozen `DflashConfig`.

The models are the single source of keys, types, defaults and descriptions; `workflow/schemas/config.schema.yaml`
is generated from them (`python -m dflash schema --write`; a test keeps the file equal to them). Errors are one line
naming the config file and the key.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import yaml
from pydantic import ValidationError

from dflash.config_model import DflashConfig

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


# ---- the JSON schema, generated from the models --------------------------------------------------------------
# Key order of a schema node in the YAML file (any other key follows).
_ORDER = ("$schema", "$id", "title", "type", "additionalProperties", "required", "pattern", "enum", "minimum",
          "exclusiveMinimum", "maximum", "exclusiveMaximum", "minItems", "maxItems", "items", "default",
          "description", "properties")


def _ordered(node: dict) -> dict:
    """A schema node with its keys in _ORDER (any other key after them)."""
    return {k: node[k] for k in sorted(node, key=lambda k: _ORDER.index(k) if k in _ORDER else len(_ORDER))}


def _plain(node, defs: dict):
    """pydantic's schema node in the form a reader (and Snakemake's validate with defaults) takes: references
    inlined, `anyOf [X, null]` as `type: [X, "null"]`, no generated titles, keys in _ORDER."""
    if isinstance(node, list):
        return [_plain(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        node = {**defs[node.pop("$ref").rsplit("/", 1)[-1]], **node}
    options = node.get("anyOf")
    if options and len(options) == 2 and {"type": "null"} in options:
        node.pop("anyOf")
        other = _plain(next(o for o in options if o != {"type": "null"}), defs)
        node = {**other, **node, "type": [other["type"], "null"]}
    out = {k: _plain(v, defs) if k != "properties" else {p: _plain(s, defs) for p, s in v.items()}
           for k, v in node.items() if k != "title" and k != "$defs"}
    return _ordered(out)


@functools.cache
def json_schema() -> dict:
    """The config's JSON schema (draft 2020-12), generated from DflashConfig: what the checked-in schema file holds."""
    raw = DflashConfig.model_json_schema()
    schema = _plain(raw, raw.get("$defs", {}))
    schema["title"] = DflashConfig.model_config["title"]
    return _ordered(schema)


def schema_text() -> str:
    """The text of workflow/schemas/config.schema.yaml."""
    return ("# GENERATED from dflash/config_model.py by `python -m dflash schema --write`: edit the models, not this "
            "file.\n" + yaml.safe_dump(json_schema(), sort_keys=False, width=118, allow_unicode=True))


def load_schema() -> dict:
    return json_schema()


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


def apply_defaults(data, schema: dict):
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


# pydantic error types of a value of the wrong JSON type
_WRONG_TYPE = {"int_type", "float_type", "string_type", "bool_type", "tuple_type", "list_type", "dict_type",
               "model_type", "model_attributes_type", "none_required"}


def _message(error: ValidationError, source: str) -> str:
    """The first error in one line naming the file and the dotted key (pydantic's `loc`, less its union tags)."""
    e = error.errors()[0]
    path, node = [], json_schema()
    for part in e["loc"]:
        if isinstance(part, int) and isinstance(node.get("items"), dict):
            node = node["items"]
        elif isinstance(part, str) and part in node.get("properties", {}):
            node = node["properties"][part]
        else:
            continue
        path.append(part)
    if e["type"] == "extra_forbidden":
        allowed = ", ".join(sorted(node.get("properties", {})))
        return f"{source}: unknown key '{_key(path + [e['loc'][-1]])}' (allowed here: {allowed})"
    if e["type"] in _WRONG_TYPE:
        return (f"{source}: key '{_key(path)}' must be {node.get('type')}, "
                f"got {type(e['input']).__name__} {e['input']!r}")
    got = "" if e["type"] == "missing" else f", got {e['input']!r}"
    return f"{source}: key '{_key(path)}': {e['msg']}{got}"


def resolve(data, source: str = "<config>") -> tuple[DflashConfig, dict]:
    """(the typed config, the resolved dict: the YAML's keys as written plus every default) or ConfigError naming
    the key. The dict is what the config hashes and what runs record."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, got {type(data).__name__}")
    raw = apply_defaults(copy.deepcopy(data), json_schema())
    try:
        return DflashConfig.model_validate(raw), raw
    except ValidationError as e:
        raise ConfigError(_message(e, source)) from None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A resolved config: the typed view (`cfg`), the plain dict (`raw`) and where it came from."""
    cfg: DflashConfig
    raw: dict
    source: str

    @property
    def hash(self) -> str:
        return config_hash(self.raw)

    @property
    def result_hash(self) -> str:
        return result_hash(self.raw)


def from_dict(data: dict, source: str = "<config>") -> Loaded:
    return Loaded(*resolve(data, source), source)


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
    resolved = resolve(set_dotted(data, overrides), str(path))[1]
    return resolved, [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
