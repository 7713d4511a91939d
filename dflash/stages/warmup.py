"""Stage `warmup`: compile the drafter's forward and backward for every length bucket on one device, single-threaded,
into the persistent Inductor cache of this environment; write results/compile/<device>.json."""
import logging

log = logging.getLogger("dflash.warmup")


def add_arguments(p):
    p.add_argument("--device", required=True, help="device to warm up (cpu, cuda:N, N, or the file form cuda0)")
    p.add_argument("--data", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--out", default=None, help="record JSON (default: <results_dir>/compile/<device>.json)")


def run(loaded, args):
    import torch

    from dflash.atomic import atomic_write_json
    from dflash import paths
    from dflash.fingerprint import compile_cache_dir
    from dflash.train import compile_guard, placement as P
    from dflash.train.context import prepare, set_shapes
    from dflash.train.step import build_drafter, random_head, warm_up

    spec = args.device
    if spec.startswith("cuda") and spec[4:].isdigit():
        spec = f"cuda:{spec[4:]}"
    device = P.parse_device(spec)
    ctx = prepare(loaded, data_dir=args.data)
    if device not in ctx.placement.drafters:
        log.warning("%s runs no drafter in this placement; warming it up anyway", device)
    cache = compile_guard.use_compile_cache(compile_cache_dir(loaded.cfg.results_dir, ctx.env["hash"]))
    reader = ctx.open_reader()
    set_shapes(ctx, reader.shapes())
    dtype = P.autocast_dtype(loaded.cfg.train, device) or torch.float32
    drafter = build_drafter(ctx, *random_head(ctx, device, dtype), device)
    record = warm_up(drafter, ctx, device, ctx.shapes)
    record.update({"env_hash": ctx.env["hash"], "cache_dir": str(cache)})
    out = args.out or paths.compile_record(loaded.cfg.results_dir, args.device)
    atomic_write_json(out, record)
    log.info("warm-up %s: %d shape(s), %d graph(s), %d cache hit(s), %.1f s -> %s", device, len(record["shapes"]),
             record["graphs"], record["cache_hits"], record["seconds"], out)
    return 0
