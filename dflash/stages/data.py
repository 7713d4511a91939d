"""Stage `data`: expand sources into tokenised, length-bucketed Arrow shards, holdout.jsonl and manifest.json
under results/data/<dataset_name>/, atomically (the folder is replaced in one rename; never one the stage did not make,
nor one holding a file it did not write: it is refused, naming them).

Three forms (the Snakemake rules use the last two when data.shards > 1):
  python -m dflash data                       the whole expansion in one process
  python -m dflash data --shard I/N --out P   scatter: shard I of N (reading, regeneration, tokenising) -> part P
  python -m dflash data --gather P0 P1 ...    gather: the parts -> length buckets, holdout and the manifest
Regenerated responses are kept in finished chunks under --cache (default <results_dir>/data/<dataset>.regen/<key>),
so a rerun after a kill regenerates only what no chunk holds.
"""
import logging

from dflash.config import Loaded

log = logging.getLogger("dflash.data")


def add_arguments(p):
    p.add_argument("--out", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>); "
                                               "with --shard, the part folder")
    p.add_argument("--shard", default=None, metavar="I/N", help="make part I (0-based) of N: the scatter job")
    p.add_argument("--gather", nargs="+", default=None, metavar="PART", help="part folders to gather into --out")
    p.add_argument("--cache", default=None, help="folder of finished regeneration chunks (default: "
                                                 "<results_dir>/data/<dataset_name>.regen/<key>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for CPU regeneration (default 1; 0 leaves torch's)")


# What the data stage writes, beside its record (manifest.json lists the dataset's files exactly; Snakemake removes it
# and holdout.jsonl before a rerun, leaving the bucket folders): a file that fits neither was put there by hand
ARROW = r"(data-\d+-of-\d+\.arrow|dataset_info\.json|state\.json)"
DATASET_LAYOUT = rf"train/bucket-\d+/{ARROW}|holdout\.jsonl"
PART_LAYOUT = rf"samples/{ARROW}|holdout\.jsonl"
REMEDY = "give --out a new folder, or the dataset folder (<results_dir>/data/<dataset_name>)"


def _shard(text):
    from dflash.errors import UserError
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise UserError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if not (n >= 1 and 0 <= i < n):
        raise UserError(f"--shard {text!r}: expected 0 <= I < N")
    return i, n


def run(loaded: Loaded, args) -> int:
    from dflash.atomic import atomic_dir
    from dflash.data import expand, gather
    from dflash.data.shards import MANIFEST
    from dflash.data.tiny_target import cpu_threads

    shard, out = _where(loaded, args)
    record_file, layout, write = ((gather.PART, PART_LAYOUT, expand.write_part) if shard else
                                  (MANIFEST, DATASET_LAYOUT, gather.write_manifest))
    with cpu_threads(args.threads), atomic_dir(out, record_file, layout, REMEDY) as tmp:
        record = expand.build(loaded, tmp, shard=shard, parts=args.gather, cache_dir=args.cache,
                              progress=not args.no_progress)
        record = write(tmp, record)
    (_log_part if shard else _log_dataset)(record, out)
    return 0


def _where(loaded: Loaded, args):
    """((I, N) for a part, else None; the folder it goes to, inside the results or the repository)."""
    from dflash import paths
    from dflash.config import REPO, inside
    from dflash.errors import UserError
    if args.shard and args.gather:
        raise UserError("--shard and --gather: give one of them")
    shard = _shard(args.shard) if args.shard else None
    if shard and not args.out:
        raise UserError("--shard needs --out (the part folder)")
    out = args.out or paths.dataset(loaded.cfg.results_dir, loaded.cfg.dataset_name)
    inside(out, loaded.cfg.results_dir, REPO)
    return shard, out


def _log_part(part: dict, out):
    regen, st = part["regeneration"], part["stats"].values()
    log.info("data part %d/%d: %d samples, %d holdout, regenerated %d tokens (%d conversations cached) -> %s",
             part["shard"], part["shards"], sum(s["samples"] for s in st), sum(s["holdout"] for s in st),
             regen.get("tokens", 0), regen.get("cached", 0), out)


def _log_dataset(m, out):
    """The written manifest (a records.manifest.Manifest) in a few lines."""
    regen = m.regeneration
    log.info("dataset %s: %d samples, %d tokens (%d supervised), buckets %s, holdout %d, content %s%s, %.1fs -> %s",
             m.dataset, m.num_samples, m.total_tokens, m.supervised_tokens, m.buckets, m.holdout, m.content_hash,
             f", regenerated {regen.tokens} tokens at {regen.tokens_per_s} tok/s ({regen.engine}, {regen.cached or 0} "
             f"conversations from the cache)" if regen.enabled else "", m.seconds, out)
    for name, s in m.sources.items():
        log.info("  source %s: %d rows, %d kept, %d samples, rejected %s", name, s.rows, s.kept, s.samples,
                 s.rejected or "none")
    few = m.filters.too_few_supervised
    if few.rejected:
        log.info("  too_few_supervised: fewer than %d supervised tokens (%s)", few.min_supervised_tokens,
                 ", ".join(f"{k} {v}" for k, v in few.keys.items()))
