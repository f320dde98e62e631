import os
import time
from pathlib import Path

import pytest

from servetune.telemetry import TelemetrySampler, resolve_devices, visible_gpus


def test_a_level_shorter_than_the_interval_still_gets_a_sample():
    with TelemetrySampler(None, os.getpid(), interval_s=60) as sampler:
        sum(range(100_000))
    summary = sampler.summary()
    assert summary["host_cpu_percent_mean"] >= 0 and summary["engine_rss_gib_max"] > 0
    assert not any(key.startswith("gpu_") for key in summary)  # no GPU indices given: the host is sampled


def test_visible_gpus_follow_cuda_visible_devices():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == [2, 3]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    # Ray and Kubernetes device plugins hand UUIDs: kept as given, for NVML to resolve
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-8f3a, MIG-1b2c,0"}) == ["GPU-8f3a", "MIG-1b2c", 0]


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
    assert visible_gpus({}) == list(range(_nvidia_gpus()))


class NotSupported(Exception):
    """What pynvml raises for a field a board does not report (NVMLError_NotSupported)."""


#: The fake's UUIDs: GPU i's and its MIG slices' (as NVML writes them since R470).
GPU_UUIDS = ["GPU-8f3a61c2-0d4e-4b7a-9e21-5c6d7e8f9a01", "GPU-8f3b0a77-1c2d-4e5f-8a9b-0c1d2e3f4a5b"]
MIG_UUIDS = ["MIG-1b2c3d4e-5f60-5a7b-8c9d-0e1f2a3b4c5d", "MIG-9e8d7c6b-5a49-5382-a1b0-c9d8e7f6a5b4"]


def fake_nvml(unsupported: dict, slices: dict[int, list[str]] | None = None):
    """pynvml's calls the sampler and the environment record make, over two GPUs (handles 0 and 1), raising
    NotSupported for the named fields of a handle. ``slices``: GPUs in MIG mode and their slices' profiles (slot
    handles ``(gpu, slot)``, UUIDs MIG_UUIDS in order, memory the profile's), which, as on a real board, report no
    utilization, and here the board's power and energy, so that a reading of them would show."""
    from types import SimpleNamespace

    slices = slices or {}
    mig_uuid = {(g, slot): uuid for (g, slot), uuid in zip(
        [(g, slot) for g in sorted(slices) for slot in range(len(slices[g]))], MIG_UUIDS, strict=False)}  # fmt: skip

    def board(handle):
        return handle if isinstance(handle, int) else handle[0]

    def call(field, value):
        def read(handle, *args):
            if field in unsupported.get(handle, set()) or (field == "util" and not isinstance(handle, int)):
                raise NotSupported(field)
            return value(handle)

        return read

    def memory(handle):
        if isinstance(handle, int):
            return SimpleNamespace(used=(10 + handle) * 1024**3, total=80 * 1024**3)
        profile = slices[handle[0]][handle[1]]
        return SimpleNamespace(used=2 * 1024**3, total=int(profile.split(".")[1].rstrip("gb")) * 1024**3)

    def by_index(i):
        if not 0 <= i < 2:
            raise NotSupported("InvalidArgument")
        return i

    def slot(gpu, index):
        if (gpu, index) not in mig_uuid:
            raise NotSupported("NotFound")
        return (gpu, index)

    def name(handle):
        return "NVIDIA H100 80GB HBM3" + ("" if isinstance(handle, int) else f" MIG {slices[handle[0]][handle[1]]}")

    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, NVML_CLOCK_SM=1, NVML_DEVICE_MIG_ENABLE=1, NVML_FEATURE_ENABLED=1,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=by_index,
        nvmlDeviceGetUUID=lambda h: GPU_UUIDS[h] if isinstance(h, int) else mig_uuid[h],
        nvmlDeviceGetMigMode=lambda h: (1, 1) if h in slices else (0, 0),
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7, nvmlDeviceGetMigDeviceHandleByIndex=slot,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=board, nvmlDeviceGetName=name,
        nvmlSystemGetDriverVersion=lambda: "580.65.06", nvmlSystemGetCudaDriverVersion_v2=lambda: 13000,
        nvmlDeviceGetNvLinkState=lambda h, link: 1,
        nvmlDeviceGetUtilizationRates=call("util", lambda h: SimpleNamespace(gpu=50 + 10 * h)),
        nvmlDeviceGetMemoryInfo=call("memory", memory),
        nvmlDeviceGetPowerUsage=call("power", lambda h: 300_000),
        nvmlDeviceGetTemperature=call("temperature", lambda h: 60 + board(h)),
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


def counter_gpu_sampler(monkeypatch) -> TelemetrySampler:
    """A sampler of one fake GPU whose energy counter gains 1 kJ at each read (its power reads 300 W) on a clock of
    whole seconds: reads at t=0 (enter), 1, 2 (two samples), 3 (the last sample), 4 (exit)."""
    import servetune.telemetry as telemetry

    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    counter = iter(range(0, 100_000_000, 1_000_000))  # mJ
    nv = fake_nvml({})
    nv.nvmlDeviceGetTotalEnergyConsumption = lambda h: next(counter) if h == 0 else 0
    monkeypatch.setattr(telemetry, "_nvml", lambda: nv)
    with TelemetrySampler([0], interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        sampler._take_sample()
        sampler._take_sample()
    return sampler


def test_a_gpus_window_energy_uses_its_counter_and_else_its_power(monkeypatch):
    sampler = counter_gpu_sampler(monkeypatch)
    # reads at t=0 (enter), 1, 2 (samples), 3 (the last sample), 4 (exit): 1 kJ a second
    assert sampler.window_energy(1.5, 3.0)["gpu_energy_measured_j"] == pytest.approx(1_500.0)
    # no counter: 300 W of sampled power over the window, on a clock from 0 again
    import servetune.telemetry as telemetry

    clock = iter(float(t) for t in range(100))
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(telemetry, "_nvml", lambda: fake_nvml({0: {"energy"}}))
    with TelemetrySampler([0], interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        sampler._take_sample()
        sampler._take_sample()
    assert sampler.window_energy(1.5, 3.0)["gpu_energy_measured_j"] == pytest.approx(450.0)


def test_uuids_mig_uuids_their_prefixes_and_mixed_lists_resolve_to_their_devices():
    nv = fake_nvml({}, slices={1: ["3g.40gb", "1g.10gb"]})
    devices, notes = resolve_devices(nv, [GPU_UUIDS[0], MIG_UUIDS[1]])
    assert [(d.handle, d.mig) for d in devices] == [(0, False), ((1, 1), True)] and notes == []
    # a unique prefix, as CUDA takes it, an index and a MIG slice in one list, in the list's order
    devices, notes = resolve_devices(nv, [MIG_UUIDS[0][:12], 0])
    assert [(d.id, d.handle) for d in devices] == [(MIG_UUIDS[0][:12], (1, 0)), (0, 0)] and notes == []


def test_an_id_that_names_no_device_is_one_note_and_cuda_sees_nothing_from_it():
    nv = fake_nvml({}, slices={1: ["3g.40gb"]})
    devices, (note,) = resolve_devices(nv, [1, "GPU-0000dead", GPU_UUIDS[0]])
    assert [d.handle for d in devices] == [1]  # the devices before it, as CUDA sees them
    assert note.startswith("CUDA_VISIBLE_DEVICES entry 'GPU-0000dead': no device NVML sees has that UUID")
    assert GPU_UUIDS[0] in note  # the entry after it, named as left out
    devices, (note,) = resolve_devices(nv, ["GPU-8f3"])  # a prefix of both GPUs' UUIDs
    assert devices == [] and "2 devices' UUIDs start with it" in note
    devices, (note,) = resolve_devices(nv, [5])
    assert devices == [] and "NVML has no GPU 5" in note


def test_a_gpu_named_by_uuid_is_sampled_and_a_mig_slice_gives_its_memory_and_no_board_wide_fields(monkeypatch):
    import servetune.telemetry as telemetry

    nv = fake_nvml({}, slices={1: ["3g.40gb"]})
    monkeypatch.setattr(telemetry, "_nvml", lambda: nv)
    with TelemetrySampler([GPU_UUIDS[0]], interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        pass
    summary = sampler.summary()
    assert summary["gpu_util_max"] == 50 and summary["gpu_memory_used_gib_max"] == 10  # GPU 0's, not GPU 1's
    assert summary["gpu_power_w_mean"] == 300 and "gpu_energy_j" in summary
    # A slice: its own memory; utilization, power and energy absent (the board's would be other tenants' too),
    # also for a full GPU beside it, whose numbers alone would not be the trial's.
    for devices in ([MIG_UUIDS[0]], [0, MIG_UUIDS[0]]):
        with TelemetrySampler(devices, interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
            pass
        summary = sampler.summary((sampler._started, sampler._ended))
        assert summary["gpu_memory_used_gib_max"] == (2 if len(devices) == 1 else 10), devices
        assert not {"gpu_util_max", "gpu_power_w_mean", "gpu_energy_j", "gpu_energy_measured_j"} & set(summary)
        assert sampler.energy_note is not None and "MIG" in sampler.energy_note


def test_a_bad_id_is_one_note_and_the_level_goes_on(monkeypatch):
    import servetune.telemetry as telemetry

    monkeypatch.setattr(telemetry, "_nvml", lambda: fake_nvml({}))
    with TelemetrySampler(["MIG-ffff"], os.getpid(), interval_s=60, rapl_root=Path("/nonexistent")) as sampler:
        pass
    summary = sampler.summary()
    assert not any(key.startswith("gpu_") for key in summary)
    assert sampler.energy_note.startswith("GPU energy not measured: CUDA_VISIBLE_DEVICES entry 'MIG-ffff'")


def test_the_environment_records_a_mig_slice_as_its_board_its_profile_and_its_memory(monkeypatch):
    import servetune.telemetry as telemetry
    from servetune.environment import _gpus

    monkeypatch.setattr(telemetry, "_nvml", lambda: fake_nvml({}, slices={0: ["1g.10gb", "3g.40gb"]}))
    record = _gpus([MIG_UUIDS[1]])
    assert record["gpu_model"] == "NVIDIA H100 80GB HBM3" and record["gpu_mig"] == "3g.40gb"
    assert record["gpu_memory_gib"] == "40.0" and record["gpu_indices"] == MIG_UUIDS[1]
    assert "no utilization, power or energy" in record["telemetry_note"]
    whole = _gpus([GPU_UUIDS[1]])
    assert whole["gpu_memory_gib"] == "80.0" and "gpu_mig" not in whole and "telemetry_note" not in whole
    bad = _gpus(["GPU-0000dead"])
    assert bad["gpu_model"] == "no NVIDIA GPU visible" and "'GPU-0000dead'" in bad["telemetry_note"]


def test_the_sampled_power_over_a_window_is_there_beside_the_counter_to_check_it_against(monkeypatch):
    """Where a GPU has an energy counter, the window's energy is the counter's; its sampled power integrated over the
    same window stays readable (:meth:`TelemetrySampler.power_window_energy`), the check #43 asks of a GPU run."""
    sampler = counter_gpu_sampler(monkeypatch)
    assert sampler.window_energy(1.5, 3.0)["gpu_energy_measured_j"] == pytest.approx(1_500.0)  # the counter's
    assert sampler.power_window_energy(1.5, 3.0) == pytest.approx(450.0)  # 300 W sampled x 1.5 s
    assert sampler.power_window_energy(3.5, 3.0) is None
