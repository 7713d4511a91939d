"""Helpers for the data/target tests: a really tiny target built once per session, and config builders.

The fixtures over them (`tiny_target`, `talking_target`, `data_cfg`, `one_thread`) are in tests/conftest.py.
The build is cached at module level, so several test files share one build.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

TINY_ARCH = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 16, "intermediate_size": 64, "vocab_size": 384, "max_position_embeddings": 1024}
TINY_PRETRAIN = {"steps": 40, "batch_size": 8, "seq_len": 64, "lr": 0.01}
_BUILT: dict = {}


def target_section(path, build="tiny") -> dict:
    return {"path": str(path), "build": build, "arch": dict(TINY_ARCH), "pretrain": dict(TINY_PRETRAIN)}


def build_tiny_target() -> Path:
    if "tiny" not in _BUILT:
        from dflash import config as C
        from dflash.data.tiny_target import build_target
        root = Path(tempfile.mkdtemp(prefix="dflash-tiny-target-"))
        path = root / "tiny"
        loaded = C.from_dict({"target": target_section(path)})
        build_target(loaded.cfg.target, path, seed=0, corpus_size=200, progress=False, threads=1)
        _BUILT["tiny"] = path
    return _BUILT["tiny"]


def make_loaded(tmp_path, target_path, sources=(), **data):
    """A loaded config: the tiny target, the given sources, no built-in corpus, no regeneration, no holdout unless set."""
    from dflash import config as C
    d = {"builtin_corpus": {"enabled": False}, "regenerate": {"enabled": False}, "holdout": 0,
         "min_supervised_blocks": 1, "max_length": 256, "bucket_edges": [64, 128, 256], "sources": list(sources)}
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            d[k] = {**d[k], **v}
        else:
            d[k] = v
    raw = {"results_dir": str(tmp_path), "target": target_section(target_path), "data": d,
           "drafter": {"block_size": 4}}
    return C.from_dict(raw)


def write_jsonl(path, rows) -> str:
    path = Path(path)
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else (json.dumps(r) + "\n").encode())
    return str(path)


def sharegpt(q, a, system=None):
    conv = ([{"from": "system", "value": system}] if system else []) + [{"from": "human", "value": q},
                                                                          {"from": "gpt", "value": a}]
    return {"conversations": conv}


def openai(q, a, system=None):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": q},
                                                                            {"role": "assistant", "content": a}]
    return {"messages": msgs}


ANSWERS = [
    "Return a new list containing all items from the iterable in ascending order.",
    "Split the string at the first occurrence of sep, and return a 3-tuple.",
    "Serialize obj to a JSON formatted str using this conversion table.",
    "Remove any common leading whitespace from every line in text.",
    "Return the number of items in a container; the argument may be a sequence.",
    "Compute the greatest common divisor of the integer arguments given.",
]


def good_rows(n=6, fmt=openai, tag=""):
    return [fmt(f"What does function number {i}{tag} do?", ANSWERS[i % len(ANSWERS)] + f" (variant {i}{tag})")
            for i in range(n)]


def build_talking_target() -> Path:
    """The tiny target's tokenizer and config with seeded random weights of a large scale, saved as safetensors: a
    target whose greedy turns are long and varied (the briefly trained tiny target answers every prompt with blank
    lines), with wide logit gaps so greedy decoding does not hinge on float rounding. Servable by `transformers serve`."""
    if "talking" not in _BUILT:
        import shutil

        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        src = build_tiny_target()
        path = Path(tempfile.mkdtemp(prefix="dflash-talking-target-")) / "talking"
        shutil.copytree(src, path)
        for f in [*path.glob("*.safetensors"), path / "build.json"]:   # other weights: not the tiny build any more
            f.unlink()
        config = AutoConfig.from_pretrained(str(path))
        config.initializer_range = 0.5
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.generation_config = AutoModelForCausalLM.from_pretrained(str(src)).generation_config
        model.save_pretrained(path, safe_serialization=True)
        _BUILT["talking"] = path
    return _BUILT["talking"]


def small_data_config(tmp_path, target_path) -> Path:
    """A config file for the data stage: the tiny target, one small source (12 good rows), no regeneration, one
    256-token bucket, block 4."""
    import yaml
    src = write_jsonl(Path(tmp_path) / "a.jsonl", good_rows(12))
    cfg = Path(tmp_path) / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "results_dir": str(Path(tmp_path) / "results"), "target": target_section(target_path),
        "data": {"builtin_corpus": {"enabled": False}, "regenerate": {"enabled": False}, "holdout": 2,
                 "min_supervised_blocks": 1, "max_length": 256, "bucket_edges": [256],
                 "sources": [{"name": "a", "path": src}]},
        "drafter": {"block_size": 4}}))
    return cfg
