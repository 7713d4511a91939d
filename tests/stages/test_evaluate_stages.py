"""Stages `evaluate` and `export` end to end on the tiny target (the data tests' session fixture), a random
drafter checkpoint and a hand-made holdout.jsonl."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from support.runs import evaluable_run
from dflash.cli import main
from dflash.data.shards import write_manifest


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def run(tmp_path, tiny_target):  # noqa: F811
    return evaluable_run(tmp_path, tiny_target, ["What does os.path.join do?", "Explain list.sort.",
                                                 "How to open a file?", "x"], (5, 10),
                         {"num_prompts": 3, "max_new_tokens": 10},
                         {"throughput": {"ktok_per_s": 1.25}, "config_hash": "c0ffee"})


def test_evaluate_writes_acceptance(run, tmp_path):
    cfg_file, run_dir, _ = run
    prompts = tmp_path / "results" / "extra.jsonl"
    prompts.write_text(json.dumps({"prompt": "Tell me about json.dumps."}) + "\n" + json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    raw = yaml.safe_load(cfg_file.read_text())
    raw["evaluate"]["prompt_files"] = [str(prompts)]
    cfg_file.write_text(yaml.safe_dump(raw))
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 0
    acc = json.loads((run_dir / "acceptance.json").read_text())
    assert acc["lossless"] is True and acc["block_size"] == 4 and acc["checkpoint_step"] == 10
    assert acc["num_prompts"] == 5 and set(acc["sets"]) == {"holdout", "extra"}
    assert acc["sets"]["holdout"]["prompts"] == 3 and acc["sets"]["extra"]["prompts"] == 2
    assert 1.0 <= acc["tau"] <= 4.0
    assert sum(acc["acceptance_histogram"].values()) == acc["verify_steps"]
    assert len(acc["acceptance_per_position"]) == 3
    assert acc["speculative_tokens_per_s"] > 0 and acc["plain_tokens_per_s"] > 0
    # temperature 0: one greedy rule for every engine, named argmax
    assert acc["proposal"] == "argmax" and list(acc["by_proposal"]) == ["argmax"]
    assert acc["by_proposal"]["argmax"]["tau"] == acc["tau"] and acc["engines"]["argmax"][0] == "vLLM (default)"


def test_evaluate_at_temperature_labels_each_policy(run):
    """evaluate.temperature > 0 (proposal auto = both): every prompt decoded under argmax and sample drafts, each
    tau labelled; the top-level tau is argmax's (what serving engines run); plain decoding once per prompt."""
    cfg_file, run_dir, _ = run
    raw = yaml.safe_load(cfg_file.read_text())
    raw["evaluate"]["temperature"] = 0.8
    cfg_file.write_text(yaml.safe_dump(raw))
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 0
    acc = json.loads((run_dir / "acceptance.json").read_text())
    assert acc["temperature"] == 0.8 and acc["proposal"] == "argmax" and acc["lossless"] is True
    assert list(acc["by_proposal"]) == ["argmax", "sample"]
    assert acc["engines"] == {"argmax": ["vLLM (default)", "SGLang", "TensorRT-LLM"],
                              "sample": ["DeepSpec", "dflash 0.1.0 (reference package)",
                                         "vLLM draft_sample_method: probabilistic (lossless from vLLM PR #54282)"]}
    for k, b in acc["by_proposal"].items():
        assert 1.0 <= b["tau"] <= 4.0 and len(b["acceptance_per_position"]) == 3
        assert sum(b["acceptance_histogram"].values()) == b["verify_steps"] and b["speedup"] > 0
    assert acc["by_proposal"]["argmax"] == {k: acc[k] for k in acc["by_proposal"]["argmax"]}   # the top: argmax's
    hold = acc["sets"]["holdout"]
    assert hold["proposal"] == "argmax" and set(hold["by_proposal"]) == {"argmax", "sample"}
    assert "plain" in hold and not any("plain" in b for b in hold["by_proposal"].values())
    assert hold["plain"]["target_forwards"] == hold["plain"]["tokens"] <= 3 * 10   # 3 prompts decoded plainly once
    assert hold["by_proposal"]["argmax"]["tau"] == hold["tau"]
    assert main(["export", "--config", str(cfg_file)]) == 0
    card = (run_dir / "drafter" / "README.md").read_text()
    assert "with argmax drafts (vLLM (default), SGLang, TensorRT-LLM); " in card and "with sample drafts (DeepSpec" in card


def test_export_then_evaluate_the_exported_folder(run, caplog):
    from dflash.model import load_drafter, reference_keys, serving_problems
    from safetensors.torch import load_file
    cfg_file, run_dir, d = run
    assert main(["export", "--config", str(cfg_file)]) == 0
    out = run_dir / "drafter"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "export.json", "model.safetensors"]
    record = json.loads((out / "export.json").read_text())   # the stage's record: what it wrote, so it is told apart
    assert sorted(record["files"]) == ["README.md", "config.json", "model.safetensors"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["block_size"] == 4 and conf["dflash_config"]["mask_token_id"] == d.cfg.mask_token_id
    # the serving contract (docs/serving.md): the mask token's text is written; target layer 1 of this 2-layer target
    # is its last, which vLLM and SGLang read differently from the reference: export warns
    assert conf["dflash_config"]["mask_token"] == "<|mask|>"
    problems = serving_problems(out)
    assert len(problems) == 1 and "target_layer_ids has id 1, but the target has 2 layers" in problems[0]
    assert f"serving contract (docs/serving.md): {problems[0]}" in caplog.messages
    sd = load_file(str(out / "model.safetensors"))
    assert sorted(sd) == reference_keys(1)
    for k, v in d.state_dict().items():
        assert torch.equal(sd[k], v)
    card = (out / "README.md").read_text()
    assert "1.250 Ktok/s" in card and "abcdef0123456789" in card and "DFlashDraftModel.from_pretrained" in card
    back = load_drafter(out, d.embed_weight, d.lm_head_weight)
    assert back.cfg == d.cfg
    # the exported folder evaluates exactly like the checkpoint it came from (greedy is deterministic)
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress", "--out", str(run_dir / "a.json")]) == 0
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress", "--drafter", str(out),
                 "--out", str(run_dir / "b.json")]) == 0
    a, b = (json.loads((run_dir / f).read_text()) for f in ("a.json", "b.json"))
    assert a["tau"] == b["tau"] and a["acceptance_histogram"] == b["acceptance_histogram"]


def test_bad_inputs_are_named(run, capsys):
    cfg_file, run_dir, _ = run
    hold = Path(yaml.safe_load(cfg_file.read_text())["results_dir"]) / "data" / "default" / "holdout.jsonl"
    hold.write_text(hold.read_text().splitlines()[0] + "\n{\"id\": 1}\n")
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 1      # not the data stage's holdout
    assert "holdout.jsonl: changed after the data stage" in capsys.readouterr().err
    write_manifest(hold.parent, {"content_hash": "abcdef0123456789", "holdout": 2})   # a data stage that wrote it so
    raw = yaml.safe_load(cfg_file.read_text())
    raw["evaluate"]["num_prompts"] = 5
    cfg_file.write_text(yaml.safe_dump(raw))
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 1
    assert "holdout.jsonl line 2" in capsys.readouterr().err
    assert not (run_dir / "acceptance.json").exists()
    import shutil
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["export", "--config", str(cfg_file)]) == 1
    assert "step-000010: missing (" in capsys.readouterr().err
    assert not (run_dir / "drafter").exists()


def test_evaluate_and_export_ignore_edited_drafter_keys(run, capsys):
    """The drafter is described by its checkpoint's config.json: editing the YAML's drafter keys after training
    changes neither the export nor the evaluation. Both read the checkpoint the run ended with (summary.json): a
    damaged one is refused by name, never replaced by an older one."""
    cfg_file, run_dir, d = run
    raw = yaml.safe_load(cfg_file.read_text())
    raw["drafter"] = {"num_layers": 3, "block_size": 8, "target_layer_ids": [1], "mask_token_id": 3}
    cfg_file.write_text(yaml.safe_dump(raw))
    assert main(["export", "--config", str(cfg_file)]) == 0
    conf = json.loads((run_dir / "drafter" / "config.json").read_text())
    assert conf["num_hidden_layers"] == 1 and conf["block_size"] == 4
    assert conf["dflash_config"] == {"mask_token_id": d.cfg.mask_token_id, "target_layer_ids": [0, 1], "block_size": 4,
                                     "mask_token": "<|mask|>"}
    assert main(["evaluate", "--config", str(cfg_file), "--no-progress"]) == 0
    acc = json.loads((run_dir / "acceptance.json").read_text())
    assert acc["block_size"] == 4 and acc["checkpoint_step"] == 10 and acc["lossless"] is True
    w = next((run_dir / "checkpoints").glob("*/step-000010")) / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    for stage in (["export"], ["evaluate", "--no-progress"]):
        assert main([stage[0], "--config", str(cfg_file), *stage[1:]]) == 1
        assert "step-000010: model.safetensors is 100 bytes" in capsys.readouterr().err
