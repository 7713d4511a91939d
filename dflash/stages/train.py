"""Stage `train`: the target/drafter pipeline (threads runtime in one process, or distributed: a process per device)."""
import logging
import os

log = logging.getLogger("dflash.train")


def add_arguments(p):
    p.add_argument("--data", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--run-dir", default=None, help="run folder (default: <results_dir>/runs/<run_name>)")
    p.add_argument("--no-progress", action="store_true", help="no live progress bar")


def run(loaded, args):
    cfg = loaded.cfg
    if cfg.train.expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import yaml

    from dflash.atomic import atomic_write_text
    from dflash.fingerprint import compile_cache_dir
    from dflash.train import compile_guard
    from dflash.train.context import prepare, set_shapes
    from dflash.train.metrics import RunMetrics
    from dflash.train.runtime import threads
    from dflash.train.telemetry import GpuSampler

    ctx = prepare(loaded, run_dir=args.run_dir, data_dir=args.data)
    if ctx.placement.runtime == "distributed":
        from dflash.train.runtime import distributed
        return distributed.launch(ctx, args)
    compile_guard.use_compile_cache(compile_cache_dir(cfg.results_dir, ctx.env["hash"]))
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(ctx.run_dir / "config.yaml", yaml.safe_dump(loaded.raw, sort_keys=False))
    reader = ctx.open_reader()
    set_shapes(ctx, reader.shapes())
    log.info("run %s: %s runtime, targets %s, drafters %s, attention %s, buckets %s", cfg.run_name,
             ctx.placement.runtime, [str(d) for d in ctx.placement.targets],
             [str(d) for d in ctx.placement.drafters], ctx.backend, reader.edges)
    metrics = RunMetrics(ctx, progress=not args.no_progress)
    metrics.sampler = GpuSampler(ctx.placement.devices)
    try:
        return threads.run(ctx, reader, metrics)
    finally:
        metrics.sampler.stop()
