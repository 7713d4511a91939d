"""Stage `gate`: after the report, exit non-zero when `report.fail_on_regression` is set and the newest run of this
run name regressed, in throughput (Ktok/s) or in quality (tau) alike. A separate stage, so a failing gate leaves the
report, the plots and the history in place."""
import json
import logging
import sys
from pathlib import Path

from dflash.config import Loaded
from dflash.errors import UserError

log = logging.getLogger("dflash.report")


def add_arguments(p):
    p.add_argument("--regressions", default=None,
                   help="the report's regressions.json (default: <results_dir>/report/regressions.json)")
    p.add_argument("--out", default=None,
                   help="the verdict, written when the gate passes (default: <results_dir>/report/gate.json)")


def latest_of(data: dict, run_name: str) -> dict | None:
    """The newest record of `run_name` (the history can hold other run names), else the newest record."""
    runs = [r for r in data.get("runs") or [] if isinstance(r, dict)]
    mine = [r for r in runs if r.get("run_name") == run_name]
    return (mine or runs or [None])[-1]


def regressed(record: dict | None) -> list[str]:
    """What regressed in a run record: ["throughput", "quality"] or a part of it (a record written before quality was
    judged: its Ktok/s verdict alone)."""
    if not record:
        return []
    if isinstance(record.get("regressed"), list):
        return [str(k) for k in record["regressed"]]
    return ["throughput"] if record.get("verdict") == "regression" else []


def run(loaded: Loaded, args) -> int:
    from dflash.atomic import atomic_write_json, check_file_ours
    from dflash import paths

    out = check_file_ours(args.out or paths.report(loaded.cfg.results_dir) / "gate.json", ("passed",), "gate")
    path = Path(args.regressions or paths.report(loaded.cfg.results_dir) / "regressions.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: cannot read the report's verdicts ({e}); run the report stage first") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    latest = latest_of(data, loaded.cfg.run_name)
    verdict = latest.get("verdict") if latest else None
    kinds = regressed(latest)
    fail = bool(loaded.cfg.report.fail_on_regression)
    if fail and kinds:
        print(f"dflash gate: regression: {latest.get('sentence')} ({' and '.join(kinds)} regressed; "
              f"report.fail_on_regression is true; the report stays in {path.parent})", file=sys.stderr)
        return 3
    atomic_write_json(out, {"run_id": latest.get("run_id") if latest else None, "verdict": verdict,
                            "quality_verdict": ((latest or {}).get("quality") or {}).get("verdict"),
                            "regressed": kinds, "fail_on_regression": fail, "passed": True})
    log.info("gate passed: %s", latest.get("sentence") if latest else "no runs in the history")
    return 0
