"""Interop case, our side (run by the project venv): a tiny Qwen3 target (save_pretrained), a DFlash drafter
briefly trained on the target's own greedy outputs, exported with dflash.model.save_drafter, and our evaluator's
greedy speculative decoding of a few prompts (tokens, acceptance lengths) plus the drafter's block logits on a
fixed input, for tests/interop/check_reference.py (run by the reference package's venv) to compare.

    python tests/interop/make_case.py OUT_DIR
writes OUT_DIR/target/, OUT_DIR/drafter/, OUT_DIR/case.json, OUT_DIR/forward.safetensors.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

VOCAB, LAYERS, HIDDEN, BLOCK = 48, 4, 32, 4
MASK = VOCAB - 1
MAX_NEW = 40


def build_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=False, initializer_range=0.3, rope_theta=10000.0,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def random_prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def train_drafter(target, steps=150):
    from dflash.evaluate import target_generate
    from dflash.model import DFlashDrafter, DrafterConfig, block_labels, dflash_loss, sample_anchors
    cfg = DrafterConfig.from_target(target.config, {"num_layers": 2, "num_target_layers": 2, "block_size": BLOCK},
                                    mask_token_id=MASK)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    seqs = []
    for p in random_prompts(48, seed=11):
        seqs.append(p + target_generate(target, p, 40).tokens)
    L = min(len(s) for s in seqs)
    ids = torch.tensor([s[:L] for s in seqs])
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], -1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[:, :4] = False
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        idx = torch.randint(0, ids.shape[0], (8,), generator=g)
        anchors = sample_anchors(mask[idx], 8, BLOCK, g)
        labels, weights = block_labels(ids[idx], mask[idx], anchors)
        out = dflash_loss(drafter(feats[idx], ids[idx], anchors, backend="sdpa"), drafter.lm_head_weight, labels,
                          weights, BLOCK)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return drafter.eval().requires_grad_(False), float(out.loss.detach())


def main(out_dir: str) -> int:
    from safetensors.torch import save_file

    from dflash.evaluate import DFlashDraft, speculative_generate, target_generate
    from dflash.model import save_drafter
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = build_target()
    target.save_pretrained(out / "target")
    drafter, loss = train_drafter(target)
    save_drafter(drafter, out / "drafter")
    draft = DFlashDraft(drafter)
    cases = []
    for p in random_prompts(6, seed=5):
        spec = speculative_generate(target, draft, p, MAX_NEW, mask_token_id=MASK)
        plain = target_generate(target, p, MAX_NEW)
        cases.append({"prompt_ids": p, "tokens": spec.tokens, "acceptance_lengths": spec.produced,
                      "plain_tokens": plain.tokens, "lossless": spec.tokens == plain.tokens})
    # the drafter's block logits on a fixed input: context of S positions, block [anchor, MASK x (B-1)] at S..
    g = torch.Generator().manual_seed(9)
    S = 10
    k = len(drafter.cfg.target_layer_ids)
    feats = torch.randn(1, S, k * HIDDEN, generator=g)
    block = torch.full((1, BLOCK), MASK, dtype=torch.long)
    block[0, 0] = 7
    draft.reset()
    logits = draft.propose(block[:, :0].new_zeros(1, S), feats, block, S)
    save_file({"target_hidden": feats, "block_ids": block, "logits": logits.contiguous()},
              str(out / "forward.safetensors"))
    produced = [a for c in cases for a in c["acceptance_lengths"]]
    case = {"max_new_tokens": MAX_NEW, "block_size": BLOCK, "mask_token_id": MASK, "train_loss": loss,
            "tau": sum(produced) / len(produced), "cases": cases, "context_length": S}
    (out / "case.json").write_text(json.dumps(case, indent=1))
    print(f"our side: drafter loss {loss:.3f}, tau {case['tau']:.3f} over {len(produced)} steps, lossless "
          f"{all(c['lossless'] for c in cases)}, {time.perf_counter() - t0:.1f}s -> {out}")
    return 0 if all(c["lossless"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/interop"))
