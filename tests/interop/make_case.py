"""Interop case, our side (run by the project venv), for tests/interop/check_reference.py (run by the reference
package's venv) to compare:

  generation  a tiny Qwen3 target (save_pretrained) and DFlash drafters in several layer layouts (all full;
              mixed sliding/full with a window below and above the block size), each briefly trained on the
              target's own greedy outputs and exported with dflash.model.save_drafter; our evaluator's greedy
              speculative decoding of a few prompts (tokens, acceptance lengths) and each drafter's block logits
              on a fixed input.
  forward     untrained float64 drafters in full, sliding and mixed layouts (windows below and above the block
              size), exported in float64, with our training forward over several anchors and our cached decoding
              path (DFlashDrafter.draft) on the same context features, for a float64 comparison with the
              reference's DFlashDraftModel on each block.

    python tests/interop/make_case.py OUT_DIR
writes OUT_DIR/target/, OUT_DIR/case.json, OUT_DIR/<drafter>/{drafter/,forward.safetensors} per generation
drafter, OUT_DIR/forward/<layout>/{drafter/,case.safetensors} per forward layout.
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
SW, FA = "sliding_attention", "full_attention"
# drafters trained and decoded with both stacks: layer layouts with windows below and above the block size (4)
GENERATION = {
    "full": {},
    "mixed_w3": {"layer_types": [SW, FA], "sliding_window": 3},
    "mixed_w6": {"layer_types": [FA, SW], "sliding_window": 6},
}
# untrained float64 drafters for the forward comparison (3 layers)
FORWARD = {
    "full": {},
    "sliding_w2": {"layer_types": [SW] * 3, "sliding_window": 2},
    "sliding_w6": {"layer_types": [SW] * 3, "sliding_window": 6},
    "mixed_w3": {"layer_types": [SW, FA, SW], "sliding_window": 3},
    "mixed_w9": {"layer_types": [FA, SW, FA], "sliding_window": 9},
}
FORWARD_ANCHORS = [3, 9, 14, 20]   # context of 24 positions; block j sees the features of 0..anchor-1


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


def training_data(target, num_target_layers=2):
    from dflash.evaluate import target_generate
    from dflash.model import default_target_layer_ids
    seqs = [p + target_generate(target, p, 40).tokens for p in random_prompts(48, seed=11)]
    L = min(len(s) for s in seqs)
    ids = torch.tensor([s[:L] for s in seqs])
    layer_ids = default_target_layer_ids(LAYERS, num_target_layers)
    with torch.no_grad():
        hs = target(ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hs[i + 1] for i in layer_ids], -1)
    return ids, feats


def train_drafter(target, data, layout: dict, steps=150):
    from dflash.model import DFlashDrafter, DrafterConfig, block_labels, dflash_loss, sample_anchors
    cfg = DrafterConfig.from_target(target.config, {"num_layers": 2, "num_target_layers": 2, "block_size": BLOCK,
                                                    **layout}, mask_token_id=MASK)
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    ids, feats = data
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


def generation_case(target, drafter, out: Path) -> dict:
    from safetensors.torch import save_file

    from dflash.evaluate import DFlashDraft, speculative_generate, target_generate
    from dflash.model import save_drafter
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
    feats = torch.randn(1, S, len(drafter.cfg.target_layer_ids) * HIDDEN, generator=g)
    block = torch.full((1, BLOCK), MASK, dtype=torch.long)
    block[0, 0] = 7
    draft.reset()
    logits = draft.propose(block[:, :0].new_zeros(1, S), feats, block, S)
    save_file({"target_hidden": feats, "block_ids": block, "logits": logits.contiguous()},
              str(out / "forward.safetensors"))
    produced = [a for c in cases for a in c["acceptance_lengths"]]
    return {"layer_types": drafter.cfg.layer_types, "sliding_window": drafter.cfg.sliding_window,
            "tau": sum(produced) / len(produced), "cases": cases}


def forward_case(layout: dict, out: Path, seed: int) -> None:
    """An untrained float64 drafter (non-trivial norms), our training forward over FORWARD_ANCHORS (plus a padded
    block) and our cached decoding path over the same anchors in order."""
    from safetensors.torch import save_file

    from dflash.model import Anchors, DFlashDrafter, DrafterConfig, save_drafter
    cfg = DrafterConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, intermediate_size=48, target_layer_ids=[0, 2],
                        mask_token_id=MASK, num_target_layers=LAYERS, block_size=BLOCK, rope_theta=10000.0,
                        **layout)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    d = DFlashDrafter(cfg, embed, head).to(torch.float64)
    d.reset_parameters(std=0.2)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    d.eval().requires_grad_(False)
    S = 24
    feats = torch.randn(1, S, 2 * HIDDEN, generator=g, dtype=torch.float64)
    ids = torch.randint(0, MASK, (1, S), generator=g)
    anchors = Anchors(torch.tensor([FORWARD_ANCHORS + [0]]), torch.tensor([[True] * len(FORWARD_ANCHORS) + [False]]),
                      BLOCK)
    with torch.no_grad():
        ours = d(feats, ids, anchors, backend="sdpa")[:, : len(FORWARD_ANCHORS) * BLOCK]   # [1, Q, H]
        cache, prev, cached = d.new_cache(), 0, []
        for a in FORWARD_ANCHORS:
            block = torch.full((1, BLOCK), MASK, dtype=torch.long)
            block[0, 0] = ids[0, a]
            cached.append(d.draft(block, feats[:, prev:a], cache))
            prev = a
    save_drafter(d, out / "drafter")
    save_file({"target_hidden": feats, "input_ids": ids, "embed": embed, "ours": ours.contiguous(),
               "ours_cached": torch.cat(cached, 1).contiguous(), "anchors": torch.tensor(FORWARD_ANCHORS)},
              str(out / "case.safetensors"))


def main(out_dir: str) -> int:
    torch.set_num_threads(1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    target = build_target()
    target.save_pretrained(out / "target")
    data = training_data(target)
    drafters = {}
    for name, layout in GENERATION.items():
        drafter, loss = train_drafter(target, data, layout)
        drafters[name] = {**generation_case(target, drafter, out / name), "train_loss": loss}
    for i, (name, layout) in enumerate(FORWARD.items()):
        forward_case(layout, out / "forward" / name, seed=100 + i)
    case = {"max_new_tokens": MAX_NEW, "block_size": BLOCK, "mask_token_id": MASK, "drafters": drafters,
            "forward": {name: layout for name, layout in FORWARD.items()}}
    (out / "case.json").write_text(json.dumps(case, indent=1))
    lossless = all(c["lossless"] for d in drafters.values() for c in d["cases"])
    print("our side: " + "; ".join(f"{n}: loss {d['train_loss']:.3f}, tau {d['tau']:.3f}" for n, d in drafters.items())
          + f"; {len(FORWARD)} forward layouts; lossless {lossless}; {time.perf_counter() - t0:.1f}s -> {out}")
    return 0 if lossless else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/interop"))
