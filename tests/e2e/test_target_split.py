"""A target that does not fit one device (train.target_split): its decoder layers split over a worker's devices by
transformers' device_map; the captured features equal the unsplit target's, on two `cpu` placements here (the real
loading and dispatch path, the same device twice) and on two GPUs in the `gpu` test. The memory estimate counts each
device's share."""
import pytest
import torch

from dflash.config_model import TargetSection
from dflash.target import load_target, split_map, target_config
from dflash.train import memory
from dflash.train.features import LayerCapture

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def targets(family_targets, one_thread):
    return {f: TargetSection.model_validate({"path": str(family_targets(f)), "build": "tiny", "arch": {"family": f}})
            for f in ("qwen3", "gemma3_text")}


def test_the_split_map_runs_layers_evenly_with_the_embedding_first_and_the_head_last(targets):
    devs = [torch.device("cuda", i) for i in range(3)]
    m = split_map(target_config(targets["qwen3"]), devs)
    assert [m[f"model.layers.{i}"] for i in range(4)] == ["cuda:0", "cuda:0", "cuda:1", "cuda:2"]
    assert (m["model.embed_tokens"], m["model.rotary_emb"], m["model.norm"], m["lm_head"]) == \
        ("cuda:0", "cuda:0", "cuda:2", "cuda:2")
    tied = split_map(target_config(targets["gemma3_text"]), devs)   # a head tied to the embedding stays with it
    assert (tied["model.embed_tokens"], tied["lm_head"], tied["model.norm"]) == ("cuda:0", "cuda:0", "cuda:2")


def _features(section, devices, ids, layer_ids):
    model = load_target(section, devices[0], devices=devices)
    cap = LayerCapture(model, layer_ids)
    try:
        return cap(ids.to(devices[0])).cpu(), model
    finally:
        cap.remove()


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_split_features_equal_the_unsplit_targets(targets, family):
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    whole, _ = _features(targets[family], [CPU], ids, [0, 1, 2, 3])
    split, model = _features(targets[family], [CPU, CPU], ids, [0, 1, 2, 3])
    assert torch.equal(whole, split)
    assert sum(memory.target_bytes(model).values()) == \
        sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


@pytest.mark.gpu
def test_split_over_two_gpus_equals_one(targets):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    for family in ("qwen3", "gemma3_text"):
        section = targets[family].model_copy(update={"dtype": "float32"})
        whole, _ = _features(section, devs[:1], ids, [0, 1, 2, 3])
        split, model = _features(section, devs, ids, [0, 1, 2, 3])
        assert {str(p.device) for p in model.parameters()} == {"cuda:0", "cuda:1"}
        per = memory.target_bytes(model)
        assert per[devs[0]] > 0 and per[devs[1]] > 0
        assert torch.allclose(whole, split, atol=1e-5, rtol=0), (whole - split).abs().max()


def test_the_train_stage_trains_the_same_drafter_on_a_split_target(tmp_path):
    """`dflash train` with one target worker over two `cpu` placements (train.target_split 2) against one over one:
    the same losses step for step (the same features reach the drafter), the run's memory estimate with it."""
    import json

    from support.train import prepared, run_dir, train_ok
    losses = {}
    for n, targets in ((1, ["cpu"]), (2, ["cpu", "cpu"])):
        cfg = prepared(tmp_path / f"split{n}", targets=targets, target_split=n, drafters=["cpu"], steps=4,
                       checkpoint_every=4)
        train_ok(cfg)
        rows = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
        losses[n] = [r["loss"] for r in rows if "loss" in r]
        summary = json.loads((run_dir(cfg) / "summary.json").read_text())
        assert summary["status"] == "completed" and [w["role"] for w in summary["workers"]].count("target") == 1
    assert losses[1] and losses[1] == losses[2]
