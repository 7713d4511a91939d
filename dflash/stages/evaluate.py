"""Stage `evaluate`: speculative decoding of held-out prompts with the target and the trained drafter.

Writes results/runs/<run>/acceptance.json: tau (tokens per target verification step, bonus included), its
distribution over 1..block_size, per-position acceptance, speculative vs plain tokens/s, losslessness (greedy
speculative output token-identical to plain greedy decoding), per prompt set. At temperature > 0 tau depends on the
draft policy (evaluate.proposal): each policy decoded has its figures under `by_proposal`, the top-level ones are
`proposal`'s (argmax, what vLLM, SGLang and TensorRT-LLM run, when decoded), `engines` names who runs which. The
logic is in dflash/evaluate/.
"""
import logging
from functools import partial
from pathlib import Path

from dflash import paths
from dflash.atomic import check_file_ours
from dflash.config import Loaded
from dflash.errors import UserError
from dflash.records import write
from dflash.stages import check_run_config

log = logging.getLogger("dflash.evaluate")


OURS = ("drafter", "sets")   # keys of every acceptance.json: an existing --out without them is not the stage's


def add_arguments(p):
    p.add_argument("--run-dir", default=None, help="run folder (default: <results_dir>/runs/<run_name>)")
    p.add_argument("--drafter", default=None,
                   help="a drafter folder: an export or a checkpoint (default: the checkpoint the run ended with, "
                        "as its summary.json names it)")
    p.add_argument("--holdout", default=None,
                   help="held-out prompts (default: <results_dir>/data/<dataset_name>/holdout.jsonl)")
    p.add_argument("--out", default=None, help="output JSON (default: <run-dir>/acceptance.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--same-config", action="store_true",
                   help="refuse a run trained with another config, e.g. by hand with --set (the workflow passes it)")


def run(loaded: Loaded, args) -> int:
    from dflash.data.shards import HOLDOUT
    from dflash.evaluate.run import check_holdout, evaluate, trained_on
    from dflash.train.checkpoint import ended_with, load_drafter
    from dflash.train.placement import resolve

    cfg = loaded.cfg
    folder = paths.RunFolder(args.run_dir or paths.run(cfg.results_dir, cfg.run_name))
    out = Path(args.out) if args.out else folder.acceptance()
    failed = out.with_name(out.stem + ".failed.json")
    for f in (out, failed):   # before minutes of decoding: a folder, or a file that is not ours, is refused now
        check_file_ours(f, OURS, "evaluate")
    holdout = Path(args.holdout or paths.dataset(cfg.results_dir, cfg.dataset_name) / HOLDOUT)
    check_holdout(holdout, given=bool(args.holdout))
    if args.same_config and not args.drafter:
        check_run_config(loaded, folder)
    path = Path(args.drafter) if args.drafter else ended_with(folder)
    trained = None if args.drafter else trained_on(cfg.target, folder)
    split = resolve(cfg.train).target_groups[0] if cfg.train.target_split > 1 else None
    record = evaluate(loaded, path, partial(load_drafter, path), holdout, trained, split, not args.no_progress)
    if not record.lossless and record.dtype == "float32":
        write(failed, record)
        raise UserError(f"greedy speculative decoding differs from plain greedy decoding on "
                        f"{sum(len(r.mismatches) for r in record.sets.values())} prompt(s) in float32: a bug "
                        f"(details in {failed})")
    write(out, record)
    for k, b in record.by_proposal.items():
        log.info("tau %.3f (%s drafts, block %d), speculative %.1f tok/s vs plain %.1f tok/s", b.tau or 0, k,
                 record.block_size, b.speculative_tokens_per_s or 0, b.plain_tokens_per_s or 0)
    log.info("lossless %s -> %s", record.lossless, out)
    if not record.lossless:
        log.warning("greedy speculative decoding differs from plain greedy decoding (in %s, batch-dependent "
                    "rounding can flip near-tied argmaxes); details in %s", record.dtype, out)
    return 0
