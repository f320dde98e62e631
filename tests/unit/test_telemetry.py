import os
import time
from pathlib import Path

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
def test_a_gpus_window_energy_leaves_an_idle_start_out_and_matches_its_power():
    """Idle for 2 s, then 4 s of matmuls: the energy of the busy window from the counter is near its sampled
    power integrated over it, and below the whole span's."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with TelemetrySampler([0], interval_s=0.25) as sampler:
        time.sleep(2)
        start = time.perf_counter()
        while time.perf_counter() - start < 4:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
        end = time.perf_counter()
    window = sampler.window_energy(start, end)["gpu_energy_measured_j"]
    powered = [(t, s["gpu_power_w"]) for t, s in zip(sampler._sample_times, sampler._samples, strict=True)]
    from servetune.telemetry import power_energy

    integrated = power_energy([t for t, _ in powered], [w for _, w in powered], start, end)
    assert 0.7 < window / integrated < 1.3, (window, integrated)
    assert window < sampler.window_energy(sampler._started, sampler._ended)["gpu_energy_measured_j"]


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


def test_a_counters_energy_over_the_window_leaves_the_warm_up_out():
    """An NVML-like counter (J) read once a second: 100 W through a warm-up, 300 W once the measured window opens
    at t=10.5; the window's energy is 300 W x its length, interpolated between reads at both ends."""
    from servetune.telemetry import counter_energy

    times = [float(t) for t in range(21)]
    readings = [5_000.0 + (100.0 * t if t <= 10 else 1_000.0 + 300.0 * (t - 10)) for t in times]
    # the read at t=11 covers 10 -> 11 at 300 W: from 10.5 on, half of that second
    assert counter_energy(times, readings, 10.5, 20.0) == pytest.approx(300.0 * 9.5)
    assert counter_energy(times, readings, 0.0, 20.0) == pytest.approx(1_000.0 + 3_000.0)  # the whole level
    assert counter_energy(times, readings, 0.0, 20.0) > counter_energy(times, readings, 10.5, 20.0)
    # a counter that went back without a known range was reset: no energy rather than a wrong one
    assert counter_energy([0.0, 1.0, 2.0], [10.0, 20.0, 5.0], 0.0, 2.0) is None
    assert counter_energy([0.0], [10.0], 0.0, 1.0) is None  # one read: nothing to tell


def test_a_rapl_counter_that_wraps_adds_its_range():
    from servetune.telemetry import counter_energy

    wrap = 262_143.328850  # a package's max_energy_range_uj / 1e6: 2^32 uJ-ish
    times = [0.0, 1.0, 2.0, 3.0]
    readings = [wrap - 60.0, wrap - 20.0, 20.0, 60.0]  # 40 J each second, through the wrap
    assert counter_energy(times, readings, 0.0, 3.0, wrap=wrap) == pytest.approx(120.0)
    assert counter_energy(times, readings, 1.5, 2.5, wrap=wrap) == pytest.approx(40.0)


def test_sampled_power_is_integrated_over_exactly_the_window():
    from servetune.telemetry import power_energy

    times, watts = [0.0, 1.0, 2.0, 3.0, 4.0], [100.0, 100.0, 300.0, 300.0, 300.0]
    assert power_energy(times, watts, 2.0, 4.0) == pytest.approx(600.0)
    assert power_energy(times, watts, 1.0, 2.0) == pytest.approx(200.0)  # the ramp, a trapezoid
    assert power_energy(times, watts, 2.5, 2.0) is None


def _powercap(root, zones):
    """A /sys/class/powercap tree: {dir name: (name, energy_uj, max_energy_range_uj)}."""
    for dirname, (name, energy, wrap) in zones.items():
        zone = root / dirname
        zone.mkdir(parents=True)
        (zone / "name").write_text(name + "\n")
        (zone / "energy_uj").write_text(f"{energy}\n")
        (zone / "max_energy_range_uj").write_text(f"{wrap}\n")
    return root


def test_rapl_reads_package_zones_and_says_why_it_cannot(tmp_path):
    from servetune.telemetry import rapl_zones

    zones, note = rapl_zones(tmp_path / "absent")
    assert zones == [] and note == f"RAPL not readable: {tmp_path / 'absent'} absent"
    root = _powercap(tmp_path / "powercap", {
        "intel-rapl:0": ("package-0", 1_000_000, 2**32), "intel-rapl:0:0": ("core", 5, 2**32),
        "intel-rapl:1": ("psys", 7, 2**32), "intel-rapl:2": ("package-1", 3_000_000, 2**32),
    })  # fmt: skip
    zones, note = rapl_zones(root)
    assert note is None and [z.name for z in zones] == ["package-0", "package-1"]  # sub-zones and psys left out
    assert zones[0].read_j() == pytest.approx(1.0) and zones[1].max_energy_range_uj == 2**32
    (root / "intel-rapl:2" / "energy_uj").chmod(0)
    if os.geteuid() != 0:  # root reads any file: the refusal is a non-root's
        zones, note = rapl_zones(root)
        assert zones == [] and note.startswith("RAPL not readable: ") and "Permission denied" in note


def test_a_level_without_rapl_has_no_host_energy_and_says_why(tmp_path):
    with TelemetrySampler(None, os.getpid(), interval_s=60, rapl_root=tmp_path / "none") as sampler:
        pass
    assert "cpu_energy_measured_j" not in sampler.summary((0.0, time.perf_counter()))
    assert sampler.energy_note == f"RAPL not readable: {tmp_path / 'none'} absent"


def test_the_host_energy_of_the_window_comes_from_its_rapl_counter(tmp_path):
    root = _powercap(tmp_path / "powercap", {"intel-rapl:0": ("package-0", 0, 10_000_000)})
    counter = root / "intel-rapl:0" / "energy_uj"
    with TelemetrySampler(None, os.getpid(), interval_s=60, rapl_root=root) as sampler:
        started = time.perf_counter()
        counter.write_text("4000000\n")  # 4 J after the first read
        sampler._take_sample()
        counter.write_text("1000000\n")  # wrapped at 10 J: 7 J more
    ended = time.perf_counter()
    summary = sampler.summary((started - 1.0, ended + 1.0))  # the window holds every read
    assert summary["cpu_energy_measured_j"] == pytest.approx(11.0) and sampler.energy_note is None


def test_a_gpus_window_energy_uses_its_counter_and_else_its_power(monkeypatch):
    import servetune.telemetry as telemetry

    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    counter = iter(range(0, 100_000_000, 1_000_000))  # mJ: 1 kJ more at each read
    nv = fake_nvml({})
    nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(counter) if h == 0 else 0
    monkeypatch.setattr(telemetry, "_nvml", lambda: nv)
    with TelemetrySampler([0], interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        sampler._take_sample()
        sampler._take_sample()
    # reads at t=0 (enter), 1, 2 (samples), 3 (the last sample), 4 (exit): 1 kJ a second
    assert sampler.window_energy(1.5, 3.0)["gpu_energy_measured_j"] == pytest.approx(1_500.0)
    # no counter: 300 W of sampled power over the window
    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(telemetry, "_nvml", lambda: fake_nvml({0: {"energy"}}))
    with TelemetrySampler([0], interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        sampler._take_sample()
        sampler._take_sample()
    assert sampler.window_energy(1.5, 3.0)["gpu_energy_measured_j"] == pytest.approx(450.0)
