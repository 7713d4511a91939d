"""Interop case, the reference's side: run by the venv that has the published `dflash==0.1.0` (.venv-interop),
never by the project venv (both packages are named `dflash`; this file's folder, not the repository, is on
sys.path, so `import dflash` is the reference).

    .venv-interop/bin/python tests/interop/check_reference.py OUT_DIR
reads what tests/interop/make_case.py wrote and checks, with the reference package:
  1. DFlashDraftModel.from_pretrained loads every exported drafter: no missing, unexpected or mismatched key, and
     each layer runs the attention it was trained with (sliding window and causality per layer_types);
  2. forward: for every layout (full, sliding, mixed; windows below and above the block size), the reference's
     hidden states of each block (context = the features before its anchor, no cache) equal our training
     forward and our cached decoding path to float64 rounding (max |diff| <= 1e-10);
  3. per trained drafter, its block logits on a fixed input equal ours, and the reference generation loop
     (dflash_generate, greedy) with our tiny target produces the same tokens and the same acceptance lengths as
     our evaluator, prompt by prompt.
The reference times itself with torch.cuda.synchronize() when asked for statistics (acceptance lengths); on a CPU
the timer is replaced by time.perf_counter (timing only, the decoding is untouched). Writes OUT_DIR/reference.json;
exits 1 on any difference.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

FLOAT64_TOL = 1e-10


def load(ref, path, dtype, problems, name):
    model, info = ref.DFlashDraftModel.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa",
                                                       output_loading_info=True)
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            problems.append(f"{name}: from_pretrained {k}: {sorted(map(str, info[k]))}")
    return model.eval()


def check_layers(model, layout, problems, name) -> list:
    """Each reference layer's (sliding_window, is_causal) as read from our config.json, against the layout."""
    types = layout.get("layer_types") or ["full_attention"] * len(model.layers)
    got = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        sliding = types[i] == "sliding_attention"
        want = (layout.get("sliding_window") if sliding else None, sliding)
        got.append([a.sliding_window, bool(a.is_causal)])
        if (a.sliding_window, bool(a.is_causal)) != want:
            problems.append(f"{name}: reference layer {i} runs sliding_window={a.sliding_window}, "
                            f"is_causal={a.is_causal}; trained as {types[i]} (window {layout.get('sliding_window')})")
    return got


def forward_cases(ref, out: Path, case: dict, problems: list) -> dict:
    from safetensors.torch import load_file
    results = {}
    for name, layout in case["forward"].items():
        d = out / "forward" / name
        model = load(ref, d / "drafter", torch.float64, problems, f"forward {name}")
        layers = check_layers(model, layout, problems, f"forward {name}")
        t = load_file(str(d / "case.safetensors"))
        Bk = model.block_size
        diffs, diffs_cached = [], []
        with torch.inference_mode():
            for j, a in enumerate(t["anchors"].tolist()):
                block = torch.full((1, Bk), model.mask_token_id, dtype=torch.long)
                block[0, 0] = t["input_ids"][0, a]
                noise = torch.nn.functional.embedding(block, t["embed"])
                hidden = model(target_hidden=t["target_hidden"][:, :a], noise_embedding=noise,
                               position_ids=torch.arange(a + Bk)[None])
                diffs.append(float((hidden - t["ours"][:, j * Bk:(j + 1) * Bk]).abs().max()))
                diffs_cached.append(float((hidden - t["ours_cached"][:, j * Bk:(j + 1) * Bk]).abs().max()))
        results[name] = {"layer_attention": layers, "max_abs_diff": max(diffs),
                         "max_abs_diff_cached": max(diffs_cached)}
        if max(diffs) > FLOAT64_TOL or max(diffs_cached) > FLOAT64_TOL:
            problems.append(f"forward {name}: reference hidden states differ from ours: max |diff| training forward "
                            f"{max(diffs):.2e}, cached decoding {max(diffs_cached):.2e} (per block {diffs})")
    return results


def generation(ref, target, out: Path, case: dict, problems: list) -> dict:
    from safetensors.torch import load_file
    results = {}
    for name, d in case["drafters"].items():
        model = load(ref, out / name / "drafter", torch.float32, problems, name)
        layout = {"layer_types": d["layer_types"], "sliding_window": d["sliding_window"]}
        layers = check_layers(model, layout, problems, name)
        for key, want in (("block_size", case["block_size"]), ("mask_token_id", case["mask_token_id"])):
            if getattr(model, key) != want:
                problems.append(f"{name}: reference reads {key}={getattr(model, key)!r}, we wrote {want!r}")
        # block logits: context S positions 0..S-1, block at S..S+B-1, no cache
        fw = load_file(str(out / name / "forward.safetensors"))
        S, B = fw["target_hidden"].shape[1], fw["block_ids"].shape[1]
        with torch.inference_mode():
            noise = torch.nn.functional.embedding(fw["block_ids"], target.get_input_embeddings().weight)
            hidden = model(target_hidden=fw["target_hidden"], noise_embedding=noise,
                           position_ids=torch.arange(S + B)[None])[:, 1:]
            logits = model.compute_logits(hidden, target.lm_head).float()
        diff = float((logits - fw["logits"]).abs().max())
        same_argmax = bool((logits.argmax(-1) == fw["logits"].argmax(-1)).all())
        if diff > 1e-4 or not same_argmax:
            problems.append(f"{name}: block logits differ: max |diff| {diff:.2e}, same argmax {same_argmax}")
        # the reference's greedy generation loop against our evaluator's tokens and acceptance lengths
        prompts = []
        for i, c in enumerate(d["cases"]):
            ids = torch.tensor([c["prompt_ids"]])
            r = ref.dflash_generate(model, target, ids, case["max_new_tokens"], None, temperature=0.0,
                                    return_stats=True)
            tokens = r.output_ids[0, ids.shape[1]:].tolist()
            acc = [int(a) for a in r.acceptance_lengths]
            same_tok, same_acc = tokens == c["tokens"], acc == c["acceptance_lengths"]
            prompts.append({"prompt": i, "tokens_equal": same_tok, "acceptance_equal": same_acc,
                            "reference_tau": sum(acc) / len(acc), "our_tau": sum(c["acceptance_lengths"]) / len(acc)})
            if not same_tok:
                j = next((j for j, (a, b) in enumerate(zip(tokens, c["tokens"])) if a != b),
                         min(len(tokens), len(c["tokens"])))
                problems.append(f"{name} prompt {i}: tokens differ from position {j}: reference {tokens[j:j + 6]}, "
                                f"ours {c['tokens'][j:j + 6]}")
            if not same_acc:
                problems.append(f"{name} prompt {i}: acceptance lengths differ: reference {acc}, ours "
                                f"{c['acceptance_lengths']}")
        steps = sum(len(c["acceptance_lengths"]) for c in d["cases"])
        results[name] = {"layer_attention": layers, "forward": {"max_abs_diff": diff, "same_argmax": same_argmax},
                         "prompts": prompts, "steps": steps, "tau_ours": d["tau"],
                         "tau_reference": sum(p["reference_tau"] * len(c["acceptance_lengths"])
                                              for p, c in zip(prompts, d["cases"])) / steps}
    return results


def main(out_dir: str) -> int:
    import dflash
    import dflash.model as ref
    from transformers import AutoModelForCausalLM

    if not hasattr(dflash, "DFlashDraftModel") and "DFlashDraftModel" not in getattr(dflash, "__all__", []):
        print(f"`import dflash` is not the reference package ({dflash.__file__})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    out = Path(out_dir)
    case = json.loads((out / "case.json").read_text())
    problems: list[str] = []
    target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    ref._cuda_time = time.perf_counter          # CPU: the reference's timer calls torch.cuda.synchronize()
    result = {"reference_file": ref.__file__,
              "forward": forward_cases(ref, out, case, problems),
              "generation": generation(ref, target, out, case, problems),
              "problems": problems}
    (out / "reference.json").write_text(json.dumps(result, indent=1))
    fw = result["forward"]
    print(f"reference dflash ({ref.__file__}): forward, max |diff| per layout (training / cached): "
          + ", ".join(f"{n} {r['max_abs_diff']:.1e}/{r['max_abs_diff_cached']:.1e}" for n, r in fw.items()))
    for n, g in result["generation"].items():
        p = g["prompts"]
        print(f"  {n}: block logits max |diff| {g['forward']['max_abs_diff']:.1e}; "
              f"{sum(x['tokens_equal'] for x in p)}/{len(p)} prompts token-identical, "
              f"{sum(x['acceptance_equal'] for x in p)}/{len(p)} with identical acceptance lengths "
              f"({g['steps']} steps, tau ours {g['tau_ours']:.3f}, reference {g['tau_reference']:.3f})")
    for p in problems:
        print("MISMATCH:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/interop"))
