"""torch.compile callable from several threads of one process (the threads runtime's replicas and targets).

Two hazards of torch <= 2.13, both of threads sharing compiled code, and the one wrapper that prevents them:
  1. any FX trace (torch.fx.symbolic_trace, make_fx inside a compile, an uncompiled create_block_mask) sets the
     process-wide `torch.fx._symbolic_trace._is_fx_tracing_flag`; a compiled function entered by *another* thread
     meanwhile raises "Detected that you are using FX to symbolically trace a dynamo-optimized function".
     Defence: `FX_GUARD`, an FX trace holds it exclusively (Tracer.trace wrapped once, process-wide) and every
     compiled call holds it shared, so no compiled call starts while a trace is open;
  2. dynamo keeps the compiled entries of one code object (every replica's Layer.forward shares it) in one list and
     moves the entry that matched to the front. A thread walking that list can be switched out while a guard runs
     Python; another thread's move then makes it skip the matching entry, so a warmed shape "recompiles" and fails
     after warm-up ("runtime guards failed even though they passed during recompilation-reason analysis").
     Defence: calls into one code object are serialized, on the host only (what they launch on a GPU still runs
     concurrently).

`compiled(fn)` is torch.compile(fn) with both defences (and `eager()`, a thread's way around the compiled code); they act
inside `threaded()`, which the threads transport holds
while its worker threads run (every compile happened before, in the single-threaded warm-up). A process with one
training thread (the distributed runtime, the warm-up stage) never turns them on: its compiled calls go straight to
torch. Pure torch: the model and the trainer both use it.
"""
from __future__ import annotations

import contextlib
import functools
import threading

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
_CODE_LOCKS: dict = {}
_STATE = {"depth": 0, "trace": None}
_GUARD = threading.Lock()


@contextlib.contextmanager
def threaded():
    """Both defences on while the body runs (the threads transport's workers; re-entrant): torch.fx.Tracer.trace
    wrapped so every FX trace holds FX_GUARD exclusively, every `compiled` call holding it shared and its code
    object's lock. Off again afterwards: a compile outside the workers (a warm-up, a later run in this process) then
    runs as plain torch.compile."""
    with _GUARD:
        if not _STATE["depth"]:
            original = _STATE["trace"] = torch.fx.Tracer.trace

            @functools.wraps(original)
            def trace(self, *args, **kwargs):
                with FX_GUARD.exclusive():
                    return original(self, *args, **kwargs)

            torch.fx.Tracer.trace = trace
        _STATE["depth"] += 1
    try:
        yield
    finally:
        with _GUARD:
            _STATE["depth"] -= 1
            if not _STATE["depth"]:
                torch.fx.Tracer.trace = _STATE["trace"]


def enabled() -> bool:
    return _STATE["depth"] > 0


def exclusive():
    """Held by a single-threaded warm-up (every compile): compiled calls and traces of other threads wait for it."""
    return FX_GUARD.exclusive() if enabled() else contextlib.nullcontext()


_LOCAL = threading.local()


@contextlib.contextmanager
def eager():
    """Inside the body, on this thread only, every `compiled` function runs its original Python: no compiled code,
    no compile (the in-training evaluation decodes at shapes the warm-up never compiled, while the other threads go
    on running the compiled code; torch.compiler.set_stance would switch every thread of the process)."""
    before = getattr(_LOCAL, "eager", False)
    _LOCAL.eager = True
    try:
        yield
    finally:
        _LOCAL.eager = before


def _code_of(fn):
    """The code object dynamo keeps the compiled entries on: a function's or a bound method's. Not a module's: for
    torch.compile(module) of a torch.nn class dynamo runs a wrapper (external_utils.wrap_inline) whose code every such
    module shares, so a lock on type(module).forward would not cover it; compile `module.forward` instead."""
    if isinstance(fn, torch.nn.Module):
        raise TypeError(f"compile_threads.compiled: pass {type(fn).__name__}.forward (a bound method), not the module")
    return getattr(fn, "__func__", fn).__code__


def compiled(fn, **compile_kwargs):
    """torch.compile(fn, **compile_kwargs); inside `threaded()`, each call holds FX_GUARD shared and the lock of fn's
    code object (shared by every function compiled from the same code)."""
    code = _code_of(fn)
    with _GUARD:
        lock = _CODE_LOCKS.setdefault(code, threading.RLock())
    inner = torch.compile(fn, **compile_kwargs)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if getattr(_LOCAL, "eager", False):
            return fn(*args, **kwargs)
        if not _STATE["depth"]:
            return inner(*args, **kwargs)
        with FX_GUARD.shared(), lock:
            return inner(*args, **kwargs)

    return call
