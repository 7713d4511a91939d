"""The built-in corpus: instruction/response conversations made offline from the Python standard library.

Every machine with the same Python minor version produces the same conversations: a fixed, sorted list of
platform-independent stdlib modules, members visited in sorted order, and a seeded shuffle. Questions ask what a
module, function, class or method does (answer: the first paragraphs of its docstring), for a signature, for the
source of a short function, or for a class's methods; some conversations have two turns and a system prompt.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import random
import re
import textwrap
import warnings

# Platform-independent modules only (no os/sys/posix-specific docs); sorted; imports without side effects.
MODULES = sorted([
    "abc", "argparse", "array", "ast", "base64", "bisect", "calendar", "cmath", "codecs", "collections",
    "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib",
    "dis", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "functools", "getopt", "gettext", "glob",
    "graphlib", "gzip", "heapq", "hmac", "html", "html.parser", "http", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "linecache", "logging", "math", "mimetypes", "numbers", "operator",
    "pathlib", "pickle", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex",
    "shutil", "statistics", "string", "struct", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "tomllib", "traceback", "types", "typing", "unicodedata", "urllib.parse", "uuid", "warnings",
    "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
])

SYSTEM_PROMPTS = [
    "You are a helpful assistant who knows the Python standard library well.",
    "You are a concise Python expert. Answer from the official documentation.",
]
MAX_ANSWER_CHARS = 900
MAX_SOURCE_LINES = 30
MIN_ANSWER_CHARS = 100      # shorter answers teach the tiny target to stop before a drafter block is filled
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")   # object reprs in defaults differ per process


def _paragraphs(doc: str | None, max_chars: int = MAX_ANSWER_CHARS) -> str:
    """First paragraph(s) of a docstring, whole paragraphs up to max_chars (at least one, cut if huge)."""
    if not doc:
        return ""
    doc = inspect.cleandoc(doc).strip()
    paras = [p.strip() for p in re.split(r"\n\s*\n", doc) if p.strip()]
    out: list[str] = []
    size = 0
    for p in paras:
        if out and size + len(p) > max_chars:
            break
        out.append(p)
        size += len(p) + 2
    text = "\n\n".join(out)
    return text[:max_chars].rstrip()


def _signature(obj) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    return _ADDRESS.sub("", sig)


def _ast_records(mod) -> list[dict] | None:
    """Members of a pure-Python module read from its source with `ast`: independent of what the running process
    imported or monkeypatched (torch patches inspect, transformers adds Logger methods)."""
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    try:
        text = open(path, encoding="utf-8").read()
        tree = ast.parse(text)
        lines = text.splitlines()
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    public = None
    for node in tree.body:    # a literal __all__ in the source, not the (mutable) module attribute
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                public = set(ast.literal_eval(node.value))
            except ValueError:
                public = None
    recs = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        name = node.name
        if name.startswith("_") or (public is not None and name not in public):
            continue
        rec = {"name": name, "kind": "class" if isinstance(node, ast.ClassDef) else "function",
               "doc": ast.get_docstring(node), "sig": None, "src": None, "methods": []}
        if rec["kind"] == "function":
            rec["sig"] = f"({ast.unparse(node.args)})"
            if node.end_lineno - node.lineno < MAX_SOURCE_LINES and not node.decorator_list:
                rec["src"] = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno])).rstrip()
        else:
            init = next((b for b in node.body if isinstance(b, ast.FunctionDef) and b.name == "__init__"), None)
            if init is not None:
                args = ast.unparse(init.args)
                args = re.sub(r"^self(, )?", "", args)
                rec["sig"] = f"({args})"
            for b in sorted((b for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))
                             and not b.name.startswith("_")), key=lambda b: b.name):
                rec["methods"].append((b.name, ast.get_docstring(b)))
        recs[name] = rec
    return [recs[k] for k in sorted(recs)]


def _inspect_records(mod) -> list[dict]:
    """Members of a C module (its attributes are fixed at build time), sorted by name."""
    names = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    out = []
    for name in sorted(set(names)):
        obj = getattr(mod, name, None)
        if name.startswith("_") or not (inspect.isbuiltin(obj) or inspect.isclass(obj)):
            continue
        rec = {"name": name, "kind": "class" if inspect.isclass(obj) else "function", "doc": obj.__doc__,
               "sig": _signature(obj), "src": None, "methods": []}
        if inspect.isclass(obj):
            for m in sorted(vars(obj)):
                mobj = vars(obj)[m]
                if not m.startswith("_") and (inspect.ismethoddescriptor(mobj) or inspect.isbuiltin(mobj)):
                    rec["methods"].append((m, getattr(mobj, "__doc__", None)))
        out.append(rec)
    return out


def _conv(kind: str, key: str, turns: list[tuple[str, str]], system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    for q, a in turns:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"id": f"stdlib-{kind}-{key}", "messages": messages}


def _first_line(doc, n=160) -> str:
    p = _paragraphs(doc, n)
    return p.splitlines()[0] if p else ""


def _module_conversations(modname: str) -> list[dict]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(modname)
    except Exception:       # a module missing from a trimmed Python build: skip it, deterministically
        return []
    records = _ast_records(mod)
    if records is None:
        records = _inspect_records(mod)
    convs = []
    mdoc = _paragraphs(mod.__doc__)
    if mdoc:
        convs.append(_conv("module", modname, [(f"What is the `{modname}` module for?", mdoc)]))
    if records:
        listing = "\n".join(f"- `{r['name']}`: {_first_line(r['doc'])}" if _first_line(r["doc"]) else f"- `{r['name']}`"
                            for r in records[:25])
        convs.append(_conv("listing", modname, [(f"What does the `{modname}` module provide?", listing)]))
    for i, r in enumerate(records):
        qual = f"{modname}.{r['name']}"
        doc = _paragraphs(r["doc"])
        sig = _ADDRESS.sub("", r["sig"]) if r["sig"] else None
        kind = r["kind"]
        if doc:
            q = f"What does `{qual}` do?" if kind == "function" else f"What is the `{qual}` class?"
            if sig and i % 3 == 0:
                # two turns: the description, then the signature
                convs.append(_conv("twoturn", qual, [(q, doc), ("Show its signature.",
                                   f"```python\n{qual}{sig}\n```")], SYSTEM_PROMPTS[i % 2]))
            else:
                convs.append(_conv("doc", qual, [(q, doc)], SYSTEM_PROMPTS[i % 2] if i % 5 == 1 else None))
        if sig:
            first = doc.split("\n\n")[0] if doc else ""
            answer = f"```python\n{qual}{sig}\n```" + (f"\n\n{first}" if first else "")
            convs.append(_conv("signature", qual, [(f"Show the signature of `{qual}`.", answer)]))
        if r["src"]:
            convs.append(_conv("source", qual, [(f"Show the source code of `{qual}`.", f"```python\n{r['src']}\n```")]))
        if r["methods"]:
            listing = "\n".join(f"- `{m}`: {_first_line(d, 200)}" if _first_line(d, 200) else f"- `{m}`"
                                for m, d in r["methods"][:20])
            convs.append(_conv("methods", qual, [(f"Which public methods does `{qual}` have?", listing)]))
            for m, d in r["methods"][:8]:
                mdoc_ = _paragraphs(d)
                if mdoc_:
                    convs.append(_conv("method", f"{qual}.{m}", [(f"What does `{qual}.{m}` do?", mdoc_)]))
    return convs


@functools.lru_cache(maxsize=4)
def _all_conversations() -> tuple:
    convs = []
    seen = set()
    for modname in MODULES:
        for c in _module_conversations(modname):
            answers = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
            if c["id"] in seen or sum(len(a) for a in answers) < MIN_ANSWER_CHARS:
                continue
            seen.add(c["id"])
            convs.append(c)
    return tuple(convs)


def conversations(max_conversations: int = 1500, seed: int = 0) -> list[dict]:
    """Up to `max_conversations` conversations {"id", "messages"} in OpenAI form; deterministic."""
    convs = list(_all_conversations())
    random.Random(seed).shuffle(convs)
    return [{"id": c["id"], "messages": [dict(m) for m in c["messages"]]} for c in convs[:max_conversations]]


def corpus_hash(convs: list[dict]) -> str:
    h = hashlib.sha256()
    for c in convs:
        h.update(c["id"].encode())
        for m in c["messages"]:
            h.update(m["role"].encode() + b"\0" + m["content"].encode() + b"\0")
    return h.hexdigest()[:16]
