"""Per-device memory and utilisation: torch's peak-memory counters plus an NVML sampler thread on GPUs."""
from __future__ import annotations

import threading
import time

import torch



class GpuSampler:
    """Samples NVML utilisation (percent) every `period` seconds for the given CUDA devices, each sample stamped with
    `time.perf_counter()` so a mean can cover the measured steps only (not a run's first steps or its last save)."""

    def __init__(self, devices, period: float = 0.5):
        self.devices = [d for d in devices if d.type == "cuda"]
        self.period = period
        self.samples: dict[str, list[tuple[float, float]]] = {str(d): [] for d in self.devices}
        self._stop = threading.Event()
        self._thread = None
        self.excluded: list[tuple[float, float]] = []   # windows left out of every mean (in-training evaluations)

    def start(self):
        if not self.devices:
            return self
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:
            self.devices = []
            return self
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self):
        import pynvml
        handles = {str(d): nvml_handle(d.index) for d in self.devices}
        while not self._stop.wait(self.period):
            for name, h in handles.items():
                try:
                    self.samples[name].append((time.perf_counter(),
                                               float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)))
                except Exception:
                    pass

    def stop(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=2)

    def exclude(self, start: float, end: float) -> None:
        """Leave the samples of [start, end] (perf_counter seconds) out of every mean: a pause of training (the
        in-training evaluation, whose eager decoding is not training's utilisation)."""
        self.excluded.append((start, end))

    def mean(self, device, since: float | None = None, until: float | None = None) -> float | None:
        """Mean utilisation of the samples taken in [since, until] (perf_counter seconds; None: unbounded) outside
        the excluded windows; all of them when that window holds none (a run too short to sample its measured
        steps)."""
        s = [(t, u) for t, u in self.samples.get(str(device)) or [] if not any(a <= t <= b for a, b in self.excluded)]
        inside = [u for t, u in s if (since is None or t >= since) and (until is None or t <= until)]
        use = inside or [u for _, u in s]
        return sum(use) / len(use) if use else None


def nvml_handle(index: int):
    """The NVML handle of CUDA device `index` as this process numbers it: CUDA_VISIBLE_DEVICES may renumber
    devices by index ("2,3") or name them by UUID ("GPU-8f1c...", "MIG-...")."""
    import os

    import pynvml
    visible = [x.strip() for x in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if not visible:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    entry = visible[index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def device_rows(roles: dict, name_of, sampler: GpuSampler | None, window=(None, None)) -> list[dict]:
    """summary.json's device rows of one process: per device (`roles`: {device: ["target", "drafter"]}), its name
    (`name_of(device)`: cuda:0, node1/cuda:0), its roles, peak memory and mean utilisation over `window` (the measured
    steps, see RunMetrics)."""
    out = []
    for d, r in roles.items():
        row = {"device": name_of(d), "roles": list(r), "peak_memory_gb": None, "util_mean": None}
        if d.type == "cuda":
            row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(d) / 2**30, 3)
            row["util_mean"] = sampler.mean(d, *window) if sampler else None
        out.append(row)
    return out
