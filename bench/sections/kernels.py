"""Sections on kernels alone: the GPU's ceilings, the block mask's build, flex against sdpa attention, and the flex
kernel options (tiles, warps, stages, flags) of the drafter's attention. Shapes: the bench config's (bench.shapes)."""
from __future__ import annotations

import json

import torch

from bench.common import Option, Section, Stopwatch, median_ms


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_anchors(b: int, s: int, a: int, bk: int, seed: int = 0):
    """`a` sorted anchor positions per sequence, drawn among the first s - 1 (all valid)."""
    from dflash.model import Anchors
    g = torch.Generator(device="cpu").manual_seed(seed)
    pos = torch.stack([torch.randperm(s - 1, generator=g)[:a].sort().values for _ in range(b)])
    return Anchors(pos.to(device()), torch.ones(b, a, dtype=torch.bool, device=device()), bk)


def parse_shapes(text: str, default: tuple[int, int]) -> list[tuple[int, int]]:
    """CONTEXTxANCHORS,... ('' -> [default])."""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")] if text else [default]


def ceilings(job) -> dict:
    """The bf16 matmul ceiling (8192^3) and the HBM copy bandwidth (1 GiB)."""
    n, dev = 8192, device()
    x, y = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = median_ms(lambda: x @ y, reps=20)
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms_copy = median_ms(lambda: dst.copy_(src), reps=20)
    return {"bf16_matmul_tflops": round(2 * n**3 / ms / 1e9, 1), "copy_gbps": round(2 * 2**30 / ms_copy / 1e6, 1)}


def mask(job) -> dict:
    """Our block mask's build against create_block_mask of the same mask_mod, and whether their tiles agree."""
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash.model import block_mask
    sh = job.shapes
    S, A, BK = sh.context, sh.anchors, sh.block
    anchors = random_anchors(1, S, A, BK)
    ours = median_ms(lambda: block_mask(anchors, S), warmup=5, reps=50)
    pos = anchors.pos[0]

    def mod(b, h, q, kv):
        j = q // BK
        return torch.where(kv < S, kv < pos[j], (kv - S) // BK == j)
    ref = median_ms(lambda: create_block_mask(mod, 1, None, A * BK, S + A * BK, device=device()), warmup=2, reps=10)
    bm = block_mask(anchors, S)
    cb = create_block_mask(mod, 1, None, A * BK, S + A * BK, device=device())
    same = bool(torch.equal(bm.to_dense().bool(), cb.to_dense().bool()))
    return {"ours_ms": round(ours, 4), "create_block_mask_ms": round(ref, 3), "speedup": round(ref / ours, 1),
            "same_tiles": same}


def qkv(sh, s: int, a: int, g: torch.Generator | None = None, grad: bool = False):
    """q [1, heads, a*block, dim], k and v [1, kv heads, s + a*block, dim] (bf16) of the drafter's attention, drawn
    in that order from `g` (a CPU generator; None: torch's)."""
    d = sh.drafter_config()
    q_len = a * sh.block
    shapes = ((d.num_attention_heads, q_len), (d.num_key_value_heads, s + q_len), (d.num_key_value_heads, s + q_len))
    return [torch.randn(1, h, n, d.head_dim, generator=g).to(device(), torch.bfloat16).requires_grad_(grad)
            for h, n in shapes]


def attention(job) -> dict:
    """The drafter's attention forward + backward: compiled flex_attention with our BlockMask against sdpa with the
    dense boolean mask; the first flex call's seconds (its compile)."""
    import torch.nn.functional as F

    from dflash.model import compiled_flex, dense_mask
    from dflash.model.masks import block_mask
    sh = job.shapes
    S, A = sh.context, sh.anchors
    anchors = random_anchors(1, S, A, sh.block)
    q, k, v = qkv(sh, S, A, grad=True)
    bm, dm, flex = block_mask(anchors, S), dense_mask(anchors, S), compiled_flex()

    def run_flex():
        flex(q, k, v, block_mask=bm, enable_gqa=True).sum().backward()

    def run_sdpa():
        F.scaled_dot_product_attention(q, k, v, attn_mask=dm, enable_gqa=True).sum().backward()
    first = Stopwatch()
    run_flex()
    compile_s = first.s
    return {"flex_fwd_bwd_ms": round(median_ms(run_flex), 3), "sdpa_dense_fwd_bwd_ms": round(median_ms(run_sdpa), 3),
            "flex_first_call_s": round(compile_s, 1)}


# flex kernel options tried by flex_tune: forward (BLOCK_M, BLOCK_N, num_warps, num_stages) and backward
# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages); {} = torch's own choice for the device
FLEX_FWD = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3)]
FLEX_BWD = [(64, 128, 128, 64, 8, 3), (64, 128, 128, 64, 4, 3), (32, 128, 128, 32, 4, 3), (64, 64, 64, 64, 4, 3),
            (32, 64, 64, 32, 4, 3), (64, 128, 128, 64, 8, 2), (128, 128, 128, 128, 8, 2), (32, 128, 128, 32, 8, 3)]
FLEX_FLAGS = [{"PRESCALE_QK": True}, {"USE_TMA": True}, {"ROWS_GUARANTEED_SAFE": True}]


def flex_option_sets() -> list[tuple[str, dict]]:
    sets = [("default", {})]
    sets += [(f"fwd{c}", {"fwd_BLOCK_M": c[0], "fwd_BLOCK_N": c[1], "fwd_num_warps": c[2], "fwd_num_stages": c[3]})
             for c in FLEX_FWD]
    sets += [(f"bwd{c}", {"bwd_BLOCK_M1": c[0], "bwd_BLOCK_N1": c[1], "bwd_BLOCK_M2": c[2], "bwd_BLOCK_N2": c[3],
                          "bwd_num_warps": c[4], "bwd_num_stages": c[5]}) for c in FLEX_BWD]
    return sets + [(",".join(f), f) for f in FLEX_FLAGS]


def flex_row(fn, q0, k0, v0, go, bm, opts: dict, ref: list | None) -> tuple[dict, list | None]:
    """One option set: compile seconds, forward ms, forward+backward ms, bwd_ms their difference (an estimate: the
    forward alone is timed without autograd, a graph of its own) and the largest difference of the output and of
    dq/dk/dv from `ref` (the default's; None: this one is the reference)."""
    q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))

    def fwd():
        return fn(q, k, v, block_mask=bm, enable_gqa=True, kernel_options=dict(opts) or None)

    def fwd_bwd():
        fwd().backward(go)
    row = {}
    try:
        first = Stopwatch()
        fwd_bwd()
        torch.cuda.synchronize()
        row["compile_s"] = round(first.s, 1)
        with torch.no_grad():
            row["fwd_ms"] = round(median_ms(fwd, warmup=3, reps=20), 3)
        row["fwd_bwd_ms"] = round(median_ms(fwd_bwd, warmup=3, reps=20), 3)
        row["bwd_ms"] = round(row["fwd_bwd_ms"] - row["fwd_ms"], 3)
        q.grad = k.grad = v.grad = None
        o = fwd()
        o.backward(go)
        got = [o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
        if ref is None:
            ref = got
        else:
            row["max_abs_diff"] = [round((x - y).abs().max().item(), 5) for x, y in zip(got, ref)]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:400]
    return row, ref


def flex_tune(job) -> dict:
    """The drafter's attention (our BlockMask, the drafter's GQA heads, bf16) with each kernel option set of FLEX_FWD,
    FLEX_BWD and FLEX_FLAGS, one at a time on top of torch's defaults (flex_row), per shape; the best forward and
    backward."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash.model.masks import block_mask
    sh = job.shapes
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    out = {}
    for s, a in parse_shapes(job.opts["shapes"], (sh.context, sh.anchors)):
        g = torch.Generator(device="cpu").manual_seed(1)
        q0, k0, v0 = qkv(sh, s, a, g)
        go = torch.randn(q0.shape, generator=g).to(device(), q0.dtype)
        bm, ref, rows = block_mask(random_anchors(1, s, a, sh.block), s), None, {}
        for name, opts in flex_option_sets():
            rows[name], ref = flex_row(fn, q0, k0, v0, go, bm, opts, ref)
            print("flex_tune", f"{s}x{a}", name, json.dumps(rows[name]), flush=True)
        ok = {n: r for n, r in rows.items() if "fwd_bwd_ms" in r}
        best_f = min((n for n in ok if n.startswith("fwd") or n == "default"), key=lambda n: ok[n]["fwd_ms"],
                     default=None)
        best_b = min((n for n in ok if n.startswith("bwd") or n == "default"), key=lambda n: ok[n]["bwd_ms"],
                     default=None)
        out[f"{s}x{a}"] = {"rows": rows, "best_fwd": best_f, "best_bwd": best_b}
    return out


SECTIONS = [
    Section("ceilings", ceilings, "bf16 matmul TFLOP/s and copy bandwidth", default=True),
    Section("mask", mask, "our block mask's build against create_block_mask", default=True),
    Section("attention", attention, "flex vs sdpa attention, forward + backward", default=True),
    Section("flex_tune", flex_tune, "the drafter's attention under each flex kernel option set, fwd and bwd ms",
            options=(Option("shapes", "", "CONTEXTxANCHORS,... (default: the config's)", "BENCH_FLEX_SHAPES"),)),
]
