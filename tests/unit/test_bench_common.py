"""bench/common.py: the tree a bench records is a hash of the source files on disk (so a stale or missing .git cannot
misname it), with the commit only where git's HEAD holds exactly those files; the envelope's command can be typed
again (its BENCH_* variables in front); the timer counts its calls; the budget keeps its reserve."""
import json
import shutil
import subprocess

import pytest

from bench import common


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "r"
    for path, text in {"dflash/a.py": "x = 1\n", "config/c.yaml": "k: 1\n", "bench/b.py": "y = 2\n",
                       "bench/results/s/summary.json": "{}\n", "README.md": "not code\n"}.items():
        (r / path).parent.mkdir(parents=True, exist_ok=True)
        (r / path).write_text(text)
    git(tmp_path, "init", "-q", str(r))
    git(r, "add", "-A")
    git(r, "commit", "-qm", "one")
    return r


def test_a_checkout_at_its_commit_records_the_commit_and_the_same_hash_as_git(repo):
    state = common.tree_state(repo)
    head = git(repo, "rev-parse", "HEAD")
    assert state["commit"] == head and state["files"] == 3          # dflash, config, bench less its results
    assert state["hash"] == common.tree_hash(common.commit_blobs("HEAD", repo))
    assert common.find_commits(state["hash"], root=repo) == [head]


def test_changed_source_names_the_files_and_no_commit_results_do_not_count(repo):
    before = common.tree_state(repo)["hash"]
    (repo / "bench/results/s/summary.json").write_text('{"new": 1}\n')   # a result, not code
    (repo / "README.md").write_text("changed\n")                          # outside the tree
    (repo / "dflash" / "__pycache__").mkdir()
    (repo / "dflash" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    assert common.tree_state(repo)["hash"] == before and common.tree_state(repo)["commit"]
    (repo / "dflash/a.py").write_text("x = 2\n")
    (repo / "dflash/new.py").write_text("")                               # untracked code counts too
    state = common.tree_state(repo)
    assert state["hash"] != before and state["commit"] is None
    assert state["head"] == git(repo, "rev-parse", "HEAD")
    assert state["differs"] == {"count": 2, "paths": ["dflash/a.py", "dflash/new.py"]}
    assert "differs in 2 file(s)" in common.tree_label(state)


def test_a_stale_or_missing_git_still_records_the_files(repo):
    """The lent machine: the files are a newer commit's while its .git says an older one, or .git is absent; the
    hash is the files', never git's word, and no commit is claimed."""
    one = git(repo, "rev-parse", "HEAD")
    (repo / "dflash/a.py").write_text("x = 2\n")
    git(repo, "commit", "-qam", "two")
    two = common.tree_state(repo)
    git(repo, "update-ref", "HEAD", one)           # a stale .git: HEAD at one, the files two's
    stale = common.tree_state(repo)
    assert stale["hash"] == two["hash"] and stale["commit"] is None and stale["head"] == one
    assert stale["differs"]["paths"] == ["dflash/a.py"]
    shutil.rmtree(repo / ".git")
    assert common.tree_state(repo) == {"hash": two["hash"], "files": 3, "commit": None}


def test_the_command_carries_its_bench_variables(monkeypatch):
    monkeypatch.setenv("BENCH_E2E_RUNS", "1t1d,restart")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("OTHER", "x")
    cmd = common.command(["bench/h200.py", "--sections", "e2e", "--opt", "e2e.runs=a b"])
    assert cmd.startswith("BENCH_E2E_RUNS=1t1d,restart CUDA_VISIBLE_DEVICES=1 ")
    assert cmd.endswith("bench/h200.py --sections e2e --opt 'e2e.runs=a b'") and "OTHER" not in cmd


def test_a_record_saves_its_envelope(tmp_path):
    rec = common.Record(tmp_path / "out" / "x.json", ["bench/x.py"])
    rec["figure"] = 1.5
    doc = json.loads(rec.save().read_text())
    assert doc["figure"] == 1.5 and doc["device"] == "cpu" and doc["devices"] == []
    assert {"command", "date", "python", "torch", "triton", "transformers", "cuda", "tree"} <= set(doc)
    assert len(doc["tree"]["hash"]) == 16 and doc["tree"]["files"] > 100


def test_the_timer_and_the_budget():
    calls = []
    ms = common.median_ms(lambda: calls.append(1), warmup=2, reps=5)
    assert len(calls) == 7 and ms >= 0
    assert common.peak_gb(lambda: None) is None           # no GPU here
    b = common.Budget(100, reserve=20)
    assert 79 < b.left() <= 80 and b.left(cap=10) == 10
    assert common.Budget(5, reserve=20).left() == 0.0     # never below 0


def test_profile_traces_stay_out_of_git():
    """A trace kept beside a result (bench/traces.py names them *.trace.json.gz) is ignored; its figures are not."""
    def ignored(path):
        return subprocess.run(["git", "-C", str(common.REPO), "check-ignore", "-q", "--no-index", path]).returncode == 0
    assert ignored("bench/results/2027-01-01-h200/profile.trace.json.gz")
    assert ignored("bench/results/2027-01-01-h200/regen-profile-static-512.trace.json.gz")
    assert not ignored("bench/results/2027-01-01-h200/profile-1t1d.json")
    assert not ignored("bench/results/2027-01-01-h200/regen.json")
