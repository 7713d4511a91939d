"""The run history: a write-once snapshot per training run (`history/<run_id>.json`, the record) and `history.csv`,
a flat view of them rebuilt on every report.

`history.csv` holds the flat numbers (Ktok/s, tau, MFU, time split, hashes, headline versions) so it reads well in
a spreadsheet; `history/<run_id>.json` keeps the whole summary (env fingerprint, data manifest summary, resolved
config, git, devices, workers, compile counters, acceptance), because the run folder itself gets overwritten by the
next run of the same name. A snapshot is never rewritten (its acceptance is filled in once when it arrives late);
history.csv can be damaged, edited or deleted without losing a run.
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


def tau_of(data) -> float | None:
    """tau of an acceptance.json: a number under `tau`, or the mean over prompt sets when `tau` is a mapping."""
    tau = data.get("tau") if isinstance(data, dict) else None
    if isinstance(tau, dict):
        values = [v.get("tau") if isinstance(v, dict) else v for v in tau.values()]
        values = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        tau = sum(values) / len(values) if values else None
    return None if isinstance(tau, bool) or not isinstance(tau, (int, float)) else float(tau)


def read_tau(path: Path) -> tuple[float | None, dict | None]:
    """(tau, the acceptance mapping) from a run's acceptance.json; (None, None) when it is absent or unreadable."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable acceptance file (%s); tau left empty", path, e)
        return None, None
    tau = tau_of(data)
    if tau is None:
        log.warning("%s: no numeric 'tau'; tau left empty", path)
    return tau, data if isinstance(data, dict) else None


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
NUMERIC = ("ktok_per_s", "samples_per_s", "draft_positions_per_s", "mfu", "tau", "loss", "steps", "measured_steps")


class History:
    """`<root>/history/<run_id>.json` (one snapshot per run: the record) and `<root>/history.csv` (a view of them).

    Snapshots are written once, when a run is first seen (its acceptance is filled in once if it arrives later);
    history.csv is rebuilt from the snapshots on every update and replaced atomically, so a damaged, edited or
    deleted history.csv loses nothing. Rows of the old history.csv that do not parse are named, never made into runs.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.csv = self.root / "history.csv"
        self.snapdir = self.root / "history"

    def load(self) -> tuple[dict[str, tuple[str, dict]], list[dict]]:
        """{run_id: (relative path, snapshot)} of every readable snapshot, and the unreadable ones with reasons."""
        snaps, skipped = {}, []
        for path in sorted(self.snapdir.glob("*.json")) if self.snapdir.is_dir() else []:
            try:
                try:
                    data = json.loads(path.read_text())
                except (UnicodeDecodeError, ValueError) as e:
                    raise BadSummary(f"{path}: not valid JSON ({e})") from None
                validate_summary(data, path)
                if data["run_id"] in snaps:
                    raise BadSummary(f"{path}: run {data['run_id']} already recorded in {snaps[data['run_id']][0]}")
            except (BadSummary, OSError) as e:
                reason = str(e).removeprefix(f"{path}: ")
                log.warning("skipped snapshot %s: %s", path, reason)
                skipped.append({"file": str(path), "reason": reason})
                continue
            snaps[data["run_id"]] = (path.relative_to(self.root).as_posix(), data)
        return snaps, skipped

    def check_view(self, known: set[str]) -> list[dict]:
        """Name what in the old history.csv does not parse (or has no snapshot); it is rewritten anyway."""
        if not self.csv.is_file():
            return []
        name, out = str(self.csv), []

        def bad(where, reason):
            log.warning("%s%s: %s; history.csv is rebuilt from %s", name, where, reason, self.snapdir)
            out.append({"file": f"{name}{where}", "reason": reason})
        try:
            text = self.csv.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            bad("", f"not UTF-8 text (byte {e.start}); whole file ignored")
            return out
        except OSError as e:
            bad("", f"unreadable ({e.strerror})")
            return out
        if not text.strip():
            return out
        try:
            lines = list(csv.reader(io.StringIO(text)))
        except csv.Error as e:
            bad("", f"not CSV ({e}); whole file ignored")
            return out
        header = lines[0]
        missing = [c for c in ("run_id", *NUMERIC) if c not in header]
        if missing:
            bad(":1", f"header lacks column(s) {', '.join(missing)} (renamed?); rows not read")
            return out
        for n, fields in enumerate(lines[1:], 2):
            if not fields:
                continue
            if len(fields) != len(header):
                bad(f":{n}", f"{len(fields)} field(s), the header has {len(header)}; row skipped")
                continue
            row = dict(zip(header, fields))
            nan = [c for c in NUMERIC if row[c] and to_float(row[c]) is None]
            if nan:
                bad(f":{n}", f"not a number in {', '.join(f'{c}={row[c]!r}' for c in nan)}; row skipped")
            elif row["run_id"] not in known:
                bad(f":{n}", f"run {row['run_id']!r} has no snapshot in {self.snapdir.name}/; row skipped")
        return out

    def update(self, summaries: list[tuple[Path, dict]]) -> tuple[list[Run], list[str], list[dict]]:
        """Record the runs not yet recorded; return every run (start order), the ids recorded now, what was skipped."""
        snaps, skipped = self.load()
        skipped += self.check_view(set(snaps) | {s["run_id"] for _, s in summaries})
        folders, new = {}, []
        for folder, s in sorted(summaries, key=lambda fs: (fs[1]["started_at"], fs[1]["run_id"])):
            rid = s["run_id"]
            folders.setdefault(rid, folder)
            if rid not in snaps:                         # first sight (or its snapshot was unreadable): record it
                rel = f"history/{safe_name(rid)}.json"
                snaps[rid] = (rel, to_snapshot(s))
                atomic_write_json(self.root / rel, snaps[rid][1])
                new.append(rid)
            elif snaps[rid][1].get("acceptance") is None and s.get("_acceptance") is not None:
                rel, snap = snaps[rid]                   # tau that arrived after the run was recorded: filled once
                snaps[rid] = (rel, dict(snap, acceptance=s["_acceptance"]))
                atomic_write_json(self.root / rel, snaps[rid][1])
        runs = [Run(row=to_row(dict(snap, _tau=tau_of(snap.get("acceptance"))), rel), snapshot=snap,
                    folder=folders.get(rid)) for rid, (rel, snap) in snaps.items()]
        runs.sort(key=lambda r: (r.row.get("started_at") or "", r.run_id))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r.row for r in runs)
        atomic_write_text(self.csv, buf.getvalue())     # always (a declared output must be newer than its inputs)
        return runs, new, skipped
