"""run_trial itself, through its Engine protocol: a fake server in this process stands in for vLLM (no Ray)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.errors import EngineStartError
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.results import find_knee
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.runner import TrialSpec, run_trial
from tests.conftest import serve_fake


class FakeEngine:
    """The Engine protocol over an in-process fake server; ``lives_for`` levels, then it is gone."""

    def __init__(self, fake: FakeOpenAI, lives_for: int | None = None, start_error: str | None = None,
                 start_log: str = "ERROR: it never came up") -> None:  # fmt: skip
        self.fake, self.lives_for, self.start_error, self.start_log = fake, lives_for, start_error, start_log
        self.process = SimpleNamespace(pid=os.getpid())
        self.startup_s, self.url, self.levels_seen, self.stopped = 0.01, "", 0, False

    def __enter__(self) -> FakeEngine:
        if self.start_error:
            raise EngineStartError(self.start_error, self.start_log)
        self._serving = serve_fake(self.fake)
        self.url = self._serving.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._serving.__exit__(None, None, None)
        self.stopped = True

    def kv_capacity(self):
        return None

    def alive(self) -> bool:
        return self.lives_for is None or self.fake.resets <= self.lives_for  # one reset per level run

    def failure_reason(self) -> str:
        return "exit code -9"

    def log_tail(self, lines: int = 40) -> str:
        return "ERROR fake engine killed"


def spec(tmp_path: Path, levels=(1, 4), slo: str = "ttft_ms.p99=2000", capacity_levels: int = 0) -> TrialSpec:
    """The trial these tests run: the ladder alone unless ``capacity_levels`` asks for the capacity search."""
    return TrialSpec(
        study="direct", trials_dir=tmp_path, params={"max_num_seqs": 8}, engine_args={"max_num_seqs": 8}, env={},
        model="fake-model", device="cpu", devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"),
        levels=tuple(Level("concurrency", c) for c in levels), requests_per_level=8, seconds_per_level=None,
        warmup_requests=1, request_timeout_s=30, startup_timeout_s=30, stop_on_slo_break=True,
        min_throughput_gain=0.0, slo=Slo.parse(slo), capacity_levels=capacity_levels,
    )  # fmt: skip


def run(tmp_path, tokenizer, engine: FakeEngine, **kwargs):
    reports = []
    result = run_trial(spec(tmp_path, **kwargs), reports.append, lambda: PromptFactory(tokenizer),
                       engine=lambda s, d: engine)  # fmt: skip
    return result, reports


def test_a_trial_measures_every_level_on_its_engine_and_writes_its_result(tmp_path, tiny_tokenizer):
    engine = FakeEngine(FakeOpenAI(ttft_ms=5, itl_ms=1))
    result, reports = run(tmp_path, tiny_tokenizer, engine)
    assert result.outcome == "COMPLETE" and [lv.summary.level for lv in result.levels] == [
        {"concurrency": 1},
        {"concurrency": 4},
    ]
    assert [r["level_index"] for r in reports] == [0, 1] and result.best_level_index == 1 and engine.stopped
    assert engine.fake.resets == 2  # a cold prefix cache for each level
    on_disk = json.loads((tmp_path / result.trial_id / "result.json").read_text())
    assert on_disk["outcome"] == "COMPLETE" and on_disk["schema_version"] >= 2
    rows = [json.loads(line) for line in (tmp_path / result.trial_id / "requests.jsonl").read_text().splitlines()]
    assert {row["level"] for row in rows} == {0, 1} and len(rows) == 2 * (8 + 1)  # one warm-up request a level


def test_an_engine_that_dies_mid_ladder_is_failed_data_with_its_log_tail_and_the_level_it_died_in(
    tmp_path, tiny_tokenizer
):
    result, reports = run(tmp_path, tiny_tokenizer, FakeEngine(FakeOpenAI(ttft_ms=5, itl_ms=1), lives_for=0))
    assert result.outcome == "FAILED" and result.reason == "the engine died during concurrency 1 (exit code -9)"
    assert result.log_tail == "ERROR fake engine killed" and len(result.levels) == 1 and reports == []


def test_an_engine_that_does_not_start_is_failed_data(tmp_path, tiny_tokenizer):
    result, _ = run(tmp_path, tiny_tokenizer, FakeEngine(FakeOpenAI(), start_error="vLLM exited with code 1"))
    assert result.outcome == "FAILED" and result.reason == "engine start: vLLM exited with code 1"
    assert result.log_tail == "ERROR: it never came up" and result.levels == []
    assert result.failure is not None and result.failure.kind == "configuration" and not result.runs_again
    assert result.retried == []


def test_a_port_taken_before_the_engine_binds_it_is_retried_on_a_fresh_port(
    tmp_path, tiny_tokenizer, fake_python, monkeypatch
):
    """The collision for real: the first port handed to the engine is held by this test when the (fake) engine's
    server binds it, so its own OSError lands in engine.log; the trial starts it again on another port and
    measures, keeping the first start's log and its failure."""
    import socket

    import servetune.engine.server as server_module
    from servetune.trial.runner import vllm_engine

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    handed: list[int] = []
    real_free_port = server_module.free_port

    def first_one_taken(host: str = "127.0.0.1") -> int:
        handed.append(held.getsockname()[1] if not handed else real_free_port(host))
        return handed[-1]

    monkeypatch.setattr(server_module, "free_port", first_one_taken)
    trial = replace(spec(tmp_path, levels=(1,)), python=str(fake_python), engine_args={})
    try:
        result = run_trial(trial, lambda report: None, lambda: PromptFactory(tiny_tokenizer), engine=vllm_engine)
    finally:
        held.close()
    assert result.outcome == "COMPLETE", (result.reason, result.log_tail)
    assert len(handed) == 2 and handed[1] != handed[0]
    (first,) = result.retried
    assert (first.kind, first.cause) == (
        "infrastructure",
        "port_in_use",
    ) and "address already in use" in first.evidence.lower()
    assert "address already in use" in (tmp_path / result.trial_id / "engine.attempt-1.log").read_text().lower()
    assert result.failure is None and not result.runs_again


def test_each_level_records_the_share_of_a_core_the_engines_api_server_used(tmp_path, tiny_tokenizer, fake_python):
    """The (fake) engine's API server is the process vllm serve runs in under the reaper: its CPU seconds over each
    level are read at the level's start and end, and land in result.json. An engine whose processes are not
    servetune's (the in-process FakeEngine, like a Serve replica) records none, without an error."""
    from servetune.trial.runner import vllm_engine

    env = {"SERVETUNE_FAKE_TTFT_MS": "0", "SERVETUNE_FAKE_ITL_MS": "0"}  # answered at once: the front end works
    trial = replace(spec(tmp_path, levels=(1, 16)), python=str(fake_python), engine_args={}, env=env)
    trial = replace(trial, requests_per_level=64)
    result = run_trial(trial, lambda report: None, lambda: PromptFactory(tiny_tokenizer), engine=vllm_engine)
    assert result.outcome == "COMPLETE", (result.reason, result.log_tail)
    shares = [lv.frontend_cpu_share for lv in result.levels]
    print(f"front end CPU share per level (concurrency 1, 16): {shares}")
    assert all(share is not None and 0 < share < 2 for share in shares), shares
    on_disk = json.loads((tmp_path / result.trial_id / "result.json").read_text())
    assert [lv["frontend_cpu_share"] for lv in on_disk["levels"]] == shares
    elsewhere, _ = run(tmp_path / "in-process", tiny_tokenizer, FakeEngine(FakeOpenAI(ttft_ms=5, itl_ms=1)))
    assert elsewhere.outcome == "COMPLETE" and [lv.frontend_cpu_share for lv in elsewhere.levels] == [None, None]


def test_a_gated_model_is_not_the_configurations_failure_and_is_not_retried(tmp_path, tiny_tokenizer):
    """huggingface_hub's own error for a gated repository, raised from a real 401 response: no retry (the token is
    the same next time), recorded as the cluster's, and the trial runs again on --resume."""
    import httpx2  # huggingface_hub's own HTTP client
    from huggingface_hub.utils import hf_raise_for_status

    response = httpx2.Response(401, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "Access to model org/gated "
                              "is restricted."}, request=httpx2.Request("GET", "https://huggingface.co/api/models/org/gated"))  # fmt: skip
    with pytest.raises(Exception) as raised:
        hf_raise_for_status(response)
    log = f"{type(raised.value).__name__}: {raised.value}"  # as a traceback ends in engine.log
    starts = []

    def gated(s, d):
        starts.append(d)
        return FakeEngine(FakeOpenAI(), start_error="vLLM exited with code 1 during startup", start_log=log)

    result = run_trial(spec(tmp_path), lambda report: None, lambda: PromptFactory(tiny_tokenizer), engine=gated)
    assert len(starts) == 1 and result.outcome == "FAILED"
    assert result.failure is not None and (result.failure.kind, result.failure.cause) == ("infrastructure", "hub_auth")
    assert result.runs_again and result.retried == []


def test_the_capacity_search_measures_past_the_ladder_on_the_same_engine_and_records_its_capacity(
    tmp_path, tiny_tokenizer
):
    # First tokens in 50 ms against a 20 ms bound: 2 clients break the SLO, the search goes down to 1 and
    # breaks it there too, so the capacity is an upper bound (fewer than 1 client).
    engine = FakeEngine(FakeOpenAI(ttft_ms=50, itl_ms=1))
    result, reports = run(tmp_path, tiny_tokenizer, engine, levels=(2, 4), slo="ttft_ms.p99=20", capacity_levels=4)
    assert result.outcome == "COMPLETE" and [lv.summary.level for lv in result.levels] == [
        {"concurrency": 2},
        {"concurrency": 1},
    ]
    assert result.stopped_because.startswith("SLO broken at concurrency 2")  # the ladder's reason, as before
    assert [r["level_index"] for r in reports] == [0, 1] and engine.fake.resets == 2 and engine.stopped
    capacity = result.capacity_at_slo
    assert capacity is not None and capacity.bound == "upper" and capacity.bracket == (None, 1)
    assert capacity.value is None and capacity.extra_levels == 1 and capacity.breaking_slo == "ttft_ms_p99 <= 20"
    on_disk = json.loads((tmp_path / result.trial_id / "result.json").read_text())
    assert on_disk["capacity_at_slo"]["bound"] == "upper" and len(on_disk["levels"]) == 2
    # the knee, from the two loads measured (the ladder's and the search's), recorded beside the capacity
    # (the search's knee: no load met the SLO, so it was not bisected, and it says why)
    read = find_knee(result.levels, unit="concurrency")
    assert result.knee is not None and (result.knee.value, result.knee.bracket) == (read.value, read.bracket)
    assert result.knee.value in (1, 2) and on_disk["knee"]["value"] == result.knee.value
    assert result.knee.extra_levels == 0 and on_disk["knee"]["ended"] == result.knee.ended is not None
    rows = [json.loads(line) for line in (tmp_path / result.trial_id / "requests.jsonl").read_text().splitlines()]
    assert {row["level"] for row in rows} == {0, 1}


GPU_START_LOG = (  # vLLM 0.32's own start-up lines on one H100 (gpu_model_runner.py, gpu_worker.py, kv_cache_utils.py)
    "(EngineCore pid=7) INFO Model loading took 14.99 GiB memory and 5.270000 seconds\n"
    "(EngineCore pid=7) INFO Available KV cache memory: 52.31 GiB\n"
    "(EngineCore pid=7) INFO GPU KV cache size: 1,714,112 tokens\n"
)


class LoggingEngine(FakeEngine):
    """A fake engine whose start-up log says what vLLM's says on a GPU."""

    def kv_capacity(self):
        from servetune.engine.server import KvCapacity

        return KvCapacity.from_log(GPU_START_LOG)


@pytest.mark.parametrize(
    "engine_args, why",
    [
        ({"quantization": "quark"}, "quantization quark"),
        ({"quantization": "gguf"}, "quantization gguf"),
    ],
)
def test_what_the_planner_cannot_size_starts_and_records_vllms_own_numbers(tmp_path, tiny_tokenizer, engine_args, why):
    gpu = replace(spec(tmp_path, levels=(1,)), model="meta-llama/Llama-3.1-8B-Instruct", device="gpu",
                  gpu="H100-SXM", engine_args={"max_model_len": 8192, **engine_args})  # fmt: skip
    started = []

    def engine(s, d):
        started.append(d)
        return LoggingEngine(FakeOpenAI(ttft_ms=5, itl_ms=1))

    result = run_trial(gpu, lambda report: None, lambda: PromptFactory(tiny_tokenizer), engine=engine)
    assert started and result.outcome == "COMPLETE", result.reason
    assert (
        result.capacity is not None
        and not result.capacity.planned
        and result.capacity.reason.startswith(f"not planned: {why}")
    )
    assert result.kv_capacity is not None
    assert (result.kv_capacity.tokens, result.kv_capacity.available_kv_gib, result.kv_capacity.model_load_gib) == (
        1714112,
        52.31,
        14.99,
    )
    # What is known not to fit (weights above 0.1 of the GPU) is still rejected before any engine starts.
    small = replace(
        gpu, trials_dir=tmp_path / "small", engine_args={"max_model_len": 8192, "gpu_memory_utilization": 0.1}
    )
    refused = run_trial(small, lambda report: None, lambda: PromptFactory(tiny_tokenizer), engine=engine)
    assert refused.outcome == "INFEASIBLE" and len(started) == 1


def test_a_cpu_trials_energy_per_token_comes_from_rapl_where_readable_and_is_absent_with_a_reason_where_not(
    tmp_path, tiny_tokenizer, monkeypatch
):
    """A study never fails for want of RAPL: without /sys/class/powercap (this host) each level says why it has no
    energy; with a package counter (a powercap tree a thread advances, wrapping as RAPL's does) each level has the
    energy of its measured window and its points energy per token and per request."""
    import threading

    import servetune.telemetry as telemetry

    monkeypatch.setattr(telemetry, "POWERCAP", tmp_path / "no-powercap")
    result, _ = run(tmp_path / "none", tiny_tokenizer, FakeEngine(FakeOpenAI(ttft_ms=5, itl_ms=1)))
    assert result.outcome == "COMPLETE"
    assert all(lv.energy_note == f"RAPL not readable: {tmp_path / 'no-powercap'} absent" for lv in result.levels)
    assert not any("energy_per_token" in p.metrics for p in result.operating_points())

    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "max_energy_range_uj").write_text("20000000\n")  # wraps at 20 J: 4 s at 5 W, once between reads
    (zone / "energy_uj").write_text("19000000\n")  # so the first level's counter wraps
    stop = threading.Event()

    def package():  # 5 W: 0.05 J every 10 ms
        uj = 19_000_000
        while not stop.wait(0.01):
            uj = (uj + 50_000) % 20_000_000
            (zone / "energy_uj.new").write_text(f"{uj}\n")
            (zone / "energy_uj.new").replace(zone / "energy_uj")  # whole, as sysfs reads are

    monkeypatch.setattr(telemetry, "POWERCAP", tmp_path / "powercap")
    drawing = threading.Thread(target=package, daemon=True)
    drawing.start()
    try:
        result, _ = run(tmp_path / "rapl", tiny_tokenizer, FakeEngine(FakeOpenAI(ttft_ms=5, itl_ms=1)))
    finally:
        stop.set()
        drawing.join()
    assert result.outcome == "COMPLETE" and all(lv.energy_note is None for lv in result.levels)
    for point, level in zip(result.operating_points(), result.levels, strict=True):
        joules = level.telemetry["cpu_energy_measured_j"]
        assert joules > 0  # through the wraps
        assert point.metrics["energy_per_token"] == pytest.approx(joules / level.summary.total_output_tokens)
        assert point.metrics["energy_per_request"] == pytest.approx(joules / level.summary.completed)
    on_disk = json.loads((tmp_path / "rapl" / result.trial_id / "result.json").read_text())
    assert on_disk["levels"][0]["telemetry"]["cpu_energy_measured_j"] > 0
