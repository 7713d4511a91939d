"""The serving contract (dflash/model/serving.py, docs/serving.md): our export meets it for full, sliding and mixed
drafters; an export with a field removed, a forbidden field added, a weight renamed or reshaped breaks it."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.model import reference_keys, save_drafter, serving_problems
from dflash.model.serving import ABSENT, FIELDS, LAYER_WEIGHTS, SHARED_WEIGHTS, check
from support.model import make_drafter, tiny_cfg

SW, FA = "sliding_attention", "full_attention"
LAYOUTS = {"full": {}, "sliding": {"layer_types": [SW, SW], "sliding_window": 3},
           "mixed": {"layer_types": [SW, FA], "sliding_window": 6}}
DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def export(tmp_path, layout="mixed", dtype=None):
    d = make_drafter(tiny_cfg(**LAYOUTS[layout]))
    return save_drafter(d, tmp_path / layout, dtype=dtype, mask_token="<|mask|>")


def read(out):
    conf = json.loads((out / "config.json").read_text())
    return conf, {k: tuple(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_our_export_meets_the_contract(tmp_path, layout):
    out = export(tmp_path, layout, dtype=torch.bfloat16)
    assert serving_problems(out) == []
    conf, shapes = read(out)
    assert conf["dflash_config"]["mask_token"] == "<|mask|>" and conf["dflash_config"]["mask_token_id"] == 96
    assert conf["layer_types"] == tiny_cfg(**LAYOUTS[layout]).layer_types
    assert shapes["fc.weight"] == (32, 3 * 32) and shapes["layers.1.self_attn.k_proj.weight"] == (2 * 8, 32)


def edited(conf: dict, key: str):
    """A deep copy of `conf` and (the dict holding the dotted `key`, its last part)."""
    broken = copy.deepcopy(conf)
    *path, last = key.split(".")
    node = broken
    for p in path:
        node = node[p]
    return broken, node, last


def test_every_field_removed_breaks_it(tmp_path):
    conf, shapes = read(export(tmp_path))
    for field in FIELDS:
        broken, node, last = edited(conf, field.key)
        del node[last]
        problems = check(broken, shapes)
        assert problems and field.key in problems[0], (field.key, problems)


def test_a_forbidden_field_breaks_it(tmp_path):
    conf, shapes = read(export(tmp_path))
    for key in ABSENT:
        broken, node, last = edited(conf, key)
        node[last] = False
        assert check(broken, shapes) == [f"config.json: {key} must be absent ({ABSENT[key]})"]


@pytest.mark.parametrize("change, expected", [
    ({"sliding_window": None}, "sliding_window must be the window"),
    ({"use_sliding_window": False}, "use_sliding_window must be True"),
    ({"layer_types": [SW]}, "layer_types must list"),
    ({"block_size": 8}, "dflash_config.block_size must equal block_size"),
    ({"vocab_size": 96}, "mask_token_id must be a token id below vocab_size 96"),
    ({"num_target_layers": 4}, "has id 3, but the target has 4 layers"),   # id L-1: each stack reads another thing
    ({"architectures": ["Qwen3ForCausalLM"]}, "architectures must be ['DFlashDraftModel']"),
])
def test_wrong_values_break_it(tmp_path, change, expected):
    conf, shapes = read(export(tmp_path))
    problems = check({**conf, **change}, shapes)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_renamed_missing_or_reshaped_weight_breaks_it(tmp_path):
    out = export(tmp_path)
    sd = load_file(str(out / "model.safetensors"))
    sd["layers.0.self_attn.qkv_proj.weight"] = sd.pop("layers.0.self_attn.q_proj.weight")
    del sd["hidden_norm.weight"]
    sd["fc.weight"] = sd["fc.weight"][:, :64].contiguous()
    sd["lm_head.weight"] = torch.zeros(97, 32)
    save_file(sd, str(out / "model.safetensors"))
    assert serving_problems(out) == [
        "model.safetensors: hidden_norm.weight is missing",
        "model.safetensors: layers.0.self_attn.q_proj.weight is missing",
        *[f"model.safetensors: {k} is not a drafter weight (vLLM would load embed_tokens/lm_head/d2t as the "
          "drafter's own; SGLang ignores unknown names)" for k in ("layers.0.self_attn.qkv_proj.weight",
                                                                  "lm_head.weight")],
        "model.safetensors: fc.weight has shape (32, 64), config.json says (32, 96)",
    ]


def test_weight_names_are_the_drafters_and_the_doc_has_every_row():
    assert sorted(make_drafter(tiny_cfg()).state_dict()) == reference_keys(2)
    doc = DOC.read_text()
    names = set(re.findall(r"`([\w.]+)`", doc))
    missing = [k for k in [f.key for f in FIELDS] + list(ABSENT) + list(LAYER_WEIGHTS) + list(SHARED_WEIGHTS)
               if k not in names]
    assert missing == [], f"docs/serving.md does not name {missing}"
