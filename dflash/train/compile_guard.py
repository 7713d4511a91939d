"""Compile state of a training process: the persistent compile cache, the recompile limit (per thread), the
compile stance (after the warm-up any compile is an error, naming the shape, never an eager fallback), dynamo's
counters. Both runtimes use it; the thread-safety of compiled calls is dflash.compile_threads' (threads runtime only).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch


# ---- compile state ---------------------------------------------------------------------------------------
def use_compile_cache(cache_dir: str | Path) -> Path:
    """Point Inductor's persistent caches (FX graph + AOT autograd) at a folder named by the environment."""
    path = Path(cache_dir).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    return path


def recompile_limit(num_shapes: int, workers: int = 1) -> int:
    """Compiled entries one code object may hold in this process. An entry is per shape and per device (tensor guards
    include the device), and the replicas (and compiled targets) of one process share their code objects (every
    replica's Layer.forward, the loss kernel), so `workers` compiled workers over `num_shapes` buckets hold
    shapes x workers entries; x4 for the variants within one shape (a loss chunk's remainder, window layers)."""
    return max(64, 4 * num_shapes * max(1, workers))


def configure_thread(num_shapes: int, workers: int = 1) -> None:
    """Dynamo config is per thread (torch >= 2.12): call at the start of every worker thread, with the compiled
    workers of this process (RunContext.compiled_workers).

    The recompile limit covers every warmed shape on every device; reaching it is an error, never a silent eager
    fallback. Dynamo's cap on one code object's entries over all regions (accumulated_recompile_limit, 256) is
    raised with it.
    """
    limit = recompile_limit(num_shapes, workers)
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.accumulated_recompile_limit = max(256, limit)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def counters() -> dict:
    from torch._dynamo.utils import counters as c
    frames = c["frames"]
    return {
        "graphs": int(c["stats"]["unique_graphs"]),
        "cache_hits": int(c["inductor"]["fxgraph_cache_hit"]),
        "cache_misses": int(c["inductor"]["fxgraph_cache_miss"]),
        "eager_fallbacks": int(frames["total"] - frames["ok"]) if frames["total"] else 0,
        "graph_breaks": int(sum(c["graph_break"].values())),
    }


def forbid_recompiles() -> None:
    """After warm-up: any compile is an error (process-wide stance)."""
    torch.compiler.set_stance("fail_on_recompile")


def allow_compiles() -> None:
    torch.compiler.set_stance("default")


@contextlib.contextmanager
def backward_compiled_in_forward():
    """Compile each graph's backward with its forward, on this thread (the warm-up's, which holds
    compile_threads.FX_GUARD exclusively in the threads runtime).

    AOT autograd compiles a static-shape backward lazily, at its first backward call; on a GPU that call runs on the
    autograd engine's device thread, and Inductor's post-grad pattern rewrites FX-trace there (replace_by_example ->
    make_fx -> Tracer.trace), which waits on the FX guard the warm-up holds while the warm-up waits on that backward:
    a deadlock until the guard's timeout. torch._functorch.config.force_non_lazy_backward_lowering (torch >= 2.9)
    lowers the backward at forward time instead; it is part of AOT autograd's cache key, so train and the warmup
    stage (both through step.warm_up) share their cache entries."""
    import torch._functorch.config as cfg
    if not hasattr(cfg, "force_non_lazy_backward_lowering"):
        yield
        return
    with cfg.patch(force_non_lazy_backward_lowering=True):
        yield


class RecompileError(RuntimeError):
    pass


@contextlib.contextmanager
def no_new_graphs(what: str):
    """Fail fast, naming `what` (the shape), if the body compiled anything after warm-up."""
    before = counters()["graphs"]
    try:
        yield
    except Exception as e:  # the fail_on_recompile stance raises from inside dynamo
        if "recompil" in str(e).lower() or "fail_on_recompile" in str(e):
            raise RecompileError(f"recompile after warm-up for {what}: {str(e).splitlines()[0]}") from e
        raise
    after = counters()["graphs"]
    if after != before:
        raise RecompileError(f"{after - before} new graph(s) compiled after warm-up for {what}")

