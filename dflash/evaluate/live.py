"""Acceptance measured while training (train.eval_every): tau of greedy speculative decoding, every N steps.

At step s with s % eval_every == 0, and at the run's last step, drafter replica 0 measures tau on the first
`train.eval_prompts` held-out prompts (holdout.jsonl of the run's dataset) with the target and a copy of its current
weights, by replaying greedy speculative decoding (`replay.replay`: the target's greedy continuations in one batch,
then one target and one drafter forward per prompt; equal step for step to `specdec.speculative_generate`, a few
seconds instead of a minute of batch-1 decoding), aggregated by the evaluate stage's `acceptance.summarize`, and hands
{step, tau, train_s, seconds, ...} to the run's metrics (metrics.jsonl, the progress line, summary.json `eval`):
tau against the training seconds it took (and GPU-seconds, which the metrics derive), what more training would buy.

What the evaluate stage computes on a checkpoint of that step (temperature 0): the copy is the drafter the stage
loads (built from the replica's state_dict, cast to the target's dtype, on the target's device, with the target's
embedding and LM head, eager, in eval mode), the prompts and stop tokens are the stage's. With train.eval_prompts /
eval_max_new_tokens left null (evaluate.num_prompts / max_new_tokens), the last evaluation's tau is the evaluate
stage's tau on the final checkpoint (tests/e2e/test_live_eval.py holds them equal on the CPU, in float32; in bfloat16
the batched greedy path may part from batch-1 decoding at a near-tied argmax).

Side-effect free for training: nothing of the replica is touched (its weights are read, its train mode and compiled
forwards are not used), the RNG of every device is forked, and the evaluation runs inside `compile_threads.eager()`,
so the target's compiled layers (train.compile_target), whose shapes the warm-up never saw, run their original
Python on this thread only instead of recompiling (training's recompile count stays 0; the target threads of the
threads runtime go on making features with the compiled layers meanwhile). The other replicas wait at `sync.hold` (a barrier in the
threads runtime; a key in the rendezvous store in the distributed one, so no collective is pending while they wait)
and every replica takes the pause off its training clock: the time budget, the LR schedule and Ktok/s exclude it.
"""
from __future__ import annotations

import logging
import time

import torch

from dflash import compile_threads
from dflash.config_model import DflashConfig

log = logging.getLogger("dflash.train")


def settings(cfg: DflashConfig) -> tuple[int, int]:
    """(prompts, max new tokens) of an in-training evaluation: train.eval_prompts / eval_max_new_tokens, null
    meaning the evaluate stage's num_prompts / max_new_tokens."""
    t, ev = cfg.train, cfg.evaluate
    return (t.eval_prompts if t.eval_prompts is not None else ev.num_prompts,
            t.eval_max_new_tokens if t.eval_max_new_tokens is not None else ev.max_new_tokens)


def due(every: int, step: int, final: bool) -> bool:
    """Whether step (1-based, just done) is evaluated: every `every` steps and the last one; never with 0."""
    return bool(every) and (step % every == 0 or final)


class LiveEval:
    """One replica's part: replica 0 (`target` given) evaluates, every replica pauses while it does."""

    def __init__(self, ctx, target=None, sampler=None):
        self.every = ctx.cfg.train.eval_every
        self.timeout_s = ctx.cfg.train.stall_timeout_s
        self.target = target
        self.sampler = sampler   # the process's GPU sampler: the pause is left out of utilisation
        if target is None:
            return
        from dflash.data.shards import HOLDOUT
        from dflash.evaluate.loading import read_holdout
        from dflash.target import load_tokenizer, stop_token_ids
        self.num_prompts, self.max_new_tokens = settings(ctx.cfg)
        self.prompts = [r["prompt_ids"] for r in read_holdout(ctx.data_dir / HOLDOUT, self.num_prompts)]
        self.stops = stop_token_ids(load_tokenizer(ctx.cfg.target), target)
        self.seed = ctx.cfg.seed
        log.info("tau measured every %d steps and at the last: %d held-out prompt(s) x %d tokens, greedy (replayed)",
                 self.every, len(self.prompts), self.max_new_tokens)

    def after_step(self, replica, step: int, final: bool) -> None:
        """The hook of the step loop (every replica, after the step's checks): evaluate if due."""
        if not due(self.every, step, final):
            return
        if replica.device.type == "cuda":   # the step's kernels still in flight are training's time, not the pause's
            torch.cuda.synchronize(replica.device)
        t0, c0 = time.perf_counter(), replica.clock()
        record = replica.sync.hold(replica.rank, lambda: self.evaluate(replica.drafter, step, replica.elapsed),
                                   self.timeout_s, "drafter-0's in-training evaluation (train.eval_every)")
        t1 = time.perf_counter()
        # the one measure of the pause, taken off the training clock (time budget, LR schedule), Ktok/s (metrics)
        # and the GPU utilisation of the run's device rows
        replica.t0 += replica.clock() - c0
        if self.sampler is not None:
            self.sampler.exclude(t0, t1)
        if record is not None:
            replica.metrics.eval_done({**record, "pause_s": round(t1 - t0, 4)})

    def evaluate(self, drafter, step: int, train_s: float) -> dict:
        """tau of `drafter`'s current weights on the held-out prompts after `train_s` seconds of training (see the
        module's docstring)."""
        from dflash.evaluate.acceptance import summarize
        from dflash.evaluate.replay import replay
        device = next(self.target.parameters()).device
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if device.type == "cuda" else []), \
                compile_threads.eager():
            torch.manual_seed(self.seed)                  # as the evaluate stage, before it decodes
            copy = eager_copy(drafter, self.target)
            done = replay(self.target, copy, self.prompts, self.max_new_tokens, self.stops)
        s = summarize(done.generations, [], copy.cfg.block_size)
        seconds = time.perf_counter() - t0
        log.info("step %d (%.1f s of training): tau %.3f on %d held-out prompt(s) (%d verification steps, %.2f s)",
                 step, train_s, s["tau"] or 0, s["prompts"], s["verify_steps"], seconds)
        if done.mismatches:
            log.warning("step %d: %d of the replayed greedy tokens are not the target's argmax in a whole-sequence "
                        "forward (%s rounding; tau is that of the path replayed)", step, done.mismatches,
                        str(next(self.target.parameters()).dtype).removeprefix("torch."))
        return {"step": step, "tau": s["tau"], "train_s": round(train_s, 3), "method": "replay",
                "seconds": round(seconds, 4), "prompts": s["prompts"], "max_new_tokens": self.max_new_tokens,
                "tokens": s["tokens"], "verify_steps": s["verify_steps"], "greedy_mismatches": done.mismatches}


def eager_copy(drafter, target):
    """The drafter the evaluate stage would load from a checkpoint of these weights: uncompiled, in eval mode, in
    the target's dtype on the target's device, with the target's embedding and LM head."""
    from dflash.model import DFlashDrafter
    p = next(target.parameters())
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.device("meta"):
        copy = DFlashDrafter(drafter.cfg, embed, head, drafter.embed_scale)   # shapes only: no init, no RNG
    state = {k: v.detach().to(device=p.device, dtype=p.dtype, copy=True) for k, v in drafter.state_dict().items()}
    copy.load_state_dict(state, strict=True, assign=True)
    return copy.eval()


def attach(ctx, replicas, target, sampler=None) -> None:
    """Give each replica of this process its part (train.eval_every > 0; train.context refused what cannot run):
    replica 0 the evaluation with `target` (a target model of this process), the others the pause; `sampler`: the
    process's GPU sampler, which leaves the pauses out."""
    if not ctx.cfg.train.eval_every:
        return
    for rep in replicas:
        rep.live = LiveEval(ctx, target if rep.rank == 0 else None, sampler)
