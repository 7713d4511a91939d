"""The memory estimate before the first step: close to the peak RSS a CPU micro-step really adds, and a refusal
naming the keys to change for the reported case (num_anchors=1000 on the CPU demo, killed at 24 GB RSS)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflash.errors import UserError
from dflash.model import DrafterConfig
from dflash.train import memory as M

REPO = Path(__file__).resolve().parents[2]
GiB = 2 ** 30


def demo(num_layers=2):
    """The CPU demo's drafter: the tiny target (H 128, 4/2 heads, I 384, vocab 2048), block 16."""
    return DrafterConfig(vocab_size=2048, hidden_size=128, num_layers=num_layers, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=384, target_layer_ids=[0, 1, 2],
                         mask_token_id=2047, num_target_layers=4, block_size=16)


def train(**kw):
    t = dict(batch_size=4, num_anchors=32, loss_chunk=2048, dtype="auto", queue_size=4, compile=False, objective="ce",
             recompute_weight_casts=False, fp8_lm_head=False)
    t.update(kw)
    return SimpleNamespace(**t)


MEASURE = """
import json, sys, torch
torch.set_num_threads(1)
from dflash.model import DFlashDrafter, block_labels, dflash_loss, sample_anchors
sys.path.insert(0, sys.argv[1]); from test_memory import demo

def status(key):  # kB -> bytes, from /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

b, S, A = 4, 512, 128
cfg = demo()
d = DFlashDrafter(cfg, torch.randn(cfg.vocab_size, 128), torch.randn(cfg.vocab_size, 128) * 0.02)
opt = torch.optim.AdamW(d.parameters())
feats, ids = torch.randn(b, S, 3 * 128), torch.randint(0, cfg.vocab_size - 1, (b, S))
lm = torch.ones(b, S, dtype=torch.bool)
with open("/proc/self/clear_refs", "w") as f:   # reset the peak (VmHWM): import-time peaks do not count
    f.write("5")
before = status("VmRSS:")
anchors = sample_anchors(lm, A, cfg.block_size, torch.Generator().manual_seed(0))
labels, weights = block_labels(ids, lm, anchors, 7.0)
out = dflash_loss(d(feats, ids, anchors, backend="sdpa"), d.lm_head_weight, labels, weights, 16, 2048, fused=True)
out.loss.backward()
opt.step()
print(json.dumps(status("VmHWM:") - before))
"""


def test_estimate_is_close_to_the_measured_cpu_peak():
    r = subprocess.run([sys.executable, "-c", MEASURE, str(Path(__file__).parent)], capture_output=True, text=True,
                       cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    measured = json.loads(r.stdout.strip().splitlines()[-1])
    est = M.estimate(demo(), train(num_anchors=128, queue_size=0), 512, "sdpa", "cpu")["total"]
    assert 0.9 <= est / measured <= 1.4, (est, measured)     # 646 MB vs 540-579 MB measured


@pytest.mark.parametrize("key", sorted(M.CALIBRATION))
def test_estimate_covers_each_calibration_point(key):
    """Never below what was measured (a refusal must not be needed to avoid an OOM), at most 1.3x above."""
    b, S, A, L, backend = key
    est = M.estimate(demo(L), train(batch_size=b, num_anchors=A, queue_size=0), S, backend, "cpu")["total"]
    assert 1.0 <= est / M.CALIBRATION[key] <= 1.3, est / M.CALIBRATION[key]


def test_estimate_follows_the_shapes():
    base = M.estimate(demo(), train(num_anchors=128), 512, "sdpa", "cpu")
    assert M.estimate(demo(4), train(num_anchors=128), 512, "sdpa", "cpu")["activations"] > 1.9 * base["activations"]
    flex = M.estimate(demo(), train(num_anchors=128), 512, "flex", "cpu")
    bQT = 4 * (128 * 16) * (512 + 128 * 16)   # sdpa: a boolean mask, and a float32 copy saved by each layer
    assert base["activations"] - flex["activations"] == bQT + 2 * 4 * bQT
    assert M.estimate(demo(), train(num_anchors=128, batch_size=8), 512, "sdpa", "cpu")["total"] > 1.8 * base["total"]
    # the reported case: ~10 GiB per replica of a run killed at 24 GB RSS with two replicas
    assert 9 * GiB < M.estimate(demo(), train(num_anchors=1000), 512, "sdpa", "cpu")["total"] < 14 * GiB


def test_check_refuses_what_cannot_fit_naming_the_keys(monkeypatch):
    monkeypatch.setattr(M, "capacity", lambda device: (20 * GiB, "available"))
    ok = M.check(demo(), train(), 512, "cpu", "sdpa", replicas=2)         # the demo as shipped
    assert ok["device_total"] < GiB and ok["capacity"] == 20 * GiB
    with pytest.raises(UserError) as e:
        M.check(demo(), train(num_anchors=1000), 512, "cpu", "sdpa", replicas=2)
    msg = str(e.value)
    assert "\n" not in msg and "train.batch_size" in msg and "data.bucket_edges (512)" in msg
    fit = int(msg.split("set train.num_anchors to ")[1].split()[0])
    M.check(demo(), train(num_anchors=fit), 512, "cpu", "sdpa", replicas=2)   # the advice holds
    with pytest.raises(UserError):
        M.check(demo(), train(num_anchors=fit + 1), 512, "cpu", "sdpa", replicas=2)
    # a GPU's own weights count: the target bound there leaves less room
    with pytest.raises(UserError, match="lower train.num_anchors"):
        M.check(demo(), train(), 512, "cpu", "sdpa", resident=20 * GiB)


def test_estimate_covers_the_measured_h200_drafter_step_without_wild_excess():
    """GPU calibration: the drafter step (one replica, no reduction buffers) measured on an H200 at three shapes
    (`bench/h200.py --sections specforge`, committed JSON) against the estimate for the same config."""
    from dflash import config as C
    repo = Path(__file__).resolve().parents[2]
    bench = json.loads((repo / "bench/results/2026-11-29-h200-r2/bench-specforge-loss-profile.json").read_text())
    from transformers import Qwen3Config
    tconf = Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                        intermediate_size=12288, num_hidden_layers=36, vocab_size=151936, rms_norm_eps=1e-6,
                        rope_theta=1e6, max_position_embeddings=40960)
    for shape in ("3072/512", "8192/1024", "16384/2048"):
        S, A = (int(x) for x in shape.split("/"))
        loaded = C.load(repo / "config" / "h200.yaml", {"train.num_anchors": A, "train.batch_size": 1})
        d = DrafterConfig.from_target(tconf, loaded.cfg.drafter, 151669)
        est = M.estimate(d, loaded.cfg.train, S, "flex", "cuda", reduce="none")
        measured = bench["specforge"][shape]["ours"]["peak_gb"] * GiB
        assert 1.0 <= (est["total"] - est["features"]) / measured <= 1.2, shape
        assert M.estimate(d, loaded.cfg.train, S, "flex", "cuda")["grad_buffers"] == 8 * M.num_params(d)
