"""Decode prompt sets speculatively and plainly; aggregate tau, its distribution, per-position acceptance,
throughput and losslessness into the dict written as acceptance.json.

At temperature > 0 tau depends on the draft policy (specdec's module doc): each policy asked for decodes every prompt
and has its figures under `by_proposal[policy]`; the top-level figures are those of `proposal`, the first policy
(argmax, what serving engines run, when it was decoded); `engines` names who runs each policy. Plain decoding is
done once per prompt, for every policy's speedup."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from dflash.records.acceptance import ENGINES

from .specdec import Draft, Generation, speculative_generate, target_generate

log = logging.getLogger("dflash.evaluate")


def summarize(spec: Sequence[Generation], plain: Sequence[Generation], block_size: int) -> dict:
    """tau (tokens produced per verification step, bonus included, pooled over all steps), its histogram over
    1..block_size, per-position acceptance (k = 1..block_size-1: share of steps that drafted position k and
    accepted it, given it was drafted), tokens/s of speculative and plain decoding."""
    produced = [p for g in spec for p in g.produced]
    steps = len(produced)
    hist = [0] * block_size
    for p in produced:
        hist[min(p, block_size) - 1] += 1
    acc_k, drafted_k = [0] * (block_size - 1), [0] * (block_size - 1)
    for g in spec:
        for a, d in zip(g.accepted, g.drafted):
            for k in range(d):
                drafted_k[k] += 1
                acc_k[k] += int(a > k)
    spec_tokens = sum(len(g.tokens) for g in spec)
    plain_tokens = sum(len(g.tokens) for g in plain)
    spec_s = sum(g.seconds for g in spec)
    plain_s = sum(g.seconds for g in plain)
    per_prompt = [g.tau for g in spec if g.tau is not None]
    spec_tps = spec_tokens / spec_s if spec_s > 0 else None
    plain_tps = plain_tokens / plain_s if plain_s > 0 else None
    return {
        "prompts": len(spec),
        "tau": sum(produced) / steps if steps else None,
        "tau_prompt_mean": sum(per_prompt) / len(per_prompt) if per_prompt else None,
        "tau_uncapped": sum(a + 1 for g in spec for a in g.accepted) / steps if steps else None,
        "verify_steps": steps,
        "tokens": spec_tokens,
        "acceptance_histogram": {str(i + 1): hist[i] for i in range(block_size)},
        "acceptance_distribution": {str(i + 1): (hist[i] / steps if steps else 0.0) for i in range(block_size)},
        "acceptance_per_position": [acc_k[k] / drafted_k[k] if drafted_k[k] else None for k in range(block_size - 1)],
        "drafted_per_position": drafted_k,
        "speculative": {"tokens": spec_tokens, "seconds": spec_s, "tokens_per_s": spec_tps,
                        "target_forwards": sum(g.target_forwards for g in spec)},
        "plain": {"tokens": plain_tokens, "seconds": plain_s, "tokens_per_s": plain_tps,
                  "target_forwards": sum(g.target_forwards for g in plain)},
        "speedup": (spec_tps / plain_tps) if spec_tps and plain_tps else None,
    }


def evaluate_set(target, draft: Draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 stop_ids: Sequence[int], temperature: float, mask_token_id: int, seed: int = 0,
                 proposals: Sequence[str] = ("argmax",), progress=None, name: str = "") -> dict:
    """Decode every prompt speculatively under each of `proposals` (the top-level one first) and plainly once, at
    `temperature` (and, if it is above 0, greedily as well for the losslessness check). Each policy and plain
    decoding draw from their own generator seeded with `seed`, so a policy's figures do not depend on which others
    ran. `progress` is a callable advanced once per prompt (a tqdm update) or None."""
    device = next(target.parameters()).device
    gens = {k: torch.Generator(device=device).manual_seed(seed) for k in (*proposals, "plain")}
    spec: dict[str, list[Generation]] = {k: [] for k in proposals}
    plain, mismatches = [], []
    for i, prompt in enumerate(prompts):
        for k in proposals:
            spec[k].append(speculative_generate(target, draft, prompt, max_new_tokens, stop_ids, temperature,
                                                mask_token_id, gens[k], proposal=k))
        p = target_generate(target, prompt, max_new_tokens, stop_ids, temperature, gens["plain"])
        if temperature > 0:
            sg = speculative_generate(target, draft, prompt, max_new_tokens, stop_ids, 0.0, mask_token_id)
            pg = target_generate(target, prompt, max_new_tokens, stop_ids, 0.0)
        else:
            sg, pg = spec[proposals[0]][-1], p
        if sg.tokens != pg.tokens:
            first = next((j for j, (a, b) in enumerate(zip(sg.tokens, pg.tokens)) if a != b),
                         min(len(sg.tokens), len(pg.tokens)))
            mismatches.append({"prompt": i, "first_difference": first, "speculative": sg.tokens[first:first + 8],
                               "plain": pg.tokens[first:first + 8]})
            log.error("%s prompt %d: greedy speculative output differs from plain greedy decoding at token %d",
                      name, i, first)
        plain.append(p)
        if progress is not None:
            progress()
    by = {k: summarize(spec[k], plain, draft.block_size) for k in proposals}
    own = {k: {f: v for f, v in s.items() if f not in ("prompts", "plain")} for k, s in by.items()}
    return {"proposal": proposals[0], **by[proposals[0]], "by_proposal": own, "lossless": not mismatches,
            "mismatches": mismatches}


def warm_up(target, draft: Draft, prompt, stop_ids, mask_token_id: int) -> None:
    """One short untimed decode of each kind (first-call allocations and kernel selection)."""
    speculative_generate(target, draft, prompt, min(8, 2 * draft.block_size), stop_ids, 0.0, mask_token_id)
    target_generate(target, prompt, 8, stop_ids, 0.0)


def combine(sets: dict, block_size: int) -> dict:
    """Overall figures pooled over prompt sets (evaluate_set's results), per policy under `by_proposal`, the
    top-level ones those of the sets' `proposal`; `engines` names who runs each policy."""
    first = next(iter(sets.values()))
    plain = [s["plain"] for s in sets.values()]
    by = {k: _pool([s["by_proposal"][k] for s in sets.values()], plain, block_size) for k in first["by_proposal"]}
    return {"proposal": first["proposal"], **by[first["proposal"]], "by_proposal": by,
            "engines": {k: ENGINES[k] for k in by}, "lossless": all(s["lossless"] for s in sets.values())}


def _pool(sets: list[dict], plain: list[dict], block_size: int) -> dict:
    """One policy's figures pooled over prompt sets (weights: verification steps for tau, tokens/seconds for
    speed); `plain` the sets' plain decoding."""
    steps = sum(s["verify_steps"] for s in sets)
    produced = sum((s["tau"] or 0) * s["verify_steps"] for s in sets)
    hist = [sum(s["acceptance_histogram"][str(i + 1)] for s in sets) for i in range(block_size)]
    drafted = [sum(s["drafted_per_position"][k] for s in sets) for k in range(block_size - 1)]
    accepted = [sum((s["acceptance_per_position"][k] or 0) * s["drafted_per_position"][k] for s in sets)
                for k in range(block_size - 1)]
    spec_t = sum(s["speculative"]["tokens"] for s in sets)
    spec_s = sum(s["speculative"]["seconds"] for s in sets)
    plain_t = sum(p["tokens"] for p in plain)
    plain_s = sum(p["seconds"] for p in plain)
    spec_tps = spec_t / spec_s if spec_s > 0 else None
    plain_tps = plain_t / plain_s if plain_s > 0 else None
    return {
        "tau": produced / steps if steps else None,
        "verify_steps": steps,
        "acceptance_histogram": {str(i + 1): hist[i] for i in range(block_size)},
        "acceptance_distribution": {str(i + 1): (hist[i] / steps if steps else 0.0) for i in range(block_size)},
        "acceptance_per_position": [accepted[k] / drafted[k] if drafted[k] else None for k in range(block_size - 1)],
        "speculative_tokens_per_s": spec_tps,
        "plain_tokens_per_s": plain_tps,
        "speedup": spec_tps / plain_tps if spec_tps and plain_tps else None,
    }
