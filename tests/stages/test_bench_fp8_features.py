"""bench/fp8_features.py's command on a pipeline's target (what bench/quality.py's fp8_features part was): it says why
it did not measure, in the train stage's own words, where train.fp8_target cannot run."""
import json

import torch
import yaml

from bench import fp8_features


def quality_config(tmp_path) -> str:
    """config/quality.yaml with its results and target under tmp_path, the target's config.json and one held-out
    conversation of its dataset."""
    doc = yaml.safe_load(open("config/quality.yaml"))
    doc.pop("sweep")
    doc["results_dir"] = str(tmp_path / "results")
    doc["target"]["path"] = str(tmp_path / "results" / "target")
    (tmp_path / "results" / "target").mkdir(parents=True)
    (tmp_path / "results" / "target" / "config.json").write_text("{}")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(doc))
    return str(tmp_path / "c.yaml")


def test_fp8_features_say_why_they_were_not_measured(tmp_path, monkeypatch, fake_gpus, repo):
    monkeypatch.chdir(repo)
    cfg = quality_config(tmp_path)
    assert "no target or no held-out conversations" in fp8_features.measure(cfg)["skipped"]
    data = tmp_path / "results" / "data" / "code-completion"
    data.mkdir(parents=True)
    row = {"id": "a", "prompt_ids": [1, 2], "reference_ids": [3]}
    data.joinpath("holdout.jsonl").write_text(json.dumps(row) + "\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_features.measure(cfg) == {
        "skipped": "train placement: 'cuda:0' asks for a GPU but CUDA is not available here"}
    fake_gpus(1)                                                     # an A100: no FP8 tensor cores
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    out = tmp_path / "f.json"
    assert fp8_features.main(["--config", cfg, "--out", str(out)]) == 0
    why = json.loads(out.read_text())["fp8_features"]["skipped"]
    assert why.startswith("train.fp8_target=true: cuda:0 (NVIDIA A100) has compute capability 8.0")
