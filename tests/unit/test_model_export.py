"""Reference-format export: config.json + model.safetensors with exactly the reference keys; round trip."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash.model import DrafterConfig, load_drafter, reference_config, reference_keys, save_drafter
from support.model import make_batch, make_drafter, tiny_cfg


def test_round_trip_identical_outputs_and_reference_keys(tmp_path):
    cfg = tiny_cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    d = make_drafter(cfg)
    out = save_drafter(d, tmp_path / "drafter", extra={"dflash_run": "test"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    sd = load_file(str(out / "model.safetensors"))
    assert sorted(sd) == reference_keys(2)
    assert not any("embed" in k or "lm_head" in k for k in sd)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["model_type"] == "qwen3"
    assert conf["block_size"] == 4 and conf["num_target_layers"] == 6 and conf["num_hidden_layers"] == 2
    assert conf["dflash_config"]["mask_token_id"] == 96 and conf["dflash_config"]["target_layer_ids"] == [0, 2, 3]
    assert conf["layer_types"] == ["sliding_attention", "full_attention"] and conf["sliding_window"] == 6
    assert conf["use_sliding_window"] is True and conf["dflash_run"] == "test"
    loaded = load_drafter(out, d.embed_weight, d.lm_head_weight)
    assert loaded.cfg == cfg
    hidden, ids, lm, an = make_batch(cfg, 2, 20, 4)
    with torch.no_grad():
        assert torch.equal(loaded(hidden, ids, an), d(hidden, ids, an))
    # a second save replaces the directory atomically, leaving no temporary folders behind
    save_drafter(loaded, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_sliding_window_alone_slides_every_layer_and_round_trips(tmp_path):
    """drafter.sliding_window W with layer_types null: every layer slides with window W, exactly the explicit layout
    [sliding_attention] * n (same masks, same outputs, not the full layout's); an explicit layer_types still wins;
    the export writes the explicit layout and reads it back."""
    from transformers import Qwen3Config

    from dflash.model.attention import make_mask
    SW, FA = "sliding_attention", "full_attention"
    alone, explicit, full = tiny_cfg(sliding_window=5), tiny_cfg(layer_types=[SW, SW], sliding_window=5), tiny_cfg()
    assert alone == explicit and alone.layer_types == [SW, SW] and alone.windows() == (5,)
    target = Qwen3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         intermediate_size=48, num_hidden_layers=6, vocab_size=97, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=512)
    section = {"num_layers": 2, "block_size": 4, "target_layer_ids": [0, 2, 3], "mask_token_id": 96,
               "sliding_window": 5, "layer_types": None}                 # the YAML's drafter section
    assert DrafterConfig.from_target(target, section).layer_types == [SW, SW]
    assert DrafterConfig.from_target(target, {**section, "layer_types": [FA, SW]}).layer_types == [FA, SW]
    hidden, ids, lm, an = make_batch(alone, 2, 20, 4)
    masks = {name: make_mask(an, 20, "sdpa", c.windows()) for name, c in (("alone", alone), ("explicit", explicit))}
    assert list(masks["alone"]) == [5] and torch.equal(masks["alone"][5].dense, masks["explicit"][5].dense)
    assert not torch.equal(masks["alone"][5].dense, make_mask(an, 20, "sdpa", full.windows())[None].dense)
    d = make_drafter(alone)
    with torch.no_grad():
        out = d(hidden, ids, an)
        assert torch.equal(out, make_drafter(explicit)(hidden, ids, an))
        assert not torch.allclose(out, make_drafter(full)(hidden, ids, an))
    conf = json.loads((save_drafter(d, tmp_path / "drafter") / "config.json").read_text())
    assert conf["layer_types"] == [SW, SW] and conf["use_sliding_window"] is True and conf["sliding_window"] == 5
    loaded = load_drafter(tmp_path / "drafter", d.embed_weight, d.lm_head_weight)
    assert loaded.cfg == explicit
    with torch.no_grad():
        assert torch.equal(loaded(hidden, ids, an), out)


def test_config_json_loads_as_a_transformers_qwen3_config(tmp_path):
    from transformers import Qwen3Config
    cfg = tiny_cfg(rope_theta=12345.0)
    hf = Qwen3Config(**cfg.to_hf_dict())
    assert hf.num_hidden_layers == 2 and hf.head_dim == 8 and hf.num_key_value_heads == 2
    assert hf.rope_parameters["rope_theta"] == 12345.0
    assert hf.dflash_config["target_layer_ids"] == [0, 2, 3] and hf.block_size == 4
    assert DrafterConfig.from_hf_dict(hf.to_dict()) == cfg
    # a mixed layout survives transformers' Qwen3Config, which the reference and SGLang read it through
    mixed = tiny_cfg(num_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     sliding_window=3)
    hf = Qwen3Config(**reference_config(mixed))
    assert hf.layer_types == mixed.layer_types and hf.sliding_window == 3
    assert DrafterConfig.from_hf_dict(hf.to_dict()) == mixed


def test_reference_config_layer_layout_fields():
    """What the inference stacks read to run each layer: layer_types, sliding_window, use_sliding_window; and
    configs whose layers would run differently from ours are refused."""
    full = reference_config(tiny_cfg(), dtype=torch.float32)
    assert full["layer_types"] == ["full_attention"] * 2 and full["use_sliding_window"] is False
    assert full["sliding_window"] is None and full["dtype"] == "float32"
    assert not {"is_causal", "use_swa", "causal"} & (set(full) | set(full["dflash_config"]))
    mixed = reference_config(tiny_cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=5))
    assert mixed["layer_types"] == ["full_attention", "sliding_attention"]
    assert mixed["use_sliding_window"] is True and mixed["sliding_window"] == 5
    # no layer_types: transformers' rule (layers from max_window_layers on slide, when use_sliding_window)
    legacy = {k: v for k, v in mixed.items() if k != "layer_types"} | {"max_window_layers": 1}
    assert DrafterConfig.from_hf_dict(legacy).layer_types == ["full_attention", "sliding_attention"]
    for bad in ({"is_causal": False}, {"use_sliding_window": False},
                {"dflash_config": {**mixed["dflash_config"], "causal": True}}):
        with pytest.raises(ValueError):
            DrafterConfig.from_hf_dict(mixed | bad)


def test_load_errors_name_the_file(tmp_path):
    d = make_drafter(tiny_cfg())
    out = save_drafter(d, tmp_path / "x")
    sd = load_file(str(out / "model.safetensors"))
    sd["lm_head.weight"] = torch.zeros(3, 3)
    del sd["layers.1.mlp.up_proj.weight"]
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_drafter(out, d.embed_weight, d.lm_head_weight)
    msg = str(e.value)
    assert "model.safetensors" in msg and "layers.1.mlp.up_proj.weight" in msg and "lm_head.weight" in msg
    (out / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(out, d.embed_weight, d.lm_head_weight)


def test_from_target_takes_null_sizes_from_the_target():
    from transformers import Qwen3Config
    target = Qwen3Config(vocab_size=300, hidden_size=64, num_hidden_layers=12, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=16, intermediate_size=200, rope_theta=500.0,
                         max_position_embeddings=1024)
    sec = dict(num_layers=3, hidden_size=None, num_attention_heads=None, num_key_value_heads=None, head_dim=None,
               intermediate_size=96, block_size=8, num_target_layers=4, target_layer_ids=None, mask_token_id=None,
               sliding_window=None, layer_types=None)
    cfg = DrafterConfig.from_target(target, sec, mask_token_id=299)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (300, 64, 8, 4, 16)
    assert cfg.intermediate_size == 96 and cfg.num_layers == 3 and cfg.block_size == 8
    assert cfg.target_layer_ids == [1, 4, 6, 9] and cfg.num_target_layers == 12
    assert cfg.mask_token_id == 299 and cfg.rope_theta == 500.0 and cfg.layer_types == ["full_attention"] * 3
    with pytest.raises(ValueError, match="hidden_size"):
        DrafterConfig.from_target(target, {**sec, "hidden_size": 32}, mask_token_id=299)
    with pytest.raises(ValueError, match="mask"):
        DrafterConfig.from_target(target, sec, mask_token_id=None)
    # the typed config section of the pipeline works too
    from dflash.config import from_dict
    typed = from_dict({"target": {"build": "none"},
                       "drafter": {"num_layers": 2, "target_layer_ids": [0, 11]}}).cfg.drafter
    cfg2 = DrafterConfig.from_target(target, typed, mask_token_id=5)
    assert cfg2.target_layer_ids == [0, 11] and cfg2.num_layers == 2 and cfg2.block_size == 16


def test_from_target_takes_the_config_defaults_for_keys_left_out():
    """A drafter section that leaves out num_layers, block_size and num_target_layers gets the config's defaults
    (dflash/config_model.py: 2 layers, block 16, 5 target layers), never numbers restated in code."""
    from transformers import Qwen3Config

    from dflash.config_model import DrafterSection
    target = Qwen3Config(vocab_size=300, hidden_size=64, num_hidden_layers=12, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=16, intermediate_size=200)
    cfg = DrafterConfig.from_target(target, {}, mask_token_id=299)
    want = DrafterSection()
    assert (cfg.num_layers, cfg.block_size, len(cfg.target_layer_ids)) == \
        (want.num_layers, want.block_size, want.num_target_layers) == (2, 16, 5)
    assert DrafterConfig.from_target(target, None, mask_token_id=299) == cfg
    with pytest.raises(Exception, match="num_layers"):           # a dict is read as the section: typed, strict
        DrafterConfig.from_target(target, {"num_layers": "2"}, mask_token_id=299)
