"""FP8 switches (train.precision fp8, train.fp8_lm_head, train.fp8_target), their wiring on the CPU (torch's CPU
_scaled_mm runs the real torchao code paths, small): which modules are converted, the frozen weights' FP8 copies
made once (never in a step), the weights saved and exported as the bf16 drafter's, and the refusals naming the key.
The numerics on a GPU (losses of the same batch within a stated tolerance of bf16, compiled with no recompile after
the warm-up) are in test_fp8_gpu.py."""
import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from dflash import config as C
from dflash.errors import UserError
from dflash.model import fp8
from dflash.train import precision
from dflash.train.context import RunContext
from dflash.train.step import build_drafter, micro_step
from support.model import tiny_cfg

V, H = 96, 32   # FP8 matmuls want dimensions that are multiples of 16
CPU = torch.device("cpu")


def context(**train) -> RunContext:
    t = {"num_anchors": 8, "dtype": "float32", "loss_chunk": 16, "compile": False}
    t.update(train)
    return RunContext(C.from_dict({"train": t}), None, "sdpa", None, None, None,
                      tiny_cfg(vocab_size=V, mask_token_id=V - 1), 3.0, {}, False)


def head_and_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    feats = torch.randn(2, 24, 3 * H, generator=g)
    ids = torch.randint(0, V - 1, (2, 24), generator=g)
    return embed, head, feats, ids, torch.ones(2, 24, dtype=torch.bool)


@pytest.fixture
def quantized(monkeypatch):
    """The shapes of every tensor torchao's Float8Tensor.from_hp quantizes (weights and activations alike)."""
    from torchao.quantization import Float8Tensor
    seen = []
    real = Float8Tensor.from_hp.__func__

    def spy(cls, hp, *a, **k):
        seen.append(tuple(hp.shape))
        return real(cls, hp, *a, **k)
    monkeypatch.setattr(Float8Tensor, "from_hp", classmethod(spy))
    return seen


def test_precision_fp8_converts_exactly_the_layers_linears_and_keeps_the_weights():
    from torchao.float8.float8_linear import Float8Linear
    embed, head, *_ = head_and_batch()
    base = build_drafter(context(), embed, head, CPU)
    d = build_drafter(context(precision="fp8"), embed, head, CPU)
    converted = [n for n, m in d.named_modules() if isinstance(m, Float8Linear)]
    assert converted == [n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n.startswith("layers.")]
    assert len(converted) == 2 * 7                            # q k v o gate up down, 2 layers
    assert type(d.fc) is nn.Linear                            # the context projection stays as it is
    assert "fp8_recipe" not in repr(base) and "dyn_ten_e4m3" in repr(d.layers[0].mlp.up_proj)   # tensorwise
    sd, want = d.state_dict(), base.state_dict()
    assert list(sd) == list(want)
    for k in want:                                            # the same fp32 master weights: no FP8 tensor saved
        assert type(sd[k]) is torch.Tensor and sd[k].dtype == torch.float32
        torch.testing.assert_close(sd[k], want[k], rtol=0, atol=0)
    rowwise = build_drafter(context(precision="fp8", fp8_recipe="rowwise"), embed, head, CPU)
    assert "dyn_axs_e4m3" in repr(rowwise.layers[0].self_attn.q_proj)


@pytest.mark.parametrize("switch", [{"precision": "fp8"}, {"fp8_lm_head": True},
                                    {"precision": "fp8", "fp8_lm_head": True}])
def test_fp8_step_is_close_to_the_bf16_step_on_the_same_batch(switch):
    """Same weights, batch and anchors: the loss within 1% and the layers' gradients in the same direction
    (FP8 e4m3 rounds each operand to ~3 significant bits; the CPU runs the same torchao code as the GPU)."""
    embed, head, feats, ids, mask = head_and_batch()
    out = {}
    for name, t in (("bf16", {}), ("fp8", switch)):
        c = context(**t)
        d = build_drafter(c, embed, head, CPU)
        res = micro_step(d, feats, ids, mask, 0, c, None)
        res.loss.backward()
        out[name] = float(res.loss), torch.cat([p.grad.flatten() for p in d.layers.parameters()])
    (a, ga), (b, gb) = out["bf16"], out["fp8"]
    assert a != b                                             # the FP8 path ran
    assert abs(a - b) / a < 1e-2, (a, b)
    assert torch.nn.functional.cosine_similarity(ga, gb, dim=0) > 0.98


def test_lm_head_fp8_copies_are_made_once_not_in_a_step(quantized):
    embed, head, feats, ids, mask = head_and_batch()
    c = context(fp8_lm_head=True)
    d = build_drafter(c, embed, head, CPU)
    assert quantized == [(V, H), (H, V)]                      # W for the logits, W.T for the input gradient
    copies = precision.loss_head(d)
    assert isinstance(copies, fp8.FrozenHead)
    plain = build_drafter(context(), embed, head, CPU)
    assert precision.loss_head(plain) is plain.lm_head_weight
    ptrs = (copies.w.qdata.data_ptr(), copies.wt.qdata.data_ptr())
    quantized.clear()
    for i in range(3):
        res = micro_step(d, feats, ids, mask, i, c, None)
        res.loss.backward()
    assert quantized, "the loss did not run through the FP8 head"
    assert (V, H) not in quantized and (H, V) not in quantized   # only activations: rows of H and of V columns
    assert {s[1] for s in quantized} == {H, V}
    assert precision.loss_head(d) is copies and (copies.w.qdata.data_ptr(), copies.wt.qdata.data_ptr()) == ptrs
    assert "_fp8_lm_head" not in "".join(d.state_dict())


def test_fp8_head_matmuls_match_the_weight():
    """FrozenHead.logits = h @ W.T and input_grad = g @ W, to FP8 rounding (rowwise e4m3: a few percent)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(V, H, generator=g).bfloat16()
    h, grad = torch.randn(40, H, generator=g).bfloat16(), torch.randn(40, V, generator=g).bfloat16()
    head = fp8.FrozenHead(w)
    for got, want in ((head.logits(h), h.float() @ w.float().t()), (head.input_grad(grad), grad.float() @ w.float())):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        rel = (got.float() - want).norm() / want.norm()
        assert 1e-3 < rel < 6e-2, float(rel)                  # FP8, not bf16, and close


def test_head_input_quantizer_asks_no_package_probe(monkeypatch):
    """quantize_rows runs inside torch.compile (train.compile): torchao's automatic kernel choice calls
    importlib.util.find_spec, which dynamo refused to trace on the H200 (torch 2.11), so it names torch's kernels.
    Its data and scales are torchao's rowwise e4m3 quantization of x."""
    from torchao.quantization.quantize_.workflows.float8 import float8_tensor

    def probe():
        raise AssertionError("package probe called")
    monkeypatch.setattr(float8_tensor, "_is_mslk_available", probe)
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(0)).bfloat16()
    data, scale = fp8.quantize_rows(x)
    assert data.dtype == torch.float8_e4m3fn and data.shape == x.shape and scale.shape == (8, 1)
    torch.testing.assert_close(scale, x.float().abs().amax(1, keepdim=True) / 448, rtol=1e-2, atol=0)
    rel = (data.float() * scale - x.float()).norm() / x.float().norm()
    assert 1e-3 < rel < 5e-2, float(rel)


def tiny_target(layers=4):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).eval().requires_grad_(False)


def test_fp8_target_quantizes_the_captured_layers_once(quantized):
    from types import SimpleNamespace

    from dflash.train.features import run_capture
    target = tiny_target()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    dcfg = tiny_cfg(hidden_size=H, target_layer_ids=[0, 1], num_target_layers=4)

    def ctx(on):
        return SimpleNamespace(drafter_config=dcfg, cfg=C.from_dict({"train": {"fp8_target": on}}).cfg)
    want = run_capture(target, ctx(False))(ids)
    capture = run_capture(target, ctx(True))
    layers = target.model.layers
    linears = lambda mods: [m for mod in mods for m in mod.modules() if isinstance(m, nn.Linear)]   # noqa: E731
    assert all(fp8.is_fp8(m.weight) for m in linears(layers[:2]))            # the layers the capture runs
    assert not any(fp8.is_fp8(m.weight) for m in linears(layers[2:]))        # never run: left alone
    assert not fp8.is_fp8(target.lm_head.weight) and not fp8.is_fp8(target.model.embed_tokens.weight)
    assert len(quantized) == 2 * 7
    weights = set(quantized)
    quantized.clear()
    got = [capture(ids) for _ in range(2)]
    assert quantized and all(len(s) == 3 and s not in weights for s in quantized)   # activations [B, S, in] only
    rel = (got[0].float() - want.float()).norm() / want.float().norm()
    assert 1e-3 < rel < 0.1, float(rel)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=0)
    before = [m.weight.qdata.data_ptr() for m in linears(layers[:2])]
    assert fp8.quantize_frozen(layers[:2]) == 0                              # a second call requantizes nothing
    assert [m.weight.qdata.data_ptr() for m in linears(layers[:2])] == before


@pytest.mark.parametrize("floor", [fp8.AMAX_FLOOR, None])
def test_zero_rows_quantize_to_zeros(monkeypatch, floor):
    """A zero row of an input or a weight (a token whose embedding is zero) gives zeros, not 0/0 = NaN; None is the
    code before the floor, which the H200 run on the code target hit (loss nan at the first step)."""
    monkeypatch.setattr(fp8, "AMAX_FLOOR", floor)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, H, generator=g), torch.randn(48, H, generator=g)
    x[1], w[5] = 0, 0
    data, scale = fp8.quantize_rows(x)
    y = nn.functional.linear(x, fp8._rowwise(w))
    if floor is None:
        assert torch.isnan(data.float()[1]).all() and torch.isnan(y[1]).all() and torch.isnan(y[:, 5]).all()
        return
    assert torch.isfinite(scale).all() and (data.float()[1] == 0).all() and torch.isfinite(y).all()
    assert (y[1] == 0).all() and (y[:, 5] == 0).all()
    keep = torch.ones_like(y, dtype=torch.bool)
    keep[1], keep[:, 5] = False, False
    want = x @ w.T
    assert float((y - want)[keep].norm() / want[keep].norm()) < 6e-2


def test_fp8_target_features_are_finite_with_a_zero_embedding_row():
    """A target built with pad_token_id has that token's embedding zero (nn.Embedding's padding_idx; the code target's
    <|endoftext|>): its FP8 capture stays finite and close to bf16 over a batch that holds the token."""
    from types import SimpleNamespace

    from dflash.train.features import run_capture
    target = tiny_target()
    pad = 3
    with torch.no_grad():
        target.model.embed_tokens.weight[pad] = 0
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    ids[0, 4], ids[1, 10:] = pad, pad
    dcfg = tiny_cfg(hidden_size=H, target_layer_ids=[0, 1], num_target_layers=4)

    def ctx(on):
        return SimpleNamespace(drafter_config=dcfg, cfg=C.from_dict({"train": {"fp8_target": on}}).cfg)
    want = run_capture(target, ctx(False))(ids).float()
    got = run_capture(target, ctx(True))(ids).float()
    assert torch.isfinite(got).all()
    assert 1e-3 < float((got - want).norm() / want.norm()) < 0.1


def test_fp8_drafter_saves_and_exports_as_the_bf16_one(tmp_path):
    """Checkpoints hold the fp32 masters (the reference format); export's bf16 is the masters cast; both load
    into a plain drafter."""
    from dflash.model import load_drafter, reference_keys, save_drafter
    embed, head, feats, ids, mask = head_and_batch()
    c = context(precision="fp8", fp8_lm_head=True)
    d = build_drafter(c, embed, head, CPU)
    micro_step(d, feats, ids, mask, 0, c, None).loss.backward()
    with torch.no_grad():
        for p in d.parameters():
            p.sub_(0.1 * p.grad)
    for dtype, want in ((None, torch.float32), (torch.bfloat16, torch.bfloat16)):
        out = save_drafter(d, tmp_path / str(dtype), dtype=dtype)
        tensors = load_file(str(out / "model.safetensors"))
        assert sorted(tensors) == reference_keys(d.cfg.num_layers)
        assert {t.dtype for t in tensors.values()} == {want}
        for k, v in d.state_dict().items():
            torch.testing.assert_close(tensors[k], v.to(want), rtol=0, atol=0)
        plain = load_drafter(out, embed, head)
        assert not any("Float8" in type(m).__name__ for m in plain.modules())
    resumed = build_drafter(context(precision="fp8", fp8_lm_head=True), embed, head, CPU)   # as a resume loads it
    resumed.load_state_dict(load_file(str(tmp_path / "None" / "model.safetensors")), strict=True)
    for k, v in d.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=0)


def fake_placement(*devs, targets=None):
    from dflash.train.placement import Placement
    return Placement(tuple(torch.device(t) for t in (targets or devs)), tuple(torch.device(d) for d in devs), "threads")


@pytest.mark.parametrize("key,value", [("precision", "fp8"), ("fp8_lm_head", True), ("fp8_target", True)])
def test_fp8_on_the_cpu_is_refused_naming_the_key(key, value):
    with pytest.raises(UserError, match=rf"train\.{key}.*CUDA GPU of compute capability >= 8.9.*on cpu"):
        precision.check(context(**{key: value}).cfg.train, fake_placement("cpu"))
    from dflash.train.context import prepare    # the run's own preparation refuses it first, before any target
    with pytest.raises(UserError, match=rf"train\.{key}"):
        prepare(C.from_dict({"train": {key: value}}))


def test_fp8_on_a_gpu_without_fp8_is_refused_naming_the_key(monkeypatch, fake_gpus):
    fake_gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0) if str(d) == "cuda:1" else (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    train = context(fp8_target=True).cfg.train
    precision.check(train, fake_placement("cuda:0"))                          # Hopper: fine
    with pytest.raises(UserError, match=r"train\.fp8_target.*cuda:1 \(NVIDIA A100\).*capability 8\.0"):
        precision.check(train, fake_placement("cuda:0", targets=["cuda:1"]))
    precision.check(context(precision="fp8").cfg.train, fake_placement("cuda:0", targets=["cuda:1"]))  # drafter only
    with pytest.raises(C.ConfigError, match=r"train\.fp8_lm_head"):   # refused when the config is read
        context(fp8_lm_head=True, loss_kernel="checkpointed")
    precision.check(context().cfg.train, fake_placement("cpu"))              # bf16: nothing to refuse


def test_memory_estimate_counts_the_fp8_head_copies():
    from dflash.train import memory
    d = tiny_cfg(vocab_size=V, mask_token_id=V - 1)
    base, head = (memory.estimate(d, context(**t).cfg.train, 24, "sdpa") for t in ({}, {"fp8_lm_head": True}))
    assert base["fp8_head"] == 0 and head["fp8_head"] == 2 * V * H + 16 * V     # two copies + one 16-row chunk
    assert head["total"] - base["total"] == head["fp8_head"]


def test_fp8_trained_run_exports_through_the_stage_as_a_bf16_trained_one(tmp_path):
    """The whole path of a run trained with train.precision fp8 (+ the FP8 head) on the tiny target: its real capture,
    a training step with the optimizer, the checkpoint a run writes, then `dflash export` as the pipeline runs it
    (weights as trained: the fp32 masters) and with --dtype bfloat16. Both exports are byte for byte those of a plain
    drafter holding the same weights: no FP8 tensor, module or key reaches them. (The train stage refuses FP8 on the
    CPU, so the run's context is prepared bf16 and switched, as on an FP8 GPU.)"""
    import yaml
    from torchao.float8.float8_linear import Float8Linear

    from support.data import build_tiny_target, target_section
    from dflash.cli import main
    from dflash.model import DFlashDrafter
    from dflash.target import load_target
    from dflash.train import checkpoint
    from dflash.train.context import prepare
    from dflash.train.features import run_capture
    from dflash.train.step import frozen_head
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({
        "results_dir": str(tmp_path / "results"), "run_name": "t", "target": target_section(build_tiny_target()),
        "drafter": {"num_layers": 1, "block_size": 4, "num_target_layers": 2, "target_layer_ids": [0, 1]},
        "train": {"targets": ["cpu"], "drafters": ["cpu"], "attention": "sdpa", "compile": False, "num_anchors": 8,
                  "loss_chunk": 16}}))
    ctx = prepare(C.load(cfg), need_data=False)
    ctx.loaded = C.load(cfg, {"train.precision": "fp8", "train.fp8_lm_head": True})
    target = load_target(ctx.cfg.target, "cpu")
    ids = torch.randint(0, ctx.drafter_config.vocab_size - 1, (2, 32), generator=torch.Generator().manual_seed(0))
    feats = run_capture(target, ctx)(ids).clone()            # out of inference mode, as the feature queue hands it
    d = build_drafter(ctx, *frozen_head(target, CPU), CPU)
    assert sum(isinstance(m, Float8Linear) for m in d.modules()) == 7 and precision.loss_head(d) is not d.lm_head_weight
    opt = torch.optim.AdamW(d.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    micro_step(d, feats, ids, torch.ones_like(ids, dtype=torch.bool), 0, ctx, None).loss.backward()
    opt.step()
    sched.step()
    plain = DFlashDrafter(ctx.drafter_config, *frozen_head(target, CPU))
    plain.load_state_dict(d.state_dict(), strict=True)
    run = tmp_path / "results" / "runs"
    for name, drafter in (("fp8", d), ("plain", plain)):
        ckpt = checkpoint.save(run / name, 1, 0, drafter, opt, sched,
                               {"result_hash": ctx.loaded.result_hash, "data_hash": None, "inputs_hash": None})
        for dtype in ("keep", "bfloat16"):
            assert main(["export", "--config", str(cfg), "--run-dir", str(run / name), "--checkpoint", str(ckpt),
                         "--dtype", dtype, "--out", str(tmp_path / f"{name}-{dtype}")]) == 0
    for dtype, want in (("keep", torch.float32), ("bfloat16", torch.bfloat16)):
        got, ref = tmp_path / f"fp8-{dtype}", tmp_path / f"plain-{dtype}"
        tensors = load_file(str(got / "model.safetensors"))
        assert {t.dtype for t in tensors.values()} == {want}
        assert json.loads((got / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
        torch.testing.assert_close(tensors["layers.0.mlp.up_proj.weight"],
                                   d.layers[0].mlp.up_proj.weight.detach().to(want), rtol=0, atol=0)
        assert (got / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
        assert (got / "config.json").read_text() == (ref / "config.json").read_text()
