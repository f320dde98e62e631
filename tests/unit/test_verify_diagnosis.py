"""What limited a verification (verify/diagnosis.py): the study's diagnosis rules on the levels verify's own scenarios
measured, in verify.json and in verify's summary. The levels are the recorded study's (tests/data/cpu-tiny-study,
trial e57a166985b8: concurrency 2 and 8 met the SLO, 32 broke TTFT P95), measured as verify measures a scenario
(trial/measure.py ``measure_level``), changed where a test needs a symptom."""

from __future__ import annotations

import contextlib

from servetune.cli.verify import summary_lines
from servetune.report.diagnosis import limited_by
from servetune.results import LevelResult, TrialResult
from servetune.verify import run as verification
from servetune.verify import scenarios
from servetune.verify.choose import select
from servetune.verify.diagnosis import DIAGNOSED, diagnosis, run_line, scenario_line
from servetune.verify.document import Timeouts, document
from servetune.verify.scenarios import Budget
from tests.builders import copy_recorded_study
from tests.unit.test_diagnosis import climbing, with_engine_args

NOT_RUN = "not diagnosed: the scenario measured no level (it did not run, or stopped before its end)"


def changed(level: LevelResult, **server: float) -> LevelResult:
    level = level.model_copy(deep=True)
    level.server_metrics.update(server)
    return level


def measured(trial: TrialResult, **names: int) -> dict[str, LevelResult]:
    """verify's levels, by scenario: each a recorded level of ``trial``, by its index."""
    return {name: trial.levels[index].model_copy(deep=True) for name, index in names.items()}


def test_the_run_is_judged_on_its_own_soak_and_peak_not_on_the_study():
    """The study found prefill queueing; this verification's peak was preempted: verify says so, and keeps the
    study's line apart."""
    trial = climbing()
    levels = measured(trial, soak=0, peak=2)
    levels["peak"] = changed(levels["peak"], preemptions=6.0, kv_cache_usage_max=0.97)
    line, lines = diagnosis(trial, levels)
    assert (
        line
        == lines["peak"]
        == (
            "KV-bound at concurrency 32: 6 preemptions, KV cache peak 97% → more KV cache: raise gpu_memory_utilization, "
            "kv_cache_dtype fp8, a smaller max_model_len; or fewer max_num_seqs"
        )
    )
    assert limited_by(trial).startswith("prefill queueing")  # the study's
    assert lines["soak"] == "no limit found in what was recorded at concurrency 2"
    assert lines["burst"] == lines["mix"] == NOT_RUN


def test_trends_read_from_the_soak_to_the_peak():
    """Mean TTFT grew 4.2x from the soak's load to the peak's while TPOT grew 1.3x, and the peak broke TTFT: prefill
    queueing, in the peak's line and the run's; the soak alone has no trend to read."""
    trial = climbing()
    levels = measured(trial, soak=0, peak=2)
    assert run_line(trial, levels).startswith(
        "prefill queueing: TTFT mean grew 4.2x from concurrency 2 to concurrency 32"
    )
    assert scenario_line(trial, "peak", levels) == run_line(trial, levels)
    alone = {"peak": levels["peak"]}  # no soak beneath it: a broken SLO with nothing to compare, said with its bound
    assert scenario_line(trial, "peak", alone) == (
        "SLO broken at concurrency 32 (ttft_ms_p95 = 160 > 150), no rule matched what was recorded there"
    )
    assert run_line(trial, alone) == scenario_line(trial, "peak", alone)  # nor for the run: verify runs no lower load
    assert limited_by(trial.model_copy(update={"levels": [levels["peak"]]})).startswith(
        "SLO broken at the lowest load measured (concurrency 32)"  # a study's ladder could add one
    )


def test_the_run_is_judged_where_the_soak_already_broke_the_slo():
    trial = with_engine_args(climbing(), max_num_seqs=8)
    levels = measured(trial, soak=1, peak=2)
    levels["soak"].slo_violations = ["ttft_ms_p95 = 160 > 150"]
    assert run_line(trial, levels).startswith("decode-bound at concurrency 8: 8 running = max_num_seqs 8")


def test_each_steady_scenario_is_diagnosed_on_its_own_level():
    trial = with_engine_args(climbing(), max_num_seqs=32, max_num_batched_tokens=256)
    levels = measured(trial, soak=1, peak=2, burst=2, mix=1)
    levels["burst"] = changed(levels["burst"], requests_waiting_max=12.0)
    levels["mix"] = levels["mix"].model_copy(update={"server_metrics": {}})  # /metrics not read
    lines = diagnosis(trial, levels)[1]
    assert list(lines) == list(DIAGNOSED)
    assert lines["burst"].startswith("requests waiting at concurrency 32 (up to 12) while 7 of 32 ran")
    assert lines["burst"].endswith("raise max_num_batched_tokens (now 256)")
    assert lines["mix"].startswith("not diagnosed: at concurrency 8 nothing was read of the engine")
    assert lines["soak"] == "no limit found in what was recorded at concurrency 8"


def test_what_did_not_run_or_complete_is_not_diagnosed_and_says_why():
    trial = climbing()
    assert diagnosis(trial, {}) == (
        "not diagnosed: neither the soak nor the peak ran",
        dict.fromkeys(DIAGNOSED, NOT_RUN),
    )
    died = measured(trial, soak=0)
    died["soak"].summary.completed = 0
    assert run_line(trial, died) == "not diagnosed: no request completed in soak"
    assert scenario_line(trial, "soak", died) == "not diagnosed: no request completed"


class Server:
    """The engine verify started: alive, its API server's CPU readable."""

    url = "http://127.0.0.1:1"
    startup_s = 1.0
    process = None
    cpu_binding = cpu_unclaimed = None

    def alive(self):
        return True

    def frontend_cpu(self):
        return None


class Said:
    def step(self, text, seconds=None):
        pass

    def scenario(self, name, passed, reason):
        pass


def test_a_scenarios_level_reaches_verify_json_with_what_limited_it(tmp_path, monkeypatch):
    """The burst's level, measured with the API server's CPU read (``frontend_cpu``), is kept on the engine's run and
    diagnosed in verify.json; the run's line says the soak and the peak did not run, beside the study's line."""
    selection = select(copy_recorded_study(tmp_path / "study"), "best")
    server = Server()
    recorded = climbing().levels[2].model_copy(update={"frontend_cpu_share": 0.97})
    asked = []

    async def measure_level(client, url, workload, prompts, plan, *, stream, frontend_cpu=None, **_):
        asked.append(frontend_cpu)
        return recorded, []

    @contextlib.contextmanager
    def started(*args, **kwargs):
        yield server

    monkeypatch.setattr(scenarios, "measure_level", measure_level)
    monkeypatch.setattr(verification, "started", started)
    monkeypatch.setattr(verification, "served_len", lambda server, chosen: 1024)
    budget = Budget.for_device("cpu", 6.0)
    run, result, _ = verification.with_engine(selection.winner, tmp_path / "verify" / "engine.log", Timeouts(1, 1, 1),
                                              None, budget, Said(), scenarios.burst)  # type: ignore[arg-type]  # fmt: skip
    assert asked == [server.frontend_cpu] and run.levels == {"burst": recorded}
    assert result is not None and result.numbers["frontend_cpu_share"] == 0.97
    doc = document(selection, budget, Timeouts(1, 1, 1), run, {"burst": result}, [])
    burst = doc["scenarios"]["burst"]["limited_by"]
    assert burst.startswith("front end CPU-bound at concurrency 32: the API server used 97% of a core")
    assert doc["limited_by"] == "not diagnosed: neither the soak nor the peak ran"
    assert doc["limited_by_in_study"] == limited_by(selection.winner.result)
    assert summary_lines(doc) == [
        "in this verification, what limited it (soak and peak): not diagnosed: neither the soak nor the peak ran",
        f"  burst: {burst}",
    ]


def test_the_summary_says_the_runs_line_and_only_the_scenarios_that_differ():
    trial = climbing()
    line, lines = diagnosis(trial, measured(trial, soak=0, peak=2))
    doc = {
        "limited_by": line,
        "scenarios": {name: {"limited_by": said} for name, said in lines.items() if name != "mix"},
    }
    assert summary_lines(doc) == [
        f"in this verification, what limited it (soak and peak): {line}",
        "  soak: no limit found in what was recorded at concurrency 2",
        f"  burst: {NOT_RUN}",
    ]
    assert summary_lines({"scenarios": {}}) == []  # a verify.json from before the field
