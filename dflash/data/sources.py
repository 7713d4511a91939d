"""The first two steps of the data chain: read (the configured sources: files, datasets, the hub, the built-in
corpora) and normalise (rows into conversations); malformed rows become counted rejects.

Steps (each records into a read `Tally`: `rows`, and the reject reasons of the rows it drops):
- `source_specs(data_cfg)` -> [SourceSpec]: data.sources plus the enabled built-in sources
- `read(spec, cfg, tally)` -> Row iterator; `normalised(rows, spec, tally)` -> conversations
  {id, source, file, evaluable, messages}

A source yields `Row(source, index, value, reject, file, evaluable)`; `normalise(row)` turns a row in ShareGPT
(`conversations`: `from`/`value`) or OpenAI (`messages`: `role`/`content`) form into `[{"role", "content"}]` with
roles system/user/assistant, or returns the reason it is rejected. Nothing raises for a bad row; a source that cannot
be read at all (missing file, unreadable format) raises UserError naming it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

from dflash.config_model import DataSection, DflashConfig, SourceSection
from dflash.data.tally import Tally
from dflash.errors import UserError

ROLE_ALIASES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "bot": "assistant", "chatgpt": "assistant",
}


@dataclasses.dataclass
class Row:
    source: str
    index: int
    value: Any = None
    reject: str | None = None        # reason, when the row could not even be parsed
    file: str | None = None          # the file it was made from (the code source): the unit the holdout keeps whole
    evaluable: bool = True           # may become an evaluation prompt (False: made from the target's training files)


@dataclasses.dataclass
class SourceSpec:
    name: str
    path: str
    kind: str = "auto"
    format: str = "auto"
    split: str = "train"
    limit: int | None = None
    weight: float = 1.0

    @classmethod
    def of(cls, cfg: SourceSection | dict) -> "SourceSpec":
        if isinstance(cfg, dict):
            return cls(**{f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name in cfg})
        return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


COMPRESSED = (".gz", ".zst", ".bz2")     # read through the matching decompressor (JSONL and JSON files)


def _plain_name(name: str) -> str:
    """The file name without a compression suffix: `a.jsonl.gz` -> `a.jsonl`."""
    return name[:-len(s)] if (s := next((s for s in COMPRESSED if name.endswith(s)), None)) else name


def open_source(path, spec_name: str = "?"):
    """A binary file object that decompresses `.gz`, `.zst` and `.bz2` files (by suffix), else the plain file."""
    path = Path(path)
    name = path.name.lower()
    if name.endswith(".gz"):
        import gzip
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        import bz2
        return bz2.open(path, "rb")
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"source '{spec_name}': {path} is zstd-compressed; install the `zstandard` package "
                            f"(pinned in envs/requirements.txt)") from None
        import io
        return io.BufferedReader(zstandard.open(path, "rb"))     # the zstd reader has no readline of its own
    return open(path, "rb")


def _read_error(spec: SourceSpec, e: Exception):
    """A decompression or read failure, as a UserError naming the source and file."""
    return UserError(f"source '{spec.name}': cannot read {spec.path}: {type(e).__name__}: {e}")


def detect_kind(spec: SourceSpec) -> str:
    if spec.kind != "auto":
        return spec.kind
    p = Path(spec.path)
    name = _plain_name(p.name.lower())
    if p.is_dir():
        return "disk"
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith(".parquet"):
        return "parquet"
    if not p.exists():
        raise UserError(f"source '{spec.name}': {spec.path} does not exist (set kind: hub for a hub dataset)")
    raise UserError(f"source '{spec.name}': cannot tell how to read {spec.path}; set kind to jsonl, json, parquet or disk")


def _need_file(spec: SourceSpec) -> Path:
    p = Path(spec.path)
    if not p.exists():
        raise UserError(f"source '{spec.name}': {spec.path} does not exist")
    return p


def _jsonl(spec: SourceSpec) -> Iterator[Row]:
    p = _need_file(spec)
    if p.is_dir():
        raise UserError(f"source '{spec.name}': {spec.path} is a folder, not a JSONL file")
    index = 0
    with open_source(p, spec.name) as f:
        for lineno, raw in _lines(spec, f):
            if not raw.strip():
                continue                      # blank lines are not rows
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield Row(spec.name, index, {"_line": lineno}, "invalid_utf8")
                index += 1
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError:
                yield Row(spec.name, index, {"_line": lineno}, "invalid_json")
                index += 1
                continue
            yield Row(spec.name, index, value)
            index += 1


def _lines(spec: SourceSpec, f):
    """(line number, bytes) of a (decompressed) file; a corrupt compressed stream is a UserError naming the file."""
    import zlib
    lineno = 0
    while True:
        try:
            raw = f.readline()
        except (OSError, EOFError, ValueError, zlib.error) as e:   # gzip/bz2 raise OSError/EOFError; zstd ZstdError
            raise _read_error(spec, e) from None
        except Exception as e:
            if type(e).__name__ == "ZstdError":
                raise _read_error(spec, e) from None
            raise
        if not raw:
            return
        lineno += 1
        yield lineno, raw


def _json(spec: SourceSpec) -> Iterator[Row]:
    p = _need_file(spec)
    try:
        with open_source(p, spec.name) as f:
            blob = f.read()
    except UserError:
        raise
    except Exception as e:     # OSError/EOFError (gzip, bz2), ZstdError: a corrupt compressed file
        raise _read_error(spec, e) from None
    try:
        data = json.loads(blob.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"source '{spec.name}': {spec.path} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"source '{spec.name}': {spec.path} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if isinstance(data, dict):
        for key in ("data", "rows", "train"):
            if isinstance(data.get(key), list):
                data = data[key]
                break
    if not isinstance(data, list):
        raise UserError(f"source '{spec.name}': {spec.path} must hold a JSON list of rows (or {{\"data\": [...]}})")
    for i, value in enumerate(data):
        yield Row(spec.name, i, value)


def _parquet(spec: SourceSpec) -> Iterator[Row]:
    import pyarrow.parquet as pq
    p = _need_file(spec)
    try:
        pf = pq.ParquetFile(p)
    except Exception as e:    # pyarrow raises several types for a bad file
        raise UserError(f"source '{spec.name}': {spec.path} is not a readable Parquet file: {e}") from None
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            yield Row(spec.name, i, value)
            i += 1


def _dataset_rows(spec: SourceSpec, ds) -> Iterator[Row]:
    from datasets import DatasetDict
    if isinstance(ds, DatasetDict):
        if spec.split not in ds:
            raise UserError(f"source '{spec.name}': {spec.path} has no split {spec.split!r} (has {', '.join(ds)})")
        ds = ds[spec.split]
    for i, value in enumerate(ds):
        yield Row(spec.name, i, value)


def _disk(spec: SourceSpec) -> Iterator[Row]:
    from datasets import load_from_disk
    p = _need_file(spec)
    try:
        ds = load_from_disk(str(p))
    except (FileNotFoundError, ValueError, OSError) as e:
        raise UserError(f"source '{spec.name}': {spec.path} is not a datasets folder saved with save_to_disk: "
                        f"{str(e).splitlines()[0]}") from None
    yield from _dataset_rows(spec, ds)


def _hub(spec: SourceSpec) -> Iterator[Row]:
    from datasets import load_dataset
    try:
        ds = load_dataset(spec.path, split=spec.split)
    except Exception as e:    # network, auth, missing: all the user's to fix
        raise UserError(f"source '{spec.name}': cannot load hub dataset {spec.path!r} split {spec.split!r}: "
                        f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    yield from _dataset_rows(spec, ds)


READERS = {"jsonl": _jsonl, "json": _json, "parquet": _parquet, "disk": _disk, "hub": _hub}


def read_rows(spec: SourceSpec) -> Iterator[Row]:
    """Rows of a source, at most `limit`."""
    kind = detect_kind(spec)
    n = 0
    for row in READERS[kind](spec):
        if spec.limit is not None and n >= spec.limit:
            break
        n += 1
        yield row


BUILTIN_SOURCES = {"stdlib": "builtin_corpus", "code": "code_completion"}   # source name: the data section enabling it


def source_specs(dcfg: DataSection) -> list[SourceSpec]:
    """data.sources, then the enabled built-in sources (a name once)."""
    specs = [SourceSpec.of(s) for s in dcfg.sources]
    names = [s.name for s in specs]
    for name, section in BUILTIN_SOURCES.items():
        if getattr(dcfg, section).enabled:
            if name in names:
                raise UserError(f"data.sources: the name '{name}' is taken by the built-in source data.{section}")
            specs.append(SourceSpec(name=name, path="<builtin>", kind="builtin", format="openai"))
            names.append(name)
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"data.sources: duplicate source name(s) {', '.join(dup)}")
    return specs


def _source_rows(spec: SourceSpec, cfg: DflashConfig) -> Iterator[Row]:
    if spec.kind == "builtin" and spec.name == "code":
        from dflash.data import code_corpus
        from dflash.data.rows import num_proc
        convs = code_corpus.completion_source(cfg.target.pretrain, cfg.data.code_completion,
                                              processes=num_proc(cfg.data))
        return (Row("code", i, c, file=c["file"], evaluable=c["heldout"]) for i, c in enumerate(convs))
    if spec.kind == "builtin":
        from dflash.data import corpus
        convs = corpus.conversations(cfg.data.builtin_corpus.max_conversations, seed=0)
        return (Row("stdlib", i, c) for i, c in enumerate(convs))
    return read_rows(spec)


def read(spec: SourceSpec, cfg: DflashConfig, tally: Tally) -> Iterator[Row]:
    """Step `read`: the rows of one source (counted: `rows`); a row that could not be parsed is a counted reject."""
    for row in _source_rows(spec, cfg):
        tally.counts[spec.name]["rows"] += 1
        if row.reject:
            tally.reject(spec.name, row.reject)
            continue
        yield row


def normalised(rows: Iterator[Row], spec: SourceSpec, tally: Tally) -> Iterator[dict]:
    """Step `normalise`: rows -> conversations {id, source, file, evaluable, messages}; a row that is no conversation
    is a counted reject (`normalise`'s reason). A built-in source's rows keep their own id."""
    for row in rows:
        msgs = normalise(row.value, spec.format)
        if isinstance(msgs, str):
            tally.reject(spec.name, msgs)
            continue
        rid = row.value.get("id") if spec.kind == "builtin" else None
        yield {"id": rid or f"{spec.name}-{row.index}", "source": spec.name, "file": row.file,
               "evaluable": row.evaluable, "messages": msgs}


# ---- normalisation -------------------------------------------------------------------------------------------

def _turn(turn, fmt: str):
    """(role, content) or a reject reason (str) for one turn."""
    if not isinstance(turn, dict):
        return "wrong_type"
    order = [("from", "value"), ("role", "content")] if fmt == "sharegpt" else [("role", "content"), ("from", "value")]
    for rk, ck in order:
        if rk in turn and ck in turn:
            role, content = turn[rk], turn[ck]
            break
    else:
        return "missing_key"
    if not isinstance(role, str) or not isinstance(content, str):
        if content is None:
            return "empty_turn"
        return "wrong_type"
    role = ROLE_ALIASES.get(role.strip().lower())
    if role is None:
        return "unknown_role"
    if "\ufffd" in content or any(0xD800 <= ord(c) <= 0xDFFF for c in content):
        return "invalid_utf8"
    if not content.strip():
        return "empty_turn"
    return role, content


def normalise(value, fmt: str = "auto"):
    """A list of {"role", "content"} messages, or a reject reason (str)."""
    if not isinstance(value, dict):
        return "wrong_type"
    if fmt == "openai":
        keys = ["messages"]
    elif fmt == "sharegpt":
        keys = ["conversations"]
    else:
        keys = ["messages", "conversations", "conversation"]
    turns = None
    for k in keys:
        if k in value:
            turns = value[k]
            kf = "openai" if k == "messages" else "sharegpt"
            break
    if turns is None:
        return "missing_conversation"
    if isinstance(turns, str):
        try:
            turns = json.loads(turns)
        except json.JSONDecodeError:
            return "wrong_type"
    if not isinstance(turns, (list, tuple)):
        return "wrong_type"
    if not turns:
        return "empty_conversation"
    messages = []
    system = value.get("system")
    if isinstance(system, str) and system.strip():
        messages.append({"role": "system", "content": system})
    for turn in turns:
        r = _turn(turn, kf)
        if isinstance(r, str):
            return r
        role, content = r
        if role == "system" and messages and messages[-1]["role"] != "system":
            return "bad_turn_order"            # a system turn in the middle of a conversation
        if messages and messages[-1]["role"] == role and role != "system":
            return "bad_turn_order"            # two user or two assistant turns in a row
        messages.append({"role": role, "content": content})
    roles = [m["role"] for m in messages if m["role"] != "system"]
    if "assistant" not in roles:
        return "no_assistant_turn"
    if roles[0] != "user":
        return "bad_turn_order"
    while messages[-1]["role"] != "assistant":   # a trailing user turn has no response to learn
        messages.pop()
    return messages
