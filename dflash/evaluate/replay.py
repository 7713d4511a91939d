"""tau at temperature 0 without step-by-step decoding: greedy speculative decoding replayed on the target's own
greedy continuation.

At temperature 0 speculative decoding outputs the target's greedy continuation y (it is lossless), and every one of
its steps is a function of y alone. A step whose anchor (last accepted token) is at position `start` shows the
drafter the target features of positions < start and the block [y_start, MASK x (vs-1)], vs = min(block_size,
max_length - start); its argmax drafts are accepted up to the first one that differs from y, and the bonus token is
y's next one. So instead of ~tau-spaced batch-1 target forwards per prompt, `replay` makes
  1. the greedy continuation of every prompt, max_new_tokens tokens past any stop token (the target's argmax after
     a stop is what verification compares drafts with), batched (`dflash.data.generate.regenerate`);
  2. one target forward per sequence [prompt ; y], capturing the drafter's target layers;
  3. one drafter forward per sequence with an anchor at every position of y whose block fits (the training forward,
     `DFlashDrafter.run`, masks from the same anchors), plus one forward per narrower block the last steps need;
  4. the walk of `specdec.speculative_generate` over those drafts: produced, accepted and drafted per step, the same
     caps (max_new_tokens, a stop token ends the output after it).
It returns `specdec.Generation`s that equal speculative_generate's at temperature 0 (tests/test_evaluate_replay.py
holds them equal in float32), so `acceptance.summarize` aggregates them as it does decoded ones. Their `seconds` are
0: a replay measures acceptance, not decoding speed. In bfloat16 a batched decoder and batch-1 verification round
differently and may split at a near-tied argmax (what acceptance.json's `lossless` reports of decoding); tau is then
that of the path the batched decoder took.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dflash.model.anchors import Anchors, build_blocks
from dflash.model.attention import make_mask

from .specdec import Generation


def greedy_continuations(target, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         stop_ids: Sequence[int], decoder: str = "generate", compile: bool = False) -> list[list[int]]:
    """Exactly max_new_tokens greedy tokens after each prompt (stop tokens do not end them), in one batch (left
    padding with the tokenizer's pad token, else the first stop token)."""
    from dflash.data.generate import regenerate
    out, _ = regenerate(target, tokenizer, [list(p) for p in prompts], max_new_tokens, temperature=0.0,
                        batch_size=len(prompts), progress=False, stop_ids=stop_ids, decoder=decoder,
                        compile=compile, ignore_eos=True)
    return out


@torch.inference_mode()
def drafts(drafter, feats: torch.Tensor, ids: torch.Tensor, starts: Sequence[int], width: int) -> torch.Tensor:
    """Argmax drafts [A, width-1] of blocks of `width` anchored at `starts`, each seeing the context features
    feats [1, S, k*H] of positions before its anchor; ids [1, S] hold the anchor tokens."""
    dev = drafter.fc.weight.device
    pos = torch.tensor([list(starts)], device=dev)
    anchors = Anchors(pos, torch.ones_like(pos, dtype=torch.bool), width)
    S = feats.shape[1]
    block_ids, qpos = build_blocks(ids, anchors, drafter.cfg.mask_token_id)                  # [1, A*width]
    x = F.embedding(block_ids, drafter.embed_weight).to(drafter.fc.weight.dtype)
    hidden = drafter.run(x, qpos, feats, make_mask(anchors, S, "sdpa", drafter.cfg.windows()))
    hidden = hidden.view(len(starts), width, -1)[:, 1:]                                      # [A, width-1, H]
    return drafter.logits(hidden).argmax(-1)


def walk(prompt_len: int, y: Sequence[int], max_new_tokens: int, block_size: int, stops: set[int],
         draft_at) -> Generation:
    """speculative_generate's loop at temperature 0, its target replaced by y (greedy tokens of positions
    prompt_len..prompt_len+max_new_tokens-1) and its drafter by draft_at(start, vs) -> list of vs-1 draft tokens."""
    n, max_length = prompt_len, prompt_len + max_new_tokens
    out = Generation(tokens=[y[0]], target_forwards=1)
    stopped = y[0] in stops
    start = n
    while start + 1 < max_length and not stopped:
        vs = min(block_size, max_length - start)
        d = draft_at(start, vs)
        ref = y[start + 1 - n: start + vs - n]                  # the target's argmax after each accepted prefix
        acc = next((i for i, (a, b) in enumerate(zip(d, ref)) if a != b), vs - 1)
        produced = min(acc + 1, max_length - start - 1)
        new = y[start + 1 - n: start + 1 - n + produced]        # accepted drafts then the bonus: y's tokens
        for i, t in enumerate(new):
            if t in stops:
                produced, stopped = i + 1, True
                break
        out.tokens.extend(new[:produced])
        out.produced.append(produced)
        out.accepted.append(acc)
        out.drafted.append(vs - 1)
        out.target_forwards += 1
        start += produced
    out.stopped = stopped
    return out


@torch.inference_mode()
def replay(target, drafter, tokenizer, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           stop_ids: Sequence[int], decoder: str = "generate", compile: bool = False) -> list[Generation]:
    """Greedy speculative decoding of every prompt by `drafter` (a DFlashDrafter on the target's device, in eval
    mode) verified by `target`, replayed (see the module doc): one Generation per prompt."""
    dev = next(target.parameters()).device
    bsz, layer_ids, stops = drafter.cfg.block_size, list(drafter.cfg.target_layer_ids), set(int(s) for s in stop_ids)
    conts = greedy_continuations(target, tokenizer, prompts, max_new_tokens, list(stops), decoder, compile)
    gens = []
    for prompt, y in zip(prompts, conts):
        n = len(prompt)
        ids = torch.tensor([list(prompt) + y], device=dev)                                    # [1, S]
        hs = target(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
        feats = torch.cat([hs[i + 1] for i in layer_ids], dim=-1).to(drafter.fc.weight.dtype)  # [1, S, k*H]
        full = list(range(n, n + max_new_tokens - bsz + 1))                 # anchors whose whole block fits
        table = drafts(drafter, feats, ids, full, bsz).tolist() if full else []

        def draft_at(start, vs):
            return table[start - n] if vs == bsz else drafts(drafter, feats, ids, [start], vs)[0].tolist()
        gens.append(walk(n, y, max_new_tokens, bsz, stops, draft_at))
    return gens
