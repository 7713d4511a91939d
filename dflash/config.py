"""Config: one YAML (on top of the `base:` it may name), resolved against the typed models of
dflash/config_model.py into a frozen `DflashConfig`.

The models are the single source of keys, types, defaults, descriptions, checks and roles;
`workflow/schemas/config.schema.yaml` is generated from them (`python -m dflash schema --write`; a test keeps the file
equal to them), and from each key's role come the config and result hashes (`pick`) and each Snakemake rule's rerun
trigger (`trigger`). `check_here` refuses what the machine or the files on disk cannot give a config. Errors are one
line naming the config file and the key.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
import os
import re
import typing
from pathlib import Path

import yaml
from pydantic import ValidationError

from dflash.config_model import (DEVICE_PATTERN, NAME, PLACED_PATTERN, DflashConfig, OnDevice, PathKey, Role, Section,
                                 When, drafter_misfit)
from dflash.device_names import normalize
from dflash.errors import UserError, io_error

REPO = Path(__file__).resolve().parent.parent
SCHEMA_PATH = REPO / "workflow" / "schemas" / "config.schema.yaml"


class ConfigError(UserError, ValueError):
    """A bad config: the message is one line naming the file and the key."""


# ---- each key's role, declared on its field (dflash/config_model.py), and what derives from it --------------------
def _section(annotation) -> type[Section] | None:
    """The Section class a field holds (itself, in a tuple, or nullable), or None for a leaf."""
    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation
    return next((s for a in typing.get_args(annotation) if (s := _section(a)) is not None), None)


def _fields(model: type[Section], prefix: str = ""):
    """(dotted key, field info, its Section class or None) of every field, depth first."""
    for name, field in model.model_fields.items():
        sub = _section(field.annotation)
        yield f"{prefix}{name}", field, sub
        if sub is not None:
            yield from _fields(sub, f"{prefix}{name}.")


@functools.cache
def roles(model: type[Section] = DflashConfig) -> dict[str, Role]:
    """{dotted key: Role} of every leaf key of `model` (a list's items as `data.sources.name`). A leaf without exactly
    one Role is refused: every key declares what its change redoes."""
    out = {}
    for key, field, sub in _fields(model):
        tags = [m for m in field.metadata if isinstance(m, Role)]
        if sub is None and len(tags) != 1:
            raise TypeError(f"config key {key} declares {len(tags)} roles: give its field one "
                            "(`Annotated[type, ROLE]`, dflash/config_model.py)")
        if sub is not None and tags:
            raise TypeError(f"config section {key} declares a role: its keys each declare their own")
        if sub is None:
            out[key] = tags[0]
    return out


def device_keys() -> tuple[str, ...]:
    """The keys that name devices (marked ON_DEVICE in dflash/config_model.py)."""
    return tuple(key for key, field, sub in _fields(DflashConfig)
                 if sub is None and any(isinstance(m, OnDevice) for m in field.metadata))


@functools.cache
def gates(model: type[Section] = DflashConfig) -> dict[str, tuple[When, ...]]:
    """{dotted key or section: its `When` markers} of every field read only while a switch allows it; a switch that is
    not a leaf key of `model` is refused."""
    out = {key: ws for key, field, _ in _fields(model) if (ws := tuple(m for m in field.metadata
                                                                       if isinstance(m, When)))}
    for key, ws in out.items():
        for switch in (s for w in ws for s, _ in w.cases):
            if switch not in roles(model):
                raise TypeError(f"config key {key} is gated by {switch}, which is not a config key")
    return out


@functools.cache
def path_keys(model: type[Section] = DflashConfig) -> frozenset[str]:
    """The keys that name a file or folder (marked PATH in dflash/config_model.py)."""
    return frozenset(key for key, field, _ in _fields(model) if any(isinstance(m, PathKey) for m in field.metadata))


_MISSING = object()


def _get(raw, key: str):
    for part in key.split("."):
        if not isinstance(raw, dict) or part not in raw:
            return _MISSING
        raw = raw[part]
    return raw


def is_read(raw: dict, key: str) -> bool:
    """Whether `key` (dotted; a list's items as `data.sources.path`) is read under the resolved config `raw`: every
    `When` of it and of its sections holds (some switch, itself read, holds one of its values). A switch missing from
    `raw` (an old record) holds."""
    parts = key.split(".")
    for k in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
        for w in gates().get(k, ()):
            if not any((v := _get(raw, switch)) is _MISSING or (v in values and is_read(raw, switch))
                       for switch, values in w.cases):
                return False
    return True


def _normal(value):
    """A path (or a list of them) in one spelling: `./x/` is `x`."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    return os.path.normpath(value) if isinstance(value, str) and value else value


def normalise_paths(value, model: type[Section] = DflashConfig, prefix: str = ""):
    """The raw config with every PATH key's value in one spelling (`_normal`), in place; returns it."""
    if isinstance(value, (list, tuple)):
        return [normalise_paths(x, model, prefix) for x in value]
    if not isinstance(value, dict):
        return value
    for key, v in value.items():
        field = model.model_fields.get(key)
        sub = _section(field.annotation) if field is not None else None
        if sub is not None:
            value[key] = normalise_paths(v, sub, f"{prefix}{key}.")
        elif f"{prefix}{key}" in path_keys():
            value[key] = _normal(v)
    return value


def _pick(value, model: type[Section], keep, root: dict, prefix: str = ""):
    """`value` (a section of the raw config `root`) with only the keys whose Role `keep` takes and that are read
    (`is_read`: a switched-off feature's keys are out), paths in one spelling; a section left empty is dropped, a null
    section kept when `keep` takes any of its keys, a key the models do not know kept (an old run's record hashes
    differently from a config without it)."""
    out = {}
    for key, v in value.items():
        field = model.model_fields.get(key)
        sub = _section(field.annotation) if field is not None else None
        dotted = prefix + key
        if field is None:
            out[key] = v
        elif not is_read(root, dotted):
            continue
        elif sub is None:
            if keep(roles()[dotted]):
                out[key] = _normal(v) if dotted in path_keys() else v
        elif isinstance(v, dict):
            if picked := _pick(v, sub, keep, root, f"{dotted}."):
                out[key] = picked
        elif isinstance(v, (list, tuple)):
            items = [_pick(x, sub, keep, root, f"{dotted}.") if isinstance(x, dict) else x for x in v]
            if any(items) or any(keep(r) for k, r in roles().items() if k.startswith(f"{dotted}.")):
                out[key] = items
        elif any(keep(r) for k, r in roles().items() if k.startswith(f"{dotted}.")):
            out[key] = v
    return out


def pick(raw: dict, keep) -> dict:
    """The raw config with only the keys whose Role `keep(role)` takes and that its switches leave read (nesting
    kept): what the hashes and the rerun triggers are made of, so the three agree."""
    return _pick(raw, DflashConfig, keep, raw)


def trigger(raw: dict, rule: str) -> str:
    """What reruns Snakemake rule `rule` (its `config` param): the keys whose Role names it, as one stable string."""
    return json.dumps(pick(raw, lambda r: rule in r.reruns), sort_keys=True)


def _top_level(hashed) -> tuple[str, ...]:
    return tuple(k for k in DflashConfig.model_fields
                 if not any(r.hashed in hashed for key, r in roles().items() if key == k or key.startswith(k + ".")))


# Top-level keys wholly out of the config hash (names, evaluation and report settings): what the report's attribution
# leaves out of a config's differences.
UNHASHED = _top_level(("result", "run"))
# Keys in the config hash but not in the result hash (Role hashed "run"): how a run is carried out, never the drafter it
# trains. Changing one resumes (or restores) a run instead of training it anew.
OPERATIONAL = tuple(k for k, r in roles().items() if r.hashed == "run")


# ---- the JSON schema, generated from the models --------------------------------------------------------------
# Key order of a schema node in the YAML file (any other key follows).
_ORDER = ("$schema", "$id", "title", "type", "additionalProperties", "required", "pattern", "enum", "minimum",
          "exclusiveMinimum", "maximum", "exclusiveMaximum", "minItems", "maxItems", "items", "default",
          "description", "reruns", "hashed", "read_when", "properties")


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
    for key, role in roles().items():            # each key's role, for readers (JSON Schema ignores these keywords)
        node = schema
        for part in key.split("."):
            node = (node if "properties" in node else node["items"])["properties"][part]
        node.update(reruns=list(role.reruns), hashed=role.hashed)
    for key, ws in gates().items():              # the switches a key is read under (out of every hash otherwise)
        node = schema
        for part in key.split("."):
            node = (node if "properties" in node else node["items"])["properties"][part]
        node["read_when"] = " and ".join(" or ".join(f"{s} in {json.dumps(list(v))}" if len(v) > 1 else
                                                     f"{s} = {json.dumps(v[0])}" for s, v in w.cases) for w in ws)
        node.update(_ordered(node))
    return _ordered(schema)


def schema_text() -> str:
    """The text of workflow/schemas/config.schema.yaml."""
    return ("# GENERATED from dflash/config_model.py by `python -m dflash schema --write`: edit the models, not this "
            "file.\n" + yaml.safe_dump(json_schema(), sort_keys=False, width=118, allow_unicode=True))


def load_schema() -> dict:
    return json_schema()


class StrictLoader(yaml.SafeLoader):
    """yaml.safe_load that refuses a duplicate key (PyYAML silently keeps the last value) and reads a number in
    scientific notation as a number (`1e-4`, `6E-4`, `1e5`: YAML 1.2 reads them so; PyYAML's YAML 1.1 reads them as
    text unless they have a dot)."""


# YAML 1.1's float pattern, the exponent's dot and sign made optional (as YAML 1.2): never an integer (a dot or an
# exponent is needed), so `5` stays an int
_FLOAT = re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, _FLOAT if tag == "tag:yaml.org,2002:float" else regexp) for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


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


def parse_yaml(text: str, where: str, marks: bool = True):
    """YAML text read as a config is (StrictLoader); a syntax error or a duplicate key is one line naming `where` (a
    file, or with `marks` off a command-line value) and for a file the line and column: `file:line:column: what`."""
    try:
        return yaml.load(text, Loader=StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f"{where}:{mark.line + 1}:{mark.column + 1}" if mark and marks else where
        what = " ".join(x for x in (e.problem, f"({e.context})" if e.context else None) if x)
        raise ConfigError(f"{at}: not valid YAML: {what}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {str(e).splitlines()[0]}") from None


def parse_value(text: str, where: str):
    """A value given on a command line (`--set KEY=VALUE`, Snakemake's `--config`), read as the same value in the
    config file would be: `1e-4` a number, `[1` one line naming `where`."""
    return parse_yaml(text, where, marks=False)


def read_yaml(path: str | Path):
    """A config file's YAML; a syntax error or a duplicate key is one line: `file:line:column: what`; a file that
    cannot be read is one line saying so (and what to do)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        fix = io_error(e, path, "read") if isinstance(e, OSError) else None
        raise ConfigError(str(fix) if fix else f"{path}: cannot read it ({e}): give a YAML config file") from None
    return parse_yaml(text, str(path))


def _merged(base: dict, over: dict) -> dict:
    """`over` on top of `base`: mappings merged key by key, anything else (a list, a value, null) replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _chain(path: Path, _seen: tuple = ()) -> list[tuple[Path, typing.Any]]:
    """(file, its keys less `base`) of the config at `path` and of every base under it, the deepest base first."""
    data = read_yaml(path)
    if not isinstance(data, dict) or "base" not in data:
        return [(path, data)]
    base = data.pop("base")
    if not isinstance(base, str):
        raise ConfigError(f"{path}: key 'base' must be the path of a config file, got {base!r}")
    base_path = path.parent / base
    if base_path.resolve() in _seen + (path.resolve(),):
        raise ConfigError(f"{path}: base {base} names a config that names this one (a circle of bases)")
    if not base_path.is_file():
        raise ConfigError(f"{path}: base {base}: no such config file ({base_path})")
    under = _chain(base_path, _seen + (path.resolve(),))
    if not isinstance(under[-1][1], dict):
        raise ConfigError(f"{base_path}: the config must be a mapping of keys, got {type(under[-1][1]).__name__}")
    return under + [(path, data)]


def _read(path: str | Path) -> tuple[typing.Any, dict[str, str]]:
    """A config file's keys on top of its bases' (read_config), and {dotted key: the file that set it} for every
    leaf, a base named as the base of `path` (what an error about that key names)."""
    chain = _chain(Path(path))
    data, origins = chain[0][1], {}
    for file, keys in chain[1:]:
        data = _merged(data, keys)
    for file, keys in chain:
        name = str(file) if file == chain[-1][0] else f"{file} (a base of {path})"
        origins.update({key: name for key, _ in _leaves(keys)} if isinstance(keys, dict) else {})
    return data, origins


def read_config(path: str | Path):
    """A config file's keys, on top of those of the file its `base:` names (relative to its own folder; a base may
    name a base): a GPU config keeps only its differences. The merged keys are the config; `base` is not one of them
    (a config and its base merged by hand hash the same)."""
    return _read(path)[0]


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


# what a key of each name or device pattern must be, in words
_PATTERNS = {NAME: "a folder name (letters, digits, _ . -, not starting with . or -)",
             DEVICE_PATTERN: "a device (auto, cpu, cuda, cuda:N or N)", PLACED_PATTERN: "a device (cpu, cuda:N or N)"}


def _origin(origins: dict[str, str], source: str, path: list) -> str:
    """The file that set the key at `path` (a leaf, or a list or section above it): the one that set it or its
    list, else the one file that set every key under it, else `source`."""
    parts = [str(p) for p in path]
    for n in range(len(parts), 0, -1):
        if (key := ".".join(parts[:n])) in origins:
            return origins[key]
    under = {f for k, f in origins.items() if k.startswith(".".join(parts) + ".")} if parts else set()
    return under.pop() if len(under) == 1 else source


def _message(error: ValidationError, source: str, origins: dict[str, str] | None = None) -> str:
    """The first error in one line naming the file that set the key (`origins`: a `base:` file for its keys; else
    `source`) and the dotted key (pydantic's `loc`, less its union tags)."""
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
        key = path + [e["loc"][-1]]
        return f"{_origin(origins or {}, source, key)}: unknown key '{_key(key)}' (allowed here: {allowed})"
    source = _origin(origins or {}, source, path)
    if e["type"] in _WRONG_TYPE:
        return (f"{source}: key '{_key(path)}' must be {node.get('type')}, "
                f"got {type(e['input']).__name__} {e['input']!r}")
    if e["type"] == "value_error":           # a validator's check: a section's names the keys it compares
        text = str(e["ctx"]["error"])
        if "properties" in node:
            return f"{source}: {text}"
        return f"{source}: key '{_key(path)}' {text}, got {e['input']!r}"
    if e["type"] == "string_pattern_mismatch" and e["ctx"]["pattern"] in _PATTERNS:
        return f"{source}: key '{_key(path)}' must be {_PATTERNS[e['ctx']['pattern']]}, got {e['input']!r}"
    if e["type"] == "string_too_long":
        return (f"{source}: key '{_key(path)}' must be at most {e['ctx']['max_length']} characters (it names folders "
                f"and files, and a file system takes 255 per name), got {len(e['input'])}: {e['input'][:40]!r}...")
    if e["type"] == "finite_number":
        return f"{source}: key '{_key(path)}' must be a finite number, got {e['input']!r}"
    got = "" if e["type"] == "missing" else f", got {e['input']!r}"
    return f"{source}: key '{_key(path)}': {e['msg']}{got}"


def resolve(data, source: str = "<config>", origins: dict[str, str] | None = None) -> tuple[DflashConfig, dict]:
    """(the typed config, the resolved dict: the YAML's keys as written plus every default) or ConfigError naming
    the key and the file that set it (`origins`: {dotted key: file}, for keys a `base:` file set; else `source`).
    The dict is what the config hashes and what runs record."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of keys, got {type(data).__name__}")
    raw = normalise_paths(apply_defaults(copy.deepcopy(data), json_schema()))
    try:
        return DflashConfig.model_validate(raw), raw
    except ValidationError as e:
        raise ConfigError(_message(e, source, origins)) from None


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


def from_dict(data: dict, source: str = "<config>", origins: dict[str, str] | None = None) -> Loaded:
    return Loaded(*resolve(data, source, origins), source)


def load(path: str | Path, overrides: dict | None = None) -> Loaded:
    data, origins = _read(path)
    data = data or {}
    if isinstance(data, dict):
        set_dotted(data, overrides or {})
    return from_dict(data, str(path), _given(origins, overrides or {}, str(path)))


def _given(origins: dict[str, str], overrides: dict, source: str) -> dict[str, str]:
    """`origins` less what the command line's values replace (an error about one names `source`)."""
    return {k: f for k, f in origins.items()
            if not any(k == o or k.startswith(f"{o}.") or o.startswith(f"{k}.") for o in map(str, overrides))}


def _digest(data: dict) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def config_hash(raw: dict) -> str:
    """Stable hash of what the config computes and how fast: every key whose Role is hashed ("result" or "run")."""
    return _digest(pick(raw, lambda r: r.hashed is not None))


def result_hash(raw: dict) -> str:
    """Stable hash of what decides the trained drafter: the keys whose Role is hashed "result". A checkpoint resumes,
    and a finished run is restored, only under the same result hash."""
    return _digest(pick(raw, lambda r: r.hashed == "result"))


def inside(path: str | Path, *roots: str | Path) -> Path:
    """Resolve `path` and insist it lies under one of `roots` (paths from config stay in declared folders)."""
    p = Path(path).resolve()
    for r in roots:
        r = Path(r).resolve()
        if p == r or r in p.parents:
            return p
    raise ConfigError(f"path {path} is outside the allowed folders ({', '.join(str(r) for r in roots)})")


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _target_sizes(path: Path) -> dict[str, int]:
    """{num_hidden_layers, vocab_size, num_attention_heads, num_key_value_heads} that a target folder's config.json
    states (those it states as integers); {} where it cannot be read (the stage that loads the target names it)."""
    try:
        hf = json.loads(path.read_text())
        hf = hf.get("text_config") or hf
    except (OSError, ValueError, AttributeError):
        return {}
    keys = ("num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads")
    out = {k: hf[k] for k in keys if isinstance(hf, dict) and type(hf.get(k)) is int and hf[k] > 0}
    if "num_attention_heads" in out:           # Qwen3 and its kind: no num_key_value_heads is one per query head
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
    return out


def check_here(loaded: Loaded, stage: str | None = None, devices: bool = True) -> None:
    """What a config needs of this machine and of the files already there, refused before any work in one line naming
    the key and the file: the drafter against the target folder used as it is (target.build none; a target the
    config builds is checked by the model): a target layer id past its layers, a mask token id past its vocabulary,
    heads that do not divide; and (`devices`) a CUDA device where torch has none, or fewer GPUs than named. `stage`:
    only the keys that stage reads (those whose Role reruns it); None: every key."""
    cfg, src, wanted = loaded.cfg, loaded.source, lambda key: stage is None or stage in roles()[key].reruns
    ids, path = cfg.drafter.target_layer_ids, Path(cfg.target.path) / "config.json"
    if cfg.target.build == "none" and wanted("target.path"):   # a family that cannot work, before any job
        from dflash.families import check_json
        try:
            why = check_json(json.loads(path.read_text()), cfg.target.attn_implementation, sizes=False)
        except (OSError, ValueError, AttributeError):
            why = None                                           # unreadable: the stage that loads it names it
        if why:
            raise ConfigError(f"{src}: target.path {cfg.target.path}: {why}")
    sizes = _target_sizes(path) if cfg.target.build == "none" and wanted("drafter.target_layer_ids") else {}
    layers = sizes.get("num_hidden_layers")
    if ids and layers is not None and max(ids) >= layers:
        raise ConfigError(f"{src}: drafter.target_layer_ids has id {max(ids)}, past the {layers} layers of the "
                          f"target {path} (ids 0-{layers - 1})")
    if {"vocab_size", "num_attention_heads"} <= set(sizes):
        why = drafter_misfit(cfg.drafter, sizes["vocab_size"], sizes["num_attention_heads"],
                             sizes["num_key_value_heads"], f"the target {path}")
        if why:
            raise ConfigError(f"{src}: {why}")
    cuda = [(key, v) for key in device_keys() if devices and wanted(key)
            for v in (lambda x: x if isinstance(x, tuple) else (x,))(_value(cfg, key))
            if normalize(v).startswith("cuda")]
    if cuda:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for key, v in cuda:
            index = int(normalize(v).partition(":")[2] or 0)
            if n == 0:
                build = "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)"
                raise ConfigError(f"{src}: {key} names {v} but this machine has no CUDA GPU{build}: run this config "
                                  f"on a GPU machine, or set {key} to cpu")
            if index >= n:
                raise ConfigError(f"{src}: {key} names {v} but this machine has {n} CUDA GPU(s) (cuda:0-cuda:{n - 1})")


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


def for_workflow(path: str | Path, cli: dict) -> tuple[Loaded, list[str]]:
    """The Snakefile's config: the YAML at `path` (read strictly) with Snakemake's `--config` values applied and
    validated as the stages validate it, and the `--set KEY=VALUE` arguments that give every stage the same config.

    Snakemake reads `--config train="{steps: 5}"` with YAML's base loader (every scalar a string): nested values
    are read again as YAML (StrictLoader), so 5 is an integer and 1e-4 a number as they would be in the file, and a
    section's text that is no YAML mapping (`train="{lr: [1}"`) is one line naming it."""
    data, origins = _read(path)
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys, got {type(data).__name__}")
    overrides = {}
    for key, value in _leaves(dict(cli)):
        field = DflashConfig.model_fields.get(key)
        if isinstance(value, str) and ("." in key or field is not None and _section(field.annotation) is not None):
            value = parse_value(value, f"--config {key}={value}")   # a nested value, or a section Snakemake left text
        overrides[key] = value
    return (from_dict(set_dotted(data, overrides), str(path), _given(origins, overrides, str(path))),
            [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
