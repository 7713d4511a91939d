"""Regeneration throughput of the `hf` engine (dflash.data.generate.regenerate): generated tokens per second.

    python bench/regen.py --out bench/results/regen.json                      # H200: Qwen3-8B-shaped, 512 x 256
    python bench/regen.py --out /tmp/regen.json --variants generate-128,static-256,cb
    python bench/regen.py --out /tmp/regen.json --tiny                        # CPU: tiny target, small numbers

A random Qwen3-8B-shaped target (config/h200.yaml's `target.arch`, `build: random`, bf16), prompts of random
tokens with lengths cycling --prompt-lengths, greedy, exactly --new-tokens per prompt (stop tokens ignored, so
every variant generates the same count). Each variant runs once on all prompts with 16 new tokens (warm-up: compiles,
CUDA graph capture and allocator growth happen there), then on all prompts with --new-tokens, timed. Variants:
  generate-N | generate-auto   transformers generate, dynamic KV cache, batch N (auto: from free GPU memory)
  static-N | static-auto       dflash.data.decode.StaticDecoder: static KV cache, one fixed batch shape, the decode
                               step compiled and replayed as a CUDA graph (the `hf` engine's default on GPU)
  static-N-eager               the same decode loop without compiling
  cb                           transformers continuous batching (`generate_batch`, paged attention; GPU only:
                               on CPU it did not finish 16 x 8 tokens in 8 minutes)
The JSON (written after every variant, so a timeout keeps what finished) holds the command, date, torch and
transformers versions, device, the config, and per variant: tokens, seconds, tokens/s, ms per decode step, peak
GPU memory, or the error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QWEN3_8B = {"num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rope_theta": 1000000.0}
TINY = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "intermediate_size": 64, "vocab_size": 384, "max_position_embeddings": 1024,
        "rope_theta": 10000.0}


def build(arch: dict, device: str, dtype: str, folder: Path):
    """The random target: config + the tiny tokenizer written by the `target` stage's code, weights made on device."""
    from dflash.config import from_dict
    from dflash.data.tiny_target import build_target
    from dflash.target import load_target, load_tokenizer
    loaded = from_dict({"target": {"path": str(folder), "build": "random", "dtype": dtype, "arch": arch}})
    build_target(loaded.cfg.target, folder, corpus_size=200, progress=False)
    return load_target(loaded.cfg.target, device=device, seed=0), load_tokenizer(loaded.cfg.target)


def make_prompts(tokenizer, vocab: int, n: int, lengths: list[int], seed=0) -> list[list[int]]:
    import torch
    special = set(tokenizer.all_special_ids)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        out.append([t if t not in special else t + 1 for t in ids])
    return out


def parse_variant(v: str) -> dict:
    if v == "cb":
        return {"name": v, "kind": "cb"}
    parts = v.split("-")
    if parts[0] not in ("generate", "static") or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "eager"):
        raise SystemExit(f"--variants: {v!r} is not generate-N, generate-auto, static-N, static-auto, static-N-eager or cb")
    return {"name": v, "kind": "generate", "decoder": parts[0], "batch": 0 if parts[1] == "auto" else int(parts[1]),
            "compile": len(parts) == 2}


def run_variant(model, tokenizer, prompts, new_tokens, var, device):
    import torch

    from dflash.data.decode import release
    from dflash.data.generate import regenerate
    cuda = device.startswith("cuda")
    release(model)                              # the previous variant's decoder: each variant sizes its own
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    attn = [model.config._attn_implementation]
    if var["kind"] == "cb":
        from transformers import GenerationConfig
        gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                               pad_token_id=tokenizer.pad_token_id)

        def go(ps, new):
            gen.max_new_tokens = new
            t = time.time()
            res = model.generate_batch(inputs=ps, generation_config=gen, progress_bar=False)
            if cuda:
                torch.cuda.synchronize()
            return sum(len(r.generated_tokens) for r in res.values()), time.time() - t, None
    else:
        def go(ps, new):
            t = time.time()
            _, st = regenerate(model, tokenizer, ps, new, 0.0, var["batch"], progress=False,
                               decoder=var["decoder"], compile=var["compile"], ignore_eos=True)
            if cuda:
                torch.cuda.synchronize()
            attn[0] = st["attn_implementation"]
            return st["tokens"], time.time() - t, st["batch_size"]
    _, warm_s, _ = go(prompts, min(16, new_tokens))     # warm-up: the same batches, fewer tokens
    tokens, seconds, bs = go(prompts, new_tokens)
    batches = -(-len(prompts) // bs) if bs else None
    return {"variant": var["name"], "batch_size": bs, "tokens": tokens, "seconds": round(seconds, 3),
            "attn_implementation": attn[0],
            "tokens_per_s": round(tokens / seconds, 1), "warmup_s": round(warm_s, 3),
            "ms_per_decode_step": round(1000 * seconds / (batches * new_tokens), 2) if batches else None,
            "peak_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny random target, 16 prompts x 8 tokens")
    p.add_argument("--prompts", type=int, default=None, help="prompts (default 512; tiny 16)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per prompt (default 256; tiny 8)")
    p.add_argument("--prompt-lengths", default=None, help="comma list cycled over prompts (default 128,256,384,512)")
    p.add_argument("--variants", default=None,
                   help="comma list (default static-128,static-256,static-auto,generate-128; tiny generate-4,static-4-eager)")
    p.add_argument("--device", default=None, help="default cuda (tiny: cpu)")
    args = p.parse_args(argv)
    import torch
    import transformers

    tiny = args.tiny
    device = args.device or ("cpu" if tiny else "cuda")
    n = args.prompts or (16 if tiny else 512)
    new = args.new_tokens or (8 if tiny else 256)
    lengths = [int(x) for x in (args.prompt_lengths or ("8,12,16" if tiny else "128,256,384,512")).split(",")]
    variants = [parse_variant(v) for v in (args.variants or ("generate-4,static-4-eager" if tiny else
                                                             "static-128,static-256,static-auto,generate-128")).split(",")]
    arch = TINY if tiny else QWEN3_8B
    dtype = "float32" if device == "cpu" else "bfloat16"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": datetime.now(timezone.utc).isoformat(),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
              "config": {"arch": arch, "dtype": dtype, "prompts": n, "new_tokens": new, "prompt_lengths": lengths,
                         "greedy": True, "stop_tokens": "ignored (exactly new_tokens per prompt)"},
              "results": []}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer = build(arch, device, dtype, Path(tmp) / "target")
        report["build_s"] = round(time.time() - t0, 1)
        prompts = make_prompts(tokenizer, arch["vocab_size"], n, lengths)
        for var in variants:
            try:
                r = run_variant(model, tokenizer, prompts, new, var, device)
            except Exception as e:                     # OOM, an unsupported variant: recorded, the others still run
                r = {"variant": var["name"], "error": f"{type(e).__name__}: {str(e)[:500]}",
                     "traceback": traceback.format_exc()[-2000:]}
            report["results"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "traceback"}), flush=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
    ok = [r for r in report["results"] if "tokens_per_s" in r]
    if ok:
        best = max(ok, key=lambda r: r["tokens_per_s"])
        report["best"] = {"variant": best["variant"], "tokens_per_s": best["tokens_per_s"]}
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"best: {report.get('best')} -> {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
