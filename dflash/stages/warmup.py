"""Stage `warmup`: on one device, single-threaded, into the persistent Inductor cache of this environment: compile the
drafter's forward and backward for every length bucket (a device running a drafter replica) and, with
train.compile_target, the target's captured layers for every bucket (a device running a target); write
results/compile/<device>.json."""
import logging

from dflash import paths
from dflash.atomic import check_file_ours
from dflash.config import Loaded
from dflash.config_model import TrainSection
from dflash.records import write
from dflash.records.compile import CompileRecordCore

log = logging.getLogger("dflash.warmup")


OURS = tuple(CompileRecordCore.model_fields)   # keys of every warm-up record: a --out without them is not the stage's


def add_arguments(p):
    p.add_argument("--device", required=True, help="device to warm up (cpu, cuda:N, N, or the file form cuda0)")
    p.add_argument("--data", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--out", default=None, help="record JSON (default: <results_dir>/compile/<device>.json)")


def warmup_device(spec: str, train_cfg: TrainSection):
    """--device (cpu, cuda:N, N or the file form cudaN) -> torch.device, checked before anything loads.

    Inductor's persistent cache is keyed by the CUDA device index: the FX-graph key hashes the example inputs'
    TensorMetadata, device index included, and AOT-autograd's key the same way (torch/_inductor/codecache.py
    FxGraphHashDetails / FxGraphCachePickler, torch/_functorch/_aot_autograd/autograd_cache.py). A graph compiled on
    cuda:0 is not the one train looks up on cuda:5, so a job that does not see the requested GPU cannot compile on
    another one in its place: it must see the GPUs as train numbers them (SLURM shows a job only its own GPUs, as
    cuda:0..; placement.resolve, which this stage runs, checks every config entry too)."""
    import os

    import torch

    from dflash.device_names import normalize
    from dflash.errors import UserError
    from dflash.train import placement as P

    s = str(spec).strip()
    s = f"cuda:{s[4:]}" if s.startswith("cuda") and s[4:].isdigit() else normalize(s)
    names = [normalize(d) for d in [s, *train_cfg.targets, *train_cfg.drafters]]
    need = 1 + max((int(n[5:]) for n in names if n.startswith("cuda:") and n[5:].isdigit()), default=-1)
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < need:
        here = s if s.startswith("cuda") else "cuda:N"
        raise UserError(
            f"warmup --device {spec}: this job sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) but --device and train.targets/train.drafters name "
            f"GPUs up to cuda:{need - 1}. The Inductor cache this stage fills is keyed by the CUDA device index (what "
            f"compiles on cuda:0 is not what train looks up on {here}), so it cannot compile on another GPU in its "
            f"place: give the warm-up job the GPUs the train job gets, numbered the same (on SLURM: set-resources "
            f"warmup gres: gpu:{need} in workflow/profiles/slurm/config.yaml)")
    return P.parse_device(s)


def run(loaded: Loaded, args) -> int:
    from dflash.fingerprint import compile_cache_dir
    from dflash.train import compile_guard
    from dflash.train.context import prepare, set_shapes
    from dflash.train.warmup import warm_up_device

    device = warmup_device(args.device, loaded.cfg.train)
    out = check_file_ours(args.out or paths.compile_record(loaded.cfg.results_dir, args.device), OURS, "warmup")
    ctx = prepare(loaded, data_dir=args.data)
    cache = compile_guard.use_compile_cache(compile_cache_dir(loaded.cfg.results_dir, ctx.env["hash"]))
    set_shapes(ctx, ctx.open_reader().shapes())
    record = warm_up_device(ctx, device, cache)
    write(out, record)
    for r in record.per_role:
        log.info("warm-up %s (%s): %d shape(s), %d graph(s), %d cache hit(s), %.1f s", device, r.role,
                 len(r.shapes), r.graphs, r.cache_hits, r.seconds)
    log.info("-> %s", out)
    return 0
