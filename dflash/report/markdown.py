"""report.md: first what a new user asks of the newest run (where its drafter is, how good it is, how long and how fast
it trained), then the latest verdicts (Ktok/s and tau) in one sentence, a table of runs, quality, the anomalies, the
plots (relative links)."""
from __future__ import annotations

from datetime import datetime
from pathlib import Path

from dflash.records.acceptance import ENGINES, WORDS, engines
from dflash.records.regressions import Placement, RunVerdict, Skipped
from dflash.config_model import ReportSection
from dflash.report.history import Run, evaluation, hardware_of, parse_time, proposal_text, tau_of, to_float
from dflash.report.placement import gpu_roles
from dflash.report.plots import read_metrics, tau_points, time_key
from dflash.report.regress import changed_text

PLOT_TITLES = {
    "ktok": "Ktok/s per run, with the baseline band and regressions",
    "tau": "tau per run (temperature 0), with the baseline band and quality regressions",
    "devices": "Peak memory and utilisation per device (latest run)",
    "time_split": "Time split per step (queue wait / target / drafter / optimizer)",
    "training": "Loss, per-position accuracy and tau against training GPU-seconds (latest run)",
}


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value, fmt="{:.2f}") -> str:
    return "" if value is None else fmt.format(value)


def _placement(run: Run | None, split: Placement | None) -> list[str]:
    """The Placement section: the suggested target:drafter split of the newest run; one line on a CPU-only run."""
    if split is not None:
        return ["## Placement", "", f"Run {split.run_id}: {split.sentence}", ""]
    if run is not None and run.snapshot and not gpu_roles(run.snapshot):     # (a restored run: no details to judge)
        return ["## Placement", "", "A target:drafter split is suggested for GPU runs only (the newest run used no GPU).", ""]
    return []


def duration(seconds: float) -> str:
    """72.1 s, 3 min 5 s, 2 h 4 min."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m < 60 else f"{m // 60} h {m % 60} min"


def _where(run: Run) -> str:
    """Where the run's drafter is: its run folder's `drafter/`, the export stage's folder, when this run's export is
    there."""
    if run.folder is None:
        return "its run folder is gone (the history keeps its figures only)"
    out = run.folder.drafter
    config = out / "config.json"
    if not config.is_file():
        return f"not exported yet: the export stage writes it to `{out}/`"
    finished = parse_time(run.snapshot.get("finished_at"))
    made = datetime.fromtimestamp(config.stat().st_mtime, tz=finished.tzinfo) if finished else None
    if made is not None and made < finished:
        return f"`{out}/` holds an export made before this run finished (an earlier run's): rerun the export stage"
    return (f"`{out}/`: config.json, model.safetensors and a model card (README.md), the folder the reference package, "
            f"SGLang and vLLM load (docs/serving.md)")


def _how_good(run: Run) -> str:
    """tau of the run's evaluation (acceptance.json), its measured speed-up over plain decoding and losslessness."""
    acc = run.snapshot.get("acceptance")
    a = evaluation(acc)
    if a is None:
        live = (run.snapshot.get("eval") or {}).get("tau")
        while_training = f" (tau {live:.3f} while training, at step {run.snapshot['eval'].get('step')})" \
            if to_float(live) is not None else ""
        return f"not evaluated yet: the evaluate stage writes its tau to acceptance.json{while_training}"
    tau, hot = tau_of(acc), proposal_text(acc)
    prompts, tokens = ("?" if n is None else n for n in (a.num_prompts, a.max_new_tokens))
    setting = f"{prompts} held-out prompts x {tokens} tokens"
    if tau is not None:   # README: with a large target on a GPU, verifying a block costs about one decoding step
        good = f"tau {tau:.3f} (tokens per target forward, greedy, {setting}): up to about {tau:.2f}x the speed of " \
               f"plain decoding where verifying a block costs one decoding step (a large target on a GPU)"
    else:
        good = f"tau {hot} ({setting})" if hot else "no tau in acceptance.json"
    speedup = to_float(a.speedup)
    where = ", ".join(v for v in (a.device, a.dtype) if v) or "this evaluation"
    if speedup is None:
        good += "; speed-up not measured"
    else:
        good += f"; measured {speedup:.2f}x plain decoding's tokens/s ({where}" + (
            "; slower: here a speculative step costs more than the plain steps it saves)" if speedup < 1 else ")")
    if a.lossless is True:
        return good + "; lossless: its output equals plain greedy decoding on every prompt"
    if a.lossless is False:
        return good + "; **not lossless**: its output differs from plain greedy decoding (acceptance.json `sets`)"
    return good + "; losslessness not checked"


def _how_long(run: Run) -> str:
    """Steps, training time (GPU-seconds on GPUs), the wall clock from the first step to the summary, Ktok/s."""
    s = run.snapshot
    steps, train_s = s.get("steps"), to_float(s.get("train_seconds"))
    text = f"{steps} steps" if steps is not None else "steps not recorded"
    if train_s is not None:
        gpus = len(gpu_roles(s))
        text += f" in {duration(train_s)} of training on " + (
            f"{gpus} GPU{'s' if gpus > 1 else ''}, {train_s * gpus / 3600:.2f} GPU-hours" if gpus else
            hardware_of(s))
    start, end = parse_time(s.get("started_at")), parse_time(s.get("finished_at"))
    if start and end:
        resumed = f", resumed at step {s['resumed_from_step']}" if s.get("resumed_from_step") else ""
        text += f" ({duration((end - start).total_seconds())} of wall clock from the first step to the summary, " \
                f"in-training evaluations included{resumed})"
    ktok = to_float((s.get("throughput") or {}).get("ktok_per_s"))
    return text + (f", {ktok:.2f} Ktok/s trained" if ktok is not None else ", Ktok/s not measured")


def answers(run: Run | None) -> list[str]:
    """The three questions a new user asks of the newest run, answered first."""
    if run is None:
        return []
    if not run.snapshot:   # restored from history.csv: its flat figures only
        tau, ktok = run.num("tau"), run.num("ktok_per_s")
        return [f"Newest run `{_cell(run.run_id)}` (restored from history.csv, its run folder and snapshot gone): "
                f"tau {_num(tau) or 'not measured'}, {_num(ktok) or 'not measured'} Ktok/s trained.", ""]
    status = run.snapshot.get("status")
    return [f"Newest run `{_cell(run.run_id)}`" + (f" (**{status}**: see Anomalies)" if status != "completed" else "")
            + ":", "",
            f"- **Where the drafter is:** {_where(run)}.",
            f"- **How good it is:** {_how_good(run)}.",
            f"- **How long and how fast it trained:** {_how_long(run)}.", ""]


def tau_while_training(run: Run | None) -> list[str]:
    """The latest run's in-training tau against the training time it took (metrics.jsonl; `plots.time_key`): one
    line, what more training would buy; [] without a run folder or any such row."""
    metrics = run.folder.metrics if run is not None and run.folder is not None else None
    rows = read_metrics(metrics) if metrics is not None and metrics.is_file() else []
    key = time_key(rows)
    pts = tau_points(rows, key) if key else []
    if not pts:
        return []
    unit = "GPU-s" if key == "gpu_s" else "s"
    return [f"tau while training, latest run `{_cell(run.run_id)}` (held-out prompts, temperature 0, replayed; "
            f"training {unit}, evaluations left out): " + ", ".join(f"{t:.2f} at {x:.0f} {unit}" for x, t in pts)
            + " (plot: training_latest.png).", ""]


def headline(rec: RunVerdict) -> str:
    """'regression', 'quality regression', 'throughput and quality regression', else the Ktok/s verdict."""
    kinds = rec.regressed
    if not kinds:
        return rec.verdict
    return "regression" if kinds == ["throughput"] else f"{' and '.join(kinds)} regression"


def _tau_cell(rec: RunVerdict, sampled: str = "") -> str:
    """The temperature-0 tau (earlier evaluations beside it), else that of temperature > 0 by draft policy."""
    q = rec.quality
    earlier = [f"{t:.3f}" for t in q.tau_earlier if q.tau is None or round(t, 3) != round(q.tau, 3)]
    if q.tau is None and sampled:
        return f"({sampled})"
    return _num(q.tau, "{:.3f}") + (f" (earlier {', '.join(earlier)})" if earlier else "")


def _quality_cell(rec: RunVerdict) -> str:
    q = rec.quality
    return q.verdict + (f" ({q.change:+.3f})" if q.change is not None else "")


def _quality(records: list[RunVerdict], settings: ReportSection, sampled: dict[str, str]) -> list[str]:
    """The Quality section: the rule, then each quality regression or improvement, then the re-evaluated runs, then
    the runs evaluated at temperature > 0 (`sampled`: run id -> their tau by draft policy), not judged."""
    lines = ["## Quality (tau)", "",
             f"tau is the acceptance length at temperature 0 (acceptance.json), the latest evaluation of each run. A tau "
             f"drop below {settings.tau_threshold:+.3f} vs the same baseline rule, or below {settings.noise_sigmas:g}x "
             f"the run-to-run spread of tau of identical runs when that is wider (never beyond "
             f"{settings.tau_threshold_cap:+.3f}), is a quality regression; the gate treats it like a throughput one.", ""]
    judged = [r for r in reversed(records) if r.quality.verdict in ("regression", "improvement")]
    lines += [f"- **{_cell(r.run_id)}** ({r.quality.verdict}): {r.quality.sentence}" for r in judged] or \
        ["No quality regression or improvement beyond the threshold."]
    again = [r for r in reversed(records) if r.quality.tau_earlier]
    if again:
        lines += ["", "Re-evaluated runs (the table shows the latest evaluation; the earlier ones stay in "
                  "`history/<run_id>.json` under `earlier_evaluations`):", ""]
        lines += [f"- **{_cell(r.run_id)}**: tau {_num(r.quality.tau, '{:.3f}')}, earlier "
                  f"{', '.join(f'{t:.3f}' for t in r.quality.tau_earlier)}" for r in again]
    hot = [r.run_id for r in reversed(records) if sampled.get(r.run_id)]
    if hot:
        lines += ["", "Evaluated at temperature > 0 (not judged: no temperature-0 tau), tau by draft policy: "
                  + " and ".join(f"{p} ({WORDS[p][1]}: {engines(p)})" for p in ENGINES) + ":", ""]
        lines += [f"- **{_cell(rid)}**: {sampled[rid]}" for rid in hot]
    return lines + [""]


def _runs_table(records: list[RunVerdict], sampled: dict[str, str]) -> list[str]:
    """The Runs section: one row per run, newest first, with its baseline, verdicts and what changed."""
    lines = ["## Runs", "",
             "| run | date | Ktok/s | tau | loss | MFU | status | baseline | vs baseline | verdict | quality | "
             "what changed |",
             "|---|---|---:|---:|---:|---:|---|---|---:|---|---|---|"]
    for rec in reversed(records):
        if rec.baseline:
            vs, what = f"{rec.ratio:.2f}x ({rec.change:+.0%})", rec.what_changed or "nothing recorded"
            n = len(rec.baseline.runs)
            base_id = f"median of {n} up to {rec.baseline.run_id}" if n > 1 else rec.baseline.run_id
        else:
            vs, base_id = "", ""
            prev = rec.previous
            what = (f"vs previous {prev.run_id}: {changed_text(prev.changed.model_dump()) or 'nothing recorded'}"
                    if prev else "")
        mfu = rec.mfu
        lines.append("| " + " | ".join(_cell(c) for c in (
            rec.run_id, (rec.started_at or "")[:16].replace("T", " "), _num(rec.ktok_per_s),
            _tau_cell(rec, sampled.get(rec.run_id, "")), _num(rec.loss, "{:.3f}"),
            "" if mfu is None else f"{mfu:.1%}", rec.status,
            base_id, vs, rec.verdict + (" (outlier)" if rec.outlier else ""), _quality_cell(rec), what,
        )) + " |")
    lines.append("")
    restored = [r for r in records if r.restored_from]
    if restored:
        lines += [f"Restored from `history.csv` (their snapshots were missing; flat figures only, attribution by "
                  f"hash): {', '.join(_cell(r.run_id) for r in restored)}.", ""]
    return lines


def _anomalies(records: list[RunVerdict]) -> list[str]:
    """The Anomalies section: what looks wrong in each run itself, newest first."""
    lines = ["## Anomalies", ""]
    flagged = [r for r in reversed(records) if r.anomalies]
    if not flagged:
        lines.append("None: every run completed, no diverged replicas, no recompiles after warm-up, no eager "
                     "fallbacks, no memory imbalance, no idle GPU, no silent worker.")
    for rec in flagged:
        lines.append(f"- **{_cell(rec.run_id)}**")
        lines += [f"  - {a.kind}: {a.message}" for a in rec.anomalies]
    lines.append("")
    return lines


def _by_policy(run: Run) -> str:
    """tau at temperature > 0 by draft policy, from the run's evaluation (its AcceptanceCore view); a run restored from
    history.csv has only its row's copy of that text."""
    return (proposal_text(run.snapshot.get("acceptance")) if run.snapshot else run.row.get("tau_by_proposal")) or ""


def render(runs: list[Run], records: list[RunVerdict], plots: dict[str, Path], out: Path, settings: ReportSection,
           skipped: list[Skipped], placement: Placement | None = None) -> str:
    lines = ["# dflash report: throughput and quality", ""] + answers(runs[-1] if runs else None)
    sampled = {r.run_id: _by_policy(r) for r in runs}
    if not records:
        lines += ["No runs in the history yet.", ""]
    else:
        latest = records[-1]
        lines += [f"**Latest run — {headline(latest)}.** {latest.sentence}", ""]
        base = f"pinned run `{settings.baseline_run}`" if settings.baseline_run else (
            f"the median of up to {settings.baseline_window} earlier runs of the same run name, hardware and "
            "placement that were identical to the previous one (a drop across a change is measured against the runs "
            "before it), leaving out outliers (runs that regressed with nothing changed)")
        lines += [f"Baseline: {base}. A Ktok/s change below {settings.threshold:+.0%}, or below "
                  f"{settings.noise_sigmas:g}x the run-to-run spread of identical runs when that is wider (never beyond "
                  f"{settings.threshold_cap:+.0%}), is a regression; a drop of 50% or more always is.", ""]
        lines += _runs_table(records, sampled)
        lines += _quality(records, settings, sampled)
        lines += tau_while_training(runs[-1] if runs else None)
        lines += _anomalies(records)
        lines += _placement(runs[-1] if runs else None, placement)
    if skipped:
        lines += ["## Skipped inputs", ""] + [f"- `{s.file}`: {s.reason}" for s in skipped] + [""]
    lines += ["## Plots", ""]
    for key, path in plots.items():
        rel = Path(path).relative_to(out) if Path(path).is_relative_to(out) else Path(path)
        lines += [f"### {PLOT_TITLES.get(key, key)}", "", f"![{PLOT_TITLES.get(key, key)}]({rel.as_posix()})", ""]
    lines += ["Data: `history/<run_id>.json` (one snapshot per run, the record: its summary and its evaluations) and "
              "`history.csv` (a flat view of them, rebuilt on every report), "
              "`regressions.json` (baselines, thresholds, ratios, attribution, anomalies, for Ktok/s and tau).", ""]
    return "\n".join(lines)
