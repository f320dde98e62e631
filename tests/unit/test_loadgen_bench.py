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
    firsts = [bench.round_order(bench.CLIENTS, r)[0] for r in range(len(bench.CLIENTS))]
    assert sorted(firsts) == sorted(bench.CLIENTS)
    assert all(sorted(bench.round_order(bench.CLIENTS, r)) == sorted(bench.CLIENTS) for r in range(4))


def vllm_result(starts, ttfts, itls, latencies, tokens, errors, duration):
    """The per-request lists ``vllm bench serve``'s ``benchmark()`` returns (the keys vllm_records reads)."""
    return {
        "start_times": starts, "ttfts": ttfts, "itls": itls, "latencies": latencies, "output_lens": tokens,
        "input_lens": [256] * len(starts), "errors": errors, "duration": duration,
    }  # fmt: skip


def test_vllms_outputs_become_records_on_a_clock_from_its_first_send(bench):
    result = vllm_result(
        starts=[100.0, 100.5, 101.0], ttfts=[0.25, 0.25, 0.0], itls=[[0.25, 0.5], [0.25, 0.25], []],
        latencies=[1.0, 0.75, 0.0], tokens=[3, 3, 0], errors=["", "", "Traceback: boom"], duration=2.0,
    )  # fmt: skip
    records = bench.vllm_records(result)
    assert [r.sent for r in records] == [0.0, 0.5, 1.0]
    assert records[0].chunk_times == [0.25, 0.5, 1.0] and records[0].end == 1.0
    assert records[1].chunk_times == [0.75, 1.0, 1.25] and records[1].end == 1.25
    assert [r.ok for r in records] == [True, True, False]
    assert records[2].error_kind == "failed" and records[2].output_tokens is None
    assert [r.output_tokens for r in records[:2]] == [3, 3]


def test_one_definition_reads_both_clients_records_as_vllm_divides(bench):
    # two clients; vLLM's 6 tokens over first send (0) -> last end (1.25): its own duration was 2 s
    result = vllm_result(
        starts=[100.0, 100.5], ttfts=[0.25, 0.25], itls=[[0.25, 0.5], [0.25, 0.25]], latencies=[1.0, 0.75],
        tokens=[3, 3], errors=["", ""], duration=2.0,
    )  # fmt: skip
    common = bench.common_metrics(bench.vllm_records(result), 2)
    assert common["window_output_throughput"] == pytest.approx(6 / 1.25)
    assert common["window_s"] == pytest.approx(1.25)


def staggered(bench):
    """Four clients in a closed loop, the first alone until its first answer ended at 1 s, then three more, each
    request 1 s, 4 tokens at 0.25 s steps: every client busy from 1.5 s (the fourth send) to the last send."""
    from servetune.metrics import RequestRecord

    sends = [0.0, 1.0, 1.2, 1.3, 1.5, 2.0, 2.2, 2.3, 2.5, 3.0]
    records = []
    for i, sent in enumerate(sends):
        times = [sent + 0.25 * k for k in range(1, 5)]
        record = RequestRecord(index=i, sent=sent, input_tokens=8, max_tokens=4, chunk_times=times, end=times[-1])
        record.output_tokens, record.ok = 4, True
        records.append(record)
    return records


def test_the_busy_window_leaves_out_a_staggered_start_and_the_drain(bench):
    common = bench.common_metrics(staggered(bench), 4)
    assert common["ramp_s"] == pytest.approx(1.5)  # the fourth client sent at 1.5 s
    assert common["drain_s"] == pytest.approx(1.0)  # the last send at 3.0, its end at 4.0
    assert common["window_output_throughput"] == pytest.approx(40 / 4.0)
    assert common["busy_output_throughput"] > common["window_output_throughput"]


def test_refill_gap_is_the_clients_own_pace_between_an_end_and_the_next_send(bench):
    records = staggered(bench)
    # inside the busy window (1.5, 3.0]: the sends at 2.0, 2.2, 2.3, 2.5, 3.0 follow the ends at 2.0, 2.2, 2.3, 2.5,
    # 3.0: no gap; move each 4 ms later and the client's pace reads 4 ms
    assert bench.refill_gap_ms(records, (1.5, 3.0)) == pytest.approx(0.0)
    for r in records[5:]:
        r.sent += 0.004
        r.chunk_times = [t + 0.004 for t in r.chunk_times]
        r.end += 0.004
    assert bench.refill_gap_ms(records, (1.5, 3.004)) == pytest.approx(4.0, abs=1e-6)
    assert bench.refill_gap_ms(records, None) is None


def test_vllms_benchmark_still_returns_the_per_request_lists_read(bench):
    """vllm_records reads these keys of the installed vLLM's ``benchmark()`` result: a rename fails here."""
    import inspect

    import vllm.benchmarks.serve as vserve

    source = inspect.getsource(vserve.benchmark)
    for key in ("start_times", "ttfts", "itls", "latencies", "output_lens", "input_lens", "errors", "duration"):
        assert f'"{key}":' in source, key


@pytest.mark.parametrize("worker", ["servetune", "servetune-lockstep"])
def test_servetune_worker_reports_the_common_window_on_a_fake_server(bench, tmp_path, worker):
    """servetune's worker, against the fake server: staggered, the other clients start after the first answer ended
    (ramp at least that long); all at once, every client is busy before the first answer ends."""
    import json as json_

    from servetune.testing.fake_openai import FakeOpenAI
    from tests.conftest import serve_fake

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json_.dumps({"prompt": "hi " * 8, "input_tokens": 8, "output_tokens": 6}) + "\n"
                                for _ in range(24)))  # fmt: skip
    with serve_fake(FakeOpenAI(ttft_ms=5.0, itl_ms=2.0)) as url:
        args = argparse.Namespace(url=url, model="fake", requests=str(requests), concurrency=4, worker=worker)
        result = bench.worker_servetune(args)
    assert result["completed"] == 24 and len(result["requests"]) == 24
    assert result["window_output_throughput"] == pytest.approx(result["output_throughput"])
    first_end = min(end for _, _, end, _ in result["requests"] if end is not None)
    first_sent = min(sent for sent, _, _, _ in result["requests"])
    first = next(row for row in result["requests"] if row[0] == first_sent)
    if worker == "servetune":
        assert result["ramp_s"] >= first[2] - first_sent
    else:
        assert result["ramp_s"] < first_end - first_sent
    assert result["own_window_extra_ms"] == 0.0


def test_cpu_between_reads_a_window_linearly_between_cumulative_samples(bench):
    samples = [(10.0, 1.0), (11.0, 2.0), (12.0, 2.0), (13.0, 4.0)]
    assert bench.cpu_between(samples, 10.5, 12.5) == pytest.approx(3.0 - 1.5)
    assert bench.cpu_between(samples, 10.0, 13.0) == pytest.approx(3.0)
    assert bench.cpu_between(samples, 9.0, 12.0) is None  # not covered: no reading rather than a short one
    assert bench.cpu_between(samples[:1], 10.0, 10.0) is None


def test_engine_share_is_the_engines_cpu_over_the_clients_window(bench):
    class Sampler:
        def between(self, start, end):
            return bench.cpu_between([(0.0, 0.0), (100.0, 80.0)], start, end)

    share = bench.engine_share(Sampler(), {"window_wall": [10.0, 30.0], "output_tokens": 3200})
    assert share["engine_cpu_s"] == pytest.approx(16.0)
    assert share["engine_cpu_share"] == pytest.approx(0.8)
    assert share["tokens_per_engine_cpu_s"] == pytest.approx(200.0)
    assert bench.engine_share(Sampler(), {"window_wall": None, "output_tokens": 1})["engine_cpu_share"] is None


def test_cpu_sampler_reads_this_process_over_a_busy_window(bench):
    import os
    import time

    with bench.CpuSampler([os.getpid()], every_s=0.02) as sampler:
        start, cpu = time.time(), time.process_time()
        while time.process_time() < cpu + 0.1:  # some CPU of our own
            pass
        end = time.time()
        time.sleep(0.1)
    spent = sampler.between(start, end)
    assert spent is not None and spent > 0


def test_clients_compared_add_the_lock_step_and_vllm_body_clients_where_asked(bench):
    assert bench.clients_compared(False, False) == ("servetune", "vllm")
    assert bench.clients_compared(True, False) == ("servetune", "vllm", "servetune-lockstep")
    assert bench.clients_compared(True, True) == ("servetune", "vllm", "servetune-lockstep", "servetune-vllm-body")
    assert bench.clients_compared(False, True) == ("servetune", "vllm", "servetune-vllm-body")


def test_vllm_body_client_sends_what_vllms_client_adds_and_starts_at_once(bench, tmp_path):
    """The body of vLLM's completions request (read from its request function) against servetune's: the variant
    adds the fields only vLLM's client sends, and starts every client at once as vLLM's does."""
    import inspect
    import json as json_

    from vllm.benchmarks.lib import endpoint_request_func

    from servetune.testing.fake_openai import FakeOpenAI
    from tests.conftest import serve_fake

    source = inspect.getsource(endpoint_request_func.async_request_openai_completions)
    for key, value in bench.VLLM_BODY:
        assert f'"{key}": {value!r}' in source or f'"{key}": request_func_input.{key}' in source, key

    bodies = []

    class Recording(FakeOpenAI):
        async def complete(self, request):
            bodies.append(await request.json())
            return await super().complete(request)

    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json_.dumps({"prompt": "hi", "input_tokens": 1, "output_tokens": 4}) + "\n"
                                for _ in range(8)))  # fmt: skip
    with serve_fake(Recording(ttft_ms=5.0, itl_ms=1.0)) as url:
        args = argparse.Namespace(url=url, model="fake", requests=str(requests), concurrency=4,
                                  worker="servetune-vllm-body")  # fmt: skip
        result = bench.worker_servetune(args)
        plain = bench.worker_servetune(argparse.Namespace(**{**vars(args), "worker": "servetune-lockstep"}))
    assert result["completed"] == plain["completed"] == 8
    assert all(b["repetition_penalty"] == 1.0 and "logprobs" in b and b["logprobs"] is None for b in bodies[:8])
    assert not any("repetition_penalty" in b or "logprobs" in b for b in bodies[8:])
    first = min(result["requests"])
    assert result["ramp_s"] < first[2] - first[0]  # every client busy before the first answer ended
