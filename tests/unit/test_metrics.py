"""A logging interval's loss and finiteness check, read from the summed step statistics (one helper for the metrics
row and for the ranks that write none)."""
import math

import pytest
import torch

from dflash.train.metrics import check_pending, interval_loss
from dflash.train.failures import NonFinite


def stats(loss_sum, weight_sum, k=2):   # loss_stats' layout: [loss*w, w, tokens, positions, blocks, accepted, ce*w,
    return torch.tensor([loss_sum, weight_sum, 10.0, 4.0, 1.0, 2.0, loss_sum, 0.0]       # kl*w, correct.., count..]
                        + [1.0] * k + [2.0] * k, dtype=torch.float64)


def test_interval_loss_is_the_weighted_mean_of_the_summed_steps():
    st, loss = interval_loss((stats(6.0, 2.0) + stats(2.0, 2.0)).tolist())
    assert loss == pytest.approx(2.0) and st["tokens"] == 20.0 and st["correct"] == [2.0, 2.0]
    assert interval_loss(stats(0.0, 0.0).tolist())[1] is None          # nothing scored: no loss


def test_check_pending_stops_on_a_non_finite_loss_or_norm_only():
    check_pending([(1, stats(3.0, 1.0), 0.5), (2, stats(1.0, 1.0), torch.tensor(0.7))])
    check_pending([(3, stats(0.0, 0.0), 0.5)])                           # no scored position is not a failure
    with pytest.raises(NonFinite, match="step 2: loss nan"):
        check_pending([(1, stats(3.0, 1.0), 0.5), (2, stats(math.nan, 1.0), 0.5)])
    with pytest.raises(NonFinite, match="step 4: .*gradient norm inf"):
        check_pending([(4, stats(1.0, 1.0), math.inf)])
