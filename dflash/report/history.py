"""The run history: one row per training run in `history.csv`, append-only, plus a write-once snapshot per run.

`history.csv` holds the flat numbers (Ktok/s, tau, MFU, time split, hashes, headline versions) so it reads well in
a spreadsheet; `history/<run_id>.json` keeps the nested fields the attribution needs (env fingerprint, data
manifest summary, resolved config, git, devices, workers, compile counters), because the run folder itself gets
overwritten by the next run of the same name. Nothing that was written is ever rewritten: new rows are appended
after the existing bytes, and an existing snapshot is left alone.
"""
from __future__ import annotations

import csv
import io
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from dflash.atomic import atomic_write_json, atomic_write_text

log = logging.getLogger("dflash.report")

COLUMNS = (
    "run_id", "run_name", "started_at", "finished_at", "status", "git_commit", "git_dirty",
    "config_hash", "env_hash", "data_hash", "runtime", "steps", "measured_steps",
    "ktok_per_s", "samples_per_s", "draft_positions_per_s", "mfu", "tau", "acceptance_estimate", "loss",
    "step_queue_wait_s", "step_target_s", "step_drafter_s", "step_optimizer_s",
    "recompiles_after_warmup", "eager_fallbacks", "compile_warmup_s", "queue_depth_mean",
    "python", "torch", "cuda", "gpu", "num_samples", "total_tokens", "snapshot",
)
TIME_KEYS = ("queue_wait", "target", "drafter", "optimizer")
# (key, type) that a summary must have for the report to use it; everything else is optional.
REQUIRED = (("run_id", str), ("started_at", str), ("status", str), ("git", dict), ("config_hash", str),
            ("config", dict), ("env_hash", str), ("env", dict), ("data_hash", (str, type(None))), ("data", dict),
            ("throughput", dict))


class BadSummary(ValueError):
    """A summary the report cannot use; the message names the file and the key."""


@dataclass
class Run:
    """One run as the report sees it: the flat history row and the nested snapshot."""
    row: dict
    snapshot: dict = field(default_factory=dict)
    folder: Path | None = None          # the run folder it was read from this time (None: history only)

    @property
    def run_id(self) -> str:
        return self.row["run_id"]

    def num(self, key: str) -> float | None:
        return to_float(self.row.get(key))


def to_float(value) -> float | None:
    if value is None or value == "":
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def safe_name(run_id: str) -> str:
    """A file name for a run id: no separators, no dot-dot."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", run_id).lstrip(".")
    return name or "_"


# ---- reading run folders -----------------------------------------------------------------------------------
def validate_summary(data, path: Path) -> dict:
    if not isinstance(data, dict):
        raise BadSummary(f"{path}: expected a JSON object, got {type(data).__name__}")
    for key, typ in REQUIRED:
        if key not in data:
            raise BadSummary(f"{path}: missing key '{key}'")
        if not isinstance(data[key], typ):
            want = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
            raise BadSummary(f"{path}: key '{key}' must be {want}, got {type(data[key]).__name__}")
    if not data["run_id"].strip():
        raise BadSummary(f"{path}: key 'run_id' is empty")
    if "ktok_per_s" not in data["throughput"]:
        raise BadSummary(f"{path}: missing key 'throughput.ktok_per_s'")
    ktok = data["throughput"]["ktok_per_s"]        # null: nothing was measured (a failed or very short run)
    if isinstance(ktok, bool) or not isinstance(ktok, (int, float, type(None))):
        raise BadSummary(f"{path}: key 'throughput.ktok_per_s' must be a number or null, got {ktok!r}")
    if "commit" not in data["git"]:
        raise BadSummary(f"{path}: missing key 'git.commit'")
    return data


def read_tau(path: Path) -> tuple[float | None, dict | None]:
    """tau from acceptance.json: a number under `tau`, or the mean over prompt sets when `tau` is a mapping."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable acceptance file (%s); tau left empty", path, e)
        return None, None
    tau = data.get("tau") if isinstance(data, dict) else None
    if isinstance(tau, dict):
        values = [v.get("tau") if isinstance(v, dict) else v for v in tau.values()]
        values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tau = sum(values) / len(values) if values else None
    if isinstance(tau, bool) or not isinstance(tau, (int, float)):
        log.warning("%s: no numeric 'tau'; tau left empty", path)
        return None, data if isinstance(data, dict) else None
    return float(tau), data


def scan_runs(runs_dir: str | Path) -> tuple[list[tuple[Path, dict]], list[dict]]:
    """Every readable `<runs_dir>/*/summary.json` (with its acceptance) and the skipped files with reasons."""
    runs_dir = Path(runs_dir)
    found, skipped = [], []
    if not runs_dir.is_dir():
        log.warning("%s: no runs folder; the report uses the history alone", runs_dir)
        return found, skipped
    for folder in sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        path = folder / "summary.json"
        try:
            if not path.is_file():
                raise BadSummary(f"{path}: missing (run folder without a summary; did the run finish?)")
            try:
                data = json.loads(path.read_text())
            except ValueError as e:
                raise BadSummary(f"{path}: not valid JSON ({e})") from None
            summary = validate_summary(data, path)
        except (BadSummary, OSError) as e:
            reason = str(e).removeprefix(f"{path}: ")
            log.warning("skipped %s: %s", path, reason)
            skipped.append({"file": str(path), "reason": reason})
            continue
        tau, acceptance = read_tau(folder / "acceptance.json")
        summary = dict(summary, _tau=tau, _acceptance=acceptance)
        found.append((folder, summary))
    return found, skipped


# ---- summary -> row + snapshot -----------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)


def to_row(summary: dict, snapshot_rel: str) -> dict:
    tp, ts = summary.get("throughput") or {}, summary.get("time_split_s") or {}
    comp, env, data = summary.get("compile") or {}, summary.get("env") or {}, summary.get("data") or {}
    gpu = env.get("gpu") or {}
    gpu_text = ""
    if gpu.get("count"):
        gpu_text = f"{gpu.get('count')}x {'/'.join(gpu.get('models') or [])} (driver {gpu.get('driver')})"
    row = {
        "run_id": summary["run_id"], "run_name": summary.get("run_name"), "started_at": summary["started_at"],
        "finished_at": summary.get("finished_at"), "status": summary["status"],
        "git_commit": summary["git"].get("commit"), "git_dirty": summary["git"].get("dirty"),
        "config_hash": summary["config_hash"], "env_hash": summary["env_hash"], "data_hash": summary["data_hash"],
        "runtime": summary.get("runtime"), "steps": summary.get("steps"), "measured_steps": summary.get("measured_steps"),
        "ktok_per_s": tp.get("ktok_per_s"), "samples_per_s": tp.get("samples_per_s"),
        "draft_positions_per_s": tp.get("draft_positions_per_s"), "mfu": tp.get("mfu"),
        "tau": summary.get("_tau"), "acceptance_estimate": summary.get("acceptance_estimate"), "loss": summary.get("loss"),
        **{f"step_{k}_s": ts.get(k) for k in TIME_KEYS},
        "recompiles_after_warmup": comp.get("recompiles_after_warmup"), "eager_fallbacks": comp.get("eager_fallbacks"),
        "compile_warmup_s": comp.get("warmup_s"), "queue_depth_mean": summary.get("queue_depth_mean"),
        "python": env.get("python"), "torch": (env.get("packages") or {}).get("torch"), "cuda": env.get("cuda"),
        "gpu": gpu_text, "num_samples": data.get("num_samples"), "total_tokens": data.get("total_tokens"),
        "snapshot": snapshot_rel,
    }
    return {k: _fmt(v) for k, v in row.items()}


def to_snapshot(summary: dict) -> dict:
    snap = {k: v for k, v in summary.items() if not k.startswith("_")}
    snap["acceptance"] = summary.get("_acceptance")
    return snap


# ---- the store ---------------------------------------------------------------------------------------------
class History:
    """`<root>/history.csv` and `<root>/history/<run_id>.json`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.csv = self.root / "history.csv"
        self.snapdir = self.root / "history"

    def read_rows(self) -> tuple[list[str], list[dict]]:
        if not self.csv.is_file():
            return list(COLUMNS), []
        text = self.csv.read_text()
        reader = csv.DictReader(io.StringIO(text))
        rows = [dict(r) for r in reader]
        return list(reader.fieldnames or COLUMNS), rows

    def snapshot(self, row: dict) -> dict:
        rel = row.get("snapshot") or f"history/{safe_name(row['run_id'])}.json"
        path = self.root / rel
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("%s: snapshot of run %s unreadable (%s); attribution falls back to hashes", path, row["run_id"], e)
            return {}

    def late_tau(self, current: dict[str, float | None], rows: list[dict]) -> dict[str, str]:
        """tau that arrived after its run was recorded: appended once to history/late_tau.csv (rows stay as written)."""
        path = self.snapdir / "late_tau.csv"
        text = path.read_text() if path.is_file() else ""
        late = {r["run_id"]: r["tau"] for r in csv.DictReader(io.StringIO(text))} if text else {}
        add = [(r["run_id"], current[r["run_id"]]) for r in rows
               if not r.get("tau") and r["run_id"] not in late and current.get(r["run_id"]) is not None]
        if add:
            buf = io.StringIO()
            w = csv.writer(buf, lineterminator="\n")
            if not text:
                w.writerow(["run_id", "tau"])
            w.writerows((rid, _fmt(tau)) for rid, tau in add)
            atomic_write_text(path, text + buf.getvalue())
            late.update((rid, _fmt(tau)) for rid, tau in add)
        return late

    def append(self, summaries: list[tuple[Path, dict]]) -> tuple[list[Run], list[str]]:
        """Append the runs not yet recorded; return every run (history order) and the ids appended now."""
        header, rows = self.read_rows()
        known = {r["run_id"] for r in rows}
        folders = {}
        new = []
        for folder, s in sorted(summaries, key=lambda fs: (fs[1]["started_at"], fs[1]["run_id"])):
            folders.setdefault(s["run_id"], folder)
            if s["run_id"] in known:
                continue
            known.add(s["run_id"])
            rel = f"history/{safe_name(s['run_id'])}.json"
            snap_path = self.root / rel
            if not snap_path.exists():          # write-once: an existing snapshot is never replaced
                atomic_write_json(snap_path, to_snapshot(s))
            new.append(to_row(s, rel))
        if new:
            old = self.csv.read_text() if self.csv.is_file() else ""
            if old and not old.endswith("\n"):
                old += "\n"
            buf = io.StringIO()
            writer = csv.DictWriter(buf, fieldnames=header, extrasaction="ignore", lineterminator="\n")
            if not old:
                writer.writeheader()
            writer.writerows(new)
            atomic_write_text(self.csv, old + buf.getvalue())
            rows += [{k: r.get(k, "") for k in header} for r in new]
        late = self.late_tau({s["run_id"]: s.get("_tau") for _, s in summaries}, rows)
        rows = [dict(r, tau=late[r["run_id"]]) if not r.get("tau") and r["run_id"] in late else r for r in rows]
        runs = [Run(row=r, snapshot=self.snapshot(r), folder=folders.get(r["run_id"])) for r in rows]
        runs.sort(key=lambda r: (r.row.get("started_at") or "", r.run_id))
        return runs, [r["run_id"] for r in new]
