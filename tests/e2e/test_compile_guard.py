"""The seed's failure, reproduced, and the guard that prevents it.

While one thread holds an FX trace open, another thread entering a compiled function raises
"Detected that you are using FX to symbolically trace a dynamo-optimized function" (torch <= 2.13: the tracing flag
is a process-wide global). Calls made through compile_threads.compiled() wait for the trace instead, once the threads
runtime enabled its defences.
"""
import threading

import pytest
import torch

from dflash import compile_threads
from dflash.train import compile_guard


@pytest.fixture
def threaded():
    """The threads transport's defences on for the test (as while its workers run), off after it."""
    with compile_threads.threaded():
        yield


def _sin(x):
    return torch.sin(x) * 2 + 1


def _compiled():
    return torch.compile(_sin, backend="eager", dynamic=False)


class _WaitsWhileTraced(torch.nn.Module):
    def __init__(self, tracing: threading.Event, release: threading.Event):
        super().__init__()
        self.tracing, self.release = tracing, release

    def forward(self, x):
        self.tracing.set()
        self.release.wait(10)
        return x + 1


def _run_threads(fn, n, x):
    results, errors = [None] * n, [None] * n

    def work(i):
        try:
            results[i] = fn(x)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results, errors


def test_fx_trace_hazard_reproduced_and_guarded(threaded):
    f = _compiled()
    safe = compile_threads.compiled(_sin, backend="eager", dynamic=False)
    x = torch.randn(8)
    expected = torch.sin(x) * 2 + 1
    with compile_threads.exclusive():  # the single-threaded warm-up
        torch.testing.assert_close(f(x), expected)
        torch.testing.assert_close(safe(x), expected)

    tracing, release = threading.Event(), threading.Event()
    tracer = threading.Thread(target=lambda: torch.fx.symbolic_trace(_WaitsWhileTraced(tracing, release)))
    tracer.start()
    assert tracing.wait(10)
    assert torch.fx._symbolic_trace.is_fx_tracing()  # the process-wide flag is up

    # the seed's way: three workers call the compiled function directly -> all three die
    threads, _, errors = _run_threads(f, 3, x)
    for t in threads:
        t.join(10)
    assert all(isinstance(e, RuntimeError) and "Detected that you are using FX" in str(e) for e in errors), errors

    # the project's way: the same calls through the one wrapper wait for the trace, then succeed
    threads, results, errors = _run_threads(safe, 3, x)
    for t in threads:
        t.join(0.3)
    assert all(t.is_alive() for t in threads)  # waiting, not failing
    release.set()
    tracer.join(10)
    for t in threads:
        t.join(10)
    assert errors == [None, None, None]
    for r in results:
        torch.testing.assert_close(r, expected)


def test_compile_inside_guarded_call_is_refused_not_deadlocked(threaded):
    with pytest.raises(RuntimeError, match="inside a guarded compiled call"):
        with compile_threads.FX_GUARD.shared():   # what every compiled call holds
            torch.fx.symbolic_trace(torch.nn.Identity())


def test_the_defences_are_on_only_inside_threaded():
    """What the distributed runtime and the warm-up stage run: plain torch.compile, no trace wrapper, no locks; the
    threads transport's workers run inside threaded(), and afterwards it is all undone."""
    plain_trace = torch.fx.Tracer.trace
    f = compile_threads.compiled(_sin, backend="eager", dynamic=False)
    x = torch.randn(4)
    with compile_threads.FX_GUARD.exclusive():   # held by another thread, say: an unguarded call does not wait
        assert not compile_threads.enabled()
        done = []
        t = threading.Thread(target=lambda: done.append(f(x)))
        t.start()
        t.join(10)
        assert done
    with compile_threads.threaded():
        assert compile_threads.enabled() and torch.fx.Tracer.trace is not plain_trace
        with compile_threads.FX_GUARD.exclusive():   # inside: the same call waits for the holder
            t = threading.Thread(target=lambda: done.append(f(x)))
            t.start()
            t.join(0.3)
            assert t.is_alive()
        t.join(10)
        assert len(done) == 2
    assert not compile_threads.enabled() and torch.fx.Tracer.trace is plain_trace


def test_shared_calls_run_together_exclusive_waits():
    lock = compile_threads.SharedExclusiveLock()
    inside = threading.Barrier(3, timeout=5)

    def reader():
        with lock.shared():
            inside.wait()  # three holders at once, or this times out

    ts = [threading.Thread(target=reader) for _ in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(5)
    assert not inside.broken
    order = []
    with lock.shared():
        w = threading.Thread(target=lambda: (lock.exclusive().__enter__(), order.append("writer")))
        w.start()
        w.join(0.3)
        assert order == []  # the writer waits for the shared holder
    w.join(5)
    assert order == ["writer"]


class _TwoShapes(torch.nn.Module):
    """Like a drafter layer: tensors, a dict and a tuple as arguments; one compiled entry per length."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, ctx, masks, rope):
        return self.proj(x) * rope[0] + ctx.sum(1, keepdim=True) + masks[None].sum()


def _replicas_in_lockstep(forwards, rounds: int) -> list:
    """Two threads, as two replicas: every round both call their own module's forward with the same length, the
    length changing between rounds (a step's micro-batches share a bucket). Returns the errors raised."""
    lengths = (4, 6, 8, 10)
    errors, step = [], threading.Barrier(len(forwards))

    def inputs(n):
        return torch.randn(1, n, 8), torch.randn(1, n, 8), {None: torch.ones(n)}, (torch.randn(n, 1),)

    for fwd in forwards:   # the single-threaded warm-up: every length, every replica
        for n in lengths:
            with torch.no_grad():
                fwd(*inputs(n))

    def replica(fwd):
        try:
            for i in range(rounds):
                step.wait()
                with torch.no_grad():
                    for _ in range(4):
                        fwd(*inputs(lengths[i % len(lengths)]))
        except threading.BrokenBarrierError:
            pass
        except Exception as e:  # noqa: BLE001 - the test inspects it
            errors.append(e)
            step.abort()

    import sys
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible: the race shows within a second
    compile_guard.forbid_recompiles()
    try:
        threads = [threading.Thread(target=replica, args=(f,)) for f in forwards]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        compile_guard.allow_compiles()
        sys.setswitchinterval(interval)
    return errors


def test_threads_calling_one_compiled_code_object_recompile_spuriously_unless_serialized(threaded):
    """The CI failure of a threads run (1 in 4 on 2 cores): two replicas' compiled layers share one code object;
    plain torch.compile lets one thread make the other miss a warmed entry, so a warmed shape 'recompiles'.
    compile_threads.compiled serializes the calls: no error in many more rounds. The race is a race: where plain
    torch.compile does not show it within 20 s (a loaded machine, a torch that fixed it), the serialized run proves
    nothing and the test says so (skip) instead of failing."""
    import time
    plain = [torch.compile(_TwoShapes().forward, backend="eager", fullgraph=True, dynamic=False) for _ in range(2)]
    errors, t0 = [], time.perf_counter()
    while not errors and time.perf_counter() - t0 < 20:   # most often within the first 2000 rounds (< 1 s)
        errors = _replicas_in_lockstep(plain, 2000)
    assert not errors or "Detected recompile" in str(errors[0]), errors

    torch._dynamo.reset()
    with pytest.raises(TypeError, match="LayerNorm.forward"):   # a module's entries may sit on a shared wrapper's code
        compile_threads.compiled(torch.nn.LayerNorm(8))
    safe = [compile_threads.compiled(_TwoShapes().forward, backend="eager", fullgraph=True, dynamic=False)
            for _ in range(2)]
    assert _replicas_in_lockstep(safe, 4000) == []
    if not errors:
        pytest.skip("plain torch.compile showed no spurious recompile within 20 s here: nothing to compare against")


def test_recompile_limit_covers_every_device_and_shape():
    """A compiled entry is per shape and per device (tensor guards include the device); the threads runtime's
    process holds them for all its workers: 8 GPUs each running a compiled target and a drafter replica over 16
    buckets make 16 x 16 entries on a shared code object (the old max(64, 4 x shapes) stopped at 64)."""
    from dflash.train.placement import Placement
    gpus = tuple(torch.device("cuda", i) for i in range(8))
    workers = Placement(gpus, gpus, "threads").compiled_workers(compile_target=True)
    shapes = 16
    assert workers == 16 and compile_guard.recompile_limit(shapes, workers) >= shapes * workers
    assert compile_guard.recompile_limit(shapes, 1) == 64 and compile_guard.recompile_limit(2) == 64   # the floor
    seen = {}

    def worker():   # dynamo config is per thread (torch >= 2.12): each worker thread applies it
        compile_guard.configure_thread(shapes, workers)
        c = torch._dynamo.config
        seen.update(limit=c.recompile_limit, accumulated=c.accumulated_recompile_limit, fail=c.fail_on_recompile_limit_hit)

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    limit = compile_guard.recompile_limit(shapes, workers)
    assert seen == {"limit": limit, "accumulated": max(256, limit), "fail": True} and limit >= 256


def test_backward_compiled_in_forward_never_waits_on_the_warm_ups_guard(tmp_path, monkeypatch, threaded):
    """On a GPU a backward runs on the autograd engine's device thread. AOT autograd compiles a static-shape backward
    lazily, at that call, and Inductor's pattern rewrites FX-trace there (w's gradient, mm + mm -> addmm): that thread
    waits on the FX guard the warm-up holds while the warm-up waits on it. Simulated on CPU with the backward on
    another thread, over an empty Inductor cache (a cache hit would skip the compile): compiled with its forward, the
    backward never traces there."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # read per compile; Inductor's config is per thread

    def f(a, b, w):   # w used twice: its gradient a.T @ g + b.T @ g is rewritten by an FX trace
        return torch.tanh(a @ w) + torch.tanh(b @ w)

    a, b, w = (torch.randn(8, 8, requires_grad=True) for _ in range(3))
    done = threading.Event()
    with compile_threads.exclusive(), compile_guard.backward_compiled_in_forward():
        out = torch.compile(f, fullgraph=True, dynamic=False)(a, b, w)
        t = threading.Thread(target=lambda: (out.sum().backward(), done.set()), daemon=True)
        t.start()
        t.join(60)
        in_time = done.is_set()
    t.join(120)   # (the guard released: a backward that waited on it finishes now)
    assert in_time, "the backward compiled on the autograd thread and waited on the FX guard held by the warm-up"
    torch.testing.assert_close(w.grad, torch.autograd.grad(f(a, b, w).sum(), w)[0])


def test_eager_runs_the_original_python_on_this_thread_only():
    """The in-training evaluation decodes inside compile_threads.eager(): the compiled functions run their original
    Python on that thread, while another thread (the threads runtime's target workers) keeps the compiled code."""
    def f(x):
        return x + (1.0 if torch.compiler.is_compiling() else 0.0)   # 1 in the compiled code, 0 in the original

    g = compile_threads.compiled(f, backend="eager", fullgraph=True, dynamic=False)
    x = torch.zeros(2)
    assert g(x).sum().item() == 2.0
    other = {}
    with compile_threads.eager():
        assert g(x).sum().item() == 0.0
        t = threading.Thread(target=lambda: other.setdefault("sum", g(x).sum().item()))
        t.start()
        t.join()
    assert other["sum"] == 2.0 and g(x).sum().item() == 2.0
