"""What stops a training run, in both runtimes: the stop signals, the exceptions, the test hook that injects one, and
the record of a failure that summary.json keeps (`{"kind": "diverged" | "non_finite" | "worker" | "stall" |
"not_ready", "worker", "message", ...}`)."""
from __future__ import annotations

import math
import signal
from typing import Callable

from dflash.config_model import TrainSection


# Every way a run is stopped short of SIGKILL: the replicas finish their step and checkpoint, the run exits 128 + the
# signal. Ctrl-C, what SLURM and scancel send, a scheduler's early warning, a closed terminal or SSH connection (the
# writes to the terminal that fail afterwards are dropped by logging and tqdm; the --log file keeps the log).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)


class StopRun(Exception):
    """All replicas agreed to stop after this step (a signal); the checkpoint is written."""


class Diverged(RuntimeError):
    """Replicas' weights differ: their gradients or updates were not identical. `info`: {step, replicas}."""

    def __init__(self, message: str, step: int, groups: list[list[int]]):
        super().__init__(message)
        self.info = {"step": step, "replicas": groups}


class NonFinite(RuntimeError):
    """The step's loss or gradient norm is NaN or infinite."""


class InjectedFailure(RuntimeError):
    """The `train.fail_at_step` test hook."""


def check_finite(step: int, loss: float | None, gnorm: float) -> None:
    """NonFinite when the loss (None: nothing scored, no loss) or the gradient norm is not finite."""
    if not ((loss is None or math.isfinite(loss)) and math.isfinite(gnorm)):
        raise NonFinite(f"step {step}: loss {loss}, gradient norm {gnorm} is not finite; stopping (lower train.lr, "
                        "check the data, or resume from an earlier checkpoint)")


def injector(train_cfg: TrainSection, name: str) -> Callable[[int], None]:
    """`fail(step)` for worker `name`: raises InjectedFailure at train.fail_at_step's step (0: at init) when the hook
    names this worker, else does nothing."""
    hook = train_cfg.fail_at_step
    at = hook.get("step") if hook and hook.get("worker") == name else None

    def fail(step: int) -> None:
        if at == step:
            raise InjectedFailure(f"{name}: injected failure at {'init' if step == 0 else f'step {step}'}")
    return fail


def kind(exc: BaseException) -> str:
    return "diverged" if isinstance(exc, Diverged) else "non_finite" if isinstance(exc, NonFinite) else "worker"


def record(worker: str, exc: BaseException) -> dict:
    """summary.json's `failure` for `exc` raised in `worker`."""
    return {"kind": kind(exc), "worker": worker, "message": str(exc), **getattr(exc, "info", {})}


def first(records: list[dict]) -> dict | None:
    """The failure a run reports among several: the first, unless a later one is a failed check (diverged,
    non-finite: it explains the worker errors that follow it)."""
    out = None
    for r in records:
        if out is None or (out["kind"] == "worker" and r["kind"] != "worker"):
            out = r
    return out
