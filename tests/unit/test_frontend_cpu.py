"""The front end's CPU over a level (engine/frontend.py): the busiest API server's CPU seconds over the window
between two readings, the API servers vllm serve starts found by their title, and the share in MLflow."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from servetune.engine.frontend import CpuReading, busiest_share, front_end, read_cpu
from servetune.tracking.fields import trial_metrics
from tests.unit.test_diagnosis import climbing, with_level


def test_the_share_is_the_busiest_processs_cpu_seconds_over_the_window():
    before = CpuReading(at_s=100.0, cpu_s={10: 5.0, 11: 1.0})
    after = CpuReading(at_s=104.0, cpu_s={10: 6.0, 11: 4.6})
    assert busiest_share(before, after) == pytest.approx(3.6 / 4)  # pid 11: 3.6 s over 4 s


def test_a_process_read_only_once_is_left_out():
    before = CpuReading(at_s=0.0, cpu_s={10: 0.0, 12: 0.0})
    after = CpuReading(at_s=2.0, cpu_s={10: 1.0, 11: 50.0})  # 11 started in between: its seconds are not the window's
    assert busiest_share(before, after) == pytest.approx(0.5)
    assert busiest_share(before, CpuReading(at_s=2.0, cpu_s={11: 1.0})) is None


@pytest.mark.parametrize(
    "before, after",
    [
        (None, CpuReading(1.0, {1: 1.0})),
        (CpuReading(1.0, {1: 1.0}), None),
        (CpuReading(1.0, {1: 0.0}), CpuReading(1.0, {1: 1.0})),
    ],
)
def test_no_share_without_both_readings_or_a_window(before, after):
    assert busiest_share(before, after) is None


def test_the_api_servers_vllm_serve_started_are_read_beside_it():
    """vLLM titles each API server it starts (api_server_count > 1) VLLM::APIServer_N; other children (the engine
    core) are not the front end."""
    sleep = "import time; time.sleep(30)"
    children = [
        subprocess.Popen([sys.executable, "-c", sleep, title])
        for title in ("VLLM::APIServer_0", "VLLM::EngineCore_DP0")
    ]
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(psutil.Process().children()) < 2:
            time.sleep(0.05)
        found = {p.pid for p in front_end(psutil.Process().pid)}
        assert found == {psutil.Process().pid, children[0].pid}
        reading = read_cpu(front_end(psutil.Process().pid))
        assert reading is not None and set(reading.cpu_s) == found
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert front_end(children[0].pid) == [] and read_cpu([]) is None  # gone: nothing to read


def test_each_levels_front_end_share_goes_to_mlflow_beside_its_telemetry():
    trial = with_level(climbing(), 2, frontend_cpu_share=0.97)
    by_step = {(m.key, m.step): m.value for m in trial_metrics(trial)}
    assert by_step[("by_level/frontend_cpu_share", 2)] == 0.97
    assert ("by_level/frontend_cpu_share", 0) not in by_step  # not recorded: no point
