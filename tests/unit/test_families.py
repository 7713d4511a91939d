"""The families as data (dflash.families): which engines serve a DFlash drafter for each, the config keys that build
one, what a family that cannot work says at config load, docs/targets.md against the table, train.target_split's
placement. The matrix itself (every family end to end) is tests/e2e/test_family_matrix.py."""
import re
import typing

import pytest

from dflash import config as C
from dflash import families as FAM
from dflash.config_model import FAMILIES as CONFIG_FAMILIES, ArchSection

# read from vLLM 0.33.0, SGLang 0.5.23 and dflash 0.1.0 (docs/targets.md names the files): who takes a DFlash drafter
SERVED = {
    "llama": {"reference", "vllm", "sglang"},
    "qwen2": {"reference", "vllm"},
    "qwen3": {"reference", "vllm", "sglang"},
    "qwen3_moe": {"reference", "vllm", "sglang"},
    "gemma3_text": {"reference"},
    "mistral": {"reference", "vllm", "sglang"},
    "gpt_oss": {"reference", "vllm", "sglang"},
    "qwen3_next": {"vllm", "sglang"},
    "lfm2": {"reference", "sglang"},
}


def test_the_serving_contract_of_every_family():
    assert set(FAM.FAMILIES) == set(SERVED) == set(CONFIG_FAMILIES)
    for name, fam in FAM.FAMILIES.items():
        assert set(fam.serving) == set(FAM.ENGINES), name
        assert {e for e, s in fam.serving.items() if s.accepts} == SERVED[name], name
        refused = [e for e, s in fam.serving.items() if not s.accepts and e != "reference"]
        for engine in refused:   # every engine that refuses a family is named in its limits
            assert any({"vllm": "vLLM", "sglang": "SGLang"}[engine] in x for x in fam.limits), (name, engine)
    assert set(FAM.TARGET_LAYER_IDS) == set(FAM.ENGINES) and FAM.MAX_SERVED_ID == -2


def test_every_family_builds_from_the_arch_keys():
    for name in FAM.FAMILIES:
        arch = ArchSection.model_validate({"family": name, "hidden_size": 32, "num_attention_heads": 4,
                                           "num_key_value_heads": 2, "head_dim": 8})
        cfg = FAM.hf_config(arch)
        assert cfg.model_type == name and cfg.num_hidden_layers == arch.num_hidden_layers
        assert (FAM.embed_scale(cfg) == 32 ** 0.5) == (name == "gemma3_text")
    assert typing.get_args(ArchSection.model_fields["family"].annotation) == CONFIG_FAMILIES


def test_a_family_that_cannot_work_says_so_in_one_line():
    import transformers
    gemma = transformers.Gemma3Config(text_config={"hidden_size": 32, "num_hidden_layers": 2})
    assert "multimodal config" in FAM.check_config(gemma)
    oss = FAM.hf_config(ArchSection.model_validate({"family": "gpt_oss"}))
    assert "set target.attn_implementation: eager" in FAM.check_config(oss, "sdpa")
    assert FAM.check_config(oss, "eager") is None
    no_layers = transformers.Qwen3Config()
    vars(no_layers)["num_hidden_layers"] = None   # (its setter refuses None)
    assert "has no num_hidden_layers" in FAM.check_config(no_layers)
    for why in (FAM.check_config(gemma), FAM.check_config(oss, "sdpa")):
        assert "\n" not in why
    with pytest.raises(C.ConfigError, match=r"target\.arch\.family.*'mamba'"):
        C.from_dict({"target": {"arch": {"family": "mamba"}}})
    with pytest.raises(C.ConfigError, match="build code pre-trains a Qwen3 model only"):
        C.from_dict({"target": {"build": "code", "arch": {"family": "llama"}}})
    with pytest.raises(C.ConfigError, match="experts_per_token"):
        C.from_dict({"target": {"arch": {"family": "qwen3_moe", "num_experts": 2, "experts_per_token": 3}}})


def test_family_keys_of_another_family_change_no_hash():
    base = C.from_dict({"target": {"arch": {"family": "llama"}}})
    other = C.from_dict({"target": {"arch": {"family": "llama", "num_experts": 8, "sliding_window": 16}}})
    assert (base.hash, base.result_hash) == (other.hash, other.result_hash)
    moe = C.from_dict({"target": {"arch": {"family": "qwen3_moe", "num_experts": 8}}})
    assert moe.result_hash != C.from_dict({"target": {"arch": {"family": "qwen3_moe"}}}).result_hash


def test_docs_targets_md_states_the_matrix(repo):
    text = (repo / "docs" / "targets.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", text, re.M)}
    assert set(rows) == set(FAM.FAMILIES)
    for name, fam in FAM.FAMILIES.items():
        cells = [c.strip() for c in rows[name].split("|")[1:-1]]
        engines = {e for e, label in (("reference", "reference"), ("vllm", "vLLM"), ("sglang", "SGLang"))
                   if label in cells[4].split(", ")}
        assert engines == SERVED[name], (name, cells[4])
        assert fam.cache in cells[2], name
    assert "docs/targets.md" in (repo / "README.md").read_text()


def test_target_split_places_one_worker_per_run_of_devices(fake_gpus):
    from dflash.errors import UserError
    from dflash.train import placement as P
    fake_gpus(8)
    t = C.from_dict({"train": {"targets": ["0", "1", "2", "3"], "target_split": 2, "drafters": ["4", "5"]}}).cfg.train
    p = P.resolve(t)
    assert [str(d) for d in p.targets] == ["cuda:0", "cuda:2"] and p.runtime == "distributed"
    assert [str(d) for d in p.group(p.targets[1])] == ["cuda:2", "cuda:3"]
    one = P.resolve(C.from_dict({"train": {"targets": ["cpu"], "drafters": ["cpu"]}}).cfg.train)
    assert one.group(one.targets[0]) == (one.targets[0],)
    with pytest.raises(C.ConfigError, match="not a whole number of target workers"):
        C.from_dict({"train": {"targets": ["0", "1", "2"], "target_split": 2}})
    with pytest.raises(C.ConfigError, match="train.compile_target"):
        C.from_dict({"train": {"targets": ["0", "1"], "target_split": 2, "compile_target": True}})
    with pytest.raises(UserError, match="co-located"):
        P.resolve(C.from_dict({"train": {"targets": ["0", "1"], "drafters": ["0", "1"], "target_split": 2,
                                         "runtime": "distributed"}}).cfg.train)


def test_a_build_none_target_that_cannot_work_is_refused_at_config_load(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "hidden_size": 32, "vocab_size": 64,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4}))
    loaded = C.from_dict({"target": {"path": str(tmp_path), "build": "none"}})
    with pytest.raises(C.ConfigError, match=r"target\.path .*'gpt_oss'.*set target\.attn_implementation: eager"):
        C.check_here(loaded, devices=False)
    C.check_here(C.from_dict({"target": {"path": str(tmp_path), "build": "none", "attn_implementation": "eager"}}),
                 devices=False)


def test_a_soft_capped_target_trains_on_ce_only(tmp_path):
    import transformers

    from dflash.errors import UserError
    from dflash.train.context import prepare
    transformers.Gemma3TextConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=8, vocab_size=64, final_logit_softcapping=30.0).save_pretrained(tmp_path)
    loaded = C.from_dict({"target": {"path": str(tmp_path), "build": "none"}, "train": {"objective": "kl"}})
    with pytest.raises(UserError, match=r"train\.objective kl: the target soft-caps its logits"):
        prepare(loaded, need_data=False)
