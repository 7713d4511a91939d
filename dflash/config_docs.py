"""docs/config-keys.md, the reference of every config key, generated from the config's JSON schema (itself generated
from dflash/config_model.py): `python -m dflash.config_docs --write` (or `--check`, exit 1 when the file is stale;
tests/unit/test_config_docs.py fails then too)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash.config import json_schema

DOC = Path("docs/config-keys.md")
HEAD = ("# Config keys\n\nGENERATED from `dflash/config_model.py` by `python -m dflash.config_docs --write`: edit the "
        "models, not this file. Every key of a config YAML, by section: its type, default, bounds and meaning (adding a "
        "key: [config.md](config.md)).\n")
BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<", "minLength": "len >=",
          "maxLength": "len <=", "minItems": "items >=", "pattern": "matches"}
PLAIN = {"type", "default", "description", "properties", "additionalProperties", "items", "enum", "anyOf", "title",
         *BOUNDS}


def _type(p: dict) -> str:
    if "enum" in p:
        return " \\| ".join(json.dumps(v) for v in p["enum"])
    t = p.get("type", "any")
    t = " or ".join(t) if isinstance(t, list) else t
    if "items" in p:
        t += f" of {_type(p['items'])}"
    if "anyOf" in p:
        t = " or ".join(_type(a) for a in p["anyOf"])
    return t


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _row(key: str, p: dict) -> str:
    bounds = ", ".join(f"{BOUNDS[b]} {p[b]}" for b in BOUNDS if b in p)
    extra = "; ".join(f"{k}: {json.dumps(v)}" for k, v in p.items() if k not in PLAIN)   # e.g. a key's declared role
    default = json.dumps(p["default"]) if "default" in p else "(required)"
    more = "; ".join(x for x in (bounds, extra) if x)
    return (f"| `{key}` | {_cell(_type(p))} | `{_cell(default)}` | {_cell(p.get('description', ''))}"
            f"{' (' + _cell(more) + ')' if more else ''} |")


def _leaves(props: dict, prefix: str = ""):
    for name, p in props.items():
        if p.get("type") == "object" and "properties" in p:
            yield from _leaves(p["properties"], f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", p


def render() -> str:
    props = json_schema()["properties"]
    top = {k: p for k, p in props.items() if not (p.get("type") == "object" and "properties" in p)}
    out = [HEAD, "## Top level\n", "| key | type | default | meaning |", "|---|---|---|---|"]
    out += [_row(k, p) for k, p in top.items()]
    for section, p in props.items():
        if section in top:
            continue
        out += ["", f"## `{section}`\n", _cell(p.get("description", "")) + "\n",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [_row(k, q) for k, q in _leaves(p["properties"], f"{section}.")]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash.config_docs", description=__doc__)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help=f"write {DOC}")
    what.add_argument("--check", action="store_true", help=f"exit 1 when {DOC} differs from the models")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.is_file() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `python -m dflash.config_docs --write`", file=sys.stderr)
            return 1
        return 0
    if args.write:
        from dflash.atomic import atomic_write_text
        atomic_write_text(DOC, text)
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
