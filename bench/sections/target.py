"""Sections on the target and on FP8: the target's captured forward (eager, compiled), and the FP8 parts besides the
drafter's layers (the LM head's GEMMs and fused loss, the target's capture with FP8 weights) against bf16. The target
is a random-weight model of the bench config's `target.arch`."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.common import Option, Section, Stopwatch, median_ms
from bench.sections.kernels import device
from bench.sections.loss import loss_problem


def random_target(sh):
    """The config's target architecture with random bf16 weights on the bench's device (sdpa attention)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device()):
        return AutoModelForCausalLM.from_config(sh.target_config(), dtype=torch.bfloat16,
                                                attn_implementation="sdpa").eval()


def target(job) -> dict:
    """The target's full forward and its capture of the drafter's target layers (eager, then compiled in place as
    train.compile_target does) at the config's context length: ms, Ktok/s, the compiled capture's largest difference."""
    from dflash.train.features import LayerCapture
    sh, dev = job.shapes, device()
    build = Stopwatch()
    model = random_target(sh)
    build_s = build.s
    S = sh.context
    ids = torch.randint(0, sh.vocab, (1, S), device=dev)
    with torch.inference_mode():
        full = median_ms(lambda: model(ids), warmup=2, reps=5)
    cap = LayerCapture(model, sh.capture_layers)
    ms = median_ms(lambda: cap(ids), warmup=2, reps=10)
    want = cap(ids)
    cap.compile()                                    # train.compile_target: the captured layers compiled in place
    warm = cap.warm_up(dev, [(1, S)], sh.vocab)
    cms = median_ms(lambda: cap(ids), warmup=2, reps=10)
    diff = (cap(ids).float() - want.float()).abs().max().item()
    model = cap = want = None
    torch.cuda.empty_cache()
    return {"capture_ms": round(ms, 2), "capture_ktok_s": round(S / ms, 2), "full_forward_ms": round(full, 2),
            "full_forward_ktok_s": round(S / full, 2), "build_s": round(build_s, 1),
            "capture_compiled_ms": round(cms, 2), "capture_compiled_ktok_s": round(S / cms, 2),
            "compiled_vs_eager_max_abs_diff": diff, "compile_warmup_s": warm["seconds"],
            "compile_graphs": warm["graphs"]}


def fp8(job) -> dict:
    """The FP8 parts besides the drafter's layers (those: the specforge section's variants), each against bf16:
    - head (fp8_head): the frozen LM head [V, H] at the step's anchors x (block - 1) rows: making its FP8 copies (once
      per run), the logits (h @ W.T) and the input gradient (g @ W) of one train.loss_chunk-row chunk (inputs
      quantized by the compiled quantize_rows, as train.compile runs it), and training's fused loss (compiled kernel)
      forward + backward with each head: ms, the loss's and the gradient's relative difference.
    - target (fp8_target): the target's captured forward at the context length with bf16 weights and with FP8 copies
      (train.fp8_target), eager and compiled (option target_compile 0: eager only): ms and the features' relative
      error (norm of the difference / norm) against bf16.
    Option parts: comma list of head, target."""
    parts = job.opts["parts"].split(",")
    out = {"head": {}, "target": {}}
    if "head" in parts:
        fp8_head(job.shapes, out["head"])
    if "target" in parts:
        fp8_target(job.shapes, out["target"], job.opts["target_compile"] == "1")
    return out


def fp8_head(sh, hd: dict):
    from dflash.model import dflash_loss, fp8 as F8
    from dflash.train import precision
    from dflash.train.step import loss_kernel
    hidden, head, labels, weights = loss_problem(sh.anchors * sh.block, sh.context, sh.hidden, sh.vocab, sh.block)
    F8.FrozenHead(head[:64])    # torchao's first call (imports, kernels) not counted below
    torch.cuda.synchronize()
    made = Stopwatch()
    fhead = F8.FrozenHead(head, precision.quantizer(True))    # as train.compile makes it
    torch.cuda.synchronize()
    hd["make_copies_ms"] = round(made.s * 1e3, 1)
    h = hidden[0, :sh.loss_chunk].contiguous()
    g = torch.softmax((h @ head.t()).float(), -1).to(torch.bfloat16)
    hd["logits_bf16_ms"] = round(median_ms(lambda: h @ head.t()), 3)
    hd["logits_fp8_ms"] = round(median_ms(lambda: fhead.logits(h)), 3)
    hd["input_grad_bf16_ms"] = round(median_ms(lambda: g @ head), 3)
    hd["input_grad_fp8_ms"] = round(median_ms(lambda: fhead.input_grad(g)), 3)
    ref_l, ref_g = (h @ head.t()).float(), (g @ head).float()
    hd["logits_rel_err"] = round(float((fhead.logits(h).float() - ref_l).norm() / ref_l.norm()), 5)
    hd["input_grad_rel_err"] = round(float((fhead.input_grad(g).float() - ref_g).norm() / ref_g.norm()), 5)
    g = ref_l = ref_g = None
    kernel = loss_kernel(True)
    res = {}
    for name, w in (("bf16", head), ("fp8", fhead)):
        x = hidden.detach().clone().requires_grad_(True)

        def fwd_bwd():
            x.grad = None
            loss = dflash_loss(x, w, labels, weights, sh.block, sh.loss_chunk, fused=True, kernel=kernel).loss
            loss.backward()
            return loss
        loss = fwd_bwd()
        res[name] = (float(loss.detach()), x.grad.float().clone())
        hd[f"fused_loss_{name}_ms"] = round(median_ms(fwd_bwd, warmup=2, reps=10), 2)
    (a, ga), (b, gb) = res["bf16"], res["fp8"]
    hd["fused_loss_rel_diff"] = round(abs(a - b) / a, 6)
    hd["fused_grad_rel_err"] = round(float((gb - ga).norm() / ga.norm()), 5)
    res = hidden = head = fhead = None
    torch.cuda.empty_cache()


def fp8_target(sh, tg: dict, compiled: bool = True):
    from bench import fp8_features
    dev = device()
    model = random_target(sh)
    ctx = SimpleNamespace(drafter_config=sh.drafter_config(), cfg=sh.cfg)   # the config's capture
    ids = torch.randint(0, sh.vocab, (1, sh.context), device=dev)

    def measure(name, cap):
        tg[f"capture_{name}_ms"] = round(median_ms(lambda: cap(ids), warmup=2, reps=5), 2)
        feats = {name: cap(ids)}
        if compiled:
            cap.compile()
            warm = cap.warm_up(dev, [(1, sh.context)], sh.vocab)
            tg[f"capture_{name}_compiled_ms"] = round(median_ms(lambda: cap(ids), warmup=2, reps=10), 2)
            tg[f"compile_{name}_s"] = warm["seconds"]
            feats[name + "_compiled"] = cap(ids)
            for m in cap.modules:       # back to eager for the next variant (the compiled forward is an attribute)
                del m.forward
        return feats
    feats, quantize_s = fp8_features.capture_both(model, ctx, measure)
    tg["quantize_s"] = round(quantize_s, 2)
    for k, v in feats.items():
        if k != "bf16":
            tg[f"{k}_rel_err"] = round(fp8_features.relative_error(v, feats["bf16"]), 5)
    model = feats = None
    torch.cuda.empty_cache()


SECTIONS = [
    Section("fp8", fp8, "the FP8 LM head's GEMMs and fused loss, the target's FP8 capture, against bf16", options=(
        Option("parts", "head,target", "comma list of head, target", "BENCH_FP8_PARTS"),
        Option("target_compile", "1", "0: the target's captures eager only", "BENCH_FP8_TARGET_COMPILE"))),
    Section("target", target, "the target's forward and captured layers, eager and compiled", default=True),
]
