import os
import time

import pytest

from servetune.telemetry import TelemetrySampler, visible_gpu_indices


def test_a_level_shorter_than_the_interval_still_gets_a_sample():
    with TelemetrySampler(None, os.getpid(), interval_s=60) as sampler:
        sum(range(100_000))
    summary = sampler.summary()
    assert summary["host_cpu_percent_mean"] >= 0 and summary["engine_rss_gib_max"] > 0
    assert not any(key.startswith("gpu_") for key in summary)  # no GPU indices given: the host is sampled


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpu_indices({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_gpu_indices({"CUDA_VISIBLE_DEVICES": ""}) == []


def _nvidia_gpus() -> int:
    from servetune.telemetry import _nvml

    nv = _nvml()
    if nv is None:
        return 0
    try:
        return nv.nvmlDeviceGetCount()
    finally:
        nv.nvmlShutdown()


needs_gpu = pytest.mark.skipif(_nvidia_gpus() == 0, reason="needs an NVIDIA GPU and its driver (pynvml)")


@needs_gpu
def test_a_gpu_under_load_reads_busy_and_its_energy_matches_its_power():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with TelemetrySampler([0], interval_s=0.25) as sampler:
        started = time.monotonic()
        while time.monotonic() - started < 4:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    elapsed = time.monotonic() - started
    summary = sampler.summary()
    assert not any(key.startswith(("host_", "engine_")) for key in summary)  # the GPU, not the host
    assert summary["gpu_util_max"] >= 50, summary
    assert summary["gpu_memory_used_gib_max"] >= 0.25, summary  # a and a product: 2 x 128 MiB at least
    assert summary["gpu_sm_clock_mhz_max"] > 0 and summary["gpu_temperature_c_max"] > 0, summary
    # the driver's energy counter over the level against the sampled power integrated over it
    assert 0.3 < summary["gpu_energy_j"] / (summary["gpu_power_w_mean"] * elapsed) < 3, summary


@needs_gpu
def test_the_environment_names_the_gpu_and_its_driver():
    from servetune.environment import _gpus

    gpu = _gpus([0])
    assert gpu["gpu_model"] and float(gpu["gpu_memory_gib"]) > 1 and gpu["driver"], gpu
    assert visible_gpu_indices({}) == list(range(_nvidia_gpus()))
