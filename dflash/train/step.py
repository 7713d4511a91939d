"""The drafter's training step for one micro-batch (anchors -> forward -> chunked loss), the drafter built for it,
and its warm-up (every compile, for every bucket shape, single-threaded). Shared by both runtimes and the warm-up stage."""
from __future__ import annotations

import time

import torch

from dflash import compile_threads
from dflash.train import compile_guard, placement as P, precision


def frozen_head(target_model, device: torch.device):
    """The target's embedding and LM head weights on `device`: the target's own tensors there (shared, never
    copied), one frozen copy on any other device (one for both where the head is tied to the embedding). The drafter
    takes them as plain tensors."""
    e, h = (m.weight.detach() for m in (target_model.get_input_embeddings(), target_model.get_output_embeddings()))
    tied = e.data_ptr() == h.data_ptr()
    e = e.to(device)
    return e, e if tied else h.to(device)


def random_head(ctx, device: torch.device, dtype):
    """Stand-ins of the right shape for the warm-up stage (compiled graphs depend on shapes, not values)."""
    v, h = ctx.drafter_config.vocab_size, ctx.drafter_config.hidden_size
    return tuple(torch.randn(v, h, device=device, dtype=dtype) * 0.02 for _ in range(2))


def build_drafter(ctx, embed, head, device: torch.device):
    from dflash.families import embed_scale
    from dflash.model import DFlashDrafter
    from dflash.train.checkpoint import load_drafter

    init_from = ctx.cfg.drafter.init_from
    scale = embed_scale(getattr(ctx, "target_config", None))   # the block embedded as the target does (None: no target)
    if init_from:
        drafter = load_drafter(init_from, embed, head, device=device, expect=ctx.drafter_config, embed_scale=scale)
    else:
        torch.manual_seed(ctx.cfg.seed)
        with torch.device(device):
            drafter = DFlashDrafter(ctx.drafter_config, embed, head, embed_scale=scale)
    precision.apply_drafter(drafter, ctx.cfg.train, ctx.compile)   # train.precision / fp8_lm_head: before compiling
    if ctx.compile:
        from dflash.model.drafter import Linear
        for m in drafter.modules():   # train.recompute_weight_casts: bf16 weight copies recast in the backward
            if isinstance(m, Linear):
                m.recompute_cast = bool(ctx.cfg.train.recompute_weight_casts)
        for layer in drafter.layers:  # each forward compiled in place (state_dict names unchanged); traced in warm-up
            layer.forward = compile_threads.compiled(layer.forward, fullgraph=True, dynamic=False)
        for name in ("context", "final_norm"):   # the work around the layers (fc + norms), compiled the same way
            setattr(drafter, name, compile_threads.compiled(getattr(drafter, name), fullgraph=True, dynamic=False))
    return drafter.to(device).train()


_LOSS_KERNEL: dict = {}


def loss_kernel(compiled: bool, objective: str = "ce"):
    """The fused loss's per-chunk kernel (fused_ce.loss_chunk) with the objective bound; compiled (once per process,
    each objective's graphs traced in the warm-up) on the compile path."""
    import functools

    from dflash.model.fused_ce import loss_chunk
    if compiled and "k" not in _LOSS_KERNEL:
        _LOSS_KERNEL["k"] = compile_threads.compiled(loss_chunk, fullgraph=True, dynamic=False)
    return functools.partial(_LOSS_KERNEL["k"] if compiled else loss_chunk, objective=objective)


def micro_step(drafter, feats, input_ids, loss_mask, index: int, ctx, autocast_dtype):
    """Anchors -> drafter forward -> chunked loss for one micro-batch. Anchors are seeded by the batch index,
    so the same batch gets the same anchors in any runtime, replica or resumed run. `drafter` may be wrapped
    (DistributedDataParallel): it is called, its `.module` holds the LM head. feats [b, S, k*H] are the drafter's
    context, followed (train.objective kl / ce+kl) by the target's final-norm states [b, S, H] (features.py)."""
    from dflash.model import block_labels, block_teacher, dflash_loss, sample_anchors, uses_target

    core = getattr(drafter, "module", drafter)
    t = ctx.cfg.train
    device = input_ids.device
    gen = torch.Generator(device=device)
    gen.manual_seed(ctx.cfg.seed * 1_000_003 + index)
    bk, kh = ctx.drafter_config.block_size, ctx.drafter_config.num_context_layers * ctx.drafter_config.hidden_size
    anchors = sample_anchors(loss_mask, ctx.anchors_for(input_ids.shape[1]), bk, gen)
    labels, weights = block_labels(input_ids, loss_mask, anchors, ctx.gamma)
    teacher = block_teacher(feats[..., kh:], anchors) if uses_target(t.objective) else None    # [b, Q, H]
    with torch.autocast(device.type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        hidden = drafter(feats[..., :kh], input_ids, anchors, backend=ctx.backend)            # the fc reads k*H
        return dflash_loss(hidden, precision.loss_head(core), labels, weights, bk, t.loss_chunk,
                           fused=t.loss_kernel == "fused", kernel=loss_kernel(ctx.compile, t.objective),
                           objective=t.objective, teacher=teacher, weighting=t.loss_weighting,
                           dpace_alpha=t.dpace_alpha)


def dummy_batch(ctx, batch: int, length: int, device, dtype):
    """Random features (of the run's width: features.feature_width) and tokens of one bucket's shape, every
    position supervised (for warm-up)."""
    from dflash.train.features import feature_width
    g = torch.Generator(device="cpu").manual_seed(length)
    ids = torch.randint(0, ctx.drafter_config.vocab_size, (batch, length), generator=g).to(device)
    feats = torch.randn(batch, length, feature_width(ctx.drafter_config, ctx.cfg.train), generator=g)
    feats = feats.to(device=device, dtype=dtype or torch.float32)
    return feats, ids, torch.ones(batch, length, dtype=torch.bool, device=device)


def warm_up(drafter, ctx, device, shapes, optimizer=None) -> dict:
    """Compile (or just run) the drafter's forward and backward for every shape, single-threaded, holding the
    FX guard exclusively in the threads runtime (each backward compiled with its forward, on this thread: never lazily
    on the CUDA autograd thread, which would wait on that guard), then the optimizer's compiled step (a step that
    changes nothing: train/adamw.py). Leaves no gradients behind."""
    dtype = P.autocast_dtype(ctx.cfg.train, device)
    before = compile_guard.counters()
    t0 = time.perf_counter()
    per_shape = []
    with compile_threads.exclusive(), compile_guard.backward_compiled_in_forward():
        compile_guard.allow_compiles()
        compile_guard.configure_thread(len(shapes), ctx.compiled_workers)
        for b, s in shapes:
            t = time.perf_counter()
            feats, ids, mask = dummy_batch(ctx, b, s, device, dtype)
            out = micro_step(drafter, feats, ids, mask, 0, ctx, dtype)
            out.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per_shape.append({"batch": b, "length": s, "seconds": round(time.perf_counter() - t, 3)})
        drafter.zero_grad(set_to_none=True)
        if optimizer is not None:
            optimizer.warm_up()
    after = compile_guard.counters()
    return {"device": str(device), "role": "drafter", "backend": ctx.backend, "compiled": ctx.compile,
            "shapes": per_shape,
            "graphs": after["graphs"] - before["graphs"], "cache_hits": after["cache_hits"] - before["cache_hits"],
            "cache_misses": after["cache_misses"] - before["cache_misses"],
            "seconds": round(time.perf_counter() - t0, 3)}
