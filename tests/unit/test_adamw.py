"""dflash.train.adamw: the clip and AdamW's update as one function. Its math is torch's AdamW after clip_grad_norm_ on
`grad * scale`, step after step (learning rates changing, weight decay, clip active or not); its warm-up step changes
nothing, bit for bit; its state is torch's (a checkpoint moves between it and torch's AdamW either way); the
DrafterOptimizer paths agree. Eager here; compiled on the CPU in tests/e2e/test_train_compiled.py, and against the
fused AdamW on a GPU in tests/e2e/test_train_gpu.py."""
import copy

import pytest
import torch

from dflash import config as C
from dflash.train import optim
from dflash.train.adamw import CompiledAdamW


def tensors(seed: int = 0, shapes=((7, 5), (5,), (3, 4, 2))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def set_grads(params, seed: int, size: float):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * size


def reference_step(opt, params, scale: float, clip: float) -> float:
    """What the trainer meant before: grads * scale, clip_grad_norm_, torch's AdamW."""
    for p in params:
        p.grad.mul_(scale)
    norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip else torch.nn.utils.get_total_norm(
        [p.grad for p in params])
    opt.step()
    return float(norm)


@pytest.mark.parametrize("clip,wd,size", [(1.0, 0.0, 5.0), (1.0, 0.1, 0.01), (0.0, 0.05, 3.0)])
def test_update_is_torchs_adamw_after_the_clip(clip, wd, size):
    ours, ref = tensors(), tensors()
    kw = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
    fast = CompiledAdamW(torch.optim.AdamW(ours, **kw), compiled=False)
    slow = torch.optim.AdamW(ref, foreach=False, **kw)
    clipped = 0
    for step in range(6):
        lr = 3e-3 * (1 - step / 10)
        fast.group["lr"] = lr
        slow.param_groups[0]["lr"] = lr
        set_grads(ours, step, size)
        set_grads(ref, step, size)
        norm = fast.step([p.grad for p in ours], torch.tensor(0.5), clip)
        want = reference_step(slow, ref, 0.5, clip)
        clipped += bool(clip) and want > clip
        assert float(norm) == pytest.approx(want, rel=1e-5)
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)
    st = fast.opt.state[ours[0]]
    assert float(st["step"]) == 6 and st["step"].device.type == "cpu"
    torch.testing.assert_close(st["exp_avg_sq"], slow.state[ref[0]]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
    assert clipped == (6 if clip and size > 1 else 0)   # both regimes of the clip are exercised


@pytest.mark.parametrize("steps_before", [0, 3])
def test_the_warm_up_step_changes_nothing(steps_before):
    params = tensors(1)
    fast = CompiledAdamW(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), compiled=False)
    for s in range(steps_before):
        set_grads(params, s, 1.0)
        fast.step([p.grad for p in params], torch.tensor(1.0), 1.0)
    fast.state()   # a fresh optimizer's state exists before the warm-up reads it, as the first step makes it
    before = copy.deepcopy(fast.opt.state_dict()), [p.detach().clone() for p in params]
    hyper = fast.hyper.clone()
    fast.warm_up()
    after = fast.opt.state_dict()
    for a, b in zip(before[1], params):
        assert torch.equal(a, b.detach())
    for i, st in before[0]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k]), (i, k)
    assert torch.equal(hyper, fast.hyper)   # the run's own scalars are untouched by the warm-up's


def test_state_moves_between_torchs_adamw_and_the_compiled_step_both_ways():
    kw = dict(lr=1e-2, betas=(0.8, 0.9), weight_decay=0.01)
    a, b = tensors(2), tensors(2)
    fa = CompiledAdamW(torch.optim.AdamW(a, **kw), compiled=False)
    tb = torch.optim.AdamW(b, **kw)
    for s in range(2):
        set_grads(a, s, 0.1)
        set_grads(b, s, 0.1)
        fa.step([p.grad for p in a], torch.tensor(1.0), 0.0)
        tb.step()
    # swap: torch's state into a compiled stepper, the compiled one's into torch's AdamW
    c, d = [torch.nn.Parameter(p.detach().clone()) for p in b], [torch.nn.Parameter(p.detach().clone()) for p in a]
    fc = CompiledAdamW(torch.optim.AdamW(c, **kw), compiled=False)
    fc.opt.load_state_dict(tb.state_dict())
    td = torch.optim.AdamW(d, **kw)
    td.load_state_dict(fa.opt.state_dict())
    set_grads(c, 9, 0.1)
    set_grads(d, 9, 0.1)
    fc.step([p.grad for p in c], torch.tensor(1.0), 0.0)
    td.step()
    for x, y in zip(c, d):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-6, atol=1e-8)
    assert float(fc.opt.state[c[0]]["step"]) == 3


def test_drafter_optimizer_paths_agree():
    """DrafterOptimizer.step: the compiled update (here eager) and torch's for-each AdamW with the clip as the trainer
    applied it before, on the same gradients, scale and clip."""
    train = C.from_dict({"train": {"lr": 5e-3, "grad_clip": 0.5}}).cfg.train
    a, b = tensors(3), tensors(3)
    oa, _ = optim.build([(f"p{i}", p) for i, p in enumerate(a)], train, torch.device("cpu"))
    ob, _ = optim.build([(f"p{i}", p) for i, p in enumerate(b)], train, torch.device("cpu"))
    ob.compiled = CompiledAdamW(ob.parts["adamw"], compiled=False)
    for s in range(3):
        set_grads(a, s, 2.0)
        set_grads(b, s, 2.0)
        na = oa.step(a, torch.tensor(0.25), train.grad_clip)
        nb = ob.step(b, torch.tensor(0.25), train.grad_clip)
        assert float(na) == pytest.approx(float(nb), rel=1e-5) and float(na) > train.grad_clip
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), rtol=1e-5, atol=1e-7)
    assert oa.compiled is None   # on the CPU the run's optimizer is torch's unless it compiles


def test_the_compiled_step_is_for_one_adamw_group_only():
    train = C.from_dict({"train": {"optimizer": "muon"}}).cfg.train
    named = [("w", torch.nn.Parameter(torch.randn(4, 4))), ("n", torch.nn.Parameter(torch.ones(4)))]
    opt, _ = optim.build(named, train, torch.device("cpu"), compiled=True)
    assert opt.compiled is None   # Muon's group keeps torch's step
    with pytest.raises(ValueError, match="amsgrad"):
        CompiledAdamW(torch.optim.AdamW(tensors(), amsgrad=True), compiled=False)
