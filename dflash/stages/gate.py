"""Stage `gate`: after the report, exit non-zero when `report.fail_on_regression` is set and the newest run of this
run name regressed, in throughput (Ktok/s) or in quality (tau) alike. A separate stage, so a failing gate leaves the
report, the plots and the history in place."""
import logging
import sys
from pathlib import Path

from dflash import paths
from dflash.atomic import atomic_write_json, check_file_ours
from dflash.config import Loaded
from dflash.records import read
from dflash.records.regressions import RegressionsCore, RunCore

log = logging.getLogger("dflash.report")


def add_arguments(p):
    p.add_argument("--regressions", default=None,
                   help="the report's regressions.json (default: <results_dir>/report/regressions.json)")
    p.add_argument("--out", default=None,
                   help="the verdict, written when the gate passes (default: <results_dir>/report/gate.json)")


def latest_of(data: RegressionsCore, run_name: str) -> RunCore | None:
    """The newest record of `run_name` (the history can hold other run names), else the newest record."""
    mine = [r for r in data.runs if r.run_name == run_name]
    return (mine or data.runs or [None])[-1]


def regressed(record: RunCore | None) -> list[str]:
    """What regressed in a run record: ["throughput", "quality"] or a part of it (a record written before quality was
    judged: its Ktok/s verdict alone)."""
    if record is None:
        return []
    if record.regressed is not None:
        return list(record.regressed)
    return ["throughput"] if record.verdict == "regression" else []


def run(loaded: Loaded, args) -> int:
    out = check_file_ours(args.out or paths.report(loaded.cfg.results_dir) / "gate.json", ("passed",), "gate")
    path = Path(args.regressions or paths.report(loaded.cfg.results_dir) / "regressions.json")
    latest = latest_of(read(path, RegressionsCore, "rerun the report stage"), loaded.cfg.run_name)
    kinds = regressed(latest)
    fail = bool(loaded.cfg.report.fail_on_regression)
    if fail and kinds:
        print(f"dflash gate: regression: {latest.sentence} ({' and '.join(kinds)} regressed; "
              f"report.fail_on_regression is true; the report stays in {path.parent})", file=sys.stderr)
        return 3
    atomic_write_json(out, {"run_id": latest.run_id if latest else None, "verdict": latest.verdict if latest else None,
                            "quality_verdict": latest.quality.verdict if latest and latest.quality else None,
                            "regressed": kinds, "fail_on_regression": fail, "passed": True})
    log.info("gate passed: %s", latest.sentence if latest else "no runs in the history")
    return 0
