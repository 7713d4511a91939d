"""The run history: a snapshot per training run (`history/<run_id>.json`, the record) and `history.csv`, a flat view
of them rebuilt on every report.

`history.csv` holds the flat numbers (Ktok/s, tau, final loss, MFU, time split, hashes, headline versions) so it reads
well in a spreadsheet; `history/<run_id>.json` keeps the whole summary (env fingerprint, data manifest summary,
resolved config, git, devices, workers, compile counters) and the run's evaluation, because the run folder itself gets
overwritten by the next run of the same name. A snapshot's summary is never rewritten; its evaluation follows the run's
acceptance.json: a re-evaluation becomes `acceptance` and the one it replaces moves to `earlier_evaluations` (oldest
first), so the report shows the figure on disk and the earlier one stays visible. The history's `tau` is the
temperature-0 tau (quality is judged there); `tau_by_proposal` is that of an evaluation at temperature > 0, by draft
policy (who drafts each way: records.acceptance.ENGINES): `T=0.7: argmax 2.960; sample 1.160`.

The history is never rewritten smaller than what any of its sources holds: a run that history.csv holds but whose
snapshot is gone (deleted, damaged) gets its snapshot back from its row (`{"run_id", "restored_from", "row"}`: the
flat figures only), so a damaged, edited or deleted history.csv or history/ loses no run that the other one holds.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pydantic import ValidationError

from dflash.atomic import atomic_write_json, atomic_write_text
from dflash.device_names import normalize
from dflash.paths import RunFolder
from dflash.records import problem
from dflash.records.acceptance import AcceptanceCore
from dflash.records.summary import SummaryCore

log = logging.getLogger("dflash.report")

COLUMNS = (
    "run_id", "run_name", "started_at", "finished_at", "status", "git_commit", "git_dirty",
    "config_hash", "env_hash", "data_hash", "eval_hash", "runtime", "steps", "measured_steps",
    "ktok_per_s", "samples_per_s", "draft_positions_per_s", "mfu", "tau", "tau_earlier", "tau_by_proposal",
    "evaluated_at", "acceptance_estimate", "loss",
    "step_queue_wait_s", "step_target_s", "step_drafter_s", "step_optimizer_s",
    "recompiles_after_warmup", "eager_fallbacks", "compile_warmup_s", "queue_depth_mean",
    "python", "torch", "cuda", "gpu", "hardware", "placement", "num_samples", "total_tokens", "snapshot",
)
TIME_KEYS = ("queue_wait", "target", "drafter", "optimizer")
# What an evaluation measured with (tau depends on them): compared between runs, named when they differ.
EVAL_KEYS = ("temperature", "block_size", "max_new_tokens", "num_prompts", "dtype", "device", "stop_token_ids")


class BadSummary(ValueError):
    """A summary the report cannot use; the message names the file and the key."""


@dataclass
class Run:
    """One run as the report sees it: the flat history row and the nested snapshot (empty for a run restored from
    its history.csv row, whose details are gone: it is compared by its hashes)."""
    row: dict
    snapshot: dict = field(default_factory=dict)
    folder: RunFolder | None = None     # the run folder it was read from this time (None: history only)
    restored_from: str | None = None    # "history.csv:N" when only its row survives

    @property
    def run_id(self) -> str:
        return self.row["run_id"]

    def num(self, key: str) -> float | None:
        return to_float(self.row.get(key))


def to_float(value) -> float | None:
    if value is None or value == "" or isinstance(value, bool):
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


def parse_time(text) -> datetime | None:
    """An ISO-8601 time (naive ones read as UTC), or None."""
    try:
        t = datetime.fromisoformat(str(text))
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


# ---- reading run folders -----------------------------------------------------------------------------------
def validate_summary(data, path: Path) -> dict:
    """`data` when it holds what the report needs of a summary (dflash/records/summary.py: SummaryCore; everything else
    is optional), else BadSummary naming the file and the key."""
    if not isinstance(data, dict):
        raise BadSummary(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        SummaryCore.model_validate(data)
    except ValidationError as e:
        raise BadSummary(f"{path}: {problem(e)}") from None
    if not data["run_id"].strip():
        raise BadSummary(f"{path}: key 'run_id' is empty")
    return data


def evaluation(data) -> AcceptanceCore | None:
    """An evaluation (an acceptance.json's content, as a run folder or a snapshot holds it) through its reader view,
    dflash/records/acceptance.py's AcceptanceCore; None for none, or for one whose keys have other types
    (`read_acceptance` names those and keeps them out of the history)."""
    try:
        return AcceptanceCore.model_validate(data) if isinstance(data, dict) else None
    except ValidationError:
        return None


def tau_of(data) -> float | None:
    """tau at temperature 0 of an acceptance.json: `tau` (the mean over prompt sets when `tau` is a mapping); None for
    an evaluation that sampled (temperature > 0): the history tracks the greedy figure."""
    a = evaluation(data)
    if a is None or to_float(a.temperature) not in (None, 0.0):
        return None
    return to_float(a.tau)


def proposal_taus(data) -> tuple[float, dict[str, float]] | None:
    """(temperature, {draft policy: tau}) of an acceptance.json made at temperature > 0 (`by_proposal`; one made
    before it existed sampled its drafts: `sample`), None for one at temperature 0 or without a tau."""
    a = evaluation(data)
    t = to_float(a.temperature) if a is not None else None
    if not t:
        return None
    taus = {k: to_float(tau) for k, tau in a.policy_taus().items()}
    taus = {k: v for k, v in taus.items() if v is not None}
    return (t, taus) if taus else None


def proposal_text(data) -> str:
    """proposal_taus as text ('T=0.7: argmax 2.960; sample 1.160'), '' without them."""
    pt = proposal_taus(data)
    return "" if pt is None else f"T={pt[0]:g}: " + "; ".join(f"{k} {v:.3f}" for k, v in pt[1].items())


def evaluation_settings(acceptance) -> dict | None:
    """What an evaluation measured with: its settings, its prompt sets and any `*_hash` it records; None without one.
    The values as the file holds them (`eval_hash` hashes them: 0 and 0.0 stay apart, as they always were)."""
    a = evaluation(acceptance)
    if a is None:
        return None
    out = {k: acceptance[k] for k in EVAL_KEYS if k in a.model_fields_set}
    out.update({k: v for k, v in (a.model_extra or {}).items() if k.endswith("_hash")})
    if a.sets is not None:
        out["prompt_sets"] = sorted(a.sets)
    return out


def eval_hash(acceptance) -> str | None:
    settings = evaluation_settings(acceptance)
    if settings is None:
        return None
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_acceptance(path: Path, summary: dict) -> tuple[dict | None, dict | None]:
    """(the evaluation of the run in this folder, None) from its acceptance.json; (None, {file, reason}) when it cannot
    be this run's: unreadable, or made for another run (`run_id`) or before this run finished (`created_at`)."""
    if not path.is_file():
        return None, None
    rid = summary["run_id"]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, _skip(path, f"unreadable ({e}); no tau for run {rid} until evaluate writes it again")
    if not isinstance(data, dict):
        return None, _skip(path, f"expected a JSON object, got {type(data).__name__}; no tau for run {rid}")
    try:
        a = AcceptanceCore.model_validate(data)
    except ValidationError as e:
        return None, _skip(path, f"{problem(e)}; no tau for run {rid} until evaluate writes it again")
    made, done = parse_time(a.created_at), parse_time(summary.get("finished_at"))
    if a.run_id is not None and a.run_id != rid:
        return None, _skip(path, f"evaluates run {a.run_id}, not run {rid} of this folder; rerun evaluate")
    if made and done and made < done:
        return None, _skip(path, f"made at {a.created_at}, before run {rid} finished ({summary['finished_at']}):"
                                 " the evaluation of an earlier run; rerun evaluate")
    if tau_of(data) is None:
        why = f"evaluated at temperature {a.temperature} ({proposal_text(data) or 'no tau'})" \
            if to_float(a.temperature) else "no numeric 'tau'"
        log.warning("%s: %s; the history's tau (temperature 0) left empty for run %s", path, why, rid)
    return data, None


def _skip(path: Path, reason: str) -> dict:
    log.warning("skipped %s: %s", path, reason)
    return {"file": str(path), "reason": reason}


def scan_runs(runs_dir: str | Path) -> tuple[list[tuple[Path, dict]], list[dict]]:
    """Every readable `<runs_dir>/*/summary.json` (with its evaluation under `_acceptance`) and the skipped files."""
    runs_dir = Path(runs_dir)
    found, skipped = [], []
    if not runs_dir.is_dir():
        log.warning("%s: no runs folder; the report uses the history alone", runs_dir)
        return found, skipped
    for folder in sorted(p for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        path = RunFolder(folder).summary
        try:
            if not path.is_file():
                raise BadSummary(f"{path}: missing (run folder without a summary; did the run finish?)")
            try:
                data = json.loads(path.read_text())
            except ValueError as e:
                raise BadSummary(f"{path}: not valid JSON ({e})") from None
            summary = validate_summary(data, path)
        except (BadSummary, OSError) as e:
            skipped.append(_skip(path, str(e).removeprefix(f"{path}: ")))
            continue
        acceptance, bad = read_acceptance(RunFolder(folder).acceptance(), summary)
        skipped += [bad] if bad else []
        found.append((folder, dict(summary, _acceptance=acceptance)))
    return found, skipped


# ---- snapshot -> row ---------------------------------------------------------------------------------------
def _fmt(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(round(value, 6))
    return str(value)


def hardware_of(snap: dict) -> str:
    """The hardware a run measured: '8x NVIDIA H200', or 'cpu <model>'."""
    env = snap.get("env") or {}
    gpu = env.get("gpu") or {}
    if gpu.get("count"):
        return f"{gpu['count']}x {'/'.join(gpu.get('models') or [])}"
    return f"cpu {env.get('cpu') or ''}".strip()


def placement_of(snap: dict) -> str:
    """The runtime and each role's devices, spelled one way: 'threads targets=cuda:0 drafters=cuda:1 nodes=1'."""
    train = (snap.get("config") or {}).get("train") or {}
    names = lambda key: ",".join(sorted(normalize(d) for d in train.get(key) or ()))  # noqa: E731
    nodes = (train.get("rendezvous") or {}).get("nnodes", 1)
    return f"{snap.get('runtime') or train.get('runtime')} targets={names('targets')} drafters={names('drafters')} " \
           f"nodes={nodes}"


def to_row(snap: dict, snapshot_rel: str) -> dict:
    """The flat history row of a snapshot (its current evaluation's tau, the earlier ones' beside it)."""
    tp, ts = snap.get("throughput") or {}, snap.get("time_split_s") or {}
    comp, env, data = snap.get("compile") or {}, snap.get("env") or {}, snap.get("data") or {}
    acc = snap.get("acceptance") if isinstance(snap.get("acceptance"), dict) else None
    ev = evaluation(acc)
    gpu = env.get("gpu") or {}
    gpu_text = ""
    if gpu.get("count"):
        gpu_text = f"{gpu.get('count')}x {'/'.join(gpu.get('models') or [])} (driver {gpu.get('driver')})"
    earlier = [tau_of(a) for a in snap.get("earlier_evaluations") or []]
    row = {
        "run_id": snap["run_id"], "run_name": snap.get("run_name"), "started_at": snap["started_at"],
        "finished_at": snap.get("finished_at"), "status": snap["status"],
        "git_commit": snap["git"].get("commit"), "git_dirty": snap["git"].get("dirty"),
        "config_hash": snap["config_hash"], "env_hash": snap["env_hash"], "data_hash": snap["data_hash"],
        "eval_hash": eval_hash(acc),
        "runtime": snap.get("runtime"), "steps": snap.get("steps"), "measured_steps": snap.get("measured_steps"),
        "ktok_per_s": tp.get("ktok_per_s"), "samples_per_s": tp.get("samples_per_s"),
        "draft_positions_per_s": tp.get("draft_positions_per_s"), "mfu": tp.get("mfu"),
        "tau": tau_of(acc), "tau_earlier": ";".join(_fmt(t) for t in earlier if t is not None),
        "tau_by_proposal": proposal_text(acc),
        "evaluated_at": ev.created_at if ev else None,
        "acceptance_estimate": snap.get("acceptance_estimate"), "loss": snap.get("loss"),
        **{f"step_{k}_s": ts.get(k) for k in TIME_KEYS},
        "recompiles_after_warmup": comp.get("recompiles_after_warmup"), "eager_fallbacks": comp.get("eager_fallbacks"),
        "compile_warmup_s": comp.get("warmup_s"), "queue_depth_mean": snap.get("queue_depth_mean"),
        "python": env.get("python"), "torch": (env.get("packages") or {}).get("torch"), "cuda": env.get("cuda"),
        "gpu": gpu_text, "hardware": hardware_of(snap), "placement": placement_of(snap),
        "num_samples": data.get("num_samples"), "total_tokens": data.get("total_tokens"), "snapshot": snapshot_rel,
    }
    return {k: _fmt(v) for k, v in row.items()}


def to_snapshot(summary: dict) -> dict:
    snap = {k: v for k, v in summary.items() if not k.startswith("_")}
    snap["acceptance"] = summary.get("_acceptance")
    return snap


def re_evaluated(snap: dict, acceptance: dict) -> dict:
    """The snapshot with a new evaluation: it becomes `acceptance`, the one it replaces joins `earlier_evaluations`."""
    earlier = list(snap.get("earlier_evaluations") or [])
    if snap.get("acceptance") is not None:
        earlier.append(snap["acceptance"])
    return dict(snap, acceptance=acceptance, earlier_evaluations=earlier)


# ---- the store ---------------------------------------------------------------------------------------------
NUMERIC = ("ktok_per_s", "samples_per_s", "draft_positions_per_s", "mfu", "tau", "loss", "steps", "measured_steps")


def row_problem(row: dict) -> str | None:
    """Why a history row cannot stand for a run (None when it can)."""
    if not str(row.get("run_id") or "").strip():
        return "empty run_id"
    nan = [c for c in NUMERIC if row.get(c) and to_float(row[c]) is None]
    return f"not a number in {', '.join(f'{c}={row[c]!r}' for c in nan)}" if nan else None


class History:
    """`<root>/history/<run_id>.json` (one snapshot per run: the record) and `<root>/history.csv` (a view of them).

    A snapshot is written when a run is first seen; its summary is never rewritten, its evaluation follows the run's
    acceptance.json (re_evaluated). history.csv is rebuilt from the snapshots on every update and replaced atomically.
    A row of the old history.csv whose run has no readable snapshot restores that snapshot from the row; rows that do
    not parse are named, never made into runs.
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
                if isinstance(data, dict) and "restored_from" in data:
                    problem = row_problem(data["row"]) if isinstance(data.get("row"), dict) else "no 'row' mapping"
                    if problem is None and data["row"]["run_id"] != data.get("run_id"):
                        problem = "its row is of another run"
                    if problem:
                        raise BadSummary(f"{path}: restored snapshot: {problem}")
                else:
                    validate_summary(data, path)
                if data["run_id"] in snaps:
                    raise BadSummary(f"{path}: run {data['run_id']} already recorded in {snaps[data['run_id']][0]}")
            except (BadSummary, OSError) as e:
                skipped.append(_skip(path, str(e).removeprefix(f"{path}: ")))
                continue
            snaps[data["run_id"]] = (path.relative_to(self.root).as_posix(), data)
        return snaps, skipped

    def read_view(self) -> tuple[dict[str, tuple[int, dict]], list[dict]]:
        """The runs the old history.csv holds ({run_id: (line, row)}), and what in it does not parse (named)."""
        rows: dict[str, tuple[int, dict]] = {}
        if not self.csv.is_file():
            return rows, []
        name, out = str(self.csv), []

        def bad(where, reason):
            log.warning("%s%s: %s; history.csv is rebuilt from %s", name, where, reason, self.snapdir)
            out.append({"file": f"{name}{where}", "reason": reason})
        try:
            text = self.csv.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            bad("", f"not UTF-8 text (byte {e.start}); whole file ignored")
            return rows, out
        except OSError as e:
            bad("", f"unreadable ({e.strerror})")
            return rows, out
        if not text.strip():
            return rows, out
        try:
            lines = list(csv.reader(io.StringIO(text)))
        except csv.Error as e:
            bad("", f"not CSV ({e}); whole file ignored")
            return rows, out
        header = lines[0]
        missing = [c for c in ("run_id", *NUMERIC) if c not in header]
        if missing:
            bad(":1", f"header lacks column(s) {', '.join(missing)} (renamed?); rows not read")
            return rows, out
        for n, fields in enumerate(lines[1:], 2):
            if not fields:
                continue
            if len(fields) != len(header):
                bad(f":{n}", f"{len(fields)} field(s), the header has {len(header)}; row skipped")
                continue
            row = dict(zip(header, fields))
            problem = row_problem(row)
            if problem is None and row["run_id"] in rows:
                problem = f"run {row['run_id']!r} already on line {rows[row['run_id']][0]}"
            if problem:
                bad(f":{n}", f"{problem}; row skipped")
            else:
                rows[row["run_id"]] = (n, {c: row.get(c, "") for c in COLUMNS})
        return rows, out

    def update(self, summaries: list[tuple[Path, dict]]) -> tuple[list[Run], list[str], list[dict]]:
        """Record the runs not yet recorded, follow re-evaluations, restore what only history.csv still holds; return
        every run (start order), the ids recorded now, what was skipped."""
        snaps, skipped = self.load()
        view, bad = self.read_view()
        skipped += bad
        folders, new = {}, []

        def write(rid, rel, snap):
            snaps[rid] = (rel, snap)
            atomic_write_json(self.root / rel, snap)

        for folder, s in sorted(summaries, key=lambda fs: (fs[1]["started_at"], fs[1]["run_id"])):
            rid, acc = s["run_id"], s.get("_acceptance")
            folders.setdefault(rid, folder)
            rel, snap = snaps.get(rid, (f"history/{safe_name(rid)}.json", None))
            if snap is None or "restored_from" in snap:   # first sight, or its snapshot was lost: record it whole
                write(rid, rel, to_snapshot(s))
                new.append(rid)
            elif acc is not None and acc != snap.get("acceptance"):
                write(rid, rel, re_evaluated(snap, acc))
                log.info("run %s re-evaluated: tau %s -> %s (the earlier evaluation stays in %s)", rid,
                         _fmt(tau_of(snap.get("acceptance"))) or "none", _fmt(tau_of(acc)) or "none", rel)
        for rid, (line, row) in view.items():
            if rid not in snaps:                          # only history.csv still holds it: its snapshot comes back
                rel = f"history/{safe_name(rid)}.json"
                write(rid, rel, {"run_id": rid, "restored_from": f"history.csv:{line}", "row": dict(row, snapshot=rel)})
                log.warning("run %s: no snapshot in %s; restored from %s:%d (its flat figures only)", rid, self.snapdir,
                            self.csv, line)
        runs = [self._run(rel, snap, folders.get(rid)) for rid, (rel, snap) in snaps.items()]
        runs.sort(key=lambda r: (r.row.get("started_at") or "", r.run_id))
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(r.row for r in runs)
        atomic_write_text(self.csv, buf.getvalue())     # always (a declared output must be newer than its inputs)
        return runs, new, skipped

    @staticmethod
    def _run(rel: str, snap: dict, folder: Path | None) -> Run:
        folder = RunFolder(folder) if folder is not None else None
        if "restored_from" in snap:
            return Run(row=dict(snap["row"], snapshot=rel), folder=folder, restored_from=snap["restored_from"])
        return Run(row=to_row(snap, rel), snapshot=snap, folder=folder)
