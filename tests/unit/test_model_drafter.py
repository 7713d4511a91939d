"""The drafter: parameter names, backends agree (values and gradients), no leakage across blocks or from the
future, and the same numbers as the reference DFlashDraftModel's math built from transformers' Qwen3 parts."""
import time

import pytest
import torch
import torch.nn.functional as F

from dflash.model import block_mask, make_mask, reference_keys, sample_anchors
from support.model import anchors_of, make_batch, make_drafter, tiny_cfg

SLIDING = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=6)


def test_parameters_are_the_reference_names_and_target_weights_are_not_parameters():
    cfg = tiny_cfg()
    d = make_drafter(cfg)
    assert sorted(d.state_dict()) == reference_keys(cfg.num_layers)
    assert sorted(n for n, _ in d.named_parameters()) == reference_keys(cfg.num_layers)
    ids = {id(p) for p in d.parameters()}
    assert id(d.embed_weight) not in ids and id(d.lm_head_weight) not in ids
    assert d.fc.weight.shape == (cfg.hidden_size, 3 * cfg.hidden_size)
    assert d.layers[0].self_attn.k_proj.weight.shape == (2 * 8, 32)
    # init like HF Qwen3: N(0, 0.02) linears, unit norms
    torch.manual_seed(0)
    fresh = type(d)(cfg, d.embed_weight, d.lm_head_weight)
    assert abs(fresh.fc.weight.std().item() - 0.02) < 0.002 and torch.all(fresh.norm.weight == 1)


@pytest.mark.parametrize("extra", [{}, SLIDING, {**SLIDING, "sliding_window": 2}],
                         ids=["full", "sliding-above-block", "sliding-below-block"])
def test_eager_and_sdpa_agree_forward_and_backward(extra):
    cfg = tiny_cfg(**extra)
    d = make_drafter(cfg, dtype=torch.float64)
    hidden, ids, lm, an = make_batch(cfg, 3, 30, 6, dtype=torch.float64, lengths=[30, 14, 4])
    assert not an.valid.all()
    res = {}
    for backend in ("eager", "sdpa"):
        d.zero_grad()
        h = hidden.clone().requires_grad_()
        out = d(h, ids, an, backend=backend)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
        res[backend] = (out.detach(), h.grad, {n: p.grad.clone() for n, p in d.named_parameters()})
    (oe, he, ge), (os_, hs, gs) = res["eager"], res["sdpa"]
    assert torch.isfinite(oe).all()
    torch.testing.assert_close(oe, os_, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(he, hs, rtol=1e-9, atol=1e-10)
    for n in ge:
        assert ge[n].abs().sum() > 0, n
        torch.testing.assert_close(ge[n], gs[n], rtol=1e-9, atol=1e-10, msg=n)


@pytest.mark.parametrize("extra", [{}, dict(layer_types=["sliding_attention"] * 2, sliding_window=5)],
                         ids=["full", "sliding"])
def test_no_leakage_from_the_future_or_other_blocks(extra):
    cfg = tiny_cfg(**extra)
    d = make_drafter(cfg, dtype=torch.float64)
    S, Bk = 40, cfg.block_size
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, S, 3 * cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 90, (1, S), generator=g)
    an = anchors_of([[20, 12, 30, 0]], [[True, True, True, False]], Bk)
    base = d(hidden, ids, an).detach()
    blk = lambda out, j: out[0, j * Bk:(j + 1) * Bk]

    def changed_hidden(p):
        h = hidden.clone()
        h[0, p] += 3.0
        return d(h, ids, an).detach()

    for p in (20, 21, 35):                    # at or after anchor 20 (block 0): invisible to it
        torch.testing.assert_close(blk(changed_hidden(p), 0), blk(base, 0), rtol=0, atol=1e-12)
    assert (blk(changed_hidden(19), 0) - blk(base, 0)).abs().max() > 1e-3    # just before: visible
    if cfg.sliding_window:                    # all layers slide (window 5): only 16..19 visible to block 0
        torch.testing.assert_close(blk(changed_hidden(15), 0), blk(base, 0), rtol=0, atol=1e-12)
        torch.testing.assert_close(blk(changed_hidden(2), 0), blk(base, 0), rtol=0, atol=1e-12)
    else:
        assert (blk(changed_hidden(2), 0) - blk(base, 0)).abs().max() > 1e-3
        assert (blk(changed_hidden(12), 0) - blk(base, 0)).abs().max() > 1e-3
    # another block's tokens (the anchor tokens of blocks 1 and 2) do not reach block 0
    ids2 = ids.clone()
    ids2[0, 12] = (ids[0, 12] + 1) % 90
    ids2[0, 30] = (ids[0, 30] + 1) % 90
    out2 = d(hidden, ids2, an).detach()
    torch.testing.assert_close(blk(out2, 0), blk(base, 0), rtol=0, atol=1e-12)
    assert (blk(out2, 1) - blk(base, 1)).abs().max() > 1e-3                # ... but do reach their own
    # the padded block ignores all context
    h = hidden + torch.randn_like(hidden)
    torch.testing.assert_close(blk(d(h, ids, an).detach(), 3), blk(base, 3), rtol=0, atol=1e-12)


def _reference_math(drafter, ctx_hidden, block_ids):
    """One drafting step the way the reference DFlashDraftModel computes it at inference (context = the c
    positions before the block, block at positions c..c+Bk-1; no mask in full layers; in sliding layers its
    causal window mask: key position k visible from query position t when k <= t and t - k < W), from
    transformers' Qwen3 parts."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half
    cfg = drafter.cfg
    hfc = Qwen3Config(**cfg.to_hf_dict())
    sd = {k: v for k, v in drafter.state_dict().items()}
    dt = ctx_hidden.dtype

    def norm(name, dim):
        m = Qwen3RMSNorm(dim, eps=hfc.rms_norm_eps).to(dt)
        m.weight.data.copy_(sd[name])
        return m

    nh, nkv, hd = hfc.num_attention_heads, hfc.num_key_value_heads, hfc.head_dim
    c, Bk = ctx_hidden.shape[1], block_ids.shape[1]
    x = F.embedding(block_ids, drafter.embed_weight)
    ctx = norm("hidden_norm.weight", hfc.hidden_size)(ctx_hidden @ sd["fc.weight"].T)
    cos, sin = Qwen3RotaryEmbedding(hfc)(x, torch.arange(c + Bk)[None])
    for i in range(hfc.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(p + "input_layernorm.weight", hfc.hidden_size)(x)
        q = norm(p + "self_attn.q_norm.weight", hd)((h @ sd[p + "self_attn.q_proj.weight"].T).view(1, Bk, nh, hd))
        kc, kn = ctx @ sd[p + "self_attn.k_proj.weight"].T, h @ sd[p + "self_attn.k_proj.weight"].T
        vc, vn = ctx @ sd[p + "self_attn.v_proj.weight"].T, h @ sd[p + "self_attn.v_proj.weight"].T
        k = norm(p + "self_attn.k_norm.weight", hd)(torch.cat([kc, kn], 1).view(1, c + Bk, nkv, hd))
        v = torch.cat([vc, vn], 1).view(1, c + Bk, nkv, hd).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cq, sq = cos[:, None, -Bk:], sin[:, None, -Bk:]
        q = q * cq + rotate_half(q) * sq
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        mask = None
        if hfc.layer_types[i] == "sliding_attention":
            t, kp = torch.arange(c, c + Bk)[:, None], torch.arange(c + Bk)[None]
            mask = (kp <= t) & (t - kp < hfc.sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=hd ** -0.5)
        x = x + o.transpose(1, 2).reshape(1, Bk, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        mlp = Qwen3MLP(hfc).to(dt)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, n).weight.data.copy_(sd[p + f"mlp.{n}.weight"])
        x = x + mlp(norm(p + "post_attention_layernorm.weight", hfc.hidden_size)(x))
    return norm("norm.weight", hfc.hidden_size)(x)


@pytest.mark.parametrize("extra", [{}, {**SLIDING, "sliding_window": 2}, SLIDING],
                         ids=["full", "mixed-window-below-block", "mixed-window-above-block"])
def test_matches_reference_math_from_transformers_qwen3_parts(extra):
    cfg = tiny_cfg(rope_theta=5000.0, **extra)
    d = make_drafter(cfg, dtype=torch.float64)
    S, Bk = 30, cfg.block_size
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, S, 3 * cfg.hidden_size, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 90, (1, S), generator=g)
    an = anchors_of([[17, 9, 25]], [[True, True, True]], Bk)
    with torch.no_grad():
        ours = d(hidden, ids, an)
        for j, a in enumerate([17, 9, 25]):
            block = torch.full((1, Bk), cfg.mask_token_id)
            block[0, 0] = ids[0, a]
            ref = _reference_math(d, hidden[:, :a], block)
            torch.testing.assert_close(ours[:, j * Bk:(j + 1) * Bk], ref, rtol=1e-10, atol=1e-10)


def test_flex_forward_matches_sdpa_on_cpu():
    """One compiled test (CPU flex_attention: forward only; head_dim >= 32, see attention.py)."""
    for seed, window in ((0, 6), (1, 3)):   # windows above and below the block (4); same shapes: one compile
        cfg = tiny_cfg(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                       **{**SLIDING, "sliding_window": window})
        d = make_drafter(cfg)
        hidden, ids, lm, an = make_batch(cfg, 2, 45, 10, lengths=[45, 6], seed=seed)
        with torch.no_grad():
            a = d(hidden, ids, an, backend="sdpa")
            b = d(hidden, ids, an, backend="flex")
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [200, 7])   # above and below the block size 16
def test_flex_forward_backward_matches_sdpa_on_cuda(window):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    cfg = tiny_cfg(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=512, block_size=16, **{**SLIDING, "sliding_window": window})
    d = make_drafter(cfg).to(dev)
    d.set_target_weights(d.embed_weight.to(dev), d.lm_head_weight.to(dev))
    hidden, ids, lm, an = make_batch(cfg, 2, 700, 40, lengths=[700, 40], seed=0)
    hidden, ids, an = hidden.to(dev), ids.to(dev), an.to(dev)
    assert not an.valid.all()
    res = {}
    for backend in ("sdpa", "flex"):
        d.zero_grad()
        h = hidden.clone().requires_grad_()
        out = d(h, ids, an, backend=backend)
        (out * torch.linspace(-1, 1, out.shape[-1], device=dev)).sum().backward()
        res[backend] = (out.detach(), h.grad, {n: p.grad.clone() for n, p in d.named_parameters()})
    (o1, h1, g1), (o2, h2, g2) = res["sdpa"], res["flex"]
    assert torch.isfinite(o2).all() and torch.isfinite(h2).all()
    torch.testing.assert_close(o2, o1, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(h2, h1, rtol=1e-3, atol=1e-4)
    for n in g1:
        assert torch.isfinite(g2[n]).all(), n
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.gpu
def test_flex_with_tuned_kernel_options_matches_sdpa_in_bf16_on_cuda(monkeypatch):
    """bf16, head dim 128 (FLEX_TUNED's H200 entry, put under this GPU's compute capability whatever it is): the
    options reach flex_attention, and the attention equals sdpa's forward and backward within bf16 rounding."""
    import importlib

    from dflash.model import Anchors
    att = importlib.import_module("dflash.model.attention")   # the module (dflash.model.attention is the function)
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability(dev)
    opts = att.FLEX_TUNED[((9, 0), torch.bfloat16, 128)]
    monkeypatch.setitem(att.FLEX_TUNED, (cap, torch.bfloat16, 128), opts)
    seen, real = [], att.compiled_flex()

    def recording(*args, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return real(*args, **kwargs)
    monkeypatch.setattr(att, "compiled_flex", lambda: recording)
    g = torch.Generator(device="cpu").manual_seed(3)
    S, A, Bk = 640, 24, 16
    pos = torch.randperm(S - 1, generator=g)[:A].sort().values[None].to(dev)
    an = Anchors(pos, torch.ones(1, A, dtype=torch.bool, device=dev), Bk)
    q0 = torch.randn(1, 4, A * Bk, 128, generator=g).to(dev, torch.bfloat16)
    k0, v0 = (torch.randn(1, 2, S + A * Bk, 128, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    go = torch.randn(1, 4, A * Bk, 128, generator=g).to(dev, torch.bfloat16)
    res = {}
    for backend in ("sdpa", "flex"):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        out = att.attention(q, k, v, make_mask(an, S, backend)[None])
        out.backward(go)
        res[backend] = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    assert seen == [opts]
    for a, b in zip(res["flex"], res["sdpa"]):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_block_mask_build_is_fast_on_cuda():
    """3072 context + 512 blocks of 16: the BlockMask is built with tensor ops, no tracing or compiling."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    lm = torch.ones(1, 3072, dtype=torch.bool, device=dev)
    an = sample_anchors(lm, 512, 16, generator=g)
    for _ in range(3):
        block_mask(an, 3072)
    torch.cuda.synchronize()
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        bm = block_mask(an, 3072)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t) / n * 1e3
    print(f"block_mask build: {ms:.3f} ms")
    assert bm.kv_num_blocks.shape == (1, 1, 64)
    assert ms < 2.0


def test_mlp_keeps_only_gate_and_up_for_the_backward():
    """silu(gate) * up is recomputed in the backward: same output and gradients (float64) as the plain MLP, and
    compiled (AOTAutograd's min-cut partition, as Inductor) only gate and up of the [*, I] activations are saved."""
    from dflash.model.drafter import MLP
    cfg = tiny_cfg()
    torch.manual_seed(0)
    mlp = MLP(cfg).double()
    x = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    plain = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    ref = torch.autograd.grad(plain.square().sum(), [x, *mlp.parameters()])
    weights = {p.data_ptr() for p in mlp.parameters()}
    for fn in (mlp, torch.compile(mlp, backend="aot_eager_decomp_partition", fullgraph=True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(x)
        got = torch.autograd.grad(out.square().sum(), [x, *mlp.parameters()])
        torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    acts = [t for t in saved if t.shape[-1] == cfg.intermediate_size and t.data_ptr() not in weights]
    assert len(acts) == 2


def test_recomputed_weight_casts_same_gradients_and_no_bf16_weight_kept():
    """train.recompute_weight_casts: under bf16 autocast a compiled layer (min-cut partition, as Inductor) keeps no
    bf16 copy of a weight for the backward, and the gradients are those of the default path, bit for bit."""
    from dflash.model.drafter import Layer, Linear, rope_cos_sin
    cfg = tiny_cfg(num_layers=1)
    S, A, Bk = 6, 2, cfg.block_size
    anchors = anchors_of([[1, 4]], [[True, True]], Bk)
    masks = make_mask(anchors, S, "sdpa")
    torch.manual_seed(0)
    layer = Layer(cfg, 0)
    x = torch.randn(1, A * Bk, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(1, S, cfg.hidden_size, requires_grad=True)
    qpos = (anchors.pos[:, :, None] + torch.arange(Bk)).reshape(1, -1)
    rope = [rope_cos_sin(p, cfg.head_dim, cfg.rope_theta, torch.bfloat16) for p in (torch.arange(S)[None], qpos)]
    shapes = {tuple(p.shape) for p in layer.parameters() if p.dim() == 2}
    grads, kept = [], []
    for recompute in (False, True):
        for m in layer.modules():
            if isinstance(m, Linear):
                m.recompute_cast = recompute
        fn = torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
        torch._dynamo.reset()
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fn(x, ctx, *rope, masks)
        grads.append(torch.autograd.grad(out.float().square().sum(), [x, ctx, *layer.parameters()]))
        kept.append(sum(t.dtype == torch.bfloat16 and tuple(t.shape) in shapes for t in saved))
    assert kept[0] >= 7 and kept[1] == 0     # q, k, v, o, gate, up, down: bf16 copies kept only by default
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def _layer_case(cfg, dtype):
    from dflash.model.drafter import Layer, rope_cos_sin
    S, Bk = 6, cfg.block_size
    anchors = anchors_of([[1, 4]], [[True, True]], Bk)
    torch.manual_seed(0)
    layer = Layer(cfg, 0).to(dtype)
    x = torch.randn(1, 2 * Bk, cfg.hidden_size, dtype=dtype, requires_grad=True)
    ctx = torch.randn(1, S, cfg.hidden_size, dtype=dtype, requires_grad=True)
    qpos = (anchors.pos[:, :, None] + torch.arange(Bk)).reshape(1, -1)
    rope = [rope_cos_sin(p, cfg.head_dim, cfg.rope_theta, dtype) for p in (torch.arange(S)[None], qpos)]
    return layer, x, ctx, rope, make_mask(anchors, S, "sdpa")


def test_layer_norms_recomputed_in_the_backward_same_gradients():
    """The layer's two norms are recomputed in the backward (not kept): the same values and float64 gradients as the
    plain composition of its parts; compiled under bf16 autocast (min-cut partition, as Inductor) it keeps three
    [Q, H] activations besides its input, q and the attention output (was five: each norm output kept twice)."""
    cfg = tiny_cfg(num_layers=1)
    layer, x, ctx, rope, masks = _layer_case(cfg, torch.float64)
    h = x + layer.self_attn(layer.input_layernorm(x), ctx, *rope, masks[None])
    plain = h + layer.mlp(layer.post_attention_layernorm(h))
    args = [x, ctx, *layer.parameters()]
    ref = torch.autograd.grad(plain.square().sum(), args)
    out = layer(x, ctx, *rope, masks)
    torch.testing.assert_close(out, plain, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(out.square().sum(), args), ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    layer, x, ctx, rope, masks = _layer_case(cfg, torch.float32)
    fn = torch.compile(layer, backend="aot_eager_decomp_partition", fullgraph=True, dynamic=False)
    saved = []
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x.to(torch.bfloat16), ctx, *rope, masks)
    QH = x.shape[1] * cfg.hidden_size
    assert sum(t.numel() == QH and t.dtype == torch.bfloat16 for t in saved) == 6   # + q and attention out
