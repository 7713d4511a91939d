"""Race-free compilation for the threads runtime.

The hazard (torch <= 2.13): any FX trace — torch.fx.symbolic_trace, make_fx inside a torch.compile, uncompiled
create_block_mask — sets the process-wide `torch.fx._symbolic_trace._is_fx_tracing_flag`; a compiled function
entered by *another* thread meanwhile raises "Detected that you are using FX to symbolically trace a
dynamo-optimized function". Three defences, used together:
  1. every compile happens in a single-threaded warm-up before the workers start, for every shape bucket;
  2. afterwards the compile stance forbids recompiles: a new shape fails fast, naming the shape, never falls back;
  3. `FX_GUARD`: an FX trace holds an exclusive lock (Tracer.trace is wrapped once, process-wide) and compiled
     calls made through `guarded()` hold it shared, so no compiled call ever starts while a trace is open.
A second, independent hazard (spurious recompiles when threads call one compiled code object) is what
`compiled()` prevents.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path

import torch


class SharedExclusiveLock:
    """Many shared holders or one exclusive holder (re-entrant for that thread); writers are preferred."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared: dict[int, int] = {}
        self._owner: int | None = None
        self._depth = 0
        self._waiting_writers = 0

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                while self._owner is not None or (self._waiting_writers and me not in self._shared):
                    self._cond.wait()
            self._shared[me] = self._shared.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared[me] -= 1
                if not self._shared[me]:
                    del self._shared[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, timeout: float = 600.0):
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                if me in self._shared:
                    raise RuntimeError("an FX trace or compile started inside a guarded compiled call "
                                       "(a shape the warm-up did not compile?)")
                self._waiting_writers += 1
                try:
                    if not self._cond.wait_for(lambda: self._owner is None and not self._shared, timeout):
                        raise TimeoutError("FX guard: waited too long for compiled calls to finish")
                finally:
                    self._waiting_writers -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                self._cond.notify_all()


FX_GUARD = SharedExclusiveLock()
_installed = False


def install_fx_guard() -> None:
    """Wrap torch.fx.Tracer.trace so every FX trace in this process holds FX_GUARD exclusively."""
    global _installed
    if _installed:
        return
    original = torch.fx.Tracer.trace

    @functools.wraps(original)
    def trace(self, *args, **kwargs):
        with FX_GUARD.exclusive():
            return original(self, *args, **kwargs)

    torch.fx.Tracer.trace = trace
    _installed = True


def guarded(fn):
    """A compiled callable made safe to call from many threads while other code may FX-trace."""
    install_fx_guard()

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with FX_GUARD.shared():
            return fn(*args, **kwargs)

    return call


# ---- compiled callables safe to call from several threads --------------------------------------------------
_CODE_LOCKS: dict = {}
_CODE_LOCKS_GUARD = threading.Lock()


def _code_of(fn):
    """The code object dynamo keeps the compiled entries on: a function's or a bound method's. Not a module's: for
    torch.compile(module) of a torch.nn class dynamo runs a wrapper (external_utils.wrap_inline) whose code every such
    module shares, so a lock on type(module).forward would not cover it; compile `module.forward` instead."""
    if isinstance(fn, torch.nn.Module):
        raise TypeError(f"compile_guard.compiled: pass {type(fn).__name__}.forward (a bound method), not the module")
    return getattr(fn, "__func__", fn).__code__


def compiled(fn, **compile_kwargs):
    """torch.compile(fn), callable from several threads at once (the replicas of the threads runtime).

    The second hazard (torch <= 2.13): dynamo keeps the compiled entries of one code object (every replica's
    Layer.forward shares it) in one list, and moves the entry that matched to the front. A thread walking that
    list can be switched out while a guard runs Python (one always does); another thread's move then makes it skip
    the matching entry, so a warmed shape "recompiles" and fails after warm-up (dynamo: "runtime guards failed
    even though they passed during recompilation-reason analysis"). Calls into one code object are therefore
    serialized, on the host only: what they launch on a GPU still runs concurrently."""
    code = _code_of(fn)
    with _CODE_LOCKS_GUARD:
        lock = _CODE_LOCKS.setdefault(code, threading.RLock())
    inner = torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with lock:
            return inner(*args, **kwargs)

    return call


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
    """Compile each graph's backward with its forward, on this thread (the warm-up's, holding FX_GUARD exclusively).

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

