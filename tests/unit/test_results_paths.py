"""No committed result names the machine that made it (issue 50): the JSON, logs, READMEs and archived records under
bench/results/ carry paths relative to the repository, and placeholders (`<tmp>`, `~`, `<venv>`, `<site>`) for the
machine's folders outside it; the bench writes them so (bench/common.py `portable`: Record.save, the command, the
summaries and logs the e2e section copies out, the archives of bench/multi_gpu.py and bench/quality_device.sh)."""
import io
import json
import re
import tarfile
from pathlib import Path

from bench import common

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "bench" / "results"
# a path that starts at a machine's folder: its temporary, home, work or software folders, or this checkout
MACHINE = re.compile(r"(?<![\w.~/-])(?:/(?:tmp|work|root|home|opt|scratch|mnt)(?![\w.-])|" + re.escape(str(REPO)) + ")")
BINARY = re.compile(r"\.(gz|tgz|png|zip|pt|safetensors|arrow|bin)$")
TARS = (".tar.gz", ".tgz")
TEXT = (".json", ".jsonl", ".log", ".txt", ".md", ".yaml", ".yml", ".csv")


def lines_with_machine_paths(name: str, text: str) -> list[str]:
    return [f"{name}:{n}: {line.strip()[:160]}" for n, line in enumerate(text.splitlines(), 1) if MACHINE.search(line)]


def machine_paths(results: Path) -> list[str]:
    """'file:line: text' of every machine path in the text files under results, and in the text members of its
    archives ('archive!member:line: text'); images, traces and weights left out."""
    out = []
    for p in sorted(x for x in results.rglob("*") if x.is_file()):
        name = p.relative_to(results).as_posix()
        if p.name.endswith(TARS):
            with tarfile.open(p) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith(TEXT):
                        text = tar.extractfile(m).read().decode(errors="replace")
                        out += lines_with_machine_paths(f"{name}!{m.name}", text)
        elif not BINARY.search(p.name):
            out += lines_with_machine_paths(name, p.read_text(errors="replace"))
    return out


def test_no_committed_result_names_a_machine_path():
    found = machine_paths(RESULTS)
    assert not found, f"{len(found)} machine path(s) in bench/results (write them as bench/common.py portable() " \
                      "does):\n" + "\n".join(found[:20])


def test_the_check_finds_a_machine_path(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "bench.json").write_text(json.dumps({"command": "python3 bench/h200.py --out /tmp/e2e"}))
    (tmp_path / "run" / "README.md").write_text("ran in /work/main/results/runs/x\nrelative: results/runs/x\n")
    (tmp_path / "run" / "train.log").write_text(f'File "{REPO}/dflash/cli.py", line 3\n/tmpfoo is a word\n')
    with tarfile.open(tmp_path / "run" / "runs.tar.gz", "w:gz") as tar:
        data = b'{"dir": "runs/x"}\n{"out": "/root/out/x"}\n'
        info = tarfile.TarInfo("runs/x/metrics.jsonl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert machine_paths(tmp_path) == [
        'run/README.md:1: ran in /work/main/results/runs/x',
        'run/bench.json:1: {"command": "python3 bench/h200.py --out /tmp/e2e"}',
        'run/runs.tar.gz!runs/x/metrics.jsonl:2: {"out": "/root/out/x"}',
        f'run/train.log:1: File "{REPO}/dflash/cli.py", line 3']


def test_a_record_is_saved_without_the_machine_paths(tmp_path, monkeypatch):
    """The repository's paths relative to it, the temporary and home folders as placeholders; figures untouched."""
    monkeypatch.setattr(common.tempfile, "gettempdir", lambda: "/tmp")
    monkeypatch.setattr(common.Path, "home", staticmethod(lambda: Path("/root")))
    rec = common.Record.__new__(common.Record)
    rec.path = tmp_path / "bench.json"
    rec.update({"command": "python3 bench/h200.py --out /tmp/e2e", "ktok_per_s": 12.92, "steps": [1, 2],
                "error": f'Traceback:\n  File "{REPO}/dflash/cli.py", line 3\n  in {REPO}\n',
                "summary": {"out": "/root/out/x", "run_dir": f"{REPO}/results/runs/h200", "rel": "results/runs/h"}})
    rec.save()
    saved = json.loads(rec.path.read_text())
    assert saved == {"command": "python3 bench/h200.py --out <tmp>/e2e", "ktok_per_s": 12.92, "steps": [1, 2],
                     "error": 'Traceback:\n  File "dflash/cli.py", line 3\n  in .\n',
                     "summary": {"out": "~/out/x", "run_dir": "results/runs/h200", "rel": "results/runs/h"}}
    assert not machine_paths(tmp_path)
    root = Path("/srv/checkout")   # a checkout outside the temporary folder (this one may be under /tmp itself)
    assert common.portable("/srv/checkoutx /tmpfoo a/tmp/b", root) == "/srv/checkoutx /tmpfoo a/tmp/b"   # only where
    assert common.portable("/srv/checkout/dflash /srv/checkout", root) == "dflash ."                     # a path starts


def test_an_archive_of_the_runs_is_written_without_machine_paths(tmp_path, monkeypatch):
    """bench/quality_device.sh and bench/multi_gpu.py archive the runs' records and logs through add_portable."""
    monkeypatch.setattr(common.tempfile, "gettempdir", lambda: "/tmp")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "logs").mkdir(parents=True)
    (tmp_path / "results" / "logs" / "train.log").write_text(f'File "{REPO}/dflash/cli.py"\nout /tmp/x\n')
    (tmp_path / "results" / "summary.json").write_text(json.dumps({"executable": f"{REPO}/.venv/bin/python",
                                                                   "ktok_per_s": 12.92}))
    (tmp_path / "out").mkdir()
    assert common.main(["archive", "out/runs.tgz", "results/logs", "results/summary.json"]) == 0
    with tarfile.open(tmp_path / "out" / "runs.tgz") as tar:
        assert sorted(tar.getnames()) == ["results/logs/train.log", "results/summary.json"]
        assert tar.extractfile("results/logs/train.log").read().decode() == 'File "dflash/cli.py"\nout <tmp>/x\n'
        assert json.load(tar.extractfile("results/summary.json"))["ktok_per_s"] == 12.92
    assert not machine_paths(tmp_path / "out")


def test_older_results_are_rewritten_in_place(tmp_path):
    """bench/portable.py: a results folder made before the bench wrote paths portably (its text files and archived
    members), with the repository's copy on that machine named; strings change, figures do not."""
    from bench import portable
    run = tmp_path / "2027-01-01-h200"
    run.mkdir()
    doc = {"command": "python3 bench/h200.py --out /root/out/e2e", "ktok_per_s": 12.92,
           "env": {"executable": "/opt/torch/.venv/bin/python3"}, "error": 'File "/work/main/dflash/cli.py"'}
    (run / "bench.json").write_text(json.dumps(doc))
    (run / "train.log").write_text("/opt/torch/.venv/lib/python3.12/site-packages/torch/x.py:3: warning\n"
                                   "PYTHONPATH=/tmp/site:$PWD, cache /tmp/torchinductor_root, cd /work/main\n")
    with tarfile.open(run / "runs.tar.gz", "w:gz") as tar:
        data = json.dumps({"dir": "/work/main/results/runs/x", "tau": 5.355}).encode()
        info = tarfile.TarInfo("runs/x/summary.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert len(machine_paths(tmp_path)) == 4             # bench.json, two log lines, the archived summary
    assert portable.main(["--root", "/work/main", str(run)]) == 0
    assert not machine_paths(tmp_path)
    assert json.loads((run / "bench.json").read_text()) == {
        "command": "python3 bench/h200.py --out ~/out/e2e", "ktok_per_s": 12.92,
        "env": {"executable": "<venv>/bin/python3"}, "error": 'File "dflash/cli.py"'}
    assert (run / "train.log").read_text() == ("<site>/torch/x.py:3: warning\n"
                                               "PYTHONPATH=<site>:$PWD, cache <tmp>/torchinductor_root, cd .\n")
    with tarfile.open(run / "runs.tar.gz") as tar:
        assert json.load(tar.extractfile("runs/x/summary.json")) == {"dir": "results/runs/x", "tau": 5.355}
