"""Device telemetry during load levels: pynvml on NVIDIA GPUs, the host's CPU and memory elsewhere.

A :class:`TelemetrySampler` samples about once a second in a background thread while a level
runs and summarizes into flat named values. On GPUs (the trial's own, by physical index):
utilization, memory used (peak), power, energy (the driver's energy counter where it has one,
else power integrated over time), temperature and SM clock. Without an NVIDIA GPU it records
the host instead (CPU utilization, memory used, and the engine's process tree: CPU and RSS);
the ``host_`` and ``engine_`` prefixes say which it was.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import psutil

GIB = 1024**3


def _nvml() -> ModuleType | None:
    """pynvml, initialized; None where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        return None


class TelemetrySampler:
    """``with TelemetrySampler(gpu_indices, engine_pid) as t: ...``; then ``t.summary()``."""

    def __init__(
        self, gpu_indices: Sequence[int] | None = None, engine_pid: int | None = None, interval_s: float = 1.0
    ) -> None:
        self.gpu_indices = list(gpu_indices or [])
        self.engine_pid = engine_pid
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[dict[str, float]] = []
        self._energy_start: dict[int, float] = {}
        self._energy_end: dict[int, float] = {}
        self._started = self._ended = 0.0
        self._nvml: ModuleType | None = None
        self._handles: list = []

    def __enter__(self) -> TelemetrySampler:
        self._nvml = nv = _nvml() if self.gpu_indices else None
        if nv is not None:
            self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in self.gpu_indices]
            self._energy_start = self._energy(nv)
        psutil.cpu_percent(None)  # prime the counter: the next call measures from here
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="servetune-telemetry", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._take_sample()  # a last one: a level shorter than the interval still gets a sample
        self._ended = time.monotonic()
        if self._nvml is not None:
            self._energy_end = self._energy(self._nvml)
            self._nvml.nvmlShutdown()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take_sample()

    def _take_sample(self) -> None:
        nv = self._nvml
        with contextlib.suppress(Exception):  # a sample that fails is skipped, never fatal to the level
            self._samples.append(self._gpu_sample(nv) if nv is not None else self._host_sample())

    def _energy(self, nv: ModuleType) -> dict[int, float]:
        out = {}
        for i, handle in zip(self.gpu_indices, self._handles, strict=True):
            with contextlib.suppress(Exception):
                out[i] = nv.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000.0  # mJ -> J
        return out

    def _gpu_sample(self, nv: ModuleType) -> dict[str, float]:
        """One reading of every field on every GPU. A field a GPU does not report (NVML's NotSupported: power on
        some boards, clocks on a MIG slice) is left out of that GPU's reading, not the sample; a field no GPU
        reported is left out of the sample."""
        reads: dict[str, tuple[Callable[[Any], float], Callable[[list[float]], float]]] = {
            "gpu_util": (lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu, _mean),
            "gpu_memory_used_gib": (lambda h: nv.nvmlDeviceGetMemoryInfo(h).used / GIB, max),
            "gpu_power_w": (lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, sum),
            "gpu_temperature_c": (lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), max),
            "gpu_sm_clock_mhz": (lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), _mean),
        }
        sample: dict[str, float] = {}
        for name, (read, combine) in reads.items():
            values = []
            for handle in self._handles:
                with contextlib.suppress(Exception):  # nv.NVMLError and its NotSupported, NoPermission, ...
                    values.append(float(read(handle)))
            if values:
                sample[name] = combine(values)
        return sample

    def _host_sample(self) -> dict[str, float]:
        sample = {
            "host_cpu_percent": psutil.cpu_percent(None),
            "host_memory_used_gib": psutil.virtual_memory().used / GIB,
        }
        if self.engine_pid is not None:
            try:
                root = psutil.Process(self.engine_pid)
                tree = [root, *root.children(recursive=True)]
                sample["engine_rss_gib"] = sum(p.memory_info().rss for p in tree) / GIB
            except psutil.Error:
                pass
        return sample

    def summary(self) -> dict[str, float]:
        """Means and peaks of the samples, and energy on GPUs (empty if nothing was sampled)."""
        out: dict[str, float] = {}
        if not self._samples:
            return out
        keys = {k for s in self._samples for k in s}
        for key in sorted(keys):
            values = [s[key] for s in self._samples if key in s]
            out[f"{key}_mean"] = sum(values) / len(values)
            out[f"{key}_max"] = max(values)
        if self._nvml is not None:
            duration = max(self._ended - self._started, 1e-9)
            if self._energy_start and len(self._energy_end) == len(self._energy_start):
                out["gpu_energy_j"] = sum(self._energy_end[i] - self._energy_start[i] for i in self._energy_start)
            elif "gpu_power_w_mean" in out:  # no energy counter: power integrated over the window
                out["gpu_energy_j"] = out["gpu_power_w_mean"] * duration
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def visible_gpu_indices(env: dict[str, str]) -> list[int]:
    """Physical indices of the GPUs an engine with this environment sees (empty without GPUs)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(v) for v in visible.split(",") if v.strip().isdigit()]
    nv = _nvml()
    if nv is None:
        return []
    try:
        return list(range(nv.nvmlDeviceGetCount()))
    finally:
        nv.nvmlShutdown()
