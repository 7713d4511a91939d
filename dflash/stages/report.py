"""Stage `report`: the run history, regressions of Ktok/s and tau with attribution, anomalies, plots and report.md.

It exits 0 whatever the verdict (so Snakemake keeps every output); the `gate` stage fails on a regression."""
import logging

from dflash.config import Loaded

log = logging.getLogger("dflash.report")


def add_arguments(p):
    p.add_argument("--runs-dir", default=None, help="folder of run folders (default: <results_dir>/runs)")
    p.add_argument("--out", default=None,
                   help="report folder: report.md, history.csv, history/, regressions.json, *.png "
                        "(default: <results_dir>/report)")


def run(loaded: Loaded, args) -> int:
    from dflash import paths
    from dflash.report import build

    results = loaded.cfg.results_dir
    build(args.runs_dir or paths.runs(results), args.out or paths.report(results), loaded.cfg.report)
    return 0
