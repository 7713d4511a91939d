"""Where the drafter step's memory goes, counted on the CPU: the tensors autograd saves for the backward of one
drafter layer (bf16 autocast), at small shapes, scaled to the H200 shapes.

    PYTHONPATH=. python bench/drafter_memory.py [--compile inductor|aot_eager_decomp_partition]
                                               [--recompute-weight-casts]

Shapes are chosen so every dimension is a distinct number (S 80, Q 96, S+Q 176, H 256, I 768, kv 64, D 32,
8/2 heads), so each saved tensor's shape maps to the full-size one (S 3072, Q 8192, H 4096, I 12288, kv 1024,
D 128, 32/8 heads). Attention is a stand-in that saves exactly what flex_attention saves (q, k, v, out and the
float32 log-sum-exp). `--compile aot_eager_decomp_partition` compiles the layer with AOTAutograd's min-cut
partitioner (what Inductor uses to decide what to save); `--compile inductor` runs Inductor's CPU code generation
too. Parameters are not counted; the bf16 copies of the weights that autocast makes are.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
SMALL = dict(S=80, Q=96, SQ=176, H=256, I=768, KV=64, D=32, NH=8, NKV=2)
FULL = dict(S=3072, Q=8192, SQ=11264, H=4096, I=12288, KV=1024, D=128, NH=32, NKV=8)


_MASK = {}


@torch.library.custom_op("dflash_bench::flex_like", mutates_args=())
def flex_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention opaque to the partitioner that saves what compiled flex_attention saves: q, k, v, out, lse."""
    g = q.shape[1] // k.shape[1]
    s = (q.float() @ k.repeat_interleave(g, 1).float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    out = (torch.softmax(s, -1) @ v.repeat_interleave(g, 1).float()).to(q.dtype)
    return out.contiguous(), torch.logsumexp(s, -1).contiguous()


@flex_like.register_fake
def _(q, k, v, mask):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, go, glse):
    q, k, v, mask, out, lse = ctx.saved_tensors
    g, sc = q.shape[1] // k.shape[1], q.shape[-1] ** -0.5
    kk, vv = k.repeat_interleave(g, 1).float(), v.repeat_interleave(g, 1).float()
    s = ((q.float() @ kk.transpose(-1, -2)) * sc).masked_fill(~mask, float("-inf"))
    pr = torch.exp(s - lse[..., None])
    go = go.float()
    dv = pr.transpose(-1, -2) @ go
    ds = pr * (go @ vv.transpose(-1, -2) - (go * out.float()).sum(-1, keepdim=True))
    dq, dk = ds @ kk * sc, ds.transpose(-1, -2) @ q.float() * sc
    B, H, T, D = dk.shape
    red = lambda t: t.reshape(B, H // g, g, T, D).sum(2)   # noqa: E731
    return dq.to(q.dtype), red(dk).to(k.dtype), red(dv).to(v.dtype), None


flex_like.register_autograd(_backward, setup_context=_setup)


def name_shape(shape) -> str:
    inv = {v: k for k, v in SMALL.items()}
    return "[" + ",".join(inv.get(d, str(d)) for d in shape) + "]"


def full_bytes(t: torch.Tensor) -> int:
    inv = {v: k for k, v in SMALL.items()}
    n = 1
    for d in t.shape:
        n *= FULL[inv[d]] if d in inv else d
    return n * t.element_size()


def count_saved(fn, params):
    """{(name-shape, dtype): (count, full-size bytes)} of distinct tensors autograd saves while fn() runs,
    parameters and their views excluded."""
    pptr = {p.untyped_storage().data_ptr() for p in params}
    seen, rows = set(), collections.Counter()
    size = collections.Counter()

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in seen and key not in pptr and t.numel() > 1 and t.dtype != torch.bool:   # mask: flex's is tiny
            seen.add(key)
            k = (name_shape(t.shape), str(t.dtype).replace("torch.", ""))
            rows[k] += 1
            size[k] += full_bytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, rows, size


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--compile", choices=["", "inductor", "aot_eager_decomp_partition"], default="")
    p.add_argument("--recompute-weight-casts", action="store_true", help="as train.recompute_weight_casts")
    args = p.parse_args()
    import dflash.model.drafter as dm
    from dflash.model import DrafterConfig
    from dflash.model.anchors import Anchors

    s = SMALL
    cfg = DrafterConfig(vocab_size=512, hidden_size=s["H"], num_layers=1, num_attention_heads=s["NH"],
                        num_key_value_heads=s["NKV"], head_dim=s["D"], intermediate_size=s["I"],
                        target_layer_ids=[1, 2, 3, 4, 5], mask_token_id=511, num_target_layers=8,
                        block_size=16)
    A = s["Q"] // cfg.block_size
    torch.manual_seed(0)
    pos = torch.randperm(s["S"] - 1)[:A].sort().values[None]
    anchors = Anchors(pos, torch.ones(1, A, dtype=torch.bool), cfg.block_size)
    from dflash.model.masks import dense_mask
    _MASK["m"] = dense_mask(anchors, s["S"])

    def attn(q, k, v, mask, backend=None):
        dt = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else v.dtype
        return flex_like(q.to(dt), k.to(dt), v.to(dt), _MASK["m"])[0]   # flex's autocast rule: one low dtype
    dm.attention = attn   # the stand-in: flex's saved set
    layer = dm.Layer(cfg, 0)
    dm.Linear.recompute_cast = args.recompute_weight_casts
    if args.compile:
        layer.compile(backend=args.compile, fullgraph=True, dynamic=False)
    x = torch.randn(1, s["Q"], s["H"], dtype=torch.bfloat16, requires_grad=True)
    ctx = torch.randn(1, s["S"], s["H"], requires_grad=True)     # float32: hidden_norm's output under autocast
    cpos = torch.arange(s["S"])[None]
    qpos = (pos[:, :, None] + torch.arange(cfg.block_size)).reshape(1, -1)
    rope = [dm.rope_cos_sin(t, s["D"], 1e6, torch.bfloat16) for t in (cpos, qpos)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fn = lambda: layer(x, ctx, rope[0], rope[1], {None: None})   # noqa: E731
        if args.compile:
            fn()   # compile first (its own saves are not counted)
        out, rows, size = count_saved(fn, list(layer.parameters()))
    out.float().sum().backward()
    total = 0
    print(f"saved for backward by one drafter layer ({'compiled: ' + args.compile if args.compile else 'eager'}),"
          " bytes at S 3072, Q 8192 (512 anchors x 16), H 4096, I 12288:")
    for k, n in sorted(size.items(), key=lambda kv: -kv[1]):
        print(f"  {k[0]:>16} {k[1]:>9} x{rows[k]}  {n / 2**20:8.1f} MiB")
        total += n
    print(f"  total {total / 2**30:.3f} GiB per layer")


if __name__ == "__main__":
    main()
