"""A GPU's peak rates, as the estimate reads them from the capacity catalogue (``catalog/gpus.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass

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


def gpu_class(gpu: str) -> str:
    """The family the calibration fits factors for: ``A100``, ``H100``, ``H200``, ... (the name's first word)."""
    return gpu.split("-")[0].upper()
