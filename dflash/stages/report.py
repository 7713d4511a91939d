"""Stage `report`: the run history, regressions of Ktok/s and tau with attribution, anomalies, plots and report.md;
with --sweep, the config's sweep table instead (dflash/report/sweep.py: its own files, one writer each).

It exits 0 whatever the verdict (so Snakemake keeps every output); the `gate` stage fails on a regression."""
import logging

from dflash.config import Loaded

log = logging.getLogger("dflash.report")


def add_arguments(p):
    p.add_argument("--runs-dir", default=None, help="folder of run folders (default: <results_dir>/runs)")
    p.add_argument("--out", default=None,
                   help="report folder: report.md, history.csv, history/, regressions.json, *.png "
                        "(default: <results_dir>/report)")
    p.add_argument("--sweep", action="store_true",
                   help="write the config's sweep table instead (sweep.json, sweep.md, sweep_tau_gpu_seconds.png: "
                        "every run of its `sweep`, seed groups, tau against training time)")


def run(loaded: Loaded, args) -> int:
    from dflash import paths
    from dflash.report import build

    results = loaded.cfg.results_dir
    out = args.out or paths.report(results)
    check_out(out)
    if args.sweep:
        from dflash.report import sweep as table
        from dflash.sweep import expand
        table.build(expand(loaded), args.runs_dir or paths.runs(results), out, loaded.source)
        return 0
    build(args.runs_dir or paths.runs(results), out, loaded.cfg.report)
    return 0


OURS = ("regressions.json", "history", "history.csv", "sweep.json")   # what only a report folder holds


def check_out(out) -> None:
    """The report writes report.md, history.csv, the plots ... into `out`, file by file: a folder that holds files but
    none of a report's own (OURS) was not made by this stage, and nothing in it is overwritten."""
    from pathlib import Path

    from dflash.errors import UserError
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: a file, where the report stage writes a folder: give --out a folder")
    if out.is_dir() and any(out.iterdir()) and not any((out / name).exists() for name in OURS):
        raise UserError(f"{out}: exists and was not made by the report stage (no {', '.join(OURS)} in it), so nothing "
                        f"in it is overwritten: give --out a new folder, or the pipeline's report folder")
