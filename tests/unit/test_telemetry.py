"""GPU utilisation is averaged over the measured steps (the window Ktok/s counts), not the whole run."""
from __future__ import annotations

import torch

from dflash.train.telemetry import GpuSampler


def test_utilisation_mean_covers_the_measured_window_only():
    s = GpuSampler([torch.device("cuda", 0)])          # never started: samples filled by hand (time, percent)
    s.samples["cuda:0"] = [(1.0, 5.0), (2.0, 100.0), (3.0, 96.0), (4.0, 98.0), (5.0, 0.0)]   # start, steps, save
    assert s.mean("cuda:0") == (5 + 100 + 96 + 98 + 0) / 5
    assert s.mean("cuda:0", 1.5, 4.5) == (100 + 96 + 98) / 3
    assert s.mean("cuda:0", since=3.5) == (98 + 0) / 2
    assert s.mean("cuda:0", 10.0, 11.0) == s.mean("cuda:0")   # a window without samples: the whole run's mean
    assert s.mean("cuda:1") is None


def test_a_pause_of_training_is_left_out_of_the_utilisation():
    """The in-training evaluation (train.eval_every) pauses training: its samples are not training's utilisation
    (on the H200 an evaluation of 16.6 s every 100 steps took the run's mean from ~99% to 52%)."""
    s = GpuSampler([torch.device("cuda", 0)])
    s.samples["cuda:0"] = [(1.0, 99.0), (2.0, 10.0), (3.0, 12.0), (4.0, 97.0)]
    s.exclude(1.5, 3.5)
    assert s.mean("cuda:0") == (99 + 97) / 2
    assert s.mean("cuda:0", 0.0, 2.5) == 99.0
