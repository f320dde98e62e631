"""The replica-lost scenario's arithmetic over request records (verify/replica_lost.py ``judge_replica_lost``), its
refusal, the stability rate it stays out of, and the scenario driven against a stand-in deployment whose "replica"
a kill makes fail its requests until it is replaced (the real kill through Serve is run by hand: see the docs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace

from servetune.config.slo import Slo
from servetune.verify.document import EngineRun, stability
from servetune.verify.replica_lost import judge_replica_lost, refusal, replica_lost
from servetune.verify.under_load import after_windows, ttft_bound_s
from tests.builders import copy_recorded_study, edit_result, lost, served, stand_in_load, steady, virtual_time

SLO = Slo.parse("ttft_ms.p99=500")


def test_a_burst_of_failures_then_the_slo_back_is_measured_from_the_records():
    # 10 s of load, the kill at 3 s; requests failing from 3.0 to 4.45 s (every other one: the lost replica's share)
    records = [*steady(0, 3), *steady(3, 4.5, 0.2, first=100), *(lost(200 + i, 3.05 + 0.2 * i) for i in range(8)),
               *steady(4.5, 10, first=300)]  # fmt: skip
    result = judge_replica_lost(records, killed_at=3.0, replaced_at=6.0, replicas=2, slo=SLO, window_s=1.0)
    n = result.numbers
    assert result.passed, result.reason
    assert n["failed"] == 8 and n["errors_by_kind"] == {"http_5xx": 8}
    assert abs(n["error_burst_s"] - 1.4) < 1e-9 and abs(n["error_burst_from_kill_s"] - (3.05 + 1.4 + 0.05 - 3.0)) < 1e-9
    assert n["recovered"] and n["recovery_s"] == 2.0  # windows [0, 1) and [1, 2) after the kill had failures
    assert n["replaced"] and n["replaced_s"] == 3.0
    assert n["survivor_ttft_ms_p99"] is not None and n["survivor_ttft_ms_p99"] <= 500 and n["survivor_requests"] > 0
    assert "8 requests failed over 1.4 s" in result.reason and "back within the SLO 2 s after the kill" in result.reason


def test_no_failure_and_no_late_request_recovers_at_once():
    result = judge_replica_lost(steady(0, 6), killed_at=2.0, replaced_at=4.0, replicas=3, slo=SLO, window_s=1.0)
    assert result.passed and result.numbers["failed"] == 0 and result.numbers["recovery_s"] == 0.0
    assert result.numbers["error_burst_s"] is None and "no request failed" in result.reason


def test_not_replaced_not_recovered_or_slow_survivors_each_fail():
    base = [*steady(0, 3), lost(50, 3.1), *steady(3.2, 8, first=100)]
    missing = judge_replica_lost(base, 3.0, None, 2, SLO, 1.0)
    assert not missing.passed and "did not run 2 replicas again" in missing.reason
    still_failing = [*base, lost(60, 7.5)]
    stuck = judge_replica_lost(still_failing, 3.0, 5.0, 2, SLO, 1.0)
    assert not stuck.passed and "not recovered" in stuck.reason and stuck.numbers["recovery_s"] is None
    slow = [*steady(0, 3), *steady(3, 4, ttft_s=0.9, first=100), lost(50, 3.5), *steady(4, 8, first=200)]
    survivors = judge_replica_lost(slow, 3.0, 5.0, 2, SLO, 1.0)
    assert not survivors.passed and "surviving replicas' TTFT P99" in survivors.reason
    assert survivors.numbers["survivor_ttft_ms_p99"] > 500 and survivors.numbers["recovered"]


def test_new_requests_failing_past_a_health_check_period_fail_it_in_flight_ones_do_not():
    # In flight at the kill (sent before it) and failed: the lost engine's own requests.
    in_flight = [
        *steady(0, 3),
        *(lost(50 + i, 2.5 + 0.1 * i, after_s=0.6) for i in range(4)),
        *steady(3.2, 20, first=100),
    ]
    result = judge_replica_lost(in_flight, 3.0, 15.0, 2, SLO, 1.0)
    assert result.passed, result.reason
    assert result.numbers["failed_in_flight"] == 4 and result.numbers["failed_sent_after_kill"] == 0
    # Serve routes new requests to the dead replica for 12 s (its health check had not found it yet).
    black_hole = [*steady(0, 3), *(lost(50 + i, 3.0 + 0.5 * i) for i in range(25)), *steady(3.2, 30, first=100)]
    result = judge_replica_lost(black_hole, 3.0, 20.0, 2, SLO, 1.0)
    assert not result.passed and result.numbers["routed_to_dead_s"] == 12.0
    assert "Serve kept routing to the lost replica" in result.reason and "health_check_period_s" in result.reason


def test_windows_judge_errors_and_ttft_and_an_empty_window_is_no_evidence():
    records = [served(0, 2.1), lost(1, 2.2), served(2, 3.1, ttft_s=0.8), served(3, 5.5)]  # nothing sent in [4, 5)
    ws = after_windows(records, event_at=2.0, window_s=1.0, ttft_s=0.5, errors_max=0.001)
    assert [(w.start_s, w.requests, w.failed, w.good) for w in ws] == [
        (0.0, 2, 1, False), (1.0, 1, 0, False), (2.0, 0, 0, True), (3.0, 1, 0, True)
    ]  # fmt: skip
    assert ttft_bound_s(Slo.parse("ttft_ms.p50=200,ttft_ms.p99=800")) == 0.8
    assert ttft_bound_s(Slo.parse("tpot_ms.p99=50")) is None


def test_only_a_serve_deployment_of_two_or_more_replicas_runs_it():
    assert "through Ray Serve" in refusal(None)
    assert "serve.num_replicas >= 2; this trial has 1" in refusal(1)
    assert refusal(2) is None


def test_the_failures_it_caused_are_not_the_services_5xx_rate(tmp_path):
    mine = [*steady(0, 3), lost(50, 3.1), lost(51, 3.3), *steady(3.5, 6, first=100)]
    result = judge_replica_lost(mine, 3.0, 4.0, 2, SLO, 1.0)
    assert result.numbers["requests"] == len(mine) and result.numbers["http_5xx"] == 2
    elsewhere = [*steady(10, 12, first=500), lost(600, 12.5)]
    measured = stability({"replica_lost": result}, [*mine, *elsewhere], EngineRun("t", tmp_path / "engine.log"))
    assert measured["requests"] == len(elsewhere) and measured["error_rate_5xx"] == 1 / len(elsewhere)


class Deployment:
    """Two replicas; a kill makes every other request fail until the replacement runs ``down_s`` later on ``clock``."""

    def __init__(self, down_s: float, clock: Callable[[], float]) -> None:
        self.down_s = down_s
        self.clock = clock
        self.killed: float | None = None

    def kill_engine(self) -> tuple[int, str]:
        self.killed = self.clock()
        return 4242, "engine process"

    def down(self) -> bool:
        return self.killed is not None and self.clock() - self.killed < self.down_s

    def running_replicas(self) -> int:
        return 1 if self.down() else 2


def test_the_scenario_kills_a_third_in_follows_the_replica_count_and_judges(monkeypatch):
    """The scenario's own timing (kill, polling, the level's clock) against a stand-in deployment and load, all on a
    virtual clock: on the host's, a kill whose thread returned 30 ms late (a loaded host) left a request that failed
    on the kill ending before the kill's time."""
    from servetune.verify.scenarios import Budget, Target

    loop = virtual_time(monkeypatch)
    deployment = Deployment(down_s=0.5, clock=loop.time)

    stand_in_load(
        monkeypatch,
        lambda i, sent: served(i, sent, 0.02) if not (deployment.down() and i % 2) else lost(i, sent, 0.04),
        clock=loop.time,
    )
    budget = replace(Budget.for_device("cpu", 3.0), scenario_s=1.0)  # killed 0.5 s in, then 1 s after the replacement
    target = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=None, budget=budget,
                    max_model_len=0, engine=deployment)  # type: ignore[arg-type]  # fmt: skip
    with contextlib.closing(loop):
        result = loop.run_until_complete(replica_lost(target, 2, replace_timeout_s=30))
    n = result.numbers
    assert result.passed, result.reason
    assert n["killed"] == "engine process 4242" and n["failed"] > 0 and len(target.records) == n["requests"]
    assert target.errors["replica_lost"] == ["http_5xx: HTTP 500: engine dead"]
    # killed half the scenario's time in, on the level's clock: no request failed before it, the replica count was
    # whole again no sooner than the stand-in's down time after it, and the load stopped the scenario's time after
    # that (not at its 30 s cap)
    assert n["killed_at_s"] >= 0 and all(r.ok for r in target.records if r.end < n["killed_at_s"])
    assert any(r.sent < n["killed_at_s"] for r in target.records)
    assert n["replaced_s"] >= deployment.down_s - 0.01 and n["recovered"]
    last_sent = max(r.sent for r in target.records)
    assert n["killed_at_s"] + n["replaced_s"] < last_sent < n["killed_at_s"] + 30


def test_checklist_15_20_takes_the_replacement_as_its_second_half(tmp_path):
    from tests.builders import full_verify, made_trial, make_study, one

    result = made_trial()
    study = make_study(tmp_path / "study", result)
    alone = one(study, result, "15.20", full_verify())
    assert alone.status == "PASS" and "replica lost" not in alone.evidence  # not asked for: the soak's alone
    fine = judge_replica_lost([*steady(0, 3), lost(50, 3.1), *steady(3.2, 8, first=100)], 3.0, 4.0, 2, SLO, 1.0)
    with_lost = full_verify()
    with_lost["scenarios"]["replica_lost"] = fine.as_dict()
    item = one(study, result, "15.20", with_lost)
    assert (
        item.status == "PASS" and "replica lost: 1 requests failed" in item.evidence and "replaced 1 s" in item.evidence
    )
    # The replacement took traffic cold: past the SLO for two windows after the count was whole.
    cold = [
        *steady(0, 3),
        lost(50, 3.1),
        *steady(3.2, 4),
        *steady(4, 6, ttft_s=0.9, first=100),
        *steady(6, 9, first=200),
    ]
    with_lost["scenarios"]["replica_lost"] = judge_replica_lost(cold, 3.0, 4.0, 2, SLO, 1.0).as_dict()
    item = one(study, result, "15.20", with_lost)
    assert item.status == "FAIL" and "took traffic cold" in item.evidence
    with_lost["scenarios"]["replica_lost"] = judge_replica_lost(cold, 3.0, None, 2, SLO, 1.0).as_dict()
    item = one(study, result, "15.20", with_lost)
    assert item.status == "FAIL" and "did not bring the replica count back" in item.evidence
    # A soak that failed 15.20 stays failed whatever the replacement did.
    soak_cold = full_verify()
    soak_cold["scenarios"]["soak"]["p99_ttft_ms_windows"] = [2400, 1500, 620, 600, 610, 590]
    soak_cold["scenarios"]["replica_lost"] = fine.as_dict()
    assert one(study, result, "15.20", soak_cold).status == "FAIL"
    with_lost["scenarios"]["replica_lost"] = {"passed": False, "reason": "not run: no replica"}
    assert "no replacement (not run?)" in one(study, result, "15.20", with_lost).evidence


def test_verify_refuses_it_in_one_line_before_starting_anything_unless_serve_runs_two_replicas(tmp_path, capsys):
    from servetune.cli import main

    study = copy_recorded_study(tmp_path / "study")
    assert main(["verify", str(study), "--scenario", "replica_lost"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trial e57a166985b8" in err and "this one ran bare" in err
    edit_result(study, "e57a166985b8", lambda result: result["params"].update({"serve.num_replicas": 1}))
    assert main(["verify", str(study), "--scenario", "replica_lost"]) == 2
    assert "serve.num_replicas >= 2; this trial has 1" in capsys.readouterr().err
