"""Each run against its baseline, for throughput (Ktok/s) and quality (tau): a verdict, what changed (attribution)
and anomalies.

Attribution compares the run's snapshot with its baseline's, in four categories:
  environment  packages (name old -> new), python, CUDA, cuDNN, GPU models/count/driver, CPU, lock file
  data         sample count, token totals, mean length, length-histogram quantiles, bucket counts, other manifest keys
  config       every differing key, dotted (train.batch_size 8 -> 16); keys that do not change what a run computes
               (run_name, results_dir, report, evaluate, strict_env) are left out; for tau, the evaluation's own
               settings too (evaluate.num_prompts 16 -> 32), read from each run's acceptance.json
  code         git commit old -> new, and a dirty working tree
A category whose hash differs but whose fields show no difference (a snapshot is missing) is still named, by hash.

The baseline of a run is the median of the recent comparable runs (same run name, hardware and placement) that were in
the state of the previous comparable run (same config, data, environment and code; for tau also the same evaluation
settings), so a drop across a change is measured against the runs before the change. Runs that are themselves
outliers (a regression with nothing changed: a loaded machine) are left out of later baselines and spreads. The
threshold widens from its floor (report.threshold, report.tau_threshold) to `noise_sigmas` times the run-to-run spread
of identical runs, never beyond its cap (report.threshold_cap, report.tau_threshold_cap), so noise on a loaded machine
is not a regression and cannot switch the gate off; a Ktok/s drop of 50% or more is always a regression. Ktok/s is
compared as a ratio; tau (>= 1, deterministic on the CPU) as a difference in tokens per verification step.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from dflash.config import pick
from dflash.config_model import ReportSection
from dflash.errors import UserError
from dflash.report.history import Run, evaluation_settings, to_float

CATEGORIES = ("environment", "data", "config", "code")
ENV_KEYS = ("python", "cuda", "cudnn", "cpu", "lock_hash")
DATA_SKIP = ("created_at", "content_hash", "length_histogram", "buckets", "regeneration")
ALWAYS_REGRESSION = -0.5        # a Ktok/s change at or below this is a regression whatever the threshold


# ---- diffs -------------------------------------------------------------------------------------------------
def _change(key, old, new) -> dict:
    return {"key": key, "old": old, "new": new}


def change_text(c: dict) -> str:
    def show(v):
        if v is None:
            return "none"
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (list, dict)):
            import json
            return json.dumps(v, sort_keys=True)
        return str(v)
    return f"{c['key']} {show(c['old'])} -> {show(c['new'])}"


def flat_diff(old, new, prefix="") -> list[dict]:
    """Dotted keys whose values differ between two nested mappings (lists compared whole)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old and not isinstance(new[k], dict):
                out.append(_change(key, None, new[k]))
            elif k not in new and not isinstance(old[k], dict):
                out.append(_change(key, old[k], None))
            else:                                           # a section on one side only: its keys, one by one
                out += flat_diff(old.get(k, {}), new.get(k, {}), key)
        return out
    return [] if old == new else [_change(prefix or "<value>", old, new)]


def env_changes(old: dict, new: dict) -> list[dict]:
    out = []
    po, pn = old.get("packages") or {}, new.get("packages") or {}
    for name in sorted(set(po) | set(pn)):
        if po.get(name) != pn.get(name):
            out.append(_change(name, po.get(name), pn.get(name)))
    for key in ENV_KEYS:
        if old.get(key) != new.get(key) and (key in old or key in new):
            out.append(_change({"lock_hash": "lock file"}.get(key, key), old.get(key), new.get(key)))
    go, gn = old.get("gpu") or {}, new.get("gpu") or {}
    for key in sorted(set(go) | set(gn)):
        if go.get(key) != gn.get(key):
            vo, vn = go.get(key), gn.get(key)
            if key == "models":
                vo, vn = "/".join(vo or []) or None, "/".join(vn or []) or None
            out.append(_change(f"GPU {key}", vo, vn))
    return out


def _quantiles(hist) -> dict | None:
    """p50/p90 from a {bin-edge: count} histogram (or [[edge, count], ...]); None if it is not one."""
    try:
        items = hist.items() if isinstance(hist, dict) else hist
        pairs = sorted((float(e), float(c)) for e, c in items)
    except (TypeError, ValueError, AttributeError):
        return None
    total = sum(c for _, c in pairs)
    if not pairs or total <= 0:
        return None
    out, acc = {}, 0.0
    want = [("length p50", 0.5), ("length p90", 0.9)]
    for edge, count in pairs:
        acc += count
        while want and acc >= want[0][1] * total:
            out[want.pop(0)[0]] = edge
    return out


def data_changes(old: dict, new: dict) -> list[dict]:
    out = []
    for key in ("num_samples", "total_tokens", "supervised_tokens"):
        if old.get(key) != new.get(key) and (key in old or key in new):
            out.append(_change(key, old.get(key), new.get(key)))
    mo, mn = _mean_len(old), _mean_len(new)
    if mo is not None and mn is not None and round(mo, 1) != round(mn, 1):
        out.append(_change("mean length", round(mo, 1), round(mn, 1)))
    ho, hn = old.get("length_histogram"), new.get("length_histogram")
    if ho != hn:
        qo, qn = _quantiles(ho or {}), _quantiles(hn or {})
        moved = [k for k in sorted(set(qo or {}) | set(qn or {})) if (qo or {}).get(k) != (qn or {}).get(k)]
        if qo is not None and qn is not None and moved:
            out += [_change(k, qo.get(k), qn.get(k)) for k in moved]
        elif not any(c["key"] == "mean length" for c in out):
            out.append(_change("length histogram", "(before)", "(changed)"))
    bo, bn = old.get("buckets") or {}, new.get("buckets") or {}
    for edge in sorted(set(bo) | set(bn), key=_edge_key):
        if bo.get(edge) != bn.get(edge):
            out.append(_change(f"bucket {edge}", bo.get(edge), bn.get(edge)))
    skip = {"num_samples", "total_tokens", "supervised_tokens", *DATA_SKIP}
    out += flat_diff({k: v for k, v in old.items() if k not in skip}, {k: v for k, v in new.items() if k not in skip})
    if not out and old.get("content_hash") != new.get("content_hash"):
        out.append(_change("content_hash", old.get("content_hash"), new.get("content_hash")))
    return out


def _edge_key(edge):
    try:
        return (0, float(edge), "")
    except (TypeError, ValueError):
        return (1, 0.0, str(edge))


def _mean_len(d: dict) -> float | None:
    n, t = to_float(d.get("num_samples")), to_float(d.get("total_tokens"))
    return t / n if n and t is not None else None


def target_changes(old: dict | None, new: dict | None) -> list[dict]:
    """The target's files that differ between two runs' records (summary.json `target_files`: size, and sha256 where
    recorded, else mtime), as `target <file>` changes: a target swapped under the same path is named, not guessed.
    Nothing when either run recorded none (older runs). build.json (older runs recorded it) is the build's log, not the
    target: a rebuild of the same weights changes nothing."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return []
    old, new = ({k: v for k, v in rec.items() if k != "build.json"} for rec in (old, new))
    def key(rec):
        rec = rec if isinstance(rec, dict) else {}
        return (rec.get("size"), rec.get("sha256") or rec.get("mtime_ns"))
    return [_change(f"target {name}", "absent" if name not in old else key(old[name])[0],
                    "absent" if name not in new else key(new[name])[0])
            for name in sorted(set(old) | set(new)) if key(old.get(name)) != key(new.get(name))]


def config_changes(old: dict, new: dict) -> list[dict]:
    """The hashed keys that differ (a key in neither hash, e.g. data.num_proc, changes nothing a run measures)."""
    strip = lambda c: pick(c or {}, lambda role: role.hashed is not None)  # noqa: E731
    return flat_diff(strip(old), strip(new))


def code_changes(old: dict, new: dict) -> list[dict]:
    out = []
    co, cn = old.get("commit"), new.get("commit")
    if co != cn:
        out.append(_change("commit", (co or "")[:12] or None, (cn or "")[:12] or None))
    if old.get("dirty") or new.get("dirty"):
        out.append(_change("dirty", bool(old.get("dirty")), bool(new.get("dirty"))))
    return out


def eval_changes(old: dict | None, new: dict | None) -> list[dict]:
    """The evaluation settings that differ between two acceptance.json files, as `evaluate.<key>` config changes."""
    so, sn = evaluation_settings(old) or {}, evaluation_settings(new) or {}
    return [_change(f"evaluate.{c['key']}", c["old"], c["new"]) for c in flat_diff(so, sn)]


def attribute(run: Run, base: Run, evaluation: bool = False) -> dict[str, list[dict]]:
    """What differs between a run and its baseline, per category (empty lists for categories that match); with
    `evaluation`, the settings its tau was measured with too (under config)."""
    s, b = run.snapshot, base.snapshot
    both = bool(s) and bool(b)
    out = {
        "environment": env_changes(b.get("env") or {}, s.get("env") or {}) if both else [],
        "data": (data_changes(b.get("data") or {}, s.get("data") or {})
                 + target_changes(b.get("target_files"), s.get("target_files"))) if both else [],
        "config": config_changes(b.get("config") or {}, s.get("config") or {}) if both else [],
        "code": code_changes(b.get("git") or {}, s.get("git") or {}) if both else [],
    }
    # a hash that moved is always named, even where the snapshot cannot say how
    for cat, col in (("environment", "env_hash"), ("data", "data_hash"), ("config", "config_hash")):
        if not out[cat] and run.row.get(col) != base.row.get(col):
            out[cat].append(_change(col, base.row.get(col), run.row.get(col)))
    if evaluation:
        evals = eval_changes(b.get("acceptance"), s.get("acceptance")) if both else []
        if not evals and run.row.get("eval_hash") != base.row.get("eval_hash"):
            evals = [_change("eval_hash", base.row.get("eval_hash"), run.row.get("eval_hash"))]
        out["config"] += evals
    if not out["code"] and (run.row.get("git_commit") != base.row.get("git_commit")):
        out["code"].append(_change("commit", (base.row.get("git_commit") or "")[:12], (run.row.get("git_commit") or "")[:12]))
    return out


def changed_text(changes: dict[str, list[dict]], limit: int = 4) -> str:
    """'environment (torch 2.11.0 -> 2.13.0); data (num_samples 1000 -> 3000)' or '' when nothing changed."""
    parts = []
    for cat in CATEGORIES:
        items = changes.get(cat) or []
        if items:
            shown = ", ".join(change_text(c) for c in items[:limit])
            more = f", +{len(items) - limit} more" if len(items) > limit else ""
            parts.append(f"{cat} ({shown}{more})")
    return "; ".join(parts)


# ---- anomalies ---------------------------------------------------------------------------------------------
def anomalies(run: Run, st: ReportSection) -> list[dict]:
    snap, out = run.snapshot, []

    def add(kind, message, **extra):
        out.append({"kind": kind, "message": message, **extra})

    status = run.row.get("status")
    if status and status != "completed":
        add("status", f"run ended with status '{status}'")
    if run.num("ktok_per_s") is None:
        add("not_measured", "no throughput measured (no optimizer step after warm-up)")
    diverged = snap.get("diverged") if isinstance(snap.get("diverged"), dict) else {}
    if snap.get("replicas_identical") is False or diverged:
        where = f" at step {diverged['step']}" if diverged.get("step") is not None else ""
        who = f" (replicas {diverged['replicas']})" if diverged.get("replicas") else ""
        add("replicas_diverged", f"drafter replicas diverged{where}{who}: their weights differ after the all-reduce",
            step=diverged.get("step"))
    rec = to_float(run.row.get("recompiles_after_warmup")) or 0
    if rec > 0:
        add("recompiles", f"{int(rec)} recompile(s) after warm-up (a shape not compiled in warm-up)", count=int(rec))
    eager = to_float(run.row.get("eager_fallbacks")) or 0
    if eager > 0:
        add("eager_fallbacks", f"{int(eager)} eager fallback(s) (compiled attention not used)", count=int(eager))
    for w in snap.get("workers") or []:
        if isinstance(w, dict) and w.get("steps") == 0:
            add("silent_worker", f"worker {w.get('name')} ({w.get('role')}) on {w.get('device')} never produced a step",
                worker=w.get("name"), device=w.get("device"))
    devices = [d for d in snap.get("devices") or [] if isinstance(d, dict)]
    groups: dict[tuple, list[dict]] = {}
    for d in devices:
        roles = tuple(sorted(d.get("roles") or []))
        if "drafter" in roles and to_float(d.get("peak_memory_gb")) is not None:
            groups.setdefault(roles, []).append(d)
    for group in groups.values():
        if len(group) < 2:
            continue
        mems = sorted(float(d["peak_memory_gb"]) for d in group)
        mid = len(mems) // 2
        median = mems[mid] if len(mems) % 2 else (mems[mid - 1] + mems[mid]) / 2
        if median <= 0:
            continue
        for d in group:
            share = float(d["peak_memory_gb"]) / median - 1
            if abs(share) > st.memory_imbalance:
                add("memory_imbalance", f"drafter replica on {d.get('device')} peaked at {float(d['peak_memory_gb']):.1f} GB "
                    f"vs median {median:.1f} GB ({share:+.0%}); did it initialise?", device=d.get("device"), share=round(share, 4))
    for d in devices:
        util = to_float(d.get("util_mean"))
        if util is not None and not str(d.get("device", "")).startswith("cpu") and util < st.min_utilisation:
            add("low_utilisation", f"{d.get('device')} ({'/'.join(d.get('roles') or [])}) averaged {util:.0f}% utilisation "
                f"(< {st.min_utilisation:.0f}%)", device=d.get("device"), util_mean=util)
    return out


# ---- baselines and verdicts --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Metric:
    """What a verdict judges: throughput (Ktok/s, compared as a ratio) or quality (tau, compared as a difference)."""
    kind: str                           # "throughput" | "quality"
    column: str                         # its history column
    relative: bool                      # change = value / baseline - 1; else value - baseline
    floor: float                        # the threshold when runs are quiet (report.threshold, report.tau_threshold)
    cap: float                          # the widest the spread may widen it to
    state: Callable[[Run], tuple]       # runs with one state are identical: their values differ by noise alone
    always: float | None = None         # a change at or below this is a regression whatever the threshold


def metrics_of(st: ReportSection) -> tuple[Metric, Metric]:
    """(throughput, quality) from the `report` section of the config."""
    return (Metric("throughput", "ktok_per_s", True, st.threshold, st.threshold_cap, state_key, ALWAYS_REGRESSION),
            Metric("quality", "tau", False, st.tau_threshold, st.tau_threshold_cap, quality_state))


def usable(run: Run, metric: Metric) -> bool:
    value = run.num(metric.column)
    return run.row.get("status") == "completed" and value is not None and value > 0


def comparable_key(run: Run) -> tuple:
    """Runs with the same key measure the same pipeline: run name, hardware and placement (history columns)."""
    return run.row.get("run_name"), run.row.get("hardware"), run.row.get("placement")


def state_key(run: Run) -> tuple:
    """Runs with the same state are identical runs: their Ktok/s differ by noise alone."""
    return tuple(run.row.get(k) for k in ("config_hash", "data_hash", "env_hash", "git_commit", "git_dirty"))


def quality_state(run: Run) -> tuple:
    """Identical runs evaluated the same way: their tau differ by noise alone (none on the CPU)."""
    return state_key(run) + (run.row.get("eval_hash"),)


def _change_of(value: float, base: float, metric: Metric) -> float:
    return value / base - 1 if metric.relative else value - base


def spread(runs: list[Run], metric: Metric, window: int) -> float | None:
    """Run-to-run spread: a robust standard deviation (1.4826 x median absolute deviation from the median; relative
    for Ktok/s, in tau for tau), pooled over groups of identical runs (the last `window` of each); None without two
    identical runs."""
    groups: dict[tuple, list[float]] = {}
    for r in runs:
        groups.setdefault(metric.state(r), []).append(r.num(metric.column))
    devs = []
    for values in groups.values():
        values = values[-window:]
        if len(values) >= 2:
            m = statistics.median(values)
            devs += [abs(_change_of(v, m, metric)) for v in values]
    return 1.4826 * statistics.median(devs) if devs else None


def find_baseline(i: int, runs: list[Run], metric: Metric, st: ReportSection,
                  outliers: set[str]) -> tuple[list[Run], str, float | None]:
    """(the baseline runs, why them, the spread) for run i; no runs when there is nothing to compare with. Runs in
    `outliers` (regressions with nothing changed) are neither baselines nor counted in the spread."""
    run = runs[i]
    if st.baseline_run:
        if run.run_id == st.baseline_run:
            return [], "is the pinned baseline", None
        pinned = [r for r in runs if r.run_id == st.baseline_run]
        return pinned, "pinned (report.baseline_run)" if pinned else \
            f"pinned baseline {st.baseline_run} is not in the history", None
    key = comparable_key(run)
    earlier = [r for r in runs[:i] if usable(r, metric) and r.run_id not in outliers and comparable_key(r) == key]
    if not earlier:
        return [], f"no earlier completed run of '{key[0]}' with {metric.column} on this hardware and placement", None
    state = metric.state(earlier[-1])
    group = [r for r in earlier if metric.state(r) == state][-st.baseline_window:]
    why = f"median of {len(group)} identical run(s), the latest {group[-1].run_id}" if len(group) > 1 else \
        "the previous comparable run"
    return group, why, spread(earlier, metric, st.baseline_window)


def threshold_of(metric: Metric, sigma: float | None, noise_sigmas: float) -> float:
    """The floor, widened to noise_sigmas x the measured spread when that is wider, never beyond the cap."""
    return metric.floor if sigma is None else min(metric.floor, max(metric.cap, -noise_sigmas * sigma))


def compare(run: Run, group: list[Run], metric: Metric) -> dict:
    value = run.num(metric.column)
    base = statistics.median(r.num(metric.column) or 0.0 for r in group)
    change = _change_of(value, base, metric) if value is not None and base > 0 else None
    ratio = value / base if metric.relative and change is not None else None
    return {"run_id": group[-1].run_id, "value": base, "runs": [r.run_id for r in group],
            "ratio": None if ratio is None else round(ratio, 4), "change": None if change is None else round(change, 4),
            "changed": attribute(run, group[-1], evaluation=metric.kind == "quality")}


def verdict_of(change: float | None, threshold: float, always: float | None = None) -> str:
    if change is None:
        return "not measured"
    if change < threshold or (always is not None and change <= always):
        return "regression"
    if change > -threshold:
        return "improvement"
    return "ok"


def judge(i: int, runs: list[Run], metric: Metric, st: ReportSection, outliers: set[str]) -> dict:
    """Run i against its baseline for one metric; a regression with nothing changed joins `outliers`."""
    run = runs[i]
    group, why, sigma = find_baseline(i, runs, metric, st, outliers)
    out = {"baseline": None, "baseline_reason": why, "spread": None if sigma is None else round(sigma, 4),
           "threshold": round(threshold_of(metric, sigma, st.noise_sigmas), 4), "ratio": None, "change": None,
           "changed": {c: [] for c in CATEGORIES}, "outlier": False}
    if group:
        cmp_ = compare(run, group, metric)
        out.update(baseline={"run_id": cmp_["run_id"], metric.column: cmp_["value"], "runs": cmp_["runs"]},
                   ratio=cmp_["ratio"], change=cmp_["change"], changed=cmp_["changed"])
        out["verdict"] = verdict_of(cmp_["change"], out["threshold"], metric.always)
        if out["verdict"] == "regression" and not st.baseline_run and metric.state(run) == metric.state(group[-1]):
            out["outlier"] = True                           # nothing changed: noise, not a new level
            outliers.add(run.run_id)
    elif metric.kind == "quality" and run.num(metric.column) is None:
        out["verdict"] = "not measured"
    else:
        out["verdict"] = "baseline" if why == "is the pinned baseline" else "first run" if i == 0 else "no baseline"
    out["what_changed"] = changed_text(out["changed"]) if group else ""
    return out


def evaluate(runs: list[Run], st: ReportSection) -> list[dict]:
    """One record per run (history order) for regressions.json: throughput at the top level, quality under
    `quality`, `regressed` naming which of the two regressed."""
    throughput, quality = metrics_of(st)
    outliers: dict[str, set[str]] = {"throughput": set(), "quality": set()}
    out = []
    for i, run in enumerate(runs):
        t = judge(i, runs, throughput, st, outliers["throughput"])
        q = judge(i, runs, quality, st, outliers["quality"])
        rec = {"run_id": run.run_id, "run_name": run.row.get("run_name"), "started_at": run.row.get("started_at"),
               "status": run.row.get("status"), "ktok_per_s": run.num("ktok_per_s"), "tau": run.num("tau"),
               "loss": run.num("loss"), "mfu": run.num("mfu"), "restored_from": run.restored_from, **t,
               "previous": None}
        earlier = [r for r in runs[:i] if usable(r, throughput)]
        if t["baseline"] is None and earlier and t["verdict"] != "baseline":
            # nothing comparable (another run name, hardware or placement): how it compares with the run before it
            cmp_ = compare(run, earlier[-1:], throughput)
            rec["previous"] = {"run_id": earlier[-1].run_id, "ktok_per_s": cmp_["value"], "ratio": cmp_["ratio"],
                               "changed": cmp_["changed"]}
        earlier_taus = [to_float(x) for x in (run.row.get("tau_earlier") or "").split(";")]
        rec["quality"] = {"tau": run.num("tau"), "tau_earlier": [x for x in earlier_taus if x is not None],
                          "loss": run.num("loss"), **q}
        rec["quality"]["sentence"] = quality_sentence(rec["quality"])
        rec["regressed"] = [kind for kind, v in (("throughput", t["verdict"]), ("quality", q["verdict"]))
                            if v == "regression"]
        rec["anomalies"] = anomalies(run, st)
        rec["sentence"] = " ".join(x for x in (sentence(rec), rec["quality"]["sentence"]) if x)
        out.append(rec)
    return out


def anomaly_brief(items: list[dict]) -> str:
    """The anomalies of one run in a clause: grouped by kind, devices and workers named."""
    by: dict[str, list[dict]] = {}
    for a in items:
        by.setdefault(a["kind"], []).append(a)
    parts = []
    for kind, group in by.items():
        if kind == "status":
            parts.append(group[0]["message"])
        elif kind == "recompiles":
            parts.append(f"{group[0]['count']} recompile(s) after warm-up")
        elif kind == "eager_fallbacks":
            parts.append(f"{group[0]['count']} eager fallback(s)")
        elif kind == "silent_worker":
            parts.append(f"worker(s) that never stepped: {', '.join(str(a['worker']) for a in group)}")
        elif kind == "memory_imbalance":
            parts.append("drafter memory imbalance on " + ", ".join(f"{a['device']} ({a['share']:+.0%} vs median)" for a in group))
        elif kind == "replicas_diverged":
            parts.append(group[0]["message"].split(":")[0])
        elif kind == "low_utilisation":
            parts.append(f"{len(group)} GPU(s) under the utilisation floor ({', '.join(str(a['device']) for a in group)})")
        else:
            parts += [a["message"] for a in group]
    return "; ".join(parts)


def _times(ratio: float) -> str:
    return f"{1 / ratio:.1f}x" if ratio < 1 else f"{ratio:.1f}x"


def sentence(rec: dict) -> str:
    """The verdict in one sentence that names the cause."""
    rid, k = rec["run_id"], rec["ktok_per_s"] or 0.0
    anom = anomaly_brief(rec["anomalies"])
    anom_txt = f"; anomalies: {anom}" if anom else ""
    if rec["baseline"] is not None and rec["ratio"] is not None:
        b, ratio = rec["baseline"], rec["ratio"]
        base = _base_text(b)
        what = rec["what_changed"] or "nothing recorded (same environment, data, config and code)"
        nums = f"({b['ktok_per_s']:.2f} -> {k:.2f} Ktok/s, {rec['change']:+.0%}; threshold {rec['threshold']:+.0%})"
        if rec["verdict"] == "regression":
            return f"Run {rid}: Ktok/s fell {_times(ratio)} vs {base} {nums}; what changed: {what}{anom_txt}."
        if rec["verdict"] == "improvement":
            return f"Run {rid}: Ktok/s rose {_times(ratio)} vs {base} {nums}; what changed: {what}{anom_txt}."
        return f"Run {rid}: Ktok/s within the threshold of {base} {nums}; what changed: {what}{anom_txt}."
    prev = rec.get("previous")
    if rec["ktok_per_s"] is None:
        base = f" (baseline {rec['baseline']['run_id']})" if rec["baseline"] else ""
        return f"Run {rid}: no Ktok/s measured{base}{anom_txt}."
    if rec["verdict"] == "baseline":
        return f"Run {rid}: {k:.2f} Ktok/s; it is the pinned baseline (report.baseline_run){anom_txt}."
    if rec["verdict"] == "first run":
        return f"Run {rid}: first run in the history, {k:.2f} Ktok/s; no baseline yet{anom_txt}."
    text = f"Run {rid}: {k:.2f} Ktok/s; no baseline ({rec['baseline_reason']})"
    if prev and prev["ratio"]:
        what = changed_text(prev["changed"]) or "nothing recorded"
        text += f"; vs the previous run {prev['run_id']} ({prev['ktok_per_s']:.2f} Ktok/s, {_times(prev['ratio'])} " \
                f"{'slower' if prev['ratio'] < 1 else 'faster'}) what changed: {what}"
    return text + anom_txt + "."


def _base_text(base: dict) -> str:
    n = len(base.get("runs") or [base["run_id"]])
    return f"run {base['run_id']}" if n == 1 else f"the median of {n} identical runs up to {base['run_id']}"


def quality_sentence(q: dict) -> str:
    """The quality verdict in one sentence ('' for a run without tau and without a quality baseline)."""
    tau = q["tau"]
    if tau is None:
        return "No tau measured (no acceptance.json at temperature 0)." if q["baseline"] else ""
    if q["baseline"] is None or q["change"] is None:
        return {"baseline": f"tau {tau:.3f}; the pinned baseline.", "first run": f"tau {tau:.3f}."}.get(
            q["verdict"], f"tau {tau:.3f}; no quality baseline ({q['baseline_reason']}).")
    b = q["baseline"]
    nums = f"({b['tau']:.3f} -> {tau:.3f}, {q['change']:+.3f}; threshold {q['threshold']:+.3f})"
    what = q["what_changed"] or "nothing recorded (same environment, data, config, code and evaluation)"
    if q["verdict"] == "regression":
        return f"Quality regression: tau fell vs {_base_text(b)} {nums}; what changed: {what}."
    if q["verdict"] == "improvement":
        return f"Quality: tau rose vs {_base_text(b)} {nums}; what changed: {what}."
    return f"tau {tau:.3f}, within the threshold of {_base_text(b)} {nums}."
