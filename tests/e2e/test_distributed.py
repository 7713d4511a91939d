"""The distributed runtime on CPU (gloo): 1 target rank + 2 drafter ranks under torchrun (SIGTERM to the launcher and
its lock: tests/e2e/test_faults_runs.py)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from dflash import config as C
from dflash.errors import UserError
from dflash.report.placement import suggest
from dflash.train.placement import resolve
from dflash.train.runtime.distributed import launch_config, torchrun_command
from support.train import REPO, ckpt, prepared, prepared_eval, run_dir, train_ok

pytestmark = pytest.mark.slow


def train(cfg, runtime, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--no-progress",
                           "--set", f"train.runtime={runtime}"], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, **kw)


def losses(cfg):
    return [json.loads(l)["loss"] for l in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]


def agrees_with_threads(s: dict, dist_cfg, thr_cfg, logged: int) -> None:
    """A distributed run's summary `s` against the threads run of the same config: its `logged` losses within 1e-4
    relative (same data order and anchors; only the order of the gradient sum differs), and one lifecycle's summary:
    the same keys, at the top and in every section, and the same step counts."""
    a, b = losses(dist_cfg), losses(thr_cfg)
    assert len(a) == len(b) == logged
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-4 * abs(y), (a, b)
    t = json.loads((run_dir(thr_cfg) / "summary.json").read_text())
    assert t["runtime"] == "threads" and set(s) == set(t), set(s) ^ set(t)
    for k in ("throughput", "time_split_s", "compile", "checkpoint", "data"):
        assert set(s[k]) == set(t[k]), (k, set(s[k]) ^ set(t[k]))
    assert s["steps"] == t["steps"] and s["measured_steps"] == t["measured_steps"] and s["finished"] == t["finished"]


def test_gloo_matches_threads_and_replicas_stay_identical(tmp_path):
    """1 target rank, 2 drafter ranks (one launch): train.objective ce+kl with train.loss_weighting dpace, so the split
    layout's features travel target rank -> drafter ranks with the target's final-norm states beside the context
    (gloo). The replicas stay identical; the losses, CE and KL and the summary equal the threads runtime's; the target
    rank's forward time reaches the summary; the threads run, its last checkpoint damaged, resumes from step 2 to the
    same weights, and so does the distributed run, cut at the same step."""
    from safetensors.torch import load_file
    recipe = {"steps": 4, "checkpoint_every": 2, "warmup_steps_excluded": 1, "objective": "ce+kl",
              "loss_weighting": "dpace"}
    dist_cfg, thr_cfg = prepared(tmp_path / "d", **recipe), prepared(tmp_path / "t", **recipe)
    r = train(dist_cfg, "distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    train_ok(thr_cfg, "--set", "train.runtime=threads")   # the reference, in this process: one launch fewer
    s = json.loads((run_dir(dist_cfg) / "summary.json").read_text())
    assert s["runtime"] == "distributed" and s["status"] == "completed" and s["steps"] == 4
    assert s["replicas_identical"] is True and len(s["replica_checksums"]) == 2
    assert {w["name"] for w in s["workers"]} == {"target-0", "drafter-0", "drafter-1"}
    # the target rank's forward time reaches the summary (drafter rank 0 sees none of its own), so the report can
    # suggest a split: the mean forward per measured micro-batch (grad_accum 1)
    tgt = next(w for w in s["workers"] if w["name"] == "target-0")
    assert tgt["forward_batches"] >= 2 * s["measured_steps"] and tgt["forward_s"] > 0
    assert s["time_split_s"]["target"] == pytest.approx(tgt["forward_s"])
    rows = {c: [json.loads(x) for x in (run_dir(c) / "metrics.jsonl").read_text().splitlines()]
            for c in (dist_cfg, thr_cfg)}
    assert [x["step"] for x in rows[dist_cfg]] == [x["step"] for x in rows[thr_cfg]] == [1, 2, 4]
    for a, b in zip(rows[dist_cfg], rows[thr_cfg]):
        assert a["kl"] > 0 and a["loss"] == pytest.approx(a["ce"] + a["kl"], rel=1e-6)   # float32 sums
        for key in ("loss", "ce", "kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-4), (key, a, b)
    t = json.loads((run_dir(thr_cfg) / "summary.json").read_text())
    assert s["kl"] > 0
    for key in ("loss", "ce", "kl"):   # summary.json's figures weight every step alike (DECAY) in both runtimes
        assert s[key] == pytest.approx(t[key], rel=1e-4), (key, s[key], t[key])
    agrees_with_threads(s, dist_cfg, thr_cfg, logged=3)
    s["devices"] = [{"device": f"cuda:{i}", "roles": [r]} for i, r in enumerate(["target", "drafter", "drafter"])]
    assert suggest(s)["current"] == {"targets": 1, "drafters": 2}
    final = ckpt(thr_cfg, 4) / "model.safetensors"
    first = {k: v.clone() for k, v in load_file(str(final)).items()}
    final.write_bytes(final.read_bytes()[:1000])
    train_ok(thr_cfg, "--set", "train.runtime=threads")
    assert json.loads((run_dir(thr_cfg) / "summary.json").read_text())["resumed_from_step"] == 2
    for k, v in load_file(str(final)).items():
        torch.testing.assert_close(v, first[k], rtol=0, atol=0)
    # issue 47 item 5: the distributed run cut after its step-2 checkpoint (the final one damaged, the outputs gone, as
    # after a kill and Snakemake's rerun) and resumed on gloo ends as the uncut one: weights, optimizer moments, the
    # learned figures of every row and of summary.json (0.9^age), bit for bit
    final = ckpt(dist_cfg, 4)
    first = {k: v.clone() for k, v in load_file(str(final / "model.safetensors")).items()}   # not a view of the file
    moments = torch.load(final / "optimizer.pt", weights_only=True)
    was = (rows[dist_cfg], json.loads((run_dir(dist_cfg) / "summary.json").read_text()))
    (final / "model.safetensors").write_bytes(b"cut")
    for name in ("summary.json", "metrics.jsonl"):
        (run_dir(dist_cfg) / name).unlink()
    r = train(dist_cfg, "distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir(dist_cfg) / "summary.json").read_text())
    assert (s["resumed_from_step"], s["steps"], s["replicas_identical"]) == (2, 4, True)
    got = load_file(str(final / "model.safetensors"))
    assert got.keys() == first.keys() and all(torch.equal(got[k], first[k]) for k in got)
    again = torch.load(final / "optimizer.pt", weights_only=True)
    assert all(torch.equal(x, again["adamw"]["state"][i][k]) for i, st in moments["adamw"]["state"].items()
               for k, x in st.items())
    now = {x["step"]: x for x in map(json.loads, (run_dir(dist_cfg) / "metrics.jsonl").read_text().splitlines())}
    # every step's LR and gradient norm (a resumed process also logs its last excluded warm-up step: rows' intervals,
    # hence their mean losses, may differ; summary.json's figures weight each step, whatever the rows)
    assert [(x["step"], x["lr"], x["grad_norm"]) for x in was[0]] == \
        [(x["step"], now[x["step"]]["lr"], now[x["step"]]["grad_norm"]) for x in was[0]]
    assert all(s[k] == was[1][k] for k in ("loss", "ce", "kl", "acc_per_position", "acceptance_estimate"))


def test_colocated_ranks_each_run_a_target_and_a_replica_and_rank_0_evaluates(tmp_path):
    """train.targets == train.drafters: 2 ranks, each with its own target and a drafter replica (no feature
    transport); the same losses as the threads runtime on that placement (which evaluates nothing), identical
    replicas. With train.eval_every 2, drafter-0 decodes with its own target at steps 2 and 4 while drafter-1 waits
    on the store: one launch for both."""
    two = {"targets": ["cpu", "cpu"], "drafters": ["cpu", "cpu"], "steps": 4, "log_every": 1}
    dist_cfg, thr_cfg = prepared_eval(tmp_path / "d", eval_every=2, **two), prepared_eval(tmp_path / "t", **two)
    r = train(dist_cfg, "distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 rank(s) on this node" in r.stderr
    train_ok(thr_cfg, "--set", "train.runtime=threads")   # the reference, in this process: one launch fewer
    s = json.loads((run_dir(dist_cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["steps"] == 4 and s["replicas_identical"] is True
    assert {w["name"] for w in s["workers"]} == {"drafter-0", "drafter-1"}
    assert [d["roles"] for d in s["devices"]] == [["target", "drafter"]] * 2
    assert all(w["forward_batches"] >= s["measured_steps"] for w in s["workers"]) and s["time_split_s"]["target"] > 0
    agrees_with_threads(s, dist_cfg, thr_cfg, logged=4)
    assert resolve(C.load(dist_cfg, {"train.runtime": "distributed"}).cfg.train).role(1) == "drafter-1 + target (cpu)"
    # rank 0's evaluations: in their rows and in summary.json
    rows = [json.loads(x) for x in (run_dir(dist_cfg) / "metrics.jsonl").read_text().splitlines()]
    assert s["runtime"] == "distributed" and s["eval"]["steps"] == [2, 4]
    assert [(x["step"], x["tau_step"]) for x in rows] == [(1, None), (2, 2), (3, None), (4, 4)]
    assert all(x["tau"] >= 1.0 for x in rows if x["tau_step"] is not None)


@pytest.mark.parametrize("fault", ["diverged", "non_finite"])
def test_a_failed_check_stops_every_rank(tmp_path, fault):
    """Divergence (replica 1 nudged) and a non-finite loss (an absurd learning rate) stop all ranks at the same step,
    the target rank included (it stops producing; the replicas take what it already sent): exit 1, named, no hang."""
    kw = {"diverge_at_step": {"replica": 1, "step": 3}, "check_every": 2} if fault == "diverged" else {"lr": 1e30}
    cfg = prepared(tmp_path, steps=40, **kw)
    r = train(cfg, "distributed", timeout=240)
    assert r.returncode == 1 and (run_dir(cfg) / "summary.json").exists(), r.stderr[-3000:]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "failed" and s["failure"]["kind"] == fault and s["steps"] <= 4, s["failure"]


def test_killed_rank_stops_the_job_named_and_the_resumed_run_ends_at_its_time_budget(tmp_path):
    """A rank killed (-9) stops the job at once, named. The same config resumed (Muon, train.time_budget_s 4; one
    launch serves both checks) continues from the newest checkpoint until the budget: the replicas (1 target rank, 2
    DDP replicas) agree on the time (reduced with the step's statistics; the seconds before the kill count), stop at
    the same step, identical, long before train.steps, and the target rank stops making features there (it is told
    the last step, not left to fill every step's)."""
    cfg = prepared(tmp_path, steps=2000, time_budget_s=4, optimizer="muon", checkpoint_every=2)
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--no-progress",
                             "--set", "train.runtime=distributed"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    made = lambda: list((run_dir(cfg) / "checkpoints").glob("*/step-000002"))  # noqa: E731
    pid_file = run_dir(cfg) / "ranks" / "rank-2.json"
    deadline = time.time() + 300
    while not (made() and pid_file.exists()) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert made(), proc.stderr.read()[-3000:] if proc.poll() is not None else "no checkpoint"
    newest = lambda: max(int(p.name.split("-")[1]) for p in (run_dir(cfg) / "checkpoints").glob("*/step-*"))  # noqa: E731
    at_kill = newest()
    os.kill(json.loads(pid_file.read_text())["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)             # a launcher that waits on the dead rank fails here
    assert newest() <= at_kill + 2                    # the live ranks stopped at once: no checkpoint past the next
    assert proc.returncode != 0
    assert "rank 2 = drafter-1 (cpu) failed with exit code -9" in err
    # resume with the same config: continues from the newest checkpoint to the end of the budget
    r = train(cfg, "distributed")
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    assert s["status"] == "completed" and s["resumed_from_step"] >= 2 and s["replicas_identical"] is True
    assert (s["finished"], s["finished_by"], s["time_budget_s"]) == (True, "time_budget", 4)
    assert s["train_seconds"] >= 4 and s["resumed_from_step"] < s["steps"] < 2000   # ends by the budget, not steps
    target = next(w for w in s["workers"] if w["name"] == "target-0")
    assert target["steps"] <= 2 * s["steps"] + 2 * 4 + 2    # the steps' micro-batches, plus what was in flight


def test_torchrun_command_construction(tmp_path, fake_gpus):
    fake_gpus(8)
    one = C.from_dict({"train": {"targets": ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"],
                                 "drafters": ["cuda:5", "cuda:6", "cuda:7"]}}, "seed.yaml")
    cmd = torchrun_command(one, resolve(one.cfg.train))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nnodes=1"]
    assert "--nproc-per-node=8" in cmd and "--standalone" in cmd and "--max-restarts=0" in cmd
    assert cmd[-5:] == ["dflash", "train", "--config", "seed.yaml", "--no-progress"]
    two = C.from_dict({"train": {"targets": [str(i) for i in range(8)] + [str(i) for i in range(5)],
                                 "drafters": ["5", "6", "7"],
                                 "rendezvous": {"nnodes": 2, "endpoint": "node1:29500", "id": "job42"}}}, "x.yaml")
    cmd = torchrun_command(two, resolve(two.cfg.train), ["train.steps=5"])
    assert "--nnodes=2" in cmd and "--nproc-per-node=8" in cmd and "--rdzv-backend=c10d" in cmd
    assert "--rdzv-endpoint=node1:29500" in cmd and "--rdzv-id=job42" in cmd and "--standalone" not in cmd
    assert cmd[-2:] == ["--set", "train.steps=5"]
    lc = launch_config(two, resolve(two.cfg.train))
    assert (lc.min_nodes, lc.max_nodes, lc.nproc_per_node, lc.max_restarts) == (2, 2, 8, 0)
    assert lc.rdzv_endpoint == "node1:29500" and lc.run_id == "job42" and lc.rdzv_backend == "c10d"
    lc, pl = launch_config(one, resolve(one.cfg.train)), resolve(one.cfg.train)
    assert lc.nproc_per_node == 8 and lc.rdzv_endpoint == "localhost:0"
    assert pl.role(6) == "drafter-1 (cuda:6)" and pl.role(0) == "target-0 (cuda:0)"
    no_endpoint = C.from_dict({"train": {"targets": ["0", "1"], "drafters": ["2", "3"], "rendezvous": {"nnodes": 2}}})
    with pytest.raises(UserError, match="endpoint"):
        torchrun_command(no_endpoint, resolve(no_endpoint.cfg.train))
    # co-located: every GPU in both lists (either spelling), one rank each
    eight = C.from_dict({"train": {"runtime": "distributed", "targets": [str(i) for i in range(8)],
                                   "drafters": [f"cuda:{i}" for i in range(8)]}}, "8gpu.yaml")
    pl = resolve(eight.cfg.train)
    assert launch_config(eight, pl).nproc_per_node == 8 and "--nproc-per-node=8" in torchrun_command(eight, pl)
    assert pl.role(3) == "drafter-3 + target (cuda:3)"
