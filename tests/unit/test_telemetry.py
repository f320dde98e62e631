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


class NotSupported(Exception):
    """What pynvml raises for a field a board does not report (NVMLError_NotSupported)."""


def fake_nvml(unsupported: dict[int, set[str]]):
    """pynvml's calls the sampler makes, over two GPUs, raising NotSupported for the named fields of a GPU."""
    from types import SimpleNamespace

    def call(field, value):
        def read(handle, *args):
            if field in unsupported.get(handle, set()):
                raise NotSupported(field)
            return value(handle)

        return read

    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUtilizationRates=call("util", lambda h: SimpleNamespace(gpu=50 + 10 * h)),
        nvmlDeviceGetMemoryInfo=call("memory", lambda h: SimpleNamespace(used=(10 + h) * 1024**3)),
        nvmlDeviceGetPowerUsage=call("power", lambda h: 300_000),
        nvmlDeviceGetTemperature=call("temperature", lambda h: 60 + h),
        nvmlDeviceGetClockInfo=call("clock", lambda h: 1980),
        nvmlDeviceGetTotalEnergyConsumption=call("energy", lambda h: 1_000_000),
    )  # fmt: skip


def test_a_field_a_gpu_does_not_report_is_dropped_alone_not_the_sample(monkeypatch):
    import servetune.telemetry as telemetry

    # GPU 1 has no power reading; neither has a clock (a MIG slice); neither has an energy counter.
    nv = fake_nvml({0: {"clock", "energy"}, 1: {"power", "clock", "energy"}})
    monkeypatch.setattr(telemetry, "_nvml", lambda: nv)
    with TelemetrySampler([0, 1], interval_s=60) as sampler:
        pass
    summary = sampler.summary()
    assert summary["gpu_util_mean"] == 55 and summary["gpu_memory_used_gib_max"] == 11
    assert summary["gpu_temperature_c_max"] == 61 and summary["gpu_power_w_mean"] == 300  # GPU 0's alone
    assert "gpu_sm_clock_mhz_mean" not in summary  # no GPU reported it
    assert summary["gpu_energy_j"] >= 0  # no counter: power integrated over the window
    # With no power either, no energy is made up.
    monkeypatch.setattr(telemetry, "_nvml", lambda: fake_nvml({0: {"power", "energy"}, 1: {"power", "energy"}}))
    with TelemetrySampler([0, 1], interval_s=60) as sampler:
        pass
    assert "gpu_energy_j" not in sampler.summary() and sampler.summary()["gpu_util_max"] == 55
