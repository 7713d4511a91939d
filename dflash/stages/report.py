"""Stage `report`: throughput history (append-only), regressions with attribution, plots and report.md."""
import logging
import sys

log = logging.getLogger("dflash.report")


def add_arguments(p):
    p.add_argument("--runs-dir", default=None, help="folder of run folders (default: <results_dir>/runs)")
    p.add_argument("--out", default=None,
                   help="report folder: report.md, history.csv, history/, regressions.json, *.png "
                        "(default: <results_dir>/report)")


def run(loaded, args):
    from dflash import paths
    from dflash.report import build
    from dflash.report.regress import Settings

    settings = Settings.from_config(loaded.cfg)
    results = loaded.cfg.results_dir
    result = build(args.runs_dir or paths.runs(results), args.out or paths.report(results), settings)
    latest = result.latest
    if loaded.cfg.report.fail_on_regression and latest is not None and latest["verdict"] == "regression":
        print(f"dflash report: regression: {latest['sentence']}", file=sys.stderr)
        return 3
    return 0
