"""The chunked, checkpointed DFlash loss: equal to a naive computation (value, gradients, metrics), and its
largest tensor does not grow with the number of positions."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.model import IGNORE, dflash_loss


def _case(B=2, A=5, Bk=4, H=16, V=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, A * Bk, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype)
    labels = torch.randint(0, V, (B, A * Bk), generator=g)
    k = torch.arange(A * Bk) % Bk
    drop = (torch.rand(B, A * Bk, generator=g) < 0.2) | (k == 0)
    labels[drop] = IGNORE
    labels[-1, :Bk] = IGNORE                                  # a padded block
    weights = torch.exp(-(k.to(dtype) - 1) / 3.0).expand(B, -1).clone()
    weights[labels == IGNORE] = 0
    return hidden, W, labels, weights


def _naive(hidden, W, labels, weights):
    logits = hidden @ W.T
    ce = F.cross_entropy(logits.reshape(-1, W.shape[0]), labels.reshape(-1), ignore_index=IGNORE, reduction="none")
    w = weights.reshape(-1)
    return (ce * w).sum() / w.sum(), logits.argmax(-1)


def test_chunked_loss_and_gradients_equal_naive():
    hidden, W, labels, weights = _case()
    h0 = hidden.clone().requires_grad_()
    ref, pred = _naive(h0, W, labels, weights)
    ref.backward()
    for chunk in (1, 7, 1000):
        h = hidden.clone().requires_grad_()
        out = dflash_loss(h, W, labels, weights, block_size=4, chunk=chunk)
        out.loss.backward()
        torch.testing.assert_close(out.loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h.grad, h0.grad, rtol=1e-10, atol=1e-12)
    # metrics, from the naive argmax
    B, Q = labels.shape
    scored = labels != IGNORE
    ok = (pred == labels) & scored
    k = torch.arange(Q) % 4
    assert out.count.tolist() == [int(scored[:, k == i].sum()) for i in (1, 2, 3)]
    assert out.correct.tolist() == [int(ok[:, k == i].sum()) for i in (1, 2, 3)]
    acc, blocks = 0, 0
    for b in range(B):
        for j in range(Q // 4):
            if not scored[b, j * 4 + 1]:
                continue
            blocks += 1
            for i in (1, 2, 3):
                if not ok[b, j * 4 + i]:
                    break
                acc += 1
    assert int(out.blocks) == blocks and int(out.accept_sum) == acc


def test_acceptance_metrics_on_a_constructed_case():
    # V = H = 4, W = identity: the prediction is the argmax of the hidden vector
    W = torch.eye(4)
    onehot = lambda t: F.one_hot(torch.tensor(t), 4).float() * 5
    I = IGNORE
    labels = torch.tensor([[I, 1, 2, 3,   I, 0, 0, 0,   I, 2, I, 1]])
    preds = [0, 1, 2, 0,   0, 0, 1, 0,   0, 2, 2, 1]            # block 0: 2 accepted; block 1: 1; block 2: 1
    hidden = torch.stack([onehot(p) for p in preds])[None]
    weights = (labels != I).float()
    out = dflash_loss(hidden, W, labels, weights, block_size=4, chunk=5)
    assert out.count.tolist() == [3, 2, 3]
    assert out.correct.tolist() == [3, 1, 2]
    assert int(out.blocks) == 3 and int(out.accept_sum) == 4
    assert math.isclose(float(out.acceptance_estimate), 4 / 3, rel_tol=1e-6)
    # nothing scored: loss 0, no NaN
    empty = dflash_loss(hidden, W, torch.full_like(labels, I), torch.zeros_like(weights), block_size=4)
    assert float(empty.loss) == 0.0 and int(empty.blocks) == 0


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _largest(fn, A, V=512, H=16, Bk=4):
    hidden, W, labels, weights = _case(B=1, A=A, Bk=Bk, H=H, V=V, dtype=torch.float32)
    h = hidden.requires_grad_()
    with LargestTensor() as m:
        loss = fn(h, W, labels, weights)
        loss.backward()
    return m.largest


def test_chunked_loss_memory_does_not_grow_with_positions():
    chunk, V = 16, 512
    chunked = lambda h, W, l, w: dflash_loss(h, W, l, w, block_size=4, chunk=chunk).loss
    naive = lambda h, W, l, w: _naive(h, W, l, w)[0]
    small, large = _largest(chunked, A=8), _largest(chunked, A=64)
    assert small == large == chunk * V                      # one chunk of logits, whatever the positions
    n_small, n_large = _largest(naive, A=8), _largest(naive, A=64)
    assert n_large == 8 * n_small and n_large >= 64 * 4 * V  # the naive logits grow with the positions


def test_fused_loss_equals_checkpointed_loss_and_gradients():
    from dflash.model import dflash_loss
    torch.manual_seed(3)
    B, A, Bk, H, V = 2, 5, 4, 8, 40
    hidden = torch.randn(B, A * Bk, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A * Bk))
    labels[:, ::Bk] = -100
    labels[1, -Bk:] = -100          # a padded block
    weights = torch.rand(B, A * Bk, dtype=torch.float64)
    ref = dflash_loss(hidden, w, labels, weights, Bk, chunk=7)
    out = dflash_loss(hidden, w, labels, weights, Bk, chunk=7, fused=True)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-12, atol=1e-12)
    for name in ("correct", "count", "accept_sum", "blocks"):
        assert torch.equal(getattr(out, name), getattr(ref, name)), name
    g_ref, = torch.autograd.grad(ref.loss * 2.5, hidden)
    g_out, = torch.autograd.grad(out.loss * 2.5, hidden)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("compiled,objective", [(False, "ce"), (False, "kl"), (False, "ce+kl"),
                                                (True, "ce"), (True, "ce+kl")])
def test_loss_chunk_overwrites_the_logits_with_their_gradient(compiled, objective):
    """The fused loss's kernel: per-row CE / KL(p || q) / their sum, argmax hits, and d(row loss)/d(logits) written
    over the logits (one [n, V] buffer per chunk); compiled (Inductor, CPU) it allocates no [n, V] buffer."""
    from torch._inductor.utils import run_and_get_code

    from dflash.model.fused_ce import loss_chunk
    g = torch.Generator().manual_seed(5)
    n, V = 6, 33
    logits = torch.randn(n, V, generator=g, dtype=torch.float64)
    target = torch.randn(n, V, generator=g, dtype=torch.float64) * 2 if objective != "ce" else None
    labels = torch.randint(0, V, (n,), generator=g)
    labels[2] = IGNORE
    x = logits.clone().requires_grad_()
    ce = F.cross_entropy(x, labels.clamp(min=0), reduction="none")
    kl = (F.softmax(target, -1) * (F.log_softmax(target, -1) - F.log_softmax(x, -1))).sum(-1) \
        if target is not None else torch.zeros(n, dtype=torch.float64)
    ref = {"ce": ce, "kl": kl, "ce+kl": ce + kl}[objective]
    rw = torch.rand(n, generator=g, dtype=torch.float64)          # any weights: the kernel's gradient is per row
    (ref * rw).sum().backward()
    buf = logits.clone()
    args = (buf, labels, target.clone() if target is not None else None)
    if compiled:
        kernel = torch.compile(loss_chunk, fullgraph=True, dynamic=False)
        (loss, ce_out, kl_out, hits), code = run_and_get_code(lambda *a: kernel(*a, objective=objective), *args)
        allocs = [line for line in "\n".join(code).splitlines() if "empty_strided_cpu(" in line]
        assert allocs and not any(f"({n}, {V})" in line for line in allocs)   # no [n, V] buffer: written in place
    else:
        loss, ce_out, kl_out, hits = loss_chunk(*args, objective=objective)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ce_out, ce.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl_out, kl.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buf * rw[:, None], x.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(hits, logits.argmax(-1) == labels)


# ---- recipes: objective ce | kl | ce+kl, weighting decay | dpace (docs/recipes.md) --------------------------------
OBJECTIVES = ("ce", "kl", "ce+kl")


def _recipe_case(seed=11, B=1, A=3, Bk=4, H=5, V=11):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, A * Bk, H, generator=g, dtype=torch.float64)
    teacher = torch.randn(B, A * Bk, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, A * Bk), generator=g)
    labels[:, ::Bk] = IGNORE                    # position 0 is never scored
    labels[0, Bk + 2] = IGNORE                  # block 1: position 2 unscored (outside the loss mask), 3 scored
    labels[0, 2 * Bk:] = IGNORE                 # block 2: padded
    k = torch.arange(A * Bk) % Bk
    weights = torch.where(labels != IGNORE, torch.exp(-(k.double() - 1) / 2.0), torch.zeros((), dtype=torch.float64))
    return hidden, teacher, W, labels, weights


def _by_hand(hidden, teacher, W, labels, weights, Bk, objective, weighting, alpha):
    """The loss with plain Python floats and the math module, block by block."""
    H, V = W.shape[1], W.shape[0]
    Wl = W.tolist()

    def log_softmax(row):
        z = [sum(row[i] * Wl[v][i] for i in range(H)) for v in range(V)]
        m = max(z)
        lse = m + math.log(sum(math.exp(x - m) for x in z))
        return [x - lse for x in z]

    num = den = 0.0
    for b in range(hidden.shape[0]):
        for j in range(hidden.shape[1] // Bk):
            ks = range(1, Bk)
            q = [j * Bk + k for k in ks]
            scored = [int(labels[b, i]) != IGNORE for i in q]
            ce, kl = [], []
            for i in q:
                logq = log_softmax(hidden[b, i].tolist())
                ce.append(-logq[max(int(labels[b, i]), 0)])
                logp = log_softmax(teacher[b, i].tolist())
                kl.append(sum(math.exp(lp) * (lp - lq) for lp, lq in zip(logp, logq)))
            row = {"ce": ce, "kl": kl, "ce+kl": [x + y for x, y in zip(ce, kl)]}[objective]
            if weighting == "decay":
                w = [float(weights[b, i]) if s else 0.0 for i, s in zip(q, scored)]
                den += sum(w)
            else:
                smooth = [alpha + (1 - alpha) * math.exp(-c) if s else 1.0 for c, s in zip(ce, scored)]
                C = [math.prod(smooth[:n + 1]) if s else 0.0 for n, s in enumerate(scored)]
                w = [sum(C[n:]) if s else 0.0 for n, s in enumerate(scored)]
                den += any(scored)
            num += sum(wi * r for wi, r in zip(w, row))
    return num / den


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("objective", OBJECTIVES)
def test_recipe_losses_equal_a_hand_computation_and_fused_equals_checkpointed(objective, weighting):
    """Each objective x weighting against plain-Python arithmetic (B=1, 3 blocks of 4, V=11, float64: an unscored
    position inside a block, a padded block); the fused and the checkpointed paths agree on the value, the
    gradient w.r.t. the drafter's hidden states and the metrics, with chunks that cut blocks."""
    hidden, teacher, W, labels, weights = _recipe_case()
    want = _by_hand(hidden, teacher, W, labels, weights, 4, objective, weighting, alpha=0.3)
    t = teacher if objective != "ce" else None
    outs, grads = [], []
    for fused in (False, True):
        h = hidden.clone().requires_grad_()
        out = dflash_loss(h, W, labels, weights, 4, chunk=4, fused=fused, objective=objective, teacher=t,
                          weighting=weighting, dpace_alpha=0.3)
        (out.loss * 1.7).backward()
        outs.append(out)
        grads.append(h.grad)
        assert float(out.loss.detach()) == pytest.approx(want, rel=1e-12)
    ref, got = outs
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-13)
    assert grads[0].abs().sum() > 0
    for name in ("correct", "count", "accept_sum", "blocks", "weight_sum", "ce", "kl"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), rtol=1e-12, atol=0), name
    assert float(ref.weight_sum) == (2 if weighting == "dpace" else pytest.approx(float(weights.sum())))
    terms = float(ref.ce) * (objective != "kl") + float(ref.kl) * (objective != "ce")
    assert float(ref.loss.detach()) == pytest.approx(terms)


def test_dpace_weights_on_a_hand_made_block():
    """q = exp(-ce) = [0.8, 0.5, 0.25], alpha 0.5: q~ = [0.9, 0.75, 0.625], C = [0.9, 0.675, 0.421875],
    w_k = sum_{m>=k} C_m = [1.996875, 1.096875, 0.421875]. An unscored middle position is a no-op in the product
    and gets no weight: C = [0.9, -, 0.5625], w = [1.4625, 0, 0.5625]. Weights carry no gradient."""
    from dflash.model.loss import dpace_weights
    ce = -torch.log(torch.tensor([[0.8, 0.5, 0.25], [0.8, 0.5, 0.25]], dtype=torch.float64)).requires_grad_()
    scored = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(ce, scored, 0.5)
    torch.testing.assert_close(w, torch.tensor([[1.996875, 1.096875, 0.421875], [1.4625, 0.0, 0.5625]],
                                               dtype=torch.float64), rtol=1e-14, atol=1e-15)
    assert not w.requires_grad
    # alpha 1: every confidence smoothed to 1, w_k = the number of scored positions from k on
    assert dpace_weights(ce, scored, 1.0).tolist() == [[3.0, 2.0, 1.0], [2.0, 0.0, 1.0]]


@pytest.mark.parametrize("fused", [False, True])
def test_kl_is_zero_with_zero_gradient_when_the_drafter_is_the_target(fused):
    """teacher == hidden: the drafter's distribution is the target's, so KL(p || q) is 0 and so is its gradient;
    ce+kl then is the CE loss with the CE gradient."""
    hidden, _, W, labels, weights = _recipe_case(seed=3)
    res = {}
    for objective in OBJECTIVES:
        h = hidden.clone().requires_grad_()
        out = dflash_loss(h, W, labels, weights, 4, chunk=5, fused=fused, objective=objective,
                          teacher=hidden.clone() if objective != "ce" else None)
        out.loss.backward()
        res[objective] = (out, h.grad)
    kl, g_kl = res["kl"]
    assert abs(float(kl.loss)) < 1e-14 and abs(float(kl.kl)) < 1e-14 and float(kl.ce) > 0.5
    assert float(g_kl.abs().max()) < 1e-14
    torch.testing.assert_close(res["ce+kl"][0].loss, res["ce"][0].loss, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(res["ce+kl"][1], res["ce"][1], rtol=1e-12, atol=1e-14)


def test_an_objective_and_its_teacher_go_together():
    hidden, teacher, W, labels, weights = _recipe_case()
    with pytest.raises(ValueError, match="needs teacher"):
        dflash_loss(hidden, W, labels, weights, 4, objective="kl")
    with pytest.raises(ValueError, match="takes no teacher"):
        dflash_loss(hidden, W, labels, weights, 4, teacher=teacher)


@pytest.mark.gpu
def test_fused_compiled_recipe_loss_in_bf16_on_gpu_matches_a_float32_reference():
    """What training runs on a GPU (bf16, fused, the compiled kernel) for ce+kl with D-PACE, against the float32
    checkpointed path: the same loss and gradient up to bf16 rounding."""
    from dflash.train.step import loss_kernel
    dev = torch.device("cuda")
    hidden, teacher, W, labels, weights = (x.to(dev) for x in _recipe_case(seed=2, B=2, A=8, Bk=16, H=64, V=1000))
    kw = dict(objective="ce+kl", weighting="dpace")
    h32 = hidden.float().requires_grad_()
    ref = dflash_loss(h32, W.float(), labels, weights, 16, chunk=48, teacher=teacher.float(), **kw)
    ref.loss.backward()
    h16 = hidden.bfloat16().requires_grad_()
    out = dflash_loss(h16, W.bfloat16(), labels, weights, 16, chunk=48, fused=True, teacher=teacher.bfloat16(),
                      kernel=loss_kernel(True, "ce+kl"), **kw)
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(float(ref.loss.detach()), rel=2e-2)
    assert float(out.kl) == pytest.approx(float(ref.kl), rel=5e-2) and float(ref.kl) > 0
    g, g_ref = h16.grad.float(), h32.grad
    assert F.cosine_similarity(g.flatten(), g_ref.flatten(), dim=0) > 0.999
