"""The optimizer recipe options on CPU: Muon's groups cover every trainable parameter exactly once (a parameter left
out or doubled is refused, naming it), each group's LR is the one configured, and the warm-up + cosine schedule
over steps or over a time budget."""
import math

import pytest
import torch

from dflash import config as C
from dflash.train import optim
from support.model import make_drafter, tiny_cfg

MATRICES = ["fc.weight"] + [f"layers.{i}.{m}.weight" for i in range(2) for m in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
NORMS = ["hidden_norm.weight", "norm.weight"] + [f"layers.{i}.{m}.weight" for i in range(2) for m in (
    "input_layernorm", "self_attn.q_norm", "self_attn.k_norm", "post_attention_layernorm")]


def train_cfg(**train):
    return C.from_dict({"train": train}).cfg.train


def test_muon_groups_cover_every_parameter_once_and_state_their_lr():
    d = make_drafter(tiny_cfg())
    named = list(d.named_parameters())
    groups = optim.param_groups(named, "muon")
    assert sorted(n for n, _ in groups["muon"]) == sorted(MATRICES)     # every 2-D weight: the layers' and fc
    assert sorted(n for n, _ in groups["adamw"]) == sorted(NORMS)       # the rest: norm weights
    opt, _ = optim.build(named, train_cfg(optimizer="muon", lr=3e-4, muon_lr=2e-3), torch.device("cpu"))
    muon, adamw = opt.parts["muon"], opt.parts["adamw"]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert [len(g["params"]) for g in opt.param_groups] == [len(MATRICES), len(NORMS)]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in d.parameters()}
    assert muon.param_groups[0]["lr"] == 2e-3 and muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    assert adamw.param_groups[0]["lr"] == 3e-4
    opt.set_lr(0.5)                                   # one schedule factor for both groups
    assert (muon.param_groups[0]["lr"], adamw.param_groups[0]["lr"], opt.lr) == (1e-3, 1.5e-4, 1.5e-4)
    plain, _ = optim.build(named, train_cfg(), torch.device("cpu"))
    assert list(plain.parts) == ["adamw"] and len(plain.param_groups[0]["params"]) == len(named)


def test_a_parameter_left_out_or_doubled_is_refused_by_name(monkeypatch):
    d = make_drafter(tiny_cfg())
    named = list(d.named_parameters())
    groups = optim.param_groups(named, "muon")
    optim.check_partition(named, groups)
    with pytest.raises(RuntimeError, match=r"left out: fc\.weight$"):
        optim.check_partition(named, {"muon": groups["muon"][1:], "adamw": groups["adamw"]})
    with pytest.raises(RuntimeError, match=r"in two groups: norm\.weight \(in adamw and muon\)"):
        optim.check_partition(named, {"adamw": groups["adamw"], "muon": groups["muon"] + groups["adamw"][-1:]})
    # a rule that drops a matrix from Muon without giving it to AdamW (the shape of speculators PR #1066): the
    # build refuses it instead of training without it
    rule = optim.param_groups
    monkeypatch.setattr(optim, "param_groups", lambda named, o: {k: [(n, p) for n, p in v if "down_proj" not in n]
                                                                 for k, v in rule(named, o).items()})
    with pytest.raises(RuntimeError, match=r"left out: layers\.0\.mlp\.down_proj\.weight, layers\.1\.mlp\.down"):
        optim.build(named, train_cfg(optimizer="muon"), torch.device("cpu"))


def test_optimizer_state_round_trips_and_refuses_another_optimizer():
    d = make_drafter(tiny_cfg())
    opt, _ = optim.build(d.named_parameters(), train_cfg(optimizer="muon"), torch.device("cpu"))
    sum(p.square().sum() for p in d.parameters()).backward()
    opt.step([p for p in d.parameters() if p.requires_grad], torch.tensor(1.0), 0.0)
    state = opt.state_dict()
    assert set(state) == {"muon", "adamw"} and len(state["muon"]["state"]) == len(MATRICES)
    again, _ = optim.build(d.named_parameters(), train_cfg(optimizer="muon"), torch.device("cpu"))
    again.load_state_dict(state)
    for p in d.parameters():
        if p.ndim == 2:
            got, want = (o.parts["muon"].state[p]["momentum_buffer"] for o in (again, opt))
            assert torch.equal(got, want) and got.abs().sum() > 0
    plain, _ = optim.build(d.named_parameters(), train_cfg(), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"holds \['adamw', 'muon'\], this run's optimizer is \['adamw'\]"):
        plain.load_state_dict(state)


def cos_factor(progress, low=0.1):   # the cosine part by hand: 1 at 0, `low` at 1
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def test_schedule_over_steps_and_over_a_time_budget():
    steps = optim.Schedule(train_cfg(steps=10, warmup_ratio=0.2, min_lr_ratio=0.1))
    want = [0.5, 1.0] + [cos_factor(k / 8) for k in range(8)]       # 2 warm-up steps, then cosine over 8
    assert [steps.factor(s, 1e9) for s in range(10)] == pytest.approx(want, rel=1e-12)
    assert not steps.spent(1e9)                                     # no budget: the steps end the run
    timed = optim.Schedule(train_cfg(steps=10, warmup_ratio=0.1, min_lr_ratio=0.1, time_budget_s=100))
    got = [timed.factor(3, e) for e in (5, 10, 55, 100, 150)]      # the step does not matter, the time does
    assert got == pytest.approx([0.5, 1.0, cos_factor(0.5), 0.1, 0.1], rel=1e-12)
    assert not timed.spent(99.99) and timed.spent(100.0)
    timed.elapsed_s = 42.5
    again = optim.Schedule(train_cfg(time_budget_s=100))
    again.load_state_dict(timed.state_dict())
    assert again.elapsed_s == 42.5
