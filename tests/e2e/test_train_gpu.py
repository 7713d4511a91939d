"""Drafter replicas on CUDA (threads runtime): 2 and 3 replicas sharing cuda:0, and one replica per GPU where two
are visible, train 60 steps with bit-identical weights at every check and the same result as one replica that
takes the same micro-batches by gradient accumulation (bf16 autocast: losses within 2%, weights within 3% relative
per tensor). Before the stream-correct reduction this failed: replicas drifted apart (replicas_identical false)
and statistics were read from unwritten memory."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dflash.cli import main
from support.train import ckpt, prepared, run_dir

pytestmark = pytest.mark.gpu
STEPS = 60


def train(tmp_path, drafters, **kw):
    cfg = prepared(tmp_path, targets=["cuda:0"], drafters=drafters, runtime="threads", attention="flex", compile=True,
                   steps=STEPS,
                   checkpoint_every=0, log_every=1, warmup_steps_excluded=2, **kw)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    weights = load_file(str(ckpt(cfg, STEPS) / "model.safetensors"))
    return s, [r["loss"] for r in rows], weights


@pytest.mark.parametrize("layout", ["2x cuda:0", "3x cuda:0", "cuda:0 + cuda:1"])
def test_replicas_identical_and_equal_to_one_replica(tmp_path, layout):
    if layout == "cuda:0 + cuda:1":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
        drafters = ["cuda:0", "cuda:1"]
    else:
        drafters = ["cuda:0"] * int(layout[0])
    n = len(drafters)
    s, losses, weights = train(tmp_path / "replicas", drafters, check_every=1)
    assert s["status"] == "completed" and s["steps"] == STEPS, s.get("failure")
    assert s["replicas_identical"] is True and len(s["replica_checksums"]) == n
    assert all(0 <= a <= 1 for a in s["acc_per_position"])      # no statistics from unwritten memory
    assert s["throughput"]["ktok_per_s"] < 1e4
    one, one_losses, one_weights = train(tmp_path / "one", ["cuda:0"], grad_accum=n)
    assert len(losses) == len(one_losses) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, one_losses))
    assert worst < 2e-2, (worst, losses[-5:], one_losses[-5:])
    for k, w in weights.items():
        rel = (w.float() - one_weights[k].float()).norm() / one_weights[k].float().norm()
        assert rel < 3e-2, (k, float(rel))


@pytest.mark.parametrize("devices", ["cuda:0 x3", "cuda:0 + cuda:1"])
def test_gradsync_reads_only_finished_tensors_and_keeps_them_alive(devices):
    """Each replica thread makes its tensor on its own stream behind a long GPU sleep, reduces at once, then
    overwrites it at once: a reduction ordered by host barriers alone reads unfinished or overwritten memory."""
    from dflash.train.runtime.threads import GradSync
    from support.threads import in_threads
    if devices == "cuda:0 + cuda:1":
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs")
        devs = [torch.device("cuda:0"), torch.device("cuda:1")]
    else:
        devs = [torch.device("cuda:0")] * 3
    n, size, rounds = len(devs), 1 << 22, 20
    sync, bad = GradSync(n), []

    def replica(r):
        torch.cuda.set_device(devs[r])
        stream = torch.cuda.Stream(devs[r])
        with torch.cuda.stream(stream):
            for i in range(rounds):
                flat = torch.empty(size, device=devs[r])
                torch.cuda._sleep(20_000_000 * (r + 1))      # ~10 ms of GPU time before the value exists
                flat.fill_(float(r + 1 + i))
                (total,), _ = sync.reduce(r, [flat])         # in place: total is flat, summed
                want = sum(j + 1 + i for j in range(n))
                good, lo, hi = torch.all(total == want), total.min(), total.max()   # queued before the reuse
                flat.fill_(-1e6)                             # the producer reuses its memory right away
                if not good.item():
                    bad.append((r, i, float(lo), float(hi), want))

    in_threads(replica, n, timeout=120)
    assert not bad, bad[:5]


def test_recipe_levers_keep_replicas_identical_on_cuda(tmp_path):
    """Muon (eager, beside the fused AdamW of the norms), D-PACE weights and the ce+kl objective (the target's
    final-norm state captured beside the features), under bf16 autocast and compiled flex on one GPU with 2 replicas,
    ended by a time budget: replicas bit-identical at every step, losses finite, the run finished by its budget."""
    cfg = prepared(tmp_path, targets=["cuda:0"], drafters=["cuda:0", "cuda:0"], runtime="threads", attention="flex",
                   compile=True, steps=10_000, time_budget_s=8, checkpoint_every=0, log_every=1,
                   warmup_steps_excluded=2, check_every=1, optimizer="muon", loss_weighting="dpace",
                   objective="ce+kl")
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 0
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert s["status"] == "completed" and s["finished_by"] == "time_budget", s.get("failure")
    assert s["replicas_identical"] is True and len(s["replica_checksums"]) == 2
    assert 8 <= s["train_seconds"] < 8 + 5 and 10 < s["steps"] < 10_000
    assert all(torch.isfinite(torch.tensor([r["loss"], r["ce"], r["kl"]])).all() for r in rows)
    assert rows[-1]["kl"] < rows[0]["kl"] and rows[-1]["ce"] < rows[0]["ce"]
    assert s["compile"]["recompiles_after_warmup"] == 0


def test_compiled_adamw_equals_the_fused_adamw_on_cuda():
    """The compiled clip + AdamW step (dflash.train.adamw, what train runs on the compile path) against torch's fused
    AdamW with the clip folded into grad_scale (what it ran before) on the same CUDA gradients: norms and weights
    agree to float32 rounding over 5 steps, the clip active and not; its warm-up changes nothing, bit for bit."""
    from dflash.train.adamw import CompiledAdamW

    def params():
        g = torch.Generator(device="cuda").manual_seed(0)
        return [torch.nn.Parameter(torch.randn(*s, generator=g, device="cuda"))
                for s in ((1024, 512), (512,), (3, 4096))]
    ours, ref = params(), params()
    kw = dict(lr=6e-4, betas=(0.9, 0.95), weight_decay=0.01)
    fast = CompiledAdamW(torch.optim.AdamW(ours, **kw))
    fused = torch.optim.AdamW(ref, fused=True, **kw)
    fast.state()
    before = [p.detach().clone() for p in ours]
    fast.warm_up()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ours))
    for step in range(5):
        g = torch.Generator(device="cuda").manual_seed(step + 1)
        grads = [torch.randn(p.shape, generator=g, device="cuda") * (10 if step % 2 else 1e-4) for p in ours]
        scale = torch.tensor(0.5, device="cuda")
        norm = fast.step([x.clone() for x in grads], scale, 1.0)
        want = torch.nn.utils.get_total_norm(grads).double() * 0.5
        for p, x in zip(ref, grads):
            p.grad = x
        fused.grad_scale = (1 / (0.5 * torch.clamp(1.0 / (want + 1e-6), max=1.0))).float()
        fused.step()
        assert float(norm) == pytest.approx(float(want), rel=1e-5)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
