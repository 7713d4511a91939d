"""Stage `train`: the target/drafter pipeline (threads runtime in one process, or distributed: a process per device).
One writer per run folder (dflash/train/writer.py), checked writable before anything is loaded or trained."""
import contextlib
import logging
import os

from dflash.config import Loaded

log = logging.getLogger("dflash.train")


def add_arguments(p):
    p.add_argument("--data", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--run-dir", default=None, help="run folder (default: <results_dir>/runs/<run_name>)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")
    p.add_argument("--retrain", action="store_true",
                   help="train a finished run anew (its identity's checkpoints set aside, kept) instead of restoring its "
                        "outputs; an interrupted run of this identity (an interrupted retrain too) resumes. The "
                        "workflow passes it when train is forced (snakemake -R train, --forceall)")


def run(loaded: Loaded, args) -> int:
    cfg = loaded.cfg
    if cfg.train.expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from dflash.train import run_folder, writer
    from dflash.train.context import prepare
    from dflash.train.run import train
    from dflash.train.runtime import distributed

    ctx = prepare(loaded, run_dir=args.run_dir, data_dir=args.data)
    if distributed.is_rank():   # one rank of a distributed run: the lifecycle over the ranks' transport
        with writer.hold(ctx.run_dir) if distributed.writes(ctx) else contextlib.nullcontext():
            return train(ctx, distributed.Ranks(), progress=False)
    writer.check_writable(ctx.run_dir)
    # one writer per run folder, for this process's life (and its ranks'); with several nodes a launcher on each: they
    # restore in turn (each may find the run restored), then the writer rank holds the folder (distributed.writes)
    nodes = cfg.train.rendezvous.nnodes if ctx.placement.runtime == "distributed" else 1
    with writer.hold(ctx.run_dir, wait_s=60 if nodes > 1 else 0):
        done = run_folder.restore(ctx, retrain=args.retrain)
        if done is None and nodes == 1:
            return start(loaded, ctx, args)
    if done is None:
        return distributed.launch(ctx, args)
    log.info("run %s finished at step %d (%s) with this config's result keys and this data: summary.json and "
             "metrics.jsonl restored, nothing trained (--retrain, or snakemake -R train, trains it anew)",
             cfg.run_name, done.checkpoint.step, ctx.run_dir / done.checkpoint.path)
    return 0


def start(loaded: Loaded, ctx, args) -> int:
    """Train: the distributed launcher, or the threads runtime in this process."""
    import yaml

    from dflash.atomic import atomic_write_text
    from dflash.paths import RunFolder
    from dflash.train.run import train
    from dflash.train.runtime import distributed, threads

    if ctx.placement.runtime == "distributed":
        return distributed.launch(ctx, args)
    atomic_write_text(RunFolder(ctx.run_dir).config, yaml.safe_dump(loaded.raw, sort_keys=False))
    log.info("run %s: %s runtime, targets %s, drafters %s, attention %s", loaded.cfg.run_name, ctx.placement.runtime,
             [str(d) for d in ctx.placement.targets], [str(d) for d in ctx.placement.drafters], ctx.backend)
    return train(ctx, threads.Threads(), progress=not args.no_progress)
