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


@pytest.mark.parametrize("compiled", [False, True])
def test_ce_chunk_overwrites_the_logits_with_their_gradient(compiled):
    """The fused loss's kernel: weighted CE, argmax hits, and d(CE)/d(logits) written over the logits (one
    [n, V] buffer per chunk); compiled (Inductor, CPU) it allocates no [n, V] buffer of its own."""
    from torch._inductor.utils import run_and_get_code

    from dflash.model.fused_ce import ce_chunk
    g = torch.Generator().manual_seed(5)
    n, V = 6, 33
    logits = torch.randn(n, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n,), generator=g)
    labels[2] = IGNORE
    weights = torch.rand(n, generator=g, dtype=torch.float64)
    x = logits.clone().requires_grad_()
    ref = (F.cross_entropy(x, labels, ignore_index=IGNORE, reduction="none") * weights).sum()
    ref.backward()
    buf = logits.clone()
    if compiled:
        kernel = torch.compile(ce_chunk, fullgraph=True, dynamic=False)
        (loss, hits), code = run_and_get_code(kernel, buf, labels, weights)
        allocs = [line for line in "\n".join(code).splitlines() if "empty_strided_cpu(" in line]
        assert allocs and not any(f"({n}, {V})" in line for line in allocs)   # no [n, V] buffer: written in place
    else:
        loss, hits = ce_chunk(buf, labels, weights)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buf, x.grad, rtol=1e-10, atol=1e-12)
    assert torch.equal(hits, logits.argmax(-1) == labels)
