"""Throughput and quality report: history (snapshots + a csv view), regressions of Ktok/s and tau with attribution,
anomalies, plots, report.md."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dflash.config_model import ReportSection

log = logging.getLogger("dflash.report")

OUTPUTS = ("report.md", "history.csv", "regressions.json")


@dataclass
class Result:
    records: list[dict]
    appended: list[str]
    skipped: list[dict]
    out: Path

    @property
    def latest(self) -> dict | None:
        return self.records[-1] if self.records else None


def build(runs_dir: str | Path, out: str | Path, settings: ReportSection) -> Result:
    """Read run folders, record new runs and re-evaluations in the history, and write history.csv, regressions.json,
    the plots, report.md. `settings`: the config's `report` section."""
    from dflash.atomic import atomic_write_text
    from dflash.records import write
    from dflash.records.regressions import Regressions
    from dflash.report import history, markdown, placement, plots, regress

    out = Path(out)
    found, skipped = history.scan_runs(runs_dir)
    runs, appended, bad = history.History(out).update(found)
    skipped += bad
    records = regress.evaluate(runs, settings)
    split = placement.suggest(runs[-1].snapshot) if runs else None
    latest = records[-1] if records else {}
    verdicts = Regressions(
        settings=settings.model_dump(),
        latest=latest.get("run_id"),
        latest_run_name=latest.get("run_name"),
        latest_verdict=latest.get("verdict"),
        latest_quality_verdict=(latest.get("quality") or {}).get("verdict"),
        latest_regressed=latest.get("regressed"),
        latest_sentence=latest.get("sentence"),
        placement=split,
        skipped=skipped,
        runs=records,
    )
    write(out / "regressions.json", verdicts)
    pngs = plots.make_all(runs, verdicts.runs, settings, out)       # the typed verdicts to the end
    text = markdown.render(runs, verdicts.runs, pngs, out, settings, verdicts.skipped, verdicts.placement)
    atomic_write_text(out / "report.md", text)
    log.info("report: %d run(s) in the history (%d new, %d skipped) -> %s", len(runs), len(appended), len(skipped), out)
    if records:
        log.info("%s", records[-1]["sentence"])
    return Result(records, appended, skipped, out)
