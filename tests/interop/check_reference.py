"""Interop case, the reference's side: run by the venv that has the published `dflash==0.1.0` (.venv-interop),
never by the project venv (both packages are named `dflash`; this file's folder, not the repository, is on
sys.path, so `import dflash` is the reference).

    .venv-interop/bin/python tests/interop/check_reference.py OUT_DIR
reads what tests/interop/make_case.py wrote and checks, with the reference package:
  1. DFlashDraftModel.from_pretrained(OUT_DIR/drafter) loads every tensor: no missing, unexpected or mismatched key;
  2. the drafter's block logits on the fixed input equal ours (forward comparison, no cache);
  3. the reference generation loop (dflash_generate, greedy) with our tiny target produces the same tokens and the
     same acceptance lengths as our evaluator, prompt by prompt.
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


def main(out_dir: str) -> int:
    import dflash
    import dflash.model as ref
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    if not hasattr(dflash, "DFlashDraftModel") and "DFlashDraftModel" not in getattr(dflash, "__all__", []):
        print(f"`import dflash` is not the reference package ({dflash.__file__})", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    out = Path(out_dir)
    case = json.loads((out / "case.json").read_text())
    problems: list[str] = []
    result: dict = {"reference_file": ref.__file__}

    target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    model, info = ref.DFlashDraftModel.from_pretrained(str(out / "drafter"), dtype=torch.float32,
                                                       attn_implementation="sdpa", output_loading_info=True)
    model = model.eval()
    result["loading_info"] = {k: sorted(map(str, v)) for k, v in info.items()}
    for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(k):
            problems.append(f"from_pretrained {k}: {sorted(map(str, info[k]))}")
    for name, want in (("block_size", case["block_size"]), ("mask_token_id", case["mask_token_id"])):
        if getattr(model, name) != want:
            problems.append(f"reference reads {name}={getattr(model, name)!r}, we wrote {want!r}")

    # 2. forward comparison: context S positions 0..S-1, block at S..S+B-1, no cache, no mask (full attention)
    fw = load_file(str(out / "forward.safetensors"))
    S, B = fw["target_hidden"].shape[1], fw["block_ids"].shape[1]
    with torch.inference_mode():
        noise = torch.nn.functional.embedding(fw["block_ids"], target.get_input_embeddings().weight)
        hidden = model(target_hidden=fw["target_hidden"], noise_embedding=noise,
                       position_ids=torch.arange(S + B)[None])[:, 1:]
        logits = model.compute_logits(hidden, target.lm_head).float()
    diff = float((logits - fw["logits"]).abs().max())
    same_argmax = bool((logits.argmax(-1) == fw["logits"].argmax(-1)).all())
    result["forward"] = {"max_abs_diff": diff, "same_argmax": same_argmax}
    if diff > 1e-4 or not same_argmax:
        problems.append(f"block logits differ: max |diff| {diff:.2e}, same argmax {same_argmax}")

    # 3. the reference's greedy generation loop against our evaluator's tokens and acceptance lengths
    ref._cuda_time = time.perf_counter          # CPU: the reference's timer calls torch.cuda.synchronize()
    prompts = []
    for i, c in enumerate(case["cases"]):
        ids = torch.tensor([c["prompt_ids"]])
        r = ref.dflash_generate(model, target, ids, case["max_new_tokens"], None, temperature=0.0,
                                return_stats=True)
        tokens = r.output_ids[0, ids.shape[1]:].tolist()
        acc = [int(a) for a in r.acceptance_lengths]
        same_tok, same_acc = tokens == c["tokens"], acc == c["acceptance_lengths"]
        prompts.append({"prompt": i, "tokens_equal": same_tok, "acceptance_equal": same_acc,
                        "reference_tau": sum(acc) / len(acc), "our_tau": sum(c["acceptance_lengths"]) / len(acc)})
        if not same_tok:
            j = next((j for j, (a, b) in enumerate(zip(tokens, c["tokens"])) if a != b), min(len(tokens), len(c["tokens"])))
            problems.append(f"prompt {i}: tokens differ from position {j}: reference {tokens[j:j + 6]}, ours "
                            f"{c['tokens'][j:j + 6]}")
        if not same_acc:
            problems.append(f"prompt {i}: acceptance lengths differ: reference {acc}, ours {c['acceptance_lengths']}")
    result["generation"] = prompts
    ref_acc = [a for p in prompts for a in [p["reference_tau"]]]
    all_acc = [a for c in case["cases"] for a in c["acceptance_lengths"]]
    result["tau_ours"] = case["tau"]
    result["steps"] = len(all_acc)
    result["problems"] = problems
    (out / "reference.json").write_text(json.dumps(result, indent=1))
    print(f"reference dflash ({ref.__file__}): keys loaded cleanly: {not any(info.get(k) for k in info)}; "
          f"block logits max |diff| {diff:.2e}; generation: {sum(p['tokens_equal'] for p in prompts)}/{len(prompts)} "
          f"prompts token-identical, {sum(p['acceptance_equal'] for p in prompts)}/{len(prompts)} with identical "
          f"acceptance lengths ({len(all_acc)} steps, tau {case['tau']:.3f}, per-prompt reference tau "
          f"{', '.join(f'{t:.2f}' for t in ref_acc)})")
    for p in problems:
        print("MISMATCH:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/interop"))
