"""The hardware and software stack a trial ran on (the experiment record's fields).

GPU model, count, memory, interconnect, driver and CUDA versions come from pynvml; without an
NVIDIA GPU the CPU model and host memory are recorded instead. Versions of vLLM, torch, Ray and
NCCL come from package metadata, never by importing them; vLLM's, torch's, NCCL's and Python's are those of the
interpreter that runs the engine (``--python``/``--vllm-python``: an upgrade candidate may have another torch), asked
of it in one subprocess (engine/args.py ``engine_stack``), Ray's servetune's own (its Ray runs the trial).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from servetune import __version__
from servetune.engine.args import engine_stack

if TYPE_CHECKING:
    from servetune.telemetry import GpuId

GIB = 1024**3


def _version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: CPU flags that give bfloat16 arithmetic in hardware (x86 "flags", Arm "Features"); without
#: one, vLLM's CPU build emulates it.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def cpu_bf16(cpuinfo: str | None = None) -> str:
    """ "native" when the CPU does bfloat16 in hardware, "emulated" when not, "unknown" when
    /proc/cpuinfo does not say.

    It decides the CPU stand-in's speed: on an AMD EPYC with AVX2 only, the tiny model in
    bfloat16 served a third of the requests per second it served in float32 at 32 in flight.
    """
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return "unknown"
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith(("flags", "Features"))), None
    )
    if flags is None:
        return "unknown"
    return "native" if any(flag in flags for flag in BF16_FLAGS) else "emulated"


def _gpus(ids: Sequence[GpuId]) -> dict[str, str]:
    """The trial's GPUs as NVML names them: the first device's model and memory, their count and ids, NVLink, the
    driver. A MIG slice is recorded as its board's model (what the GPU catalogue knows), its profile
    (``gpu_mig``: "1g.10gb") and the slice's own memory. ``telemetry_note`` says what telemetry cannot read of them:
    an id that names no device (telemetry.resolve_devices), the fields a slice has none of. Without ids, GPU 0."""
    from servetune.telemetry import MIG_NOTE, _nvml, resolve_devices

    nv = _nvml()
    if nv is None:
        return {}
    try:
        devices, notes = resolve_devices(nv, list(ids) or [0])
        if not devices:
            return {"gpu_model": "no NVIDIA GPU visible", "telemetry_note": "; ".join(notes)}
        first = devices[0]
        board = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(first.handle) if first.mig else first.handle
        name = _text(nv.nvmlDeviceGetName(board))
        memory = nv.nvmlDeviceGetMemoryInfo(first.handle).total / GIB
        driver = nv.nvmlSystemGetDriverVersion()
        cuda = nv.nvmlSystemGetCudaDriverVersion_v2()
        try:
            nvlink = nv.nvmlDeviceGetNvLinkState(board, 0) == nv.NVML_FEATURE_ENABLED
        except Exception:
            nvlink = False
        record = {
            "gpu_model": name, "gpu_count": str(len(devices)), "gpu_memory_gib": f"{memory:.1f}",
            "gpu_indices": ",".join(str(d.id) for d in devices), "interconnect": "NVLink" if nvlink else "PCIe",
            "driver": _text(driver), "cuda": f"{cuda // 1000}.{cuda % 1000 // 10}",
        }  # fmt: skip
        if first.mig:
            record["gpu_mig"] = _text(nv.nvmlDeviceGetName(first.handle)).rpartition(" MIG ")[2]
            notes.append(MIG_NOTE)
        if notes:
            record["telemetry_note"] = "; ".join(notes)
        return record
    finally:
        nv.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def collect_environment(
    device: str, gpus: Sequence[GpuId] = (), python: str = sys.executable, cores: int | None = None
) -> dict[str, str]:
    """The record's ``environment``; ``gpus``: the trial's devices as ``CUDA_VISIBLE_DEVICES`` names them; ``python``:
    the interpreter that runs the engine, whose vLLM, torch, NCCL and Python versions are recorded."""
    stack = engine_stack(python)
    env: dict[str, str] = {
        "device": device,
        "cpu_model": _cpu_model(),
        "host_cpus": str(psutil.cpu_count(logical=True)),
        "host_memory_gib": f"{psutil.virtual_memory().total / GIB:.1f}",
        "python": stack.get("python") or "unknown",
        "servetune": __version__,
        "vllm": stack.get("vllm") or "not installed",
        "torch": stack.get("torch") or "not installed",
        "ray": _version("ray"),
        "nccl": stack.get("nccl") or "not installed",
        "niceness": str(
            os.getpriority(os.PRIO_PROCESS, 0)
        ),  # of the measuring thread; 0 unless it could not be lowered
    }
    if device == "gpu":
        env.update(_gpus(gpus) or {"gpu_model": "no NVIDIA GPU visible"})
    else:
        env["cpu_bf16"] = cpu_bf16()
        if cores is not None:
            env["cpu_cores_reserved"] = str(cores)
    return env
