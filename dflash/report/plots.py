"""PNG plots of the history and the latest run (matplotlib, Agg backend; every axis labelled with its unit)."""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dflash.records.acceptance import ENGINES, WORDS, engines  # noqa: E402
from dflash.records.regressions import RunVerdict  # noqa: E402
from dflash.config_model import ReportSection  # noqa: E402
from dflash.report.history import TIME_KEYS, Run, proposal_taus, to_float  # noqa: E402

log = logging.getLogger("dflash.report")

PLOTS = {
    "ktok": "ktok_history.png",
    "tau": "tau_history.png",
    "devices": "devices_latest.png",
    "time_split": "time_split.png",
    "training": "training_latest.png",
}
DPI = 80


def _save(fig, path: Path) -> Path:
    """Atomic like every output: render to a temporary sibling, then rename (modes as the umask gives)."""
    from dflash.atomic import follow_umask, sweep, temp_prefix
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep(path)
    fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=DPI, metadata={"Software": None})
        follow_umask(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _placeholder(path: Path, title: str, message: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 2.5), layout="constrained")
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True)
    return _save(fig, path)


def _labels(runs: list[Run]) -> list[str]:
    return [f"{r.run_id}\n{(r.row.get('started_at') or '')[:10]}" for r in runs]


def ktok_history(runs: list[Run], records: list[RunVerdict], path: Path) -> Path:
    """Ktok/s per run, the baseline (median) and its band (baseline x (1 +- threshold)), regressions crossed."""
    base = [rec.baseline.ktok_per_s if rec.baseline else float("nan") for rec in records]
    return _history(runs, [r.num("ktok_per_s") for r in runs], base,
                    [b * (1 + rec.threshold) for b, rec in zip(base, records)],
                    [b * (1 - rec.threshold) for b, rec in zip(base, records)],
                    [(i, f"{rec.ratio:.2f}x") for i, rec in enumerate(records) if rec.verdict == "regression"],
                    "Ktok/s per run", "trained throughput (Ktok/s)", "trained Ktok/s", path)


SAMPLED = {policy: (marker, color, f"{WORDS[policy][0]} ({engines(policy)})")     # marker, color, draft policy
           for policy, marker, color in zip(ENGINES, "^v", ("tab:purple", "tab:orange"))}


def tau_history(runs: list[Run], records: list[RunVerdict], path: Path) -> Path:
    """tau per run (temperature 0), the baseline and its band (baseline +- the tau threshold), quality regressions
    crossed; an earlier evaluation of a re-evaluated run as a hollow marker; a run evaluated at temperature > 0 (not
    judged) as one triangle per draft policy, labelled with the policy and the temperature."""
    hot = [(i, *pt) for i, pt in enumerate(proposal_taus(r.snapshot.get("acceptance")) for r in runs) if pt]
    if runs and all(r.num("tau") is None for r in runs) and not hot:
        return _placeholder(path, "tau per run", "no run in the history has a tau (acceptance.json) yet")
    extra = []
    for k in dict.fromkeys(k for _, _, taus in hot for k in taus):
        marker, color, policy = SAMPLED.get(k, ("s", "tab:gray", f"{k} drafts"))
        temps = ", ".join(dict.fromkeys(f"{t:g}" for _, t, taus in hot if k in taus))
        extra.append(([(i, taus[k]) for i, _, taus in hot if k in taus], marker, color, f"tau at T={temps}, {policy}"))
    q = [rec.quality for rec in records]
    base = [x.baseline.tau if x.baseline else float("nan") for x in q]
    earlier = [(i, t) for i, x in enumerate(q) for t in x.tau_earlier]
    return _history(runs, [r.num("tau") for r in runs], base,
                    [b + x.threshold for b, x in zip(base, q)], [b - x.threshold for b, x in zip(base, q)],
                    [(i, f"{x.change:+.2f}") for i, x in enumerate(q) if x.verdict == "regression"],
                    "tau per run (acceptance length, temperature 0)", "tau (tokens per verification step)",
                    "tau (latest evaluation)", path, earlier=earlier, bottom=1.0, extra=extra)


def _history(runs, values, base, lo, hi, bad, title, ylabel, label, path, earlier=(), bottom=0.0, extra=()) -> Path:
    """One figure per run in start order: the values, the baseline step line, the band, the regressions; `extra`:
    further points ([(run index, value)], marker, color, label)."""
    if not runs:
        return _placeholder(path, title, "no runs in the history yet")
    x = list(range(len(runs)))
    values = [float("nan") if v is None else v for v in values]
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(runs) + 2), 4), layout="constrained")
    ax.fill_between(x, lo, hi, step="mid", alpha=0.2, color="tab:green", label="baseline ± threshold")
    ax.step(x, base, where="mid", color="tab:green", linestyle="--", linewidth=1, label="baseline (median)")
    ax.plot(x, values, marker="o", color="tab:blue", label=label)
    if earlier:
        ax.scatter([i for i, _ in earlier], [t for _, t in earlier], marker="o", facecolors="none",
                   edgecolors="tab:gray", label="earlier evaluation")
    for pts, marker, color, text in extra:
        ax.scatter([i for i, _ in pts], [v for _, v in pts], marker=marker, color=color, label=text)
    if bad:
        ax.scatter([x[i] for i, _ in bad], [values[i] for i, _ in bad], s=140, marker="x", color="tab:red", zorder=5,
                   label="regression")
        for i, text in bad:
            ax.annotate(text, (x[i], values[i]), textcoords="offset points", xytext=(6, -12), color="tab:red",
                        fontsize=8)
    ax.set_xticks(x, _labels(runs), rotation=30, ha="right", fontsize=7)
    ax.set_xlabel("run (in start order)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=bottom)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def devices_latest(run: Run | None, min_util: float, path: Path) -> Path:
    devices = [d for d in (run.snapshot.get("devices") or [] if run else []) if isinstance(d, dict)]
    if not devices:
        return _placeholder(path, "Devices of the latest run", "no per-device figures recorded")
    if all(to_float(d.get("peak_memory_gb")) is None and to_float(d.get("util_mean")) is None for d in devices):
        return _no_telemetry(run, devices, path)
    names = [f"{d.get('device')}\n{'/'.join(d.get('roles') or [])}" for d in devices]
    mem = [to_float(d.get("peak_memory_gb")) or 0.0 for d in devices]
    util = [to_float(d.get("util_mean")) for d in devices]
    colors = ["tab:orange" if "drafter" in (d.get("roles") or []) else "tab:blue" for d in devices]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(max(7, 1.2 * len(devices) + 3), 3.5), layout="constrained")
    a1.bar(names, mem, color=colors)
    a1.set_ylabel("peak memory (GB)")
    a1.set_xlabel("device (roles)")
    a1.set_title("Peak memory per device")
    a2.bar(names, [u if u is not None else 0.0 for u in util], color=colors)
    for i, u in enumerate(util):
        if u is None:
            a2.text(i, 1, "n/a", ha="center", fontsize=7)
    a2.axhline(min_util, color="tab:red", linestyle="--", linewidth=1, label=f"min utilisation {min_util:.0f}%")
    a2.set_ylim(0, 100)
    a2.set_ylabel("mean utilisation (%)")
    a2.set_xlabel("device (roles)")
    a2.set_title("GPU utilisation per device")
    a2.legend(fontsize=7)
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"run {run.run_id} (orange: drafter)", fontsize=9)
    return _save(fig, path)


def _no_telemetry(run: Run, devices: list[dict], path: Path) -> Path:
    """No GPU in the run (CPU): say so, and show what each worker did instead of empty memory bars."""
    workers = [w for w in run.snapshot.get("workers") or [] if isinstance(w, dict) and to_float(w.get("steps")) is not None]
    where = ", ".join(f"{d.get('device')} ({'/'.join(d.get('roles') or [])})" for d in devices)
    note = f"No GPU telemetry: peak memory and utilisation are measured on CUDA devices; this run used {where}."
    if not workers:
        return _placeholder(path, f"Devices of run {run.run_id}", note)
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(workers) + 3), 3.8), layout="constrained")
    names = [f"{w.get('name')}\n{w.get('device')}" for w in workers]
    ax.bar(names, [float(w["steps"]) for w in workers],
           color=["tab:orange" if w.get("role") == "drafter" else "tab:blue" for w in workers])
    ax.set_ylabel("steps done (count)")
    ax.set_xlabel("worker (device)")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"run {run.run_id}: steps per worker (orange: drafter)", fontsize=9)
    fig.text(0.5, 0.01, note, ha="center", va="bottom", fontsize=7, wrap=True)
    fig.get_layout_engine().set(rect=(0, 0.08, 1, 0.92))
    return _save(fig, path)


def time_split(runs: list[Run], path: Path) -> Path:
    if not runs:
        return _placeholder(path, "Time split per step", "no runs in the history yet")
    x = list(range(len(runs)))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(runs) + 2), 4), layout="constrained")
    bottom = [0.0] * len(runs)
    for key in TIME_KEYS:
        vals = [1000.0 * (r.num(f"step_{key}_s") or 0.0) for r in runs]   # summary time_split_s is per step
        ax.bar(x, vals, bottom=bottom, label=key.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x, _labels(runs), rotation=30, ha="right", fontsize=7)
    ax.set_xlabel("run (in start order)")
    ax.set_ylabel("time per optimizer step (ms)")
    ax.set_title("Time split per step: queue wait / target / drafter / optimizer")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def read_metrics(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s:%d: not valid JSON; line skipped", path, n)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def training_latest(run: Run | None, path: Path) -> Path:
    metrics = run.folder.metrics if run is not None and run.folder is not None else None
    if metrics is None or not metrics.is_file():
        why = "its run folder is gone" if run is not None and run.folder is None else "no metrics.jsonl"
        return _placeholder(path, "Training curves of the latest run",
                            f"run {run.run_id if run else '-'}: {why}; curves skipped")
    rows = read_metrics(metrics)
    steps = [r.get("step") for r in rows if to_float(r.get("loss")) is not None]
    losses = [float(r["loss"]) for r in rows if to_float(r.get("loss")) is not None]
    accs = [(r.get("step"), r["acc_per_position"]) for r in rows if isinstance(r.get("acc_per_position"), list)
            and r["acc_per_position"]]
    if not steps and not accs:
        return _placeholder(path, "Training curves of the latest run", f"{metrics}: no loss or accuracy rows")
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 3.5), layout="constrained")
    a1.plot(steps, losses, color="tab:blue")
    a1.set_xlabel("optimizer step")
    a1.set_ylabel("loss (weighted CE, nats)")
    a1.set_title("Loss")
    a1.grid(alpha=0.3)
    if accs:
        picks = sorted({0, len(accs) // 2, len(accs) - 1})
        cmap = plt.get_cmap("viridis")
        for j, i in enumerate(picks):
            step, acc = accs[i]
            a2.plot(range(1, len(acc) + 1), [100.0 * (to_float(a) or 0.0) for a in acc], marker=".",
                    color=cmap(j / max(1, len(picks) - 1)), label=f"step {step}")
        a2.legend(fontsize=7)
    a2.set_xlabel("block position k")
    a2.set_ylabel("accuracy (%)")
    a2.set_title("Per-position accuracy")
    a2.grid(alpha=0.3)
    _acceptance(a3, rows)
    fig.suptitle(f"run {run.run_id}", fontsize=9)
    return _save(fig, path)


def time_key(rows: list[dict]) -> str | None:
    """The training-time measure of metrics.jsonl rows: `gpu_s` (training seconds x the run's GPUs, evaluations left
    out, over resumes) where they have it, `train_s` on the CPU, None for rows from before either (then: steps)."""
    for key in ("gpu_s", "train_s"):
        if any(to_float(r.get(key)) is not None for r in rows):
            return key
    return None


def tau_points(rows: list[dict], key: str | None) -> list[tuple[float, float]]:
    """(training time by `key`, tau) of each in-training evaluation in metrics.jsonl rows (its own `tau_<key>`; its
    `tau_step` when key is None)."""
    def x(r):
        return (r.get("tau_step") or r["step"]) if key is None else to_float(r.get(f"tau_{key}"))
    return [(x(r), float(r["tau"])) for r in rows if to_float(r.get("tau")) is not None and x(r) is not None]


def _acceptance(ax, rows: list[dict]) -> None:
    """tau of held-out prompts measured while training (train.eval_every; metrics.jsonl `tau`) next to the estimate
    from training accuracy (1 + `acceptance_estimate`, the expected accepted prefix plus the bonus token: the same
    unit, tokens per verification step), against the training time they took (`time_key`): GPU-seconds, CPU seconds
    on the CPU, optimizer steps for rows from before metrics.jsonl had `train_s`. What more training would buy is read
    off its slope."""
    key = time_key(rows)

    def at(r):   # the row's training time (its step for old rows)
        return r["step"] if key is None else to_float(r.get(key))
    est = [(at(r), 1.0 + float(r["acceptance_estimate"])) for r in rows
           if to_float(r.get("acceptance_estimate")) is not None and at(r) is not None]
    tau = tau_points(rows, key)
    if est:
        ax.plot(*zip(*est), color="tab:gray", label="estimate from training accuracy")
    if tau:
        ax.plot(*zip(*tau), marker="o", color="tab:red", label="tau, held-out prompts (greedy)")
        ax.annotate(f"{tau[-1][1]:.2f}", tau[-1], textcoords="offset points", xytext=(4, 4), fontsize=8)
    else:
        ax.text(0.5, 0.5, "no tau measured while training\n(train.eval_every: 0)", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)
    ax.set_xlabel({"gpu_s": "training GPU-seconds (evaluations left out)", "train_s": "training seconds (CPU)",
                   None: "optimizer step"}[key])
    ax.set_ylabel("tokens per verification step")
    ax.set_ylim(bottom=1.0)
    ax.set_title("Acceptance length against training time")
    ax.grid(alpha=0.3)
    if est or tau:
        ax.legend(fontsize=7)


def make_all(runs: list[Run], records: list[RunVerdict], settings: ReportSection, out: Path) -> dict[str, Path]:
    latest = runs[-1] if runs else None
    return {
        "ktok": ktok_history(runs, records, out / PLOTS["ktok"]),
        "tau": tau_history(runs, records, out / PLOTS["tau"]),
        "devices": devices_latest(latest, settings.min_utilisation, out / PLOTS["devices"]),
        "time_split": time_split(runs, out / PLOTS["time_split"]),
        "training": training_latest(latest, out / PLOTS["training"]),
    }
