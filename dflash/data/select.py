"""Which conversations go where, steps of the data chain after `normalise`: dedupe (the first of identical ones), hold
out (the evaluation prompts, their files kept whole out of training), scatter (this data shard's share). Every
decision is a function of the conversation's hash (`rows.conv_hash`), the seed and data.holdout, and every shard
reads every source, so every shard makes the same ones.

Conversations: {id, source, file, evaluable, messages, hash} (`hash` added by `dedupe`).

Public:
- `dedupe(convs, seen, tally)`: the first of identical conversations (counted: `valid`; reject `duplicate`)
- `HoldOut(n, seed)`: `watch(convs)` (passes them on, keeping the n evaluable ones of lowest seeded rank), `check(valid)`,
  `rows(tokenizer, tally)` (holdout.jsonl's rows; counted: `holdout`), `exclude(convs, tally)` (reject `holdout_file`)
- `scatter(convs, shard, nshards)`: this shard's conversations (`rows.shard_of`)
"""
from __future__ import annotations

import heapq
from typing import Iterator

from dflash.data.rows import conv_hash, rank, shard_of
from dflash.data.tally import Tally
from dflash.data.tokenise import prompt_ids
from dflash.errors import UserError


def dedupe(convs: Iterator[dict], seen: set[bytes], tally: Tally) -> Iterator[dict]:
    """Step `dedupe`: each conversation with its `hash`, unless an identical one came before (in any source: `seen`
    holds 16 bytes of each hash, all that stays in memory per conversation)."""
    for c in convs:
        h = conv_hash(c["messages"])
        hb = bytes.fromhex(h[:32])
        if hb in seen:
            tally.reject(c["source"], "duplicate")
            continue
        seen.add(hb)
        tally.counts[c["source"]]["valid"] += 1
        if c["file"] is not None:
            tally.files(c["source"], c["evaluable"])
        yield {**c, "hash": h}


def _neg(hexdigest: str) -> int:
    """For a max-heap of hex ranks (heapq is a min-heap)."""
    return -int(hexdigest[:16], 16)


class HoldOut:
    """Step `hold out`: the `n` evaluable conversations (`Row.evaluable`; the code source's: those of held-out files) of
    lowest seeded rank among all of every source, the same in every shard; no conversation of a file that gives one is
    trained on (reject `holdout_file`), so every shard excludes the same files."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self.heap: list = []            # (-rank, hash, conversation): the n lowest ranks so far

    def watch(self, convs: Iterator[dict]) -> Iterator[dict]:
        for c in convs:
            if self.n and c["evaluable"]:
                item = (_neg(rank(f"h{self.seed}", c["hash"])), c["hash"], c)
                (heapq.heappush if len(self.heap) < self.n else heapq.heappushpop)(self.heap, item)
            yield c

    def check(self, valid: int):
        """After every source is read: enough conversations to hold out, and some left to train on."""
        if self.n >= valid:
            raise UserError(f"data.holdout ({self.n}) leaves no training conversations (only {valid} valid)")
        if len(self.heap) < self.n:
            raise UserError(f"data.holdout ({self.n}) exceeds the {len(self.heap)} conversations that may be "
                            f"evaluation prompts (the code source's are those of held-out files): lower data.holdout")

    def rows(self, tokenizer, tally: Tally) -> list[dict]:
        """The held-out conversations as holdout.jsonl's rows {id, source, prompt_ids (up to the first assistant
        turn), reference_ids}, by hash."""
        out = []
        for _, _, c in sorted(self.heap, key=lambda x: x[1]):
            a = next(i for i, m in enumerate(c["messages"]) if m["role"] == "assistant")
            out.append({"id": c["id"], "source": c["source"], "prompt_ids": prompt_ids(tokenizer, c["messages"][:a]),
                        "reference_ids": tokenizer(c["messages"][a]["content"], add_special_tokens=False)["input_ids"]})
            tally.counts[c["source"]]["holdout"] += 1
        return out

    def exclude(self, convs: Iterator[dict], tally: Tally) -> Iterator[dict]:
        """The conversations to train on: not held out, and not of a file that gives an evaluation prompt."""
        held = {h for _, h, _ in self.heap}
        held_files = {c["file"] for _, _, c in self.heap} - {None}
        for c in convs:
            if c["hash"] in held:
                continue
            if c["file"] in held_files:
                tally.reject(c["source"], "holdout_file")
                continue
            yield c


def scatter(convs: Iterator[dict], shard: int, nshards: int) -> Iterator[dict]:
    """Step `scatter`, where the chain is cut into data shards: the conversations of shard `shard` of `nshards`."""
    return (c for c in convs if shard_of(c["hash"], nshards) == shard)
