"""Device telemetry during load levels: pynvml on NVIDIA GPUs, the host's CPU and memory elsewhere.

A :class:`TelemetrySampler` samples about once a second in a background thread while a level
runs and summarizes into flat named values. On GPUs (the trial's own, as ``CUDA_VISIBLE_DEVICES``
names them: physical indices, GPU UUIDs or MIG UUIDs, :func:`resolve_devices`): utilization, memory
used (peak), power, energy (the driver's energy counter where it has one, else power integrated over
time), temperature and SM clock. A MIG slice has memory of its own but no utilization, power or
energy in NVML (the board's count every slice, other tenants' too): on slices those are absent, and
the notes say why. Without an NVIDIA GPU it records
the host instead (CPU utilization, memory used, and the engine's process tree: CPU and RSS);
the ``host_`` and ``engine_`` prefixes say which it was.

Energy is also kept as a series (the GPUs' energy counters and power, the host's RAPL package counters), so
:meth:`TelemetrySampler.summary` can give the energy of exactly the level's measured window, its warm-up left
out: the counters interpolated at the window's ends (:func:`counter_energy`, wraparound included), or the
sampled power integrated over it where a GPU has no counter (:func:`power_energy`). Where RAPL cannot be read
(no ``/sys/class/powercap``, or ``energy_uj`` readable by root only) the host's energy is absent and
:attr:`TelemetrySampler.energy_note` says why.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import psutil

GIB = 1024**3
#: Where Linux exposes RAPL's energy counters (``intel-rapl:N/energy_uj``, AMD's too).
POWERCAP = Path("/sys/class/powercap")


def counter_energy(
    times: Sequence[float], readings: Sequence[float], start: float, end: float, wrap: float | None = None
) -> float | None:
    """Energy over [start, end] from a cumulative counter read at ``times`` (same unit as the readings).

    The counter is taken as linear between reads and interpolated at the window's ends (ends outside the
    reads are clamped to them). A reading below the one before is a wraparound: ``wrap`` (the counter's
    range, RAPL's ``max_energy_range_uj``) is added; without one the counter was reset and None is returned.
    None with fewer than two reads or an empty window."""
    if len(times) < 2 or len(times) != len(readings) or end <= start:
        return None
    cumulative = [0.0]
    for before, after in itertools.pairwise(readings):
        step = after - before
        if step < 0:
            if wrap is None:
                return None
            step += wrap
        cumulative.append(cumulative[-1] + step)
    return float(np.interp(end, times, cumulative) - np.interp(start, times, cumulative))


def power_energy(times: Sequence[float], watts: Sequence[float], start: float, end: float) -> float | None:
    """Joules over [start, end] from power sampled at ``times`` (trapezoids between samples, interpolated at
    the window's ends); None with fewer than two samples or an empty window."""
    if len(times) < 2 or len(times) != len(watts) or end <= start:
        return None
    cumulative = [0.0]
    for (t0, w0), (t1, w1) in itertools.pairwise(zip(times, watts, strict=True)):
        cumulative.append(cumulative[-1] + (w0 + w1) / 2 * (t1 - t0))
    return float(np.interp(end, times, cumulative) - np.interp(start, times, cumulative))


@dataclass(frozen=True)
class RaplZone:
    """One RAPL package zone: its counter file (microjoules) and the counter's range."""

    name: str
    energy_uj: Path
    max_energy_range_uj: float

    def read_j(self) -> float:
        return float(self.energy_uj.read_text()) / 1e6


def rapl_zones(root: Path = POWERCAP) -> tuple[list[RaplZone], str | None]:
    """The host's RAPL package zones (``intel-rapl:N``; their sub-zones are inside them, and ``psys`` holds the
    whole platform), or none and why they cannot be read."""
    if not root.is_dir():
        return [], f"RAPL not readable: {root} absent"
    zones = []
    for zone in sorted(root.glob("intel-rapl:*")):
        if zone.name.count(":") != 1:
            continue
        try:
            name = (zone / "name").read_text().strip()
        except OSError:
            name = zone.name
        if not name.startswith("package"):
            continue
        try:
            found = RaplZone(name, zone / "energy_uj", float((zone / "max_energy_range_uj").read_text()))
            found.read_j()
        except (OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return [], f"RAPL not readable: {zone / 'energy_uj'}: {why}"
        zones.append(found)
    if not zones:
        return [], f"RAPL not readable: no package zone (intel-rapl:N) under {root}"
    return zones, None


def _nvml() -> ModuleType | None:
    """pynvml, initialized; None where there is no NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
        return None


#: A device as ``CUDA_VISIBLE_DEVICES`` names it: a physical index, or a ``GPU-`` or ``MIG-`` UUID (or a unique
#: prefix of one, as CUDA accepts).
GpuId = int | str
#: The fields NVML reads of a whole board only: a MIG slice has no utilization or power of its own (and no energy).
NOT_PER_SLICE = ("gpu_util", "gpu_power_w")
MIG_NOTE = "on MIG slices NVML has no utilization, power or energy per slice (the board's count every slice): absent"


@dataclass(frozen=True)
class Device:
    """A device of ``CUDA_VISIBLE_DEVICES`` resolved to NVML: the id as given, its handle, whether it is a MIG slice."""

    id: GpuId
    handle: Any
    mig: bool = False


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def mig_slices(nv: ModuleType, board: Any) -> list[tuple[str, Any]]:
    """The MIG devices of a GPU in MIG mode as (UUID, handle); none for a GPU without MIG or with it off."""
    try:
        if nv.nvmlDeviceGetMigMode(board)[0] != nv.NVML_DEVICE_MIG_ENABLE:
            return []
        slots = nv.nvmlDeviceGetMaxMigDeviceCount(board)
    except Exception:  # NotSupported: a board without MIG
        return []
    found = []
    for slot in range(slots):
        with contextlib.suppress(Exception):  # NotFound: an empty slot
            handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(board, slot)
            found.append((_text(nv.nvmlDeviceGetUUID(handle)), handle))
    return found


def nvml_devices(nv: ModuleType) -> list[tuple[str, Any, bool]]:
    """Every device NVML sees as (UUID, handle, MIG slice or not): each GPU, and the MIG devices of a GPU in MIG mode."""
    found = []
    for index in range(nv.nvmlDeviceGetCount()):
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        with contextlib.suppress(Exception):
            found.append((_text(nv.nvmlDeviceGetUUID(handle)), handle, False))
        found.extend((uuid, slice_, True) for uuid, slice_ in mig_slices(nv, handle))
    return found


def resolve_devices(nv: ModuleType, ids: Sequence[GpuId]) -> tuple[list[Device], list[str]]:
    """The devices ``ids`` name, in order, and one note for an id that names none (never an exception).

    An int is a physical index; ``GPU-...`` is a GPU's UUID and ``MIG-...`` a MIG device's (R470 and later drivers),
    each whole or a prefix that only one device's UUID starts with, as CUDA takes them. CUDA sees only the devices
    before the first entry it cannot resolve, so the devices end there too and the note names the entry."""
    devices: list[Device] = []
    known: list[tuple[str, Any, bool]] | None = None
    for position, gpu in enumerate(ids):
        why = None
        if isinstance(gpu, int):
            try:
                devices.append(Device(gpu, nv.nvmlDeviceGetHandleByIndex(gpu)))
                continue
            except Exception:  # NVMLError_InvalidArgument: no such index
                why = f"NVML has no GPU {gpu}"
        else:
            known = nvml_devices(nv) if known is None else known
            matches = [(handle, mig) for uuid, handle, mig in known if gpu and uuid.startswith(gpu)]
            if len(matches) == 1:
                devices.append(Device(gpu, *matches[0]))
                continue
            why = f"{len(matches)} devices' UUIDs start with it" if matches else "no device NVML sees has that UUID"
        left = f" (and {', '.join(map(str, ids[position + 1 :]))} after it)" if position + 1 < len(ids) else ""
        return devices, [f"CUDA_VISIBLE_DEVICES entry {gpu!r}: {why}; CUDA sees no device from there{left}"]
    return devices, []


def visible_gpus(env: Mapping[str, str]) -> list[GpuId]:
    """The devices an engine with this environment sees, as ``CUDA_VISIBLE_DEVICES`` names them (indices as ints,
    UUIDs as given); every GPU NVML sees, by index, without it; empty without GPUs."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        return [int(v) if v.isdigit() else v for v in entries]
    nv = _nvml()
    if nv is None:
        return []
    try:
        return list(range(nv.nvmlDeviceGetCount()))
    finally:
        nv.nvmlShutdown()


class TelemetrySampler:
    """``with TelemetrySampler(gpus, engine_pid) as t: ...``; then ``t.summary()``.

    ``gpus``: the trial's devices as ``CUDA_VISIBLE_DEVICES`` names them (:func:`visible_gpus`); what they do not
    resolve to is said in :attr:`device_notes` and left out."""

    def __init__(
        self, gpus: Sequence[GpuId] | None = None, engine_pid: int | None = None, interval_s: float = 1.0,
        rapl_root: Path | None = None,
    ) -> None:  # fmt: skip
        self.gpus = list(gpus or [])
        self.device_notes: list[str] = []
        self._devices: list[Device] = []
        self.engine_pid = engine_pid
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[dict[str, float]] = []
        self._sample_times: list[float] = []  # time.perf_counter() of each sample
        self._energy_start: dict[int, float] = {}
        self._energy_end: dict[int, float] = {}
        # The energy counters as a series: (time.perf_counter(), GPU index or RAPL zone -> joules).
        self._gpu_counters: list[tuple[float, dict[int, float]]] = []
        self._rapl_counters: list[tuple[float, dict[str, float]]] = []
        self._rapl: list[RaplZone] = []
        self._rapl_note: str | None = None
        self._started = self._ended = 0.0
        self._nvml: ModuleType | None = None
        self.rapl_root = rapl_root  # None: POWERCAP

    def __enter__(self) -> TelemetrySampler:
        self._nvml = nv = _nvml() if self.gpus else None
        if nv is not None:
            self._devices, self.device_notes = resolve_devices(nv, self.gpus)
            if not self._devices:  # none resolved: nothing of the GPUs to read (the host is sampled)
                nv.nvmlShutdown()
                self._nvml = nv = None
        if nv is not None:
            self._energy_start = self._energy(nv)
        self._rapl, self._rapl_note = rapl_zones(self.rapl_root if self.rapl_root is not None else POWERCAP)
        psutil.cpu_percent(None)  # prime the counter: the next call measures from here
        self._started = time.perf_counter()
        self._read_counters(self._started)
        self._thread = threading.Thread(target=self._run, name="servetune-telemetry", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._take_sample()  # a last one: a level shorter than the interval still gets a sample
        self._ended = time.perf_counter()
        if self._nvml is not None:
            self._energy_end = self._energy(self._nvml)
            self._gpu_counters.append((self._ended, self._energy_end))
            self._nvml.nvmlShutdown()
        self._read_rapl(self._ended)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._take_sample()

    def _take_sample(self) -> None:
        nv = self._nvml
        now = time.perf_counter()
        with contextlib.suppress(Exception):  # a sample that fails is skipped, never fatal to the level
            self._samples.append(self._gpu_sample(nv) if nv is not None else self._host_sample())
            self._sample_times.append(now)
        self._read_counters(now)

    def _read_counters(self, now: float) -> None:
        if self._nvml is not None:
            self._gpu_counters.append((now, self._energy(self._nvml)))
        self._read_rapl(now)

    def _read_rapl(self, now: float) -> None:
        readings = {}
        for zone in self._rapl:
            with contextlib.suppress(OSError, ValueError):  # a read that fails leaves that zone out of the read
                readings[zone.name] = zone.read_j()
        if readings:
            self._rapl_counters.append((now, readings))

    @property
    def _on_slices(self) -> bool:
        return any(device.mig for device in self._devices)

    def _energy(self, nv: ModuleType) -> dict[int, float]:
        """Each device's energy counter (J), by position; none on MIG slices, whose counter is the board's."""
        out: dict[int, float] = {}
        for position, device in enumerate([] if self._on_slices else self._devices):
            with contextlib.suppress(Exception):
                out[position] = nv.nvmlDeviceGetTotalEnergyConsumption(device.handle) / 1000.0  # mJ -> J
        return out

    def _gpu_sample(self, nv: ModuleType) -> dict[str, float]:
        """One reading of every field on every GPU. A field a GPU does not report (NVML's NotSupported: power on
        some boards, clocks on a MIG slice) is left out of that GPU's reading, not the sample; a field no GPU
        reported is left out of the sample. With a MIG slice among the devices the board-wide fields
        (:data:`NOT_PER_SLICE`) are left out for all: a sum or mean over the rest would not be the trial's."""
        reads: dict[str, tuple[Callable[[Any], float], Callable[[list[float]], float]]] = {
            "gpu_util": (lambda h: nv.nvmlDeviceGetUtilizationRates(h).gpu, _mean),
            "gpu_memory_used_gib": (lambda h: nv.nvmlDeviceGetMemoryInfo(h).used / GIB, max),
            "gpu_power_w": (lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, sum),
            "gpu_temperature_c": (lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), max),
            "gpu_sm_clock_mhz": (lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), _mean),
        }
        sample: dict[str, float] = {}
        for name, (read, combine) in reads.items():
            if self._on_slices and name in NOT_PER_SLICE:
                continue
            values = []
            for handle in (device.handle for device in self._devices):
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

    def summary(self, window: tuple[float, float] | None = None) -> dict[str, float]:
        """Means and peaks of the samples, and energy on GPUs (empty if nothing was sampled).

        ``window``: the measured window, in ``time.perf_counter()`` seconds; its energy is added as
        ``gpu_energy_measured_j`` (the trial's GPUs) and ``cpu_energy_measured_j`` (the host's RAPL packages),
        each where it could be measured (:attr:`energy_note` says why one is not)."""
        out: dict[str, float] = {}
        if window is not None:
            out.update(self.window_energy(*window))
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

    def window_energy(self, start: float, end: float) -> dict[str, float]:
        """Joules of [start, end] (``time.perf_counter()`` seconds): the GPUs' from their counters (each GPU's
        interpolated at the window's ends), else from their summed power integrated over it; the host's from
        its RAPL package counters, wraparound included."""
        out: dict[str, float] = {}
        if self._nvml is not None:
            gpu = _counters_energy(self._gpu_counters, list(range(len(self._devices))), start, end, {})
            if gpu is None:
                gpu = self.power_window_energy(start, end)
            if gpu is not None:
                out["gpu_energy_measured_j"] = gpu
        if self._rapl:
            wraps = {zone.name: zone.max_energy_range_uj / 1e6 for zone in self._rapl}
            cpu = _counters_energy(self._rapl_counters, list(wraps), start, end, wraps)
            if cpu is not None:
                out["cpu_energy_measured_j"] = cpu
        return out

    def power_window_energy(self, start: float, end: float) -> float | None:
        """Joules of [start, end] from the GPUs' summed sampled power, integrated (:func:`power_energy`): the
        window's energy where a GPU has no counter, and what a counter's is checked against on a GPU
        (``bench/gpu_smoke.py``). None without power readings in reach of the window."""
        powered = [(t, s["gpu_power_w"]) for t, s in zip(self._sample_times, self._samples, strict=True)
                   if "gpu_power_w" in s]  # fmt: skip
        return power_energy([t for t, _ in powered], [w for _, w in powered], start, end)

    @property
    def energy_note(self) -> str | None:
        """Why an energy of the measured window is missing (None when every energy it could have is there)."""
        notes = []
        if self.gpus and self._nvml is None:
            notes.append(f"GPU energy not measured: {'; '.join(self.device_notes) or 'NVML not available'}")
        elif self._on_slices:
            notes.append(f"GPU energy not measured: {MIG_NOTE}")
        elif (
            self.gpus
            and not any("gpu_power_w" in s for s in self._samples)
            and not all(len(read) == len(self._devices) for _, read in self._gpu_counters)
        ):
            notes.append("GPU energy not measured: no energy counter and no power readings")
        if self._rapl_note is not None:
            notes.append(self._rapl_note)
        return "; ".join(notes) or None


def _counters_energy(
    series: Sequence[tuple[float, dict[Any, float]]], keys: list[Any], start: float, end: float,
    wraps: dict[Any, float],
) -> float | None:  # fmt: skip
    """The sum over ``keys`` of :func:`counter_energy` on each key's reads; None when a key has fewer than two."""
    total = 0.0
    for key in keys:
        reads = [(t, read[key]) for t, read in series if key in read]
        energy = counter_energy([t for t, _ in reads], [v for _, v in reads], start, end, wraps.get(key))
        if energy is None:
            return None
        total += energy
    return total if keys else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
