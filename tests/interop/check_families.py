"""Interop per target family, the reference's side (run by .venv-interop's python, where `import dflash` is the
published reference package 0.1.0): for every family of case.json (written by tests/e2e/test_family_matrix.py), the
reference's `dflash_generate` at temperature 0 with the family's tiny target and our exported drafter on each prompt;
whether its tokens and acceptance lengths are our evaluator's and whether its output is the target's greedy decoding.

    python tests/interop/check_families.py OUT_DIR        (reads OUT_DIR/case.json, writes OUT_DIR/families.json)
"""
import json
import sys
import time
from pathlib import Path

import torch


def main(out_dir: str) -> int:
    import dflash.model as ref
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    ref._cuda_time = time.perf_counter          # CPU: the reference's timer calls torch.cuda.synchronize()
    out = Path(out_dir)
    result = {}
    for family, c in json.loads((out / "case.json").read_text()).items():
        try:
            target = AutoModelForCausalLM.from_pretrained(c["target"], dtype=torch.float32,
                                                          attn_implementation=c["attn"]).eval()
            model = ref.DFlashDraftModel.from_pretrained(c["drafter"], dtype=torch.float32).eval()
            result[family] = []
            for p in c["prompts"]:
                ids = torch.tensor([p["prompt"]])
                r = ref.dflash_generate(model, target, ids, len(p["greedy"]), None, temperature=0.0, return_stats=True)
                tokens, acc = r.output_ids[0, ids.shape[1]:].tolist(), [int(a) for a in r.acceptance_lengths]
                result[family].append({"tokens_equal": tokens == p["tokens"], "acceptance_equal": acc == p["produced"],
                                       "lossless": tokens == p["greedy"]})
        except Exception as e:   # a family the reference cannot run: recorded, judged by the test
            result[family] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
        print(family, result[family])
    (out / "families.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
