"""Stage `train`: the target/drafter pipeline (threads runtime in one process, or distributed under torchrun)."""
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
    from dflash.train import checkpoint, compile_guard, threads
    from dflash.train.metrics import RunMetrics
    from dflash.train.reader import ShardReader
    from dflash.train.setup import prepare
    from dflash.train.telemetry import GpuSampler

    setup = prepare(loaded, run_dir=args.run_dir, data_dir=args.data)
    if "LOCAL_RANK" not in os.environ and checkpoint.finished(setup):  # the launcher decides, not every rank
        return 0
    if setup.placement.runtime == "distributed":
        from dflash.train import distributed
        return distributed.launch(loaded, args)
    compile_guard.use_compile_cache(compile_cache_dir(cfg.results_dir, setup.env["hash"]))
    setup.run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(setup.run_dir / "config.yaml", yaml.safe_dump(loaded.raw, sort_keys=False))
    reader = ShardReader(setup.data_dir, cfg.train.batch_size, cfg.seed, setup.extra["pad_id"])
    log.info("run %s: %s runtime, targets %s, drafters %s, attention %s, buckets %s", cfg.run_name,
             setup.placement.runtime, [str(d) for d in setup.placement.targets],
             [str(d) for d in setup.placement.drafters], setup.backend, reader.edges)
    metrics = RunMetrics(setup, progress=not args.no_progress)
    metrics.sampler = GpuSampler(setup.placement.devices)
    try:
        return threads.run(setup, reader, metrics)
    finally:
        metrics.sampler.stop()
