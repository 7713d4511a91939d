"""report.md: the latest verdict in one sentence, a table of runs, the anomalies, the plots (relative links)."""
from __future__ import annotations

from pathlib import Path

from dflash.report.history import Run
from dflash.report.placement import gpu_roles
from dflash.report.regress import changed_text

PLOT_TITLES = {
    "ktok": "Ktok/s per run, with the baseline band and regressions",
    "devices": "Peak memory and utilisation per device (latest run)",
    "time_split": "Time split per step (queue wait / target / drafter / optimizer)",
    "training": "Loss and per-position accuracy (latest run)",
}


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value, fmt="{:.2f}") -> str:
    return "" if value is None else fmt.format(value)


def _placement(run: Run | None, split: dict | None) -> list[str]:
    """The Placement section: the suggested target:drafter split of the newest run; one line on a CPU-only run."""
    if split is not None:
        return ["## Placement", "", f"Run {split['run_id']}: {split['sentence']}", ""]
    if run is not None and not gpu_roles(run.snapshot):
        return ["## Placement", "", "A target:drafter split is suggested for GPU runs only (the newest run used no GPU).", ""]
    return []


def render(runs: list[Run], records: list[dict], plots: dict[str, Path], out: Path, settings, skipped: list[dict],
           placement: dict | None = None) -> str:
    lines = ["# dflash throughput report", ""]
    if not records:
        lines += ["No runs in the history yet.", ""]
    else:
        latest = records[-1]
        lines += [f"**Latest run — {latest['verdict']}.** {latest['sentence']}", ""]
        base = f"pinned run `{settings.baseline_run}`" if settings.baseline_run else (
            f"the median Ktok/s of up to {settings.baseline_window} earlier runs of the same run name, hardware and "
            "placement that were identical to the previous one (a drop across a change is measured against the runs "
            "before it)")
        lines += [f"Baseline: {base}. A change below {settings.threshold:+.0%}, or below {settings.noise_sigmas:g}x the "
                  "run-to-run spread of identical runs when that is wider, is a regression.", ""]
        lines += ["## Runs", "",
                  "| run | date | Ktok/s | tau | MFU | status | baseline | vs baseline | verdict | what changed |",
                  "|---|---|---:|---:|---:|---|---|---:|---|---|"]
        for rec in reversed(records):
            if rec["baseline"]:
                vs, what = f"{rec['ratio']:.2f}x ({rec['change']:+.0%})", rec["what_changed"] or "nothing recorded"
                n = len(rec["baseline"].get("runs") or [])
                base_id = f"median of {n} up to {rec['baseline']['run_id']}" if n > 1 else rec["baseline"]["run_id"]
            else:
                vs, base_id = "", ""
                prev = rec.get("previous")
                what = f"vs previous {prev['run_id']}: {changed_text(prev['changed']) or 'nothing recorded'}" if prev else ""
            mfu = rec["mfu"]
            lines.append("| " + " | ".join(_cell(c) for c in (
                rec["run_id"], (rec["started_at"] or "")[:16].replace("T", " "), _num(rec["ktok_per_s"]),
                _num(rec["tau"]), "" if mfu is None else f"{mfu:.1%}", rec["status"], base_id, vs, rec["verdict"], what,
            )) + " |")
        lines.append("")
        lines += ["## Anomalies", ""]
        flagged = [r for r in reversed(records) if r["anomalies"]]
        if not flagged:
            lines.append("None: every run completed, no diverged replicas, no recompiles after warm-up, no eager "
                         "fallbacks, no memory imbalance, no idle GPU, no silent worker.")
        for rec in flagged:
            lines.append(f"- **{_cell(rec['run_id'])}**")
            lines += [f"  - {a['kind']}: {a['message']}" for a in rec["anomalies"]]
        lines.append("")
        lines += _placement(runs[-1] if runs else None, placement)
    if skipped:
        lines += ["## Skipped inputs", ""] + [f"- `{s['file']}`: {s['reason']}" for s in skipped] + [""]
    lines += ["## Plots", ""]
    for key, path in plots.items():
        rel = Path(path).relative_to(out) if Path(path).is_relative_to(out) else Path(path)
        lines += [f"### {PLOT_TITLES.get(key, key)}", "", f"![{PLOT_TITLES.get(key, key)}]({rel.as_posix()})", ""]
    lines += ["Data: `history/<run_id>.json` (one snapshot per run, the record) and `history.csv` (a flat view of them, "
              "rebuilt on every report), "
              "`regressions.json` (baselines, thresholds, ratios, attribution, anomalies).", ""]
    return "\n".join(lines)
