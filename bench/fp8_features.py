"""The target-FP8 switch (train.fp8_target) against bf16 on what the drafter reads: the target's captured features.
Shared by bench/h200.py's fp8 section (bench/sections/target.py: the random Qwen3-8B-shaped target) and this file's
command on a pipeline's pre-trained target and its held-out conversations (after `snakemake --until data`):

    python bench/fp8_features.py --config config/quality.yaml --out OUT/fp8-features.json


- `capture_both(model, ctx, measure)`: a training run's capture of `model` (dflash.train.features.run_capture on
  ctx.drafter_config's target layers, ctx.cfg.train's objective) with train.fp8_target off, then on. The second one
  quantizes the weights of the layers the capture runs, once and in place, exactly as a training run does (the model
  stays FP8 afterwards). `measure(name, capture) -> {label: features}` is called with each ("bf16", then "fp8"), and
  the capture's hooks are removed after it. Returns ({label: features as float32}, seconds the quantization took).
- `relative_error(got, ref)`: ||got - ref|| / ||ref|| over every element.
- `measure(config)`: on the config's target (loaded by the train stage's code on train.targets[0], target.dtype) and
  every held-out conversation of its dataset (holdout.jsonl: the prompt and the source's answer, cut at
  data.max_length), bf16 then FP8 weights: the relative error overall and per target layer; `{"skipped": why}` where
  train.fp8_target cannot run (the train stage's own refusal: no CUDA GPU of compute capability >= 8.9) or the target
  and data are not built yet. On the CPU it measures with torch's CPU FP8 matmul (tests/stages/test_fp8.py).
"""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run as a script: the repository's bench and dflash
from bench.common import Stopwatch  # noqa: E402


def capture_both(model, ctx, measure) -> tuple[dict, float]:
    import torch

    from dflash.train.features import run_capture
    feats, quantize_s = {}, 0.0
    device = next(model.parameters()).device
    for name, on in (("bf16", False), ("fp8", True)):
        train = ctx.cfg.train.model_copy(update={"fp8_target": on})
        quantize = Stopwatch()
        capture = run_capture(model, SimpleNamespace(drafter_config=ctx.drafter_config,
                                                     cfg=ctx.cfg.model_copy(update={"train": train})))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if on:
            quantize_s = quantize.s
        try:
            feats.update({label: f.float() for label, f in measure(name, capture).items()})
        finally:
            capture.remove()
    return feats, quantize_s


def relative_error(got, ref) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def measure(config: str) -> dict:
    import torch

    from dflash import paths
    from dflash.config import load
    from dflash.data.shards import read_holdout
    from dflash.errors import UserError
    from dflash.target import load_target
    from dflash.train import placement as P, precision
    from dflash.train.context import prepare
    loaded = load(config, {})
    cfg = loaded.cfg
    data = paths.dataset(cfg.results_dir, cfg.dataset_name)
    rows = read_holdout(data) if (data / "holdout.jsonl").is_file() else []
    if not rows or not (Path(cfg.target.path) / "config.json").exists():
        return {"skipped": f"no target or no held-out conversations in {data} yet (snakemake --until data first)"}
    try:   # the train stage's own refusals: no such GPU here, or one without FP8
        placement = P.resolve(cfg.train)
        device = placement.targets[0]
        if device.type != "cpu":
            precision.check(cfg.train.model_copy(update={"fp8_target": True}), placement)
    except UserError as e:
        return {"skipped": str(e)}
    ctx = prepare(loaded, need_data=False)
    model = load_target(cfg.target, device)
    seqs = [(r["prompt_ids"] + r["reference_ids"])[:cfg.data.max_length] for r in rows]
    layers = []

    def run(name, capture):
        layers[:] = capture.layer_ids
        return {name: torch.cat([capture(torch.tensor([s], device=device))[0] for s in seqs])}
    feats, quantize_s = capture_both(model, ctx, run)
    h = ctx.drafter_config.hidden_size
    per_layer = {str(i): round(relative_error(feats["fp8"][:, j * h:(j + 1) * h], feats["bf16"][:, j * h:(j + 1) * h]),
                               5) for j, i in enumerate(layers)}
    return {"rel_err": round(relative_error(feats["fp8"], feats["bf16"]), 5), "rel_err_per_layer": per_layer,
            "layers": layers, "conversations": len(seqs), "tokens": sum(map(len, seqs)), "target": cfg.target.path,
            "device": str(device), "dtype": str(model.dtype).replace("torch.", ""), "quantize_s": round(quantize_s, 3)}


def main(argv=None) -> int:
    import argparse
    import json

    from bench.common import envelope, portable
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="config/quality.yaml")
    p.add_argument("--out", required=True, help="the record (JSON)")
    args = p.parse_args(argv)
    from dflash.atomic import atomic_write_json
    doc = {**envelope(argv), "config": args.config, "fp8_features": measure(args.config)}
    atomic_write_json(args.out, portable(doc))
    print(json.dumps(doc["fp8_features"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
