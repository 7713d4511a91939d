"""The compile path on CPU (sdpa): every bucket compiled in the warm-up, worker threads then run many steps over
several buckets with zero recompiles (a `dflash train` process, beside the in-process tests); a shape the warm-up
did not see fails fast, naming the shape."""
import json
import subprocess
import sys
import threading

import pytest
import torch
from transformers import Qwen3Config

from dflash import config as C
from support.train import REPO, prepared, run_dir

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def compiled_run(request, tmp_path_factory):
    """`python -m dflash train` with train.compile, started in the background as this module's first test starts
    (where the test reading it is selected): its warm-up compiles on one core while the in-process compile tests
    here use the other. (config file, process, its stderr file)."""
    if not any(getattr(item, "module", None) is request.module and item.name == "test_threads_over_buckets_with_zero_recompiles"
               for item in request.session.items):
        yield None
        return
    cfg = prepared(tmp_path_factory.mktemp("compiled"), compile=True, steps=10, checkpoint_every=0)
    err = cfg.parent / "train.err"
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--config", str(cfg), "--no-progress"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    try:
        yield cfg, proc, err
    finally:
        proc.kill()
        proc.wait()


def _tiny(compiled: bool, **train):
    """A RunContext for a 1-layer drafter over a 6-layer, hidden-32 target (no files), compiled or eager."""
    from dflash.model import DrafterConfig
    from dflash.train.context import RunContext

    loaded = C.from_dict({"train": {"num_anchors": 4, "loss_chunk": 16, **train},
                          "drafter": {"num_layers": 1, "block_size": 4}})
    tconf = Qwen3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                            intermediate_size=64, num_hidden_layers=6, vocab_size=64, rms_norm_eps=1e-6,
                            rope_theta=1e6, max_position_embeddings=512)
    dcfg = DrafterConfig.from_target(tconf, loaded.cfg.drafter, 5)
    return RunContext(loaded, None, "sdpa", None, None, tconf, dcfg, 3.0, {}, compiled)


@pytest.mark.parametrize("recipe", [{}, {"objective": "ce+kl", "loss_weighting": "dpace"}])
def test_compiled_drafter_equals_eager_with_the_same_state_dict(recipe):
    """build_drafter on the compile path (layers, fc + hidden norm, final norm compiled): the same parameter names,
    loss and gradients as the eager drafter from the same seed; also with the target's final states beside the
    context features (ce+kl: the fc reads a strided slice, the compiled loss kernel the target's logits)."""
    from dflash.train.features import feature_width
    from dflash.train.step import build_drafter, micro_step, random_head
    cpu = torch.device("cpu")
    head = random_head(_tiny(False), cpu, torch.float32)
    g = torch.Generator().manual_seed(0)
    # length 20: a shape no other test here compiles (dynamo's in-process cache would otherwise serve their graphs)
    eager = _tiny(False, **recipe)
    width = feature_width(eager.drafter_config, eager.cfg.train)
    feats, ids = torch.randn(1, 20, width, generator=g), torch.randint(0, 64, (1, 20), generator=g)
    mask = torch.ones(1, 20, dtype=torch.bool)
    runs = []
    for compiled in (False, True):
        setup = _tiny(compiled, **recipe)
        d = build_drafter(setup, *head, cpu)
        out = micro_step(d, feats, ids, mask, 1, setup, None)
        out.loss.backward()
        runs.append((list(d.state_dict()), out.loss.detach(), {n: p.grad for n, p in d.named_parameters()}))
    (k0, l0, g0), (k1, l1, g1) = runs
    assert k0 == k1 and "fc.weight" in k1 and "norm.weight" in k1 and "hidden_norm.weight" in k1
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_unwarmed_shape_fails_fast_naming_it(monkeypatch):
    import contextlib

    import torch._functorch.config as functorch_config

    from dflash.train import compile_guard
    from dflash.train.step import build_drafter, micro_step, random_head, warm_up

    setup = _tiny(True)
    cpu = torch.device("cpu")
    drafter = build_drafter(setup, *random_head(setup, cpu, torch.float32), cpu)
    eager_bw = []   # the warm-up compiles each backward with its forward (test_compile_guard shows why)
    real = compile_guard.backward_compiled_in_forward

    @contextlib.contextmanager
    def seen():
        with real():
            eager_bw.append(getattr(functorch_config, "force_non_lazy_backward_lowering", True))
            yield

    monkeypatch.setattr(compile_guard, "backward_compiled_in_forward", seen)
    record = warm_up(drafter, setup, cpu, [(1, 24)])
    assert record["graphs"] >= 1 and eager_bw == [True]
    compile_guard.forbid_recompiles()
    errors = []

    def worker():
        compile_guard.configure_thread(1)
        try:
            feats = torch.randn(1, 24, 5 * 32)
            ids = torch.randint(0, 64, (1, 24))
            mask = torch.ones(1, 24, dtype=torch.bool)
            with compile_guard.no_new_graphs("batch (1, 24) on cpu"):
                micro_step(drafter, feats, ids, mask, 1, setup, None).loss.backward()  # warmed: fine
            feats, ids, mask = torch.randn(1, 40, 5 * 32), torch.randint(0, 64, (1, 40)), torch.ones(1, 40, dtype=torch.bool)
            with compile_guard.no_new_graphs("batch (1, 40) on cpu"):
                micro_step(drafter, feats, ids, mask, 2, setup, None).loss.backward()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    try:
        t = threading.Thread(target=worker)
        t.start()
        t.join(120)
    finally:
        compile_guard.allow_compiles()
    assert len(errors) == 1 and isinstance(errors[0], compile_guard.RecompileError), errors
    assert "(1, 40)" in str(errors[0])


def test_threads_over_buckets_with_zero_recompiles(compiled_run):
    """Last in this module: its run (compiled_run) trained beside the tests above."""
    cfg, proc, err = compiled_run
    assert proc.wait(timeout=900) == 0, err.read_text()[-3000:]
    s = json.loads((run_dir(cfg) / "summary.json").read_text())
    buckets = [b for b, n in s["data"]["buckets"].items() if n >= 2]
    assert len(buckets) >= 2                      # several length buckets in the stream
    assert s["compile"]["graphs"] >= len(buckets)  # each compiled in the warm-up
    assert s["compile"]["recompiles_after_warmup"] == 0 and s["compile"]["eager_fallbacks"] == 0
    assert s["status"] == "completed" and s["replicas_identical"] is True


def test_the_compiled_adamw_step_equals_eager_and_never_recompiles():
    """dflash.train.adamw compiled (on the CPU here; train compiles it on a GPU): its warm-up step leaves weights and
    state bit for bit as they were; after it, with recompiles forbidden, steps at new learning rates and clips run
    with no new graph and equal the eager function's."""
    from dflash.train import compile_guard
    from dflash.train.adamw import CompiledAdamW

    def params(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((48, 16), (16,), (8, 8, 3))]
    ours, ref = params(0), params(0)
    fast = CompiledAdamW(torch.optim.AdamW(ours, lr=1e-2, weight_decay=0.1), compiled=True)
    slow = CompiledAdamW(torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1), compiled=False)
    fast.state()
    before = [p.detach().clone() for p in ours]
    fast.warm_up()
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, ours))
    assert all(not v.any() for st in fast.opt.state.values() for k, v in st.items() if k != "step")
    compile_guard.forbid_recompiles()
    try:
        graphs = compile_guard.counters()["graphs"]
        for step, (lr, clip) in enumerate([(1e-2, 1.0), (3e-3, 0.0), (5e-4, 0.1)]):
            g = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=g) * 3 for p in ours]
            fast.group["lr"] = slow.group["lr"] = lr
            n1 = fast.step(grads, torch.tensor(0.5), clip)
            n2 = slow.step([x.clone() for x in grads], torch.tensor(0.5), clip)
            assert float(n1) == pytest.approx(float(n2), rel=1e-5)
        assert compile_guard.counters()["graphs"] == graphs
    finally:
        compile_guard.allow_compiles()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)
