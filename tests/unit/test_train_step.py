"""The training step's objective and its transport on CPU: however a step's micro-batches are split over replicas
and accumulation, the gradient is that of one batch holding them all (float64, 1e-10), and replicas stay
bit-identical; the run context's small truths (anchor cap, git state, NVML device lookup)."""
import logging
import subprocess

import pytest
import torch

from dflash import config as C
from dflash.train.context import RunContext, git_state, set_shapes
from dflash.train.runtime.threads import GradSync
from dflash.train.trainer import Micro, Replica, weight_checksum
from support.model import make_drafter, tiny_cfg
from support.threads import in_threads

S = 24
DENSITY = [0.15, 0.9, 0.35, 0.75]   # very unequal supervised-token counts per micro-batch


def context(**train) -> RunContext:
    t = {"num_anchors": 64, "grad_clip": 0.0, "dtype": "float32", "loss_chunk": 16, "compile": False}
    t.update(train)
    loaded = C.from_dict({"train": t})
    return RunContext(loaded, None, "sdpa", None, None, None, tiny_cfg(), 3.0, {}, False)


def sequences(cfg, n=len(DENSITY), width=None):
    """n sequences: features [n, S, width] (default the drafter's k*H context), tokens, loss masks."""
    g = torch.Generator().manual_seed(7)
    width = width or cfg.num_context_layers * cfg.hidden_size
    ids = torch.randint(0, cfg.vocab_size - 1, (n, S), generator=g)
    mask = torch.stack([torch.rand(S, generator=g) < d for d in DENSITY[:n]])
    return torch.randn(n, S, width, generator=g, dtype=torch.float64), ids, mask


def micro(feats, ids, mask, rows, index):
    return Micro(index, int(len(rows) * S), feats[rows], ids[rows], mask[rows])


def grads(rep):   # the step's gradient: what accumulate leaves, times the scale optimizer_step applies
    return [p.grad * rep.grad_scale.to(p.grad.dtype) for p in rep.params]


@pytest.mark.parametrize("n,accum,recipe", [
    (2, 2, {}), (1, 4, {}), (4, 1, {}),
    (2, 2, {"loss_weighting": "dpace"}), (4, 1, {"objective": "kl"}),
    (2, 2, {"loss_weighting": "dpace", "dpace_alpha": 0.3, "objective": "ce+kl"})])
def test_split_batch_has_the_gradient_of_the_whole_batch(n, accum, recipe):
    """Also for each loss recipe: D-PACE's weights depend on the drafter's own predictions (detached) and its loss
    is normalised by the blocks, kl reads the target's final states carried beside the context features."""
    from dflash.train.features import feature_width
    cfg = tiny_cfg()
    feats, ids, mask = sequences(cfg, width=feature_width(cfg, context(**recipe).cfg.train))
    assert len({int(m.sum()) for m in mask}) == 4      # unequal supervision, or the test proves nothing
    cpu = torch.device("cpu")

    whole_ctx = context(**recipe)
    whole = Replica(whole_ctx, 0, 1, cpu, make_drafter(cfg, dtype=torch.float64), GradSync(1))
    stats, _ = whole.accumulate([micro(feats, ids, mask, [0, 1, 2, 3], 0)])
    want = grads(whole)
    want_loss = float(stats[0] / stats[1])

    ctx = context(grad_accum=accum, **recipe)
    sync = GradSync(n)
    reps = [Replica(ctx, r, n, cpu, make_drafter(cfg, dtype=torch.float64), sync) for r in range(n)]
    # replica r, accumulation step a takes stream index a*n + r: row a*n + r of the whole batch
    out = in_threads(lambda r: reps[r].accumulate([micro(feats, ids, mask, [a * n + r], a * n + r)
                                                   for a in range(accum)]), n)
    for r in range(n):
        got = grads(reps[r])
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        assert float(out[r][0][0] / out[r][0][1]) == pytest.approx(want_loss, rel=1e-10)
        for g, g0 in zip(got, grads(reps[0])):
            assert torch.equal(g, g0)             # bit-identical across replicas


@pytest.mark.parametrize("n", [2, 3, 5])
def test_gradsync_sums_in_place_by_shards(n):
    """Reduce-scatter then all-gather: every replica ends with the rank-order sum, bit-identical, in its own tensors,
    for sizes that do not split evenly and tensors smaller than n."""
    g = torch.Generator().manual_seed(n)
    data = [[torch.randn(7, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)]
            for _ in range(n)]
    want = [sum(data[r][k] for r in range(n)) for k in range(2)]
    mine = [[t.clone() for t in ts] for ts in data]
    sync = GradSync(n)
    out = in_threads(lambda r: sync.reduce(r, mine[r])[0], n)
    for r in range(n):
        assert all(o is m for o, m in zip(out[r], mine[r]))                   # in place
        for k in range(2):
            torch.testing.assert_close(out[r][k], want[k], rtol=1e-15, atol=1e-15)
            assert torch.equal(out[r][k], out[0][k])


@pytest.mark.parametrize("optimizer,fused", [("adamw", False), ("adamw", True), ("adamw", "compiled"),
                                             ("muon", False), ("muon", True)])
@pytest.mark.parametrize("clip", [0.0, 1e-3, 1e6])
def test_optimizer_step_is_clip_then_the_optimizer_on_the_step_gradient(optimizer, fused, clip):
    """optimizer_step folds the 1/weight-sum scale and the clip coefficient into one factor (the fused AdamW's
    grad_scale, or one multiply; Muon has no grad_scale: always the multiply; "compiled": dflash.train.adamw's clip
    and update in one function, what train runs on a GPU's compile path, eager here): the weights after it equal torch's
    clip_grad_norm_ + the optimizer on the step gradient. muon: torch's Muon at train.muon_lr (match_rms_adamw) on
    the 2-D weights, AdamW at train.lr on the rest, both with train.weight_decay (not Muon's own default 0.1)."""
    cfg = tiny_cfg()
    feats, ids, mask = sequences(cfg)
    ctx = context(grad_clip=clip, optimizer=optimizer, muon_lr=2e-3, weight_decay=0.01)
    t = ctx.cfg.train
    rep = Replica(ctx, 0, 1, torch.device("cpu"), make_drafter(cfg), GradSync(1))
    adamw = rep.optimizer.parts["adamw"]
    if fused == "compiled":
        from dflash.train.adamw import CompiledAdamW
        rep.optimizer.compiled = CompiledAdamW(adamw, compiled=False)
    else:
        adamw.defaults["fused"] = fused
        for g in adamw.param_groups:
            g["fused"], g["foreach"] = fused, None if fused else True
    ref = make_drafter(cfg)
    ref.load_state_dict(rep.drafter.state_dict())
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    mats = [p for p in ref_params if p.ndim == 2] if optimizer == "muon" else []
    ref_opts = [torch.optim.AdamW([p for p in ref_params if p.ndim != 2 or not mats], lr=t.lr, betas=tuple(t.betas),
                                  weight_decay=t.weight_decay)]
    if mats:
        ref_opts.append(torch.optim.Muon(mats, lr=t.muon_lr, weight_decay=t.weight_decay,
                                         adjust_lr_fn="match_rms_adamw"))
    for step in range(2):
        rep.accumulate([micro(feats.float(), ids, mask, [0, 1], step)])
        for p, g in zip(ref_params, grads(rep)):
            p.grad = g.clone()
        want_norm = torch.nn.utils.clip_grad_norm_(ref_params, clip) if clip else None
        gnorm = rep.optimizer_step()
        factor = 1 / round(t.steps * t.warmup_ratio)          # step 0's warm-up factor (rep.steps stays 0 here)
        for opt, peak in zip(ref_opts, (t.lr, t.muon_lr)):
            opt.param_groups[0]["lr"] = peak * factor
            opt.step()
        assert rep.optimizer.lr == pytest.approx(t.lr * factor)
        if clip:
            assert float(gnorm) == pytest.approx(float(want_norm), rel=1e-5)
            assert (float(want_norm) > clip) == (clip == 1e-3)        # one case clips, the other does not
        for p, q in zip(rep.params, ref_params):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


def test_mean_of_micro_batch_means_is_not_the_objective():
    """The old normalisation (average of per-micro-batch weighted means) weighs a token of a sparse micro-batch
    more: the test above would catch it, since the two differ here by far more than its tolerance."""
    cfg = tiny_cfg()
    feats, ids, mask = sequences(cfg, 2)
    ctx = context()
    drafter = make_drafter(cfg, dtype=torch.float64)
    from dflash.train.step import micro_step
    outs = [micro_step(drafter, feats[[i]], ids[[i]], mask[[i]], i, ctx, None) for i in range(2)]
    w = [float(o.weight_sum) for o in outs]
    mean_of_means = sum(float(o.loss.detach()) for o in outs) / 2
    global_mean = sum(float(o.loss.detach()) * wi for o, wi in zip(outs, w)) / sum(w)
    assert abs(w[0] - w[1]) > 0.5 * max(w) and abs(mean_of_means - global_mean) > 1e-3


def test_exact_checksum_sees_one_ulp():
    d = make_drafter(tiny_cfg())
    a = weight_checksum(d)
    with torch.no_grad():
        p = next(d.parameters())
        p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1e9))
    assert not torch.equal(a, weight_checksum(d))


def test_anchor_cap_per_bucket_warns(caplog):
    ctx = context(num_anchors=200)
    with caplog.at_level(logging.WARNING, logger="dflash.train"):
        set_shapes(ctx, [(2, 64), (2, 128), (2, 512)])
    assert ctx.anchors_for(64) == 63 and ctx.anchors_for(128) == 127 and ctx.anchors_for(512) == 200
    assert "train.num_anchors=200" in caplog.text and "[64, 128]" in caplog.text


def test_git_state_is_none_outside_the_projects_own_repository(tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    monkeypatch.setattr("dflash.train.context.REPO", outer / "copy")   # a copy of the project without .git
    assert git_state() == {"commit": None, "dirty": None}
    monkeypatch.setattr("dflash.train.context.REPO", outer)
    assert len(git_state()["commit"]) == 40


def test_nvml_handle_follows_cuda_visible_devices(monkeypatch):
    import pynvml

    from dflash.train.telemetry import nvml_handle
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: ("index", i))
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda u: ("uuid", u))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaaa,GPU-bbbb")
    assert nvml_handle(1) == ("uuid", "GPU-bbbb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert nvml_handle(1) == ("index", 5)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert nvml_handle(2) == ("index", 2)


def test_anchors_scale_with_length(caplog):
    ctx = context(num_anchors=40, anchors_per_token=0.125)
    assert [ctx.anchors_for(s) for s in (64, 128, 512, 4)] == [8, 16, 40, 1]
    with caplog.at_level(logging.WARNING, logger="dflash.train"):
        set_shapes(ctx, [(2, 64), (2, 512)])
    assert "asks for more anchors" not in caplog.text   # scaled counts are not capped by the bucket
    ctx = context(num_anchors=200, anchors_per_token=1.0)   # 64 anchors wanted of a 64-token bucket: capped to 63
    with caplog.at_level(logging.WARNING, logger="dflash.train"):
        set_shapes(ctx, [(2, 64)])
    assert "train.anchors_per_token=1.0 asks for more anchors than the positions of bucket(s) [64]" in caplog.text
