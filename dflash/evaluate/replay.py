"""tau at temperature 0 without step-by-step decoding: greedy speculative decoding replayed on the target's own
greedy continuation.

At temperature 0 speculative decoding outputs the target's greedy continuation y (it is lossless), and every one of
its steps is a function of y alone. A step whose anchor (last accepted token) is at position `start` shows the
drafter the target features of positions < start and the block [y_start, MASK x (vs-1)], vs = min(block_size,
max_length - start); its argmax drafts are accepted up to the first one that differs from y, and the bonus token is
y's next one. So instead of ~tau-spaced batch-1 target forwards per prompt, `replay` makes
  1. the greedy continuation of every prompt, max_new_tokens tokens past any stop token (the target's argmax after
     a stop is what verification compares drafts with), in batches (`greedy_continuations`: the target's own forward
     and attention with a KV cache, the raw argmax: no logits processor of a generation_config);
  2. one target forward per sequence [prompt ; y], capturing the drafter's target layers, and checking that y is its
     argmax at every position (`Replayed.mismatches`: 0 in float32; in bfloat16 the batched decode and the full
     forward can round a near-tied argmax apart);
  3. drafter forwards per sequence with an anchor at every position of y whose block fits (the training forward,
     `DFlashDrafter.run`, masks from the same anchors; ANCHOR_CHUNK anchors a forward), plus one forward per narrower
     block the last steps need;
  4. the walk of `specdec.speculative_generate` over those drafts: produced, accepted and drafted per step, the same
     caps (max_new_tokens, a stop token ends the output after it).
Its `specdec.Generation`s equal speculative_generate's at temperature 0 (tests/unit/test_evaluate_replay.py holds them
equal in float32), so `acceptance.summarize` aggregates them as it does decoded ones. Their `seconds` are 0: a replay
measures acceptance, not decoding speed. In bfloat16 batch-1 decoding computes the drafter's context in pieces (the
prefill, then each verification block) and the target's argmax at batch 1; here both come from batched or whole-
sequence forwards, which round differently: a near-tied argmax may part, and tau is that of the path replayed.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from dflash.model.anchors import Anchors, build_blocks
from dflash.model.attention import make_mask

from .specdec import Generation, crop_cache, make_cache

ANCHOR_CHUNK = 256      # anchors per drafter forward: bounds its [A*block, vocab] logits and dense mask
BATCH = 32              # prompts per batch of the greedy continuation


@dataclasses.dataclass
class Replayed:
    generations: list[Generation]
    mismatches: int     # positions of y that are not the full forward's argmax (see the module doc)


@torch.inference_mode()
def greedy_continuations(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         batch_size: int = BATCH) -> list[list[int]]:
    """Exactly max_new_tokens argmax tokens after each prompt (stop tokens do not end them), batch_size prompts at a
    time, left-padded (the padding masked out, positions counted from each prompt's first token)."""
    dev = next(target.parameters()).device
    out = []
    for i in range(0, len(prompts), batch_size):
        rows = [list(p) for p in prompts[i:i + batch_size]]
        W = max(map(len, rows))
        ids = torch.zeros((len(rows), W), dtype=torch.long, device=dev)
        att = torch.zeros((len(rows), W), dtype=torch.long, device=dev)
        for r, p in enumerate(rows):
            ids[r, W - len(p):] = torch.tensor(p, device=dev)
            att[r, W - len(p):] = 1
        pos = (att.cumsum(-1) - 1).clamp_min(0)
        cache, toks = make_cache(target), []
        for _ in range(max_new_tokens):
            logits = target(input_ids=ids, attention_mask=att, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]
            crop_cache(cache)   # sliding and linear-attention layers back to what the next step reads
            toks.append(logits.argmax(-1))
            ids, pos = toks[-1][:, None], pos[:, -1:] + 1
            att = torch.cat([att, att.new_ones(len(rows), 1)], dim=1)
        out += torch.stack(toks, dim=1).tolist()
    return out


@torch.inference_mode()
def drafts(drafter, feats: torch.Tensor, ids: torch.Tensor, starts: Sequence[int], width: int) -> torch.Tensor:
    """Argmax drafts [A, width-1] of blocks of `width` anchored at `starts`, each seeing the context features
    feats [1, S, k*H] of positions before its anchor; ids [1, S] hold the anchor tokens. ANCHOR_CHUNK at a time."""
    dev, S = drafter.fc.weight.device, feats.shape[1]
    out = []
    for i in range(0, len(starts), ANCHOR_CHUNK):
        pos = torch.tensor([list(starts[i:i + ANCHOR_CHUNK])], device=dev)
        anchors = Anchors(pos, torch.ones_like(pos, dtype=torch.bool), width)
        block_ids, qpos = build_blocks(ids, anchors, drafter.cfg.mask_token_id)              # [1, A*width]
        x = drafter.embed(block_ids).to(drafter.fc.weight.dtype)
        hidden = drafter.run(x, qpos, feats, make_mask(anchors, S, "sdpa", drafter.cfg.windows()))
        out.append(drafter.logits(hidden.view(pos.shape[1], width, -1)[:, 1:]).argmax(-1))  # [A, width-1]
    return torch.cat(out)


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
def replay(target, drafter, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           stop_ids: Sequence[int]) -> Replayed:
    """Greedy speculative decoding of every prompt by `drafter` (a DFlashDrafter on the target's device, in eval
    mode) verified by `target`, replayed (see the module doc): one Generation per prompt, and the count of y's
    positions that are not the full forward's argmax."""
    dev = next(target.parameters()).device
    bsz, layer_ids, stops = drafter.cfg.block_size, list(drafter.cfg.target_layer_ids), set(int(s) for s in stop_ids)
    gens, mismatches = [], 0
    for prompt, y in zip(prompts, greedy_continuations(target, prompts, max_new_tokens)):
        n = len(prompt)
        ids = torch.tensor([list(prompt) + y], device=dev)                                    # [1, S]
        out = target(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=max_new_tokens + 1)
        mismatches += int((out.logits[0, :-1].argmax(-1) != ids[0, n:]).sum())    # y against positions n-1..S-2
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1).to(drafter.fc.weight.dtype)
        full = list(range(n, n + max_new_tokens - bsz + 1))                 # anchors whose whole block fits
        table = drafts(drafter, feats, ids, full, bsz).tolist() if full else []

        def draft_at(start, vs):
            return table[start - n] if vs == bsz else drafts(drafter, feats, ids, [start], vs)[0].tolist()
        gens.append(walk(n, y, max_new_tokens, bsz, stops, draft_at))
    return Replayed(gens, mismatches)
