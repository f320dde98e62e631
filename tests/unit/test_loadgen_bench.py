"""bench/loadgen_vs_vllm.py: the engine and the clients pinned to cores apart (``--pin``)."""

import argparse
import sys
from pathlib import Path

import pytest

from tests.builders import bench_script


@pytest.fixture(scope="module")
def bench():
    return bench_script("loadgen_vs_vllm")


@pytest.mark.parametrize(
    "text, engine, client",
    [("0:1", [0], [1]), ("0,2:1", [0, 2], [1]), ("0-2:3-4", [0, 1, 2], [3, 4]), ("1:0", [1], [0])],
)
def test_pin_parses_engine_and_client_cores(bench, text, engine, client):
    assert bench.parse_pin(text) == (engine, client)


@pytest.mark.parametrize("text", ["0", "0:", ":1", "0-1:1", "a:1", "0:1-", "2-1:0", "0:1:2"])
def test_pin_rejects_malformed_or_overlapping_lists(bench, text):
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_pin(text)


def test_bad_pin_is_one_line_and_exit_2(bench, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["loadgen_vs_vllm.py", "--pin", "0:0"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--pin 0:0: cores [0] are both the engine's and the client's" in err
    assert "Traceback" not in err


def test_unavailable_core_is_refused_before_anything_starts(bench, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["loadgen_vs_vllm.py", "--pin", "0:4095"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "cores [4095] are not available here" in capsys.readouterr().err


def test_client_worker_runs_under_taskset_on_client_cores(bench):
    argv = bench.worker_argv("vllm", "http://127.0.0.1:1", "m", Path("r.jsonl"), 8, [1])
    assert argv[:3] == ["taskset", "--cpu-list", "1"]
    assert argv[3] == sys.executable
    assert "--worker" in argv and argv[argv.index("--worker") + 1] == "vllm"
    unpinned = bench.worker_argv("vllm", "http://127.0.0.1:1", "m", Path("r.jsonl"), 8, None)
    assert unpinned == argv[3:]


def test_engine_runs_under_taskset_with_vllm_threads_bound_to_its_cores(bench, tmp_path):
    env = bench.engine_env({"VLLM_CPU_KVCACHE_SPACE": "1"}, [0, 2])
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0,2"}
    assert bench.engine_env({"VLLM_CPU_OMP_THREADS_BIND": "3"}, [0]) == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert bench.engine_env({"A": "1"}, None) == {"A": "1"}
    server = bench.pinned_server([0, 2], "model-dir", {}, env, log_path=tmp_path / "engine.log", port=1)
    argv = server.launch_argv()
    assert argv[:3] == ["taskset", "--cpu-list", "0,2"]
    assert (
        argv[3:] == bench.pinned_server(None, "model-dir", {}, env, log_path=tmp_path / "e.log", port=1).launch_argv()
    )
    assert "servetune.engine.reaper" in argv  # the reaper, and everything it starts, runs pinned


def test_threads_affinity_reads_what_the_kernel_enforces(bench):
    import os

    allowed = bench.threads_affinity([os.getpid()])
    assert len(allowed) >= 1
    assert set(bench.parse_cores(allowed[0])) <= os.sched_getaffinity(0)


def test_rounds_alternate_and_rotate_so_no_client_always_goes_first(bench):
    two = ("servetune", "vllm")
    assert [bench.round_order(two, r) for r in range(3)] == [two, ("vllm", "servetune"), two]
    firsts = [bench.round_order(bench.CLIENTS, r)[0] for r in range(3)]
    assert sorted(firsts) == sorted(bench.CLIENTS)
    assert all(sorted(bench.round_order(bench.CLIENTS, r)) == sorted(bench.CLIENTS) for r in range(4))
