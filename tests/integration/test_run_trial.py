"""run_trial itself, through its Engine protocol: a fake server in this process stands in for vLLM (no Ray)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.errors import EngineStartError
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.testing.fake_openai import FakeOpenAI
from servetune.trial.runner import TrialSpec, run_trial
from tests.conftest import serve_fake


class FakeEngine:
    """The Engine protocol over an in-process fake server; ``lives_for`` levels, then it is gone."""

    def __init__(self, fake: FakeOpenAI, lives_for: int | None = None, start_error: str | None = None) -> None:
        self.fake, self.lives_for, self.start_error = fake, lives_for, start_error
        self.process = SimpleNamespace(pid=os.getpid())
        self.startup_s, self.url, self.levels_seen, self.stopped = 0.01, "", 0, False

    def __enter__(self) -> FakeEngine:
        if self.start_error:
            raise EngineStartError(self.start_error, "ERROR: it never came up")
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


def spec(tmp_path: Path) -> TrialSpec:
    return TrialSpec(
        study="direct", trials_dir=tmp_path, params={"max_num_seqs": 8}, engine_args={"max_num_seqs": 8}, env={},
        model="fake-model", device="cpu", devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"),
        levels=(Level("concurrency", 1), Level("concurrency", 4)), requests_per_level=8, seconds_per_level=None,
        warmup_requests=1, request_timeout_s=30, startup_timeout_s=30, stop_on_slo_break=True,
        min_throughput_gain=0.0, slo=Slo.parse("ttft_ms.p99=2000"),
    )  # fmt: skip


def run(tmp_path, tokenizer, engine: FakeEngine):
    reports = []
    result = run_trial(spec(tmp_path), reports.append, lambda: PromptFactory(tokenizer), engine=lambda s, d: engine)
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
