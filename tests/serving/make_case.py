"""Serving check, our side (run by the project venv), for tests/serving/check_stacks.py (run by .venv-serving, which
has vLLM and SGLang) to load:

    python tests/serving/make_case.py OUT_DIR
writes OUT_DIR/target/config.json (a Qwen3 target's config: vLLM and SGLang build their configs from it) and, per
layer layout (all full; all sliding with a window below the block size; mixed), OUT_DIR/<layout>/drafter/ (our
export, float32, with the mask token's text) and OUT_DIR/<layout>/case.safetensors: context features of the
positions before one anchor, the block's token ids and embeddings, and our drafter's hidden states for the block
(DFlashDrafter.draft, the evaluator's path).
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

SW, FA = "sliding_attention", "full_attention"
LAYOUTS = {"full": {}, "sliding_w3": {"layer_types": [SW, SW], "sliding_window": 3},
           "mixed_w6": {"layer_types": [SW, FA], "sliding_window": 6}}
ANCHOR = 9   # the block sits at positions 9..12 and sees the features of positions 0..8


def main(out_dir: str) -> int:
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from dflash.model import save_drafter
    from support.model import make_drafter, tiny_cfg
    out = Path(out_dir)
    torch.manual_seed(0)
    for name, layout in LAYOUTS.items():
        cfg = tiny_cfg(**layout)
        d = make_drafter(cfg).eval()
        g = torch.Generator().manual_seed(7)
        feats = torch.randn(1, ANCHOR, cfg.num_context_layers * cfg.hidden_size, generator=g)
        block = torch.full((1, cfg.block_size), cfg.mask_token_id)
        block[0, 0] = 5
        with torch.no_grad():
            ours = d.draft(block, feats, d.new_cache())                        # [1, B, H]
        save_drafter(d, out / name / "drafter", mask_token="<|mask|>")
        save_file({"target_hidden": feats[0].contiguous(), "block_ids": block[0],
                   "block_embeds": d.embed_weight[block[0]].contiguous(), "ours": ours[0].contiguous(),
                   "anchor": torch.tensor(ANCHOR)}, str(out / name / "case.safetensors"))
    Qwen3Config(architectures=["Qwen3ForCausalLM"], vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_target_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, intermediate_size=48,
                max_position_embeddings=cfg.max_position_embeddings).save_pretrained(out / "target")
    print(f"our side: {', '.join(LAYOUTS)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "results/serving"))
