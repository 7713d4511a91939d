"""Sections on the step's LM-head loss and memory-bound parts: training's fused loss beside torch's and Liger's (with
agreement checks), and the bf16 step's memory-bound parts alone against the HBM copy bandwidth."""
from __future__ import annotations

import functools

import torch

from bench.common import Option, Section, median_ms, peak_gb
from bench.sections.kernels import device, random_anchors


def loss_problem(q: int, s: int, h: int, v: int, bk: int, seed: int = 0):
    """The loss's inputs as training makes them: drafter output [1, q, h] bf16, the frozen head [v, h] bf16, labels
    and weights exp(-(k-1)/gamma) of q // bk random anchors over a random sequence of s tokens (block_labels)."""
    from dflash.model import block_labels
    dev = device()
    g = torch.Generator(device="cpu").manual_seed(seed)
    anchors = random_anchors(1, s, q // bk, bk, seed)
    ids = torch.randint(0, v, (1, s), generator=g).to(dev)
    labels, weights = block_labels(ids, torch.ones(1, s, dtype=torch.bool, device=dev), anchors)
    hidden = torch.randn(1, q, h, generator=g).to(dev, torch.bfloat16)
    head = (torch.randn(v, h, generator=g) * 0.02).to(dev, torch.bfloat16)
    return hidden, head, labels, weights


def loss_variants(head, labels, weights, bk: int, chunk: int, compiled: bool | None = None) -> dict:
    """name -> f(hidden [1, Q, H]) -> the step's loss (weighted mean over scored positions), differentiable in hidden.
    The first is what training runs (train.loss_kernel fused, its kernel compiled on GPU); the others compute the
    same quantity with torch's own ops or Liger's fused linear cross-entropy (a string: why one is unavailable)."""
    import torch.nn.functional as F

    from dflash.model import IGNORE, dflash_loss
    from dflash.train.step import loss_kernel
    compiled = device().type == "cuda" if compiled is None else compiled

    def rows(x):  # [1, Q, ...] -> [N, ...]: block positions 1.. (position 0 is never scored)
        return x.reshape(-1, bk, *x.shape[2:])[:, 1:].reshape(-1, *x.shape[2:])
    lab = rows(labels)
    wk = rows(torch.where(labels != IGNORE, weights.float(), torch.zeros((), device=weights.device)))
    wsum = wk.sum()

    def torch_full(h):  # unchunked: [N, V] logits in float32 at once
        logits = (rows(h) @ head.t()).float()
        return (F.cross_entropy(logits, lab.clamp(min=0), reduction="none") * wk).sum() / wsum
    out = {
        "fused": lambda h: dflash_loss(h, head, labels, weights, bk, chunk, fused=True,
                                       kernel=loss_kernel(compiled)).loss,
        "torch_chunked_checkpointed": lambda h: dflash_loss(h, head, labels, weights, bk, chunk).loss,
        "torch_full": torch_full,
    }
    if compiled:
        out["torch_compile_full"] = torch.compile(torch_full, dynamic=False)
        out["fused_eager_kernel"] = lambda h: dflash_loss(h, head, labels, weights, bk, chunk, fused=True).loss
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        # per-position weights need reduction="none" (Liger then recomputes the logits in the backward)
        per_row = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="none")
        out["liger_flce_weighted"] = lambda h: (per_row(head, rows(h), lab) * wk).sum() / wsum
        # reference only: unweighted mean, the gradient made in the forward (Liger's fast path); a different loss
        mean = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE, reduction="mean")
        out["liger_flce_unweighted_ref"] = lambda h: mean(head, rows(h), lab)
    except Exception as e:  # not carried, or no triton (CPU)
        out["liger"] = f"unavailable: {type(e).__name__}: {e}"[:300]
    return out


def compare_one(fn, hidden, ref, reps: int) -> tuple[dict, tuple | None]:
    """One variant's loss, its agreement with `ref` ((loss, grad) of the first variant that ran: training's; None:
    this one becomes it), its forward + backward ms and peak GB."""
    h = hidden.detach().requires_grad_(True)
    value = fn(h)
    value.backward()
    grad = h.grad.float()
    r = {"loss": round(value.item(), 6)}
    if ref is None:
        ref = (value.item(), grad)
    else:
        dl = abs(value.item() - ref[0])
        dg = (grad - ref[1]).abs().max().item()
        scale = ref[1].abs().max().item()
        r.update(loss_abs_diff=dl, grad_max_abs_diff=dg, grad_max_abs=scale,
                 agrees=bool(dl <= 2e-3 * max(1.0, abs(ref[0])) and dg <= 2e-2 * scale))

    def run():
        h.grad = None
        fn(h).backward()
    r["fwd_bwd_ms"] = round(median_ms(run, warmup=2, reps=reps), 2)
    r["peak_gb"] = peak_gb(run)
    return r, ref


def loss_compare(hidden, head, labels, weights, bk: int, chunk: int, reps: int = 10, compiled=None) -> dict:
    """Every loss variant's value and gradient w.r.t. hidden against training's (fused), then its speed and peak
    memory (forward + backward). `agrees`: loss within 2e-3 relative, gradient within 2% of its largest entry."""
    res, ref = {}, None
    for name, fn in loss_variants(head, labels, weights, bk, chunk, compiled).items():
        if isinstance(fn, str):
            res[name] = {"error": fn}
            continue
        try:
            res[name], ref = compare_one(fn, hidden, ref, reps)
            if name == "fused":        # training's: the reference
                res[name]["agrees"] = True
        except Exception as e:
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        if device().type == "cuda":
            torch.cuda.empty_cache()
    ok = {k: v["fwd_bwd_ms"] for k, v in res.items() if v.get("agrees") and "fwd_bwd_ms" in v}
    res["fastest_agreeing"] = min(ok, key=ok.get) if ok else None
    res["training_uses"] = "fused"
    return res


def loss(job) -> dict:
    """The loss training runs (fused, the config's train.loss_chunk) beside torch's own and Liger's fused linear
    cross-entropy, at the config's anchors x block positions, hidden size and vocabulary, bf16."""
    sh = job.shapes
    hidden, head, labels, weights = loss_problem(sh.anchors * sh.block, sh.context, sh.hidden, sh.vocab, sh.block)
    out = loss_compare(hidden, head, labels, weights, sh.block, sh.loss_chunk, reps=int(job.opts["reps"]))
    out["shape"] = {"positions": hidden.shape[1], "scored": int((labels != -100).sum()), "hidden": sh.hidden,
                    "vocab": sh.vocab, "chunk": sh.loss_chunk}
    return out


def _hbm(fn, gb: float, reps: int = 10) -> dict:
    """fn's median ms and its bandwidth: `gb` GB read + written per call."""
    ms = median_ms(fn, warmup=2, reps=reps)
    return {"ms": round(ms, 3), "gb": round(gb, 3), "tb_per_s": round(gb / ms, 3)}


def adamw_parts(params, train, compiled: bool) -> dict:
    """The optimizer steps: torch's fused AdamW (the clip folded into grad_scale), foreach and (compiled) foreach under
    torch.compile, each on its own: ms and bandwidth (read p, g, m, v; write p, m, v in fp32); and `adamw_clip`,
    what train runs on the compile path (dflash.train.adamw: the clip's norm, the clip and the update in one compiled
    function; eager where `compiled` is False), which reads the gradients once more."""
    from dflash.train.adamw import CompiledAdamW
    n = sum(p.numel() for p in params)
    kw = dict(lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay)
    opts = {"adamw_fused": torch.optim.AdamW(params, fused=True, **kw),
            "adamw_foreach": torch.optim.AdamW(params, foreach=True, **kw)}
    opts["adamw_fused"].grad_scale = torch.tensor(1.0, device=device())
    adam_gb = n * 4 * 7 / 1e9
    out = {}
    for name, opt in opts.items():
        out[name] = _hbm(opt.step, adam_gb)
        opt.state.clear()
    if compiled:
        comp = torch.optim.AdamW(params, foreach=True, **kw)
        try:
            out["adamw_foreach_compiled"] = _hbm(torch.compile(comp.step), adam_gb)
        except Exception as e:
            out["adamw_foreach_compiled"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        comp.state.clear()
    ours = CompiledAdamW(torch.optim.AdamW(params, **kw), compiled=compiled)
    ours.warm_up()
    grads, scale = [p.grad for p in params], torch.ones((), device=device())
    out["adamw_clip"] = _hbm(lambda: ours.step(grads, scale, train.grad_clip), adam_gb + n * 4 / 1e9)
    ours.opt.state.clear()
    return out


def step_parts(sh, copy_gib: float = 4, rows: int | None = None, compiled: bool = True) -> dict:
    """The bf16 drafter step's memory-bound parts (the config's drafter, fp32 trainable weights under bf16 autocast,
    as train runs it), each alone at its real size against the HBM copy bandwidth: how much of the step's non-GEMM
    time a faster kernel could still take off. `copy`: one copy_gib GiB fp32 copy (the practical bandwidth); the AdamW
    steps (adamw_parts); `grad_norm`: the clip's norm (get_total_norm, foreach); `casts_fwd`: autocast's fp32 -> bf16
    copy of every weight; `casts_grad`: the bf16 gradients back to fp32; `loss_kernel`: training's compiled per-chunk
    loss kernel on [rows (train.loss_chunk), V] bf16 logits (logsumexp, argmax, the gradient written over the logits)
    and `loss_reduction` its reductions alone; the floor of both is one read of the logits plus one read and one
    write. `floor_ms`: GB / copy bandwidth. A CPU test shrinks it (`sh` of a small arch, `compiled` False: the eager
    loss kernel, no compiled AdamW)."""
    from dflash.model import DFlashDrafter
    from dflash.train.step import loss_kernel
    dev, rows, v = device(), rows or sh.loss_chunk, sh.vocab
    embed = head = torch.zeros(1, sh.hidden, device=dev, dtype=torch.bfloat16)   # frozen, not stepped: stand-ins
    with torch.device(dev):
        drafter = DFlashDrafter(sh.drafter_config(), embed, head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    out = {"trainable_params": n}
    x = torch.empty(int(copy_gib * 2**28), device=dev)
    y = torch.empty_like(x)
    out["copy"] = _hbm(lambda: y.copy_(x), 2 * x.numel() * 4 / 1e9)
    x = y = None
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    out.update(adamw_parts(params, sh.cfg.train, compiled))
    grads = [p.grad for p in params]
    out["grad_norm"] = _hbm(lambda: torch.nn.utils.get_total_norm(grads, 2.0, foreach=True), n * 4 / 1e9)
    out["casts_fwd"] = _hbm(lambda: [p.to(torch.bfloat16) for p in params], n * 6 / 1e9)
    g16 = [g.to(torch.bfloat16) for g in grads]
    out["casts_grad"] = _hbm(lambda: [g.to(torch.float32) for g in g16], n * 6 / 1e9)
    for p in params:
        p.grad = None
    g16 = grads = None
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(rows, v, device=dev, dtype=torch.bfloat16, generator=gen) * 3
    labels = torch.randint(0, v, (rows,), device=dev, generator=gen)
    one = rows * v * 2 / 1e9
    kernel = loss_kernel(compiled, "ce")
    out["loss_kernel"] = _hbm(lambda: kernel(logits, labels), 3 * one)

    def reduction(lg):
        return torch.logsumexp(lg.float(), -1), lg.argmax(-1)
    out["loss_reduction"] = _hbm(functools.partial(torch.compile(reduction, fullgraph=True) if compiled else
                                                   reduction, logits), one)
    bw = out["copy"]["tb_per_s"]
    for part in out.values():
        if isinstance(part, dict) and "gb" in part:
            part["floor_ms"] = round(part["gb"] / bw, 3)
    return out


SECTIONS = [
    Section("loss", loss, "training's fused loss beside torch's and Liger's, with agreement checks", default=True,
            options=(Option("reps", "10", "timed repetitions of each variant", "BENCH_LOSS_REPS"),)),
    Section("step_parts", lambda job: step_parts(job.shapes),
            "the bf16 step's memory-bound parts alone against the HBM copy bandwidth"),
]
