"""Key stamps: what reruns a rule, decided by content whether or not Snakemake's metadata (`.snakemake/`) survives.

One small file per rule and output name, `<results>/stamps/<rule>/<name>.json`, holds the hash of what the rule's
outputs depend on besides other rules' outputs: the config keys whose role names the rule (dflash.config.trigger), the
content of the files and folders the config names for it (dflash.inputs, recorded by dflash.content) and any `extra`
the workflow adds (the env rule's package versions and pins). The Snakefile writes it when it reads the config, and
only when that hash changes, atomically: its mtime moves only on a real change. It is an input of its rule, so a
change reruns the rule and what follows it by Snakemake's own mtime rule, and nothing else does (a results folder
copied with its mtimes into a fresh clone reruns nothing; the same with a config change reruns what it affects).

Modes (what Snakemake was asked to do): `run` writes a changed stamp; `plan` (a dry run, --summary, ...) never touches
the stamps a run relies on: a changed hash goes to `<results>/stamps/plan/` and that file is the input, so the plan
shows the rerun and a later run of the unchanged config reruns nothing; `read` (a cluster job reading the workflow again
on its node, --lint, --list-rules) writes nothing. A stamp made for the first time is new, so its rule reruns (results
made before stamps existed rerun once; `snakemake --touch` marks them current instead).

One stamp per rule and output: a sweep's runs (dflash.sweep) each have their own, made from the run's config.

Public: `Stamps(results_dir, cfg, raw, mode)`, `.path(rule, name="", files=(), extra=None, loaded=None)` -> the stamp's
path (written as the mode allows; `loaded`: a sweep run's config), `.moved`: the (rule, name) pairs whose hash
changed; `mode_of(args, remote)`: the mode
of a Snakemake command line.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from dflash import paths
from dflash.atomic import atomic_write_json
from dflash.config import trigger
from dflash.config_model import NAME, DflashConfig
from dflash.content import Digests, record
from dflash.inputs import named

MODES = ("run", "plan", "read")
# Snakemake's flags (argparse names) that read the workflow without planning jobs, and those that plan without running
READ_FLAGS = ("lint", "list_rules", "list_target_rules", "print_compilation")
PLAN_FLAGS = ("dryrun", "summary", "detailed_summary", "list_changes", "list_input_changes", "list_params_changes",
              "list_untracked", "dag", "rulegraph", "filegraph", "d3dag", "containerize", "generate_unit_tests",
              "archive", "delete_all_output", "delete_temp_output", "unlock", "cleanup_metadata")


def mode_of(args, remote: bool = False) -> str:
    """The stamps' mode for Snakemake's parsed command line `args` (None: unknown, e.g. the Python API: run). `remote`:
    a job reading the workflow again where it runs."""
    if remote or any(getattr(args, f, None) for f in READ_FLAGS):
        return "read"
    if any(getattr(args, f, None) for f in PLAN_FLAGS) or (getattr(args, "report", None)
                                                           and not getattr(args, "report_after_run", False)):
        return "plan"
    return "run"


def _slug(name: str) -> str:
    """`name` as a file name: itself when it is a folder name already, else its characters that are, and a hash."""
    if re.match(NAME, name):
        return name
    return (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.-") + "-"
            + hashlib.sha256(name.encode()).hexdigest()[:8])


def _hash(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class Stamps:
    def __init__(self, results_dir: str | Path, cfg: DflashConfig, raw: dict, mode: str):
        if mode not in MODES:
            raise ValueError(f"stamp mode {mode!r}: one of {', '.join(MODES)}")
        self.root, self.cfg, self.raw, self.mode = paths.stamps(results_dir), cfg, raw, mode
        self.digests = Digests(paths.digests(results_dir))
        self.moved: set[tuple[str, str]] = set()   # (rule, name) of the stamps whose hash changed

    def what(self, rule: str, files=(), extra: dict | None = None, loaded=None) -> dict:
        """What the stamp of `rule` records: its config keys, the content of the files the config names for it and
        of `files` ((label, path) pairs), and `extra`; `loaded`: a sweep run's (or dataset's) config in place of the
        config's own."""
        cfg, raw = (loaded.cfg, loaded.raw) if loaded is not None else (self.cfg, self.raw)
        inputs = {n.key: {"path": n.path, **record(n.path, self.digests)} for n in named(cfg, rule)}
        inputs.update({label: {"path": str(p), **record(p, self.digests)} for label, p in files})
        return {"rule": rule, "config": json.loads(trigger(raw, rule)), "inputs": inputs, **(extra or {})}

    def path(self, rule: str, name: str = "", files=(), extra: dict | None = None, loaded=None) -> str:
        """The stamp of `rule` for the output named `name` (a run, a dataset, a target path; "" for a rule with one
        output), written when its hash changed and the mode allows it; `loaded`: as `what`."""
        what = self.what(rule, files, extra, loaded)
        what["hash"] = _hash(what)
        if self.mode != "read":
            self.digests.save()
        stamp = self.root / rule / f"{_slug(name) if name else rule}.json"
        try:
            old = json.loads(stamp.read_text()).get("hash")
        except (OSError, ValueError, AttributeError):
            old = None
        if old == what["hash"]:
            return str(stamp)
        self.moved.add((rule, name))
        if self.mode == "read":
            return str(stamp)
        if self.mode == "plan":
            stamp = self.root / "plan" / stamp.relative_to(self.root)
        atomic_write_json(stamp, what)
        return str(stamp)
