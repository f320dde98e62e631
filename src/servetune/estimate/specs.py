"""A GPU's peak rates, as the estimate reads them from the capacity catalogue (``catalog/gpus.yaml``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from servetune.capacity import WeightQuant, find_gpu
from servetune.errors import UserError


@dataclass(frozen=True)
class DeviceRates:
    """Peak rates of one GPU for one weight format: FLOP/s, bytes/s of HBM and of the GPU link."""

    gpu: str
    flops: float
    hbm_bytes_s: float
    link_bytes_s: float
    link: str
    # The host cores the engine, its API server and the load client share (the CPU build: None for a GPU, whose
    # host has cores to spare); with ``Efficiency.host_cpu_ms_per_token`` they cap the tokens a second it streams.
    cores: float | None = None


def device_rates(gpu: str, quant: WeightQuant) -> DeviceRates:
    """Rates of catalogue GPU ``gpu``: FP8 weights run on FP8 tensor cores where the GPU has them."""
    spec = find_gpu(gpu)
    if spec.perf is None:
        raise UserError(f"--gpu {gpu}: the catalogue has no performance numbers for {spec.name} (catalog/gpus.yaml)")
    perf = spec.perf
    tflops = perf.fp8_tflops if quant.method == "fp8" and perf.fp8_tflops else perf.bf16_tflops
    return DeviceRates(
        gpu=spec.name,
        flops=tflops * 1e12,
        hbm_bytes_s=perf.hbm_gbps * 1e9,
        link_bytes_s=perf.link_gbps * 1e9,
        link=perf.link,
    )


def cpu_rates(gflops: float, memory_gbps: float, cores: float | None = None) -> DeviceRates:
    """Rates of the CPU cores one vLLM CPU rank runs on (ranks talk through shared memory), and how many cores
    the host gives the engine and its front end (None: not counted)."""
    return DeviceRates(
        gpu="cpu",
        flops=gflops * 1e9,
        hbm_bytes_s=memory_gbps * 1e9,
        link_bytes_s=memory_gbps * 1e9,
        link="memory",
        cores=cores,
    )


def measure_cpu_rates(size: int = 512, copy_mib: int = 64, repeats: int = 5) -> DeviceRates:
    """This host's float32 matmul FLOP/s and memory copy bandwidth (read + write), best of ``repeats``.

    numpy's BLAS uses every core it is given, as vLLM's CPU build does with its OpenMP threads; on
    a busy host the numbers are low, so measure when the host is quiet (or pass measured numbers
    to :func:`cpu_rates`).
    """
    a = np.ones((size, size), dtype=np.float32)
    src = np.ones(copy_mib << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # touch the pages once
    matmul = copy = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        matmul = min(matmul, time.perf_counter() - start)
        start = time.perf_counter()
        np.copyto(dst, src)
        copy = min(copy, time.perf_counter() - start)
    return cpu_rates(2 * size**3 / matmul / 1e9, 2 * src.nbytes / copy / 1e9, cores=len(os.sched_getaffinity(0)))


def gpu_class(gpu: str) -> str:
    """The family the calibration fits factors for: ``A100``, ``H100``, ``H200``, ... (the name's first word)."""
    return gpu.split("-")[0].upper()
