"""The committed GPU results as the pipeline's own run history, for `python -m dflash report`.

    python bench/history.py [--results bench/results] [--out bench/out/history] [--no-report]

Every run summary committed under bench/results/ becomes a history snapshot (`<out>/history/<run_id>.json`, the
record dflash/report/history.py keeps; `<out>/history.csv` its flat view): the `summary*.json` files the h200 bench
copies out, the summaries inside `multi_gpu*.json` parts, and the `runs/*/summary.json` of `runs*.tar.gz` archives
(with the run's temperature-0 evaluation: its acceptance.json, or the quality bench's acceptance-t0.json). A run
found in several places is recorded once. Then (unless --no-report) the report stage's code builds report.md,
regressions.json and the plots over that history, the same as

    python -m dflash report --config config/h200.yaml --runs-dir <out>/runs --out <out>

(no `<out>/runs` folder: the report reads the history alone). Runs are compared with earlier runs of the same name,
hardware and placement, so the H200 series (h200-1t1d, h200-1t1d-fp8all, ...) gets its regressions and attribution.

The code a run measured: a summary's `git.commit` is what the lent machine's `.git` said, which was stale there.
Each snapshot's `git` is therefore, in this order: the tree the bench recorded beside the summary (`bench.tree`,
bench/common.py: its commit, or a commit of this repository whose files hash the same), the commit whose short hash
ends the file's name (`summary-1t1d-7bbc115.json`: the session named the tree it ran), the tree the quality bench's
table recorded beside an archive (`quality.json` `git`), else the summary's own as recorded. `git.source` says which,
`git.recorded` keeps the summary's, `bench_source` names the file.
"""
from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import find_commits, git  # noqa: E402
from dflash.paths import RunFolder  # noqa: E402

SHORT = re.compile(r"-([0-9a-f]{7,40})$")


@functools.cache
def commit_of_tree(hash_: str) -> str | None:
    """The newest commit (of the last 200) whose tree hashes to `hash_`."""
    return next(iter(find_commits(hash_)), None)


def full_commit(short: str) -> str | None:
    out = git("rev-parse", "--verify", "-q", f"{short}^{{commit}}")
    return out.strip() if out else None


def code_of(summary: dict, source: Path) -> dict:
    """The snapshot's `git`: {commit, dirty, source, recorded} (see the module's docstring)."""
    recorded = summary.get("git") or {}
    tree = (summary.get("bench") or {}).get("tree") or {}
    commit = tree.get("commit") or (commit_of_tree(tree["hash"]) if tree.get("hash") else None)
    if commit:
        return {"commit": commit, "dirty": False, "source": "bench record", "recorded": recorded}
    if tree.get("hash"):
        return {"commit": f"tree {tree['hash']}", "dirty": True, "source": "bench record (no commit has its files)",
                "recorded": recorded}
    m = SHORT.search(source.name.split(".")[0])
    if m:
        return {"commit": full_commit(m.group(1)) or m.group(1), "dirty": None, "source": "file name",
                "recorded": recorded}
    q = source.parent / "quality.json"          # an archive of the quality bench: the tree its table recorded
    if source.name.endswith(".tar.gz") and q.exists() and isinstance(json.loads(q.read_text()).get("git"), str):
        short = json.loads(q.read_text())["git"]
        return {"commit": full_commit(short) or short, "dirty": None, "source": "quality.json beside it",
                "recorded": recorded}
    return {**recorded, "source": "as recorded (the lent machine's .git may have been stale)", "recorded": recorded}


def acceptance_t0(files: dict[str, dict]) -> dict | None:
    """The run's temperature-0 evaluation among {file name: content}: acceptance.json, else acceptance-t0.json."""
    for name in (RunFolder.ACCEPTANCE, RunFolder("").acceptance(0).name):
        a = files.get(name)
        if isinstance(a, dict) and (a.get("temperature") in (0, 0.0, None)):
            return a
    return None


def from_archive(path: Path) -> list[tuple[dict, dict | None]]:
    """(summary, its T=0 evaluation) of every runs/<run>/summary.json in a tar.gz."""
    runs: dict[str, dict[str, dict]] = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 3 and parts[0] == "runs" and parts[2].endswith(".json"):
                runs.setdefault(parts[1], {})[parts[2]] = json.load(tar.extractfile(m))
    return [(f[RunFolder.SUMMARY], acceptance_t0(f)) for _, f in sorted(runs.items()) if RunFolder.SUMMARY in f]


def collect(results: Path) -> list[tuple[Path, dict]]:
    """(source, summary with its evaluation under `_acceptance`) of every committed run, each run once."""
    found, seen = [], set()

    def add(source: Path, summary, acceptance=None):
        if not isinstance(summary, dict) or not summary.get("run_id") or summary["run_id"] in seen:
            return
        seen.add(summary["run_id"])
        rel = source.relative_to(REPO).as_posix() if source.is_relative_to(REPO) else str(source)
        found.append((source, {**summary, "git": code_of(summary, source), "bench_source": rel,
                               "_acceptance": acceptance}))
    for f in sorted(results.glob("*/summary*.json")):
        add(f, json.loads(f.read_text()))
    for f in sorted(results.glob("*/multi_gpu*.json")):
        for part in (json.loads(f.read_text()).get("parts") or {}).values():
            add(f, (part or {}).get("summary"))
    for f in sorted(results.glob("*/runs*.tar.gz")):
        for summary, acceptance in from_archive(f):
            add(f, summary, acceptance)
    return found


def write(results: Path, out: Path, report: bool = True, config: str = "config/h200.yaml") -> list:
    """Record every committed run in `<out>`'s history (snapshots + history.csv) and build the report over it;
    returns the history's runs."""
    from dflash.report import history
    found = collect(results)
    for _, s in found:
        history.validate_summary(s, Path(s["bench_source"]))
    runs, new, skipped = history.History(out).update(found)
    print(f"{len(runs)} run(s) in {out}/history ({len(new)} new, {len(skipped)} skipped)", flush=True)
    if report:
        from dflash import config as C
        from dflash.report import build
        build(out / "runs", out, C.load(REPO / config).cfg.report)
        print(f"report: {out / 'report.md'}", flush=True)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(REPO / "bench" / "results"))
    p.add_argument("--out", default=str(REPO / "bench" / "out" / "history"))
    p.add_argument("--no-report", action="store_true", help="the history only, no report.md")
    args = p.parse_args(argv)
    write(Path(args.results), Path(args.out), not args.no_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
