"""Stage `data`: expand sources into tokenised, length-bucketed Arrow shards, holdout.jsonl and manifest.json
under results/data/<dataset_name>/, atomically (the folder is replaced in one rename)."""
import logging

log = logging.getLogger("dflash.data")


def add_arguments(p):
    p.add_argument("--out", default=None, help="dataset folder (default: <results_dir>/data/<dataset_name>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for CPU regeneration (default 1; 0 leaves torch's)")


def run(loaded, args):
    from dflash import paths
    from dflash.atomic import atomic_dir
    from dflash.config import REPO, inside
    from dflash.data.expand import expand

    out = args.out or paths.dataset(loaded.cfg.results_dir, loaded.cfg.dataset_name)
    inside(out, loaded.cfg.results_dir, REPO)
    with atomic_dir(out) as tmp:
        m = expand(loaded, tmp, progress=not args.no_progress, threads=args.threads)
    regen = m["regeneration"]
    log.info("dataset %s: %d samples, %d tokens (%d supervised), buckets %s, holdout %d, content %s%s, %.1fs -> %s",
             m["dataset"], m["num_samples"], m["total_tokens"], m["supervised_tokens"], m["buckets"], m["holdout"],
             m["content_hash"], f", regenerated {regen['tokens']} tokens at {regen['tokens_per_s']} tok/s"
             if regen["enabled"] else "", m["seconds"], out)
    for name, s in m["sources"].items():
        log.info("  source %s: %d rows, %d kept, %d samples, rejected %s", name, s["rows"], s["kept"], s["samples"],
                 s["rejected"] or "none")
    return 0
