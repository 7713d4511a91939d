"""The sweep table (`python -m dflash report --sweep`): every run of a config's sweep (dflash/sweep.py) read from its
run folder, its seed group's mean and spread, which groups beat the baseline's spread, and tau against training time:
sweep.json (the record, records/sweep.py), sweep.md and sweep_tau_gpu_seconds.png, each written atomically.

A run's tau at temperature 0 is its acceptance.json's when the evaluate stage decoded it there, else its last
in-training evaluation when that is the stage's measure (made at the last step of a finished run, on
evaluate.num_prompts prompts x evaluate.max_new_tokens tokens, no extra prompt sets: the replay equals greedy
speculative decoding step for step). Runs that differ only in `seed` (and keys that cannot change the drafter, such as
train.eval_every) are one group; a group beats the baseline's when
|its mean - the baseline's mean| exceeds the larger of the two spreads (max - min), judged only with 2 seeds or more
on each side.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from dflash import paths
from dflash.config import roles
from dflash.records.acceptance import AcceptanceCore
from dflash.records.sweep import Group, Point, SweepRecord, SweepRun
from dflash.sweep import Run, Sweep

log = logging.getLogger("dflash.report")

OUTPUTS = ("sweep.json", "sweep.md", "sweep_tau_gpu_seconds.png")


def recipe(overrides: dict) -> dict:
    """What makes a run's group: its keys that change the trained drafter (role hashed "result"), but its seed."""
    return {k: v for k, v in overrides.items() if k != "seed" and roles()[k].hashed == "result"}


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _replayed(run: Run, summary: dict) -> float | None:
    """The run's last in-training tau when it is the evaluate stage's measure at temperature 0, else None."""
    ev, e = summary.get("eval") or {}, run.loaded.cfg.evaluate
    same = (ev.get("tau") is not None and ev.get("step") == summary.get("steps") and summary.get("finished") is True
            and ev.get("prompts") == e.num_prompts and ev.get("max_new_tokens") == e.max_new_tokens
            and not e.prompt_files)
    return ev["tau"] if same else None


def _row(run: Run, runs_dir: Path, results: str, group: str) -> tuple[SweepRun, str | None, dict]:
    """The run's row, the time key of its metrics and its summary ({} when it has none)."""
    from dflash.report.plots import read_metrics, tau_points, time_key
    folder = paths.RunFolder(runs_dir / run.name)
    s = _json(folder.summary) or {}
    manifest = _json(paths.dataset(results, run.dataset) / "manifest.json") or {}
    tau = by = lossless = None
    hot: dict[str, dict[str, float | None]] = {}
    for f in folder.evaluations():
        if (a := _json(f)) is None:
            continue
        a = AcceptanceCore.model_validate(a)
        if a.temperature == 0:
            tau, by, lossless = a.tau, "evaluate", a.lossless
        elif a.temperature is not None:
            hot[f"{a.temperature:g}"] = a.policy_taus()
    if tau is None and s and (replay := _replayed(run, s)) is not None:
        tau, by = replay, "in-training replay"
    rows = read_metrics(folder.metrics) if folder.metrics.is_file() else []
    key = time_key(rows)
    return SweepRun(run=run.name, own=run.own, overrides=run.overrides, group=group, seed=run.loaded.cfg.seed,
                    dataset=run.dataset, samples=manifest.get("num_samples"), status=s.get("status"),
                    steps=s.get("steps"), train_seconds=s.get("train_seconds"),
                    ktok_per_s=(s.get("throughput") or {}).get("ktok_per_s"), tau=tau, tau_by=by, lossless=lossless,
                    hot=hot, curve=[Point(x=x, tau=t) for x, t in sorted(tau_points(rows, key))]), key, s


def table(sweep: Sweep, runs_dir, config: str) -> SweepRecord:
    """The sweep's record from its run folders under `runs_dir`."""
    runs_dir = Path(runs_dir)
    groups: dict[str, str] = {}          # {keys but seed: group name}
    rows, keys, devices = [], set(), []
    for run in sweep.runs.values():
        seedless = json.dumps(recipe(run.overrides), sort_keys=True)
        row, key, summary = _row(run, runs_dir, run.loaded.cfg.results_dir, groups.setdefault(seedless, run.name))
        rows.append(row)
        keys.add(key)
        devices += [d for d in ((summary.get("env") or {}).get("gpu") or {}).get("models") or [] if d not in devices]
    base = next(r.group for r in rows if r.run == sweep.baseline)
    stats = {}
    for name in dict.fromkeys(r.group for r in rows):
        members = [r for r in rows if r.group == name]
        taus = [r.tau for r in members if r.tau is not None and r.status in ("completed", None)]
        stats[name] = (members, taus, sum(taus) / len(taus) if taus else None,
                       max(taus) - min(taus) if len(taus) >= 2 else None)
    _, _, base_mean, base_spread = stats[base]
    out = []
    for name in [base, *[g for g in stats if g != base]]:
        members, taus, mean, spread = stats[name]
        vs = mean - base_mean if mean is not None and base_mean is not None and name != base else None
        beats = (abs(vs) > max(spread, base_spread) if vs is not None and spread is not None
                 and base_spread is not None else None)
        out.append(Group(group=name, overrides=recipe(members[0].overrides),
                         runs=[r.run for r in members], n=len(taus), mean=mean, spread=spread, vs_baseline=vs,
                         beats_spread=beats))
    temps = sorted({t for r in rows for t in r.hot}, key=float)
    x_unit = next((k for k in ("gpu_s", "train_s") if k in keys), "step")
    return SweepRecord(config=config, source=sweep.source, baseline=base, temperatures=temps, x_unit=x_unit,
                       devices=devices, runs=rows, groups=out)


def _f(x, nd=3) -> str:
    return "" if x is None else f"{x:.{nd}f}"


def _by(r: SweepRun) -> str:
    return r.tau_by or ("not trained" if r.status is None else f"{r.status}, no tau measure")


def _keys(overrides: dict) -> str:
    return ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in overrides.items()) or "(the config's)"


def markdown(rec: SweepRecord) -> str:
    policies = sorted({p for r in rec.runs for h in r.hot.values() for p in h})
    hot = [(t, p) for t in rec.temperatures for p in policies]
    head = ("| run | keys (beside the config's) | seed | data (samples) | steps | train s | Ktok/s | tau T=0 | by | "
            + "".join(f"T={t} {p} | " for t, p in hot) + "lossless |\n|" + "---|" * 2 + "---:|---|" + "---:|" * 4
            + "---|" + "---:|" * len(hot) + "---|\n")
    lines = [f"| {r.run}{' (own)' if r.own else ''} | {_keys(r.overrides)} | {r.seed} | {r.dataset} "
             f"({r.samples if r.samples is not None else '-'}) | {r.steps if r.steps is not None else ''} | "
             f"{_f(r.train_seconds, 1)} | {_f(r.ktok_per_s, 2)} | {_f(r.tau)} | {_by(r)} | "
             + "".join(f"{_f(r.hot.get(t, {}).get(p))} | " for t, p in hot)
             + f"{'' if r.lossless is None else r.lossless} |" for r in rec.runs]
    groups = ["| group | keys (beside the config's, but seed) | runs | n | mean tau T=0 | spread | vs baseline | "
              "beats the spread |", "|---|---|---|---:|---:|---:|---:|---|"]
    groups += [f"| {g.group}{' (baseline)' if g.group == rec.baseline else ''} | {_keys(g.overrides)} | "
               f"{', '.join(g.runs)} | {g.n} | {_f(g.mean)} | {_f(g.spread)} | {_f(g.vs_baseline)} | "
               f"{'' if g.beats_spread is None else 'yes' if g.beats_spread else 'no'} |" for g in rec.groups]
    beat = [g.group for g in rec.groups if g.beats_spread]
    verdict = (f"Groups that beat the spread: {', '.join(beat)}." if beat else
               "No group beats the spread" + (" (a group needs 2 seeds or more to be judged)."
                                               if any(g.beats_spread is None and g.group != rec.baseline
                                                      for g in rec.groups) else "."))
    return (f"# Sweep of `{rec.config}`\n\n{len(rec.runs)} runs (rows: `{rec.source}`) on "
            f"{', '.join(rec.devices) or 'the CPU'}. tau on the held-out prompts at temperature 0: the evaluate "
            f"stage's, or the run's last in-training evaluation where it is the same measure (column `by`); at other "
            f"temperatures per draft policy (argmax: vLLM's default, SGLang, TensorRT-LLM; sample: the reference "
            f"package, DeepSpec, vLLM's probabilistic drafts). Runs differing only in `seed` (or in keys that cannot "
            f"change the drafter) are one group; a group "
            f"beats the baseline group (`{rec.baseline}`) when |its mean - the baseline's| exceeds the larger of the "
            f"two spreads (max - min). Curves: `sweep_tau_gpu_seconds.png`; every figure: `sweep.json`.\n\n"
            + head + "\n".join(lines) + "\n\n## Seed groups\n\n" + "\n".join(groups) + f"\n\n{verdict}\n")


def plot(rec: SweepRecord, path: Path) -> Path:
    """Each run's in-training tau against its training time, one colour per seed group."""
    from dflash.report.plots import _placeholder, _save, plt
    if not any(r.curve for r in rec.runs):
        return _placeholder(path, "tau against training time", "no in-training tau (train.eval_every: 0)")
    fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
    colours = {g.group: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(rec.groups)}
    for r in rec.runs:
        if r.curve:
            ax.plot([p.x for p in r.curve], [p.tau for p in r.curve], marker="o", markersize=3, color=colours[r.group],
                    label=f"{r.run} ({r.curve[-1].tau:.2f})")
    ax.set_xlabel({"gpu_s": "training GPU-seconds (evaluations left out)", "train_s": "training seconds (CPU)",
                   "step": "optimizer step"}[rec.x_unit])
    ax.set_ylabel("tau, held-out prompts (T=0)")
    ax.set_title(f"Sweep of {rec.config}: tau against training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def build(sweep: Sweep, runs_dir, out, config: str) -> SweepRecord:
    """sweep.json, sweep.md and the plot into `out`."""
    from dflash.atomic import atomic_write_text
    from dflash.records import write
    rec = table(sweep, runs_dir, config)
    out = Path(out)
    write(out / "sweep.json", rec)
    atomic_write_text(out / "sweep.md", markdown(rec))
    plot(rec, out / "sweep_tau_gpu_seconds.png")
    judged = [f"{g.group} {g.vs_baseline:+.3f} ({'beats' if g.beats_spread else 'within'} the spread)"
              for g in rec.groups if g.beats_spread is not None]
    log.info("sweep: %d run(s), %d group(s)%s -> %s", len(rec.runs), len(rec.groups),
             f"; against {rec.baseline}: {', '.join(judged)}" if judged else "", out)
    return rec
