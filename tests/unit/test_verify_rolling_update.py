"""The rolling-update scenario's arithmetic over request records (verify/rolling_update.py ``judge_rolling_update``),
its refusal and the configuration it moves to (a runner-up passed over where its replicas could not be placed during
the rollout), the stability rate it stays out of, and the scenario driven against a stand-in deployment whose rollout
makes some requests fail and slow until it is done (the real rollout through Serve, to a runner-up of other engine
arguments: tests/integration/test_rolling_update_serve.py; on vLLM, by hand: docs/concepts/verify.md)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from servetune.config.slo import Slo
from servetune.serve.trial import trial_llm_config
from servetune.verify.document import EngineRun, stability
from servetune.verify.rolling_update import (
    SAME_CONFIGURATION,
    judge_rolling_update,
    new_configuration,
    placement_problem,
    refusal,
    rolling_update,
)
from tests.builders import copy_recorded_study, lost, served, stand_in_load, steady

SLO = Slo.parse("ttft_ms.p99=500")


def test_a_clean_rollout_passes_with_its_time_worst_ttft_and_p99_from_the_records():
    # 12 s of load, the update at 3 s, done at 8 s; slower (300 ms TTFT, one at 450 ms) while replicas roll over
    records = [*steady(0, 3), *steady(3, 8, ttft_s=0.3, first=100), served(999, 5.05, 0.45), *steady(8, 12, first=200)]
    result = judge_rolling_update(records, updated_at=3.0, done_at_s=8.0, slo=SLO, window_s=1.0)
    n = result.numbers
    assert result.passed, result.reason
    assert n["rolled_out"] and n["update_s"] == 5.0 and n["failed"] == 0
    # in flight during the change: every request sent from 2.7 s (ends 0.3 s after its TTFT) until 8 s
    assert n["requests_during"] == sum(1 for r in records if r.sent < 8.0 and r.end >= 3.0)
    assert abs(n["ttft_ms_max_during"] - 450) < 1e-6 and 300 <= n["ttft_ms_p99_during"] <= 450
    assert n["requests_after"] == 40 and n["held_after"] and abs(n["ttft_ms_p99_after"] - 100) < 1e-6
    assert n["change"] == SAME_CONFIGURATION and "rolled out in 5" in result.reason
    assert [w["start_s"] for w in n["windows"]] == [0.0, 1.0, 2.0, 3.0] and all(w["good"] for w in n["windows"])
    assert n["replicas_after"] is None and n["replicas_on_new"] is None  # not read: no word on them
    # the replicas after it, as they say what they run: all on the new configuration, or one still on the old
    kept = judge_rolling_update(records, 3.0, 8.0, SLO, 1.0, replicas=(2, 2))
    assert kept.passed and (kept.numbers["replicas_after"], kept.numbers["replicas_on_new"]) == (2, 2)
    stale = judge_rolling_update(records, 3.0, 8.0, SLO, 1.0, replicas=(2, 1))
    assert not stale.passed and "1 of the 2 replicas after it run another configuration" in stale.reason


def test_failures_slow_ttft_no_rollout_or_a_bad_after_each_fail_it():
    base = [*steady(0, 3), *steady(3, 8, first=100), *steady(8, 12, first=200)]
    dropped = [*base, lost(500, 4.0), lost(501, 2.9, after_s=0.5)]  # one sent during, one in flight at the call
    result = judge_rolling_update(dropped, 3.0, 8.0, SLO, 1.0)
    assert not result.passed and result.numbers["failed"] == 2 and "failed (bound 0.10%)" in result.reason
    assert result.numbers["errors_by_kind"] == {"http_5xx": 2}
    slow = [*steady(0, 3), *steady(3, 8, ttft_s=0.8, first=100), *steady(8, 12, first=200)]
    result = judge_rolling_update(slow, 3.0, 8.0, SLO, 1.0)
    assert not result.passed and "TTFT P99 during the change" in result.reason
    stuck = judge_rolling_update(base, 3.0, None, SLO, 1.0)
    assert not stuck.passed and not stuck.numbers["rolled_out"] and stuck.numbers["update_s"] is None
    assert "did not finish the rollout" in stuck.reason and stuck.numbers["requests_after"] == 0
    cold = [*steady(0, 3), *steady(3, 8, first=100), *steady(8, 12, ttft_s=0.9, first=200)]
    result = judge_rolling_update(cold, 3.0, 8.0, SLO, 1.0)
    assert not result.passed and not result.numbers["held_after"] and "after the rollout" in result.reason
    ended = judge_rolling_update(steady(0, 8), 3.0, 8.0, SLO, 1.0)
    assert not ended.passed and "no request was sent after the rollout" in ended.reason


def test_refusal_and_the_configuration_it_moves_to(tmp_path):
    from servetune.trial.context import StudyContext, resolve_levels
    from tests.unit.test_serve_trials import space

    assert refusal(None) is not None and "ran bare" in refusal(None)  # type: ignore[operator]
    assert refusal(1) is None and refusal(3) is None
    s = space(tmp_path, "params:\n  serve.num_replicas: [1, 2]\n  max_num_seqs: [4, 8]\n")
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(s, workload, tmp_path, "/models/tiny", resolve_levels(s, workload))
    winner = context.spec_for({"serve.num_replicas": 2, "max_num_seqs": 4})
    runner_up = context.spec_for({"serve.num_replicas": 1, "max_num_seqs": 8})
    assert new_configuration(winner, None) == (None, SAME_CONFIGURATION)
    assert new_configuration(winner, replace(runner_up, serve_replicas=None)) == (None, SAME_CONFIGURATION)
    assert new_configuration(winner, replace(runner_up, model="/models/other")) == (None, SAME_CONFIGURATION)
    moved, change = new_configuration(winner, runner_up)
    assert moved is runner_up and f"trial {runner_up.trial_id}" in change
    config = trial_llm_config(moved)  # its LLMConfig is built when the update is made (serve/trial.py update)
    assert config["engine_kwargs"]["max_num_seqs"] == 8
    assert config["deployment_config"]["autoscaling_config"]["min_replicas"] == 1
    # a runner-up of more replicas than the winner's (Serve would start the extra ones beside the old ones)
    moved, change = new_configuration(runner_up, winner)
    assert moved is None and change.startswith(SAME_CONFIGURATION)
    assert f"(the runner-up, trial {winner.trial_id}, runs 2 replicas, the verified deployment 1:" in change


def test_a_runner_up_whose_replicas_could_not_take_the_winners_places_during_the_rollout_is_passed_over(tmp_path):
    """Serve (max_surge_percent 0) stops old replicas before starting as many new ones, but starts the ones a larger
    count adds beside the old: the room is what the winner's deployment holds (a local Ray is started with that)."""
    from servetune.trial.context import StudyContext, resolve_levels
    from tests.unit.test_serve_trials import space

    s = space(tmp_path, "params:\n  serve.num_replicas: [1, 2]\n  max_num_seqs: [4, 8]\n")
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(s, workload, tmp_path, "/models/tiny", resolve_levels(s, workload))
    one = context.spec_for({"serve.num_replicas": 1, "max_num_seqs": 4})
    two = context.spec_for({"serve.num_replicas": 2, "max_num_seqs": 8})

    def tp(spec, size, **changes):
        return replace(spec, engine_args={**spec.engine_args, "tensor_parallel_size": size}, **changes)

    # more replicas though fewer CPUs in all (1 x TP 4: 6 Ray CPUs; 2 x TP 1: 5): the extra one waits beside the old
    moved, change = new_configuration(tp(one, 4), two)
    assert moved is None and "runs 2 replicas, the verified deployment 1" in change
    assert placement_problem(tp(one, 4), two) is not None and placement_problem(two, tp(one, 2)) is None
    # as many replicas, each bigger: 7 Ray CPUs where the winner's deployment holds 5
    moved, change = new_configuration(two, tp(two, 2))
    assert moved is None and "needs 7 CPUs in all, the verified deployment holds 5" in change
    # fewer replicas, each bigger, in as many GPUs: Serve scales down first, then replaces: taken
    gpu_one, gpu_two = replace(tp(one, 2), device="gpu"), replace(two, device="gpu")
    assert new_configuration(gpu_two, gpu_one)[0] is gpu_one
    assert "needs 4 GPUs in all, the verified deployment holds 2" in new_configuration(gpu_two, tp(gpu_two, 2))[1]
    # pinned to another GPU type (its replicas would wait for nodes of that type); not pinned: anywhere
    on_h100 = replace(gpu_two, gpu_type="H100")
    moved, change = new_configuration(on_h100, replace(gpu_one, gpu_type="A100"))
    assert moved is None and "runs on A100 GPUs, the verified deployment on H100" in change
    assert (
        "the verified deployment on GPUs of any type"
        in new_configuration(gpu_two, replace(gpu_one, gpu_type="A100"))[1]
    )
    assert new_configuration(on_h100, replace(gpu_one, gpu_type="H100"))[0] is not None
    assert new_configuration(on_h100, gpu_one)[0] is gpu_one


def test_the_rollouts_5xx_stay_out_of_the_stability_rate(tmp_path):
    mine = [*steady(0, 3), lost(50, 3.5), *steady(3.6, 12, first=100)]
    elsewhere = steady(20, 30, first=1000)
    result = judge_rolling_update(mine, 3.0, 8.0, SLO, 1.0)
    assert result.numbers["requests"] == len(mine) and result.numbers["http_5xx"] == 1
    measured = stability({"rolling_update": result}, [*mine, *elsewhere], EngineRun("t", tmp_path / "engine.log"))
    assert measured["error_rate_5xx"] == 0.0


class Deployment:
    """Replicas that roll over ``roll_s`` after an update; while they do, every fifth request fails."""

    def __init__(self, roll_s: float) -> None:
        self.roll_s = roll_s
        self.updated: float | None = None
        self.specs: list[object] = []
        self.asked: list[float] = []  # when the replicas were asked what they run

    def update(self, spec=None) -> list[str]:
        self.updated = time.monotonic()
        self.specs.append(spec)
        return ["old-replica"]

    def replicas_on_deployed(self) -> tuple[int, int]:
        self.asked.append(time.monotonic())
        return 2, 2

    def rolling(self) -> bool:
        return self.updated is not None and time.monotonic() - self.updated < self.roll_s

    def rolled_out(self, old: list[str]) -> bool:
        assert old == ["old-replica"]
        return self.updated is not None and not self.rolling()


def test_the_scenario_updates_half_way_follows_the_rollout_and_judges(monkeypatch):
    """The scenario's own timing (update, polling, the level's clock) against a stand-in deployment and load."""
    from servetune.verify.scenarios import Budget, Target

    deployment = Deployment(roll_s=0.5)

    stand_in_load(
        monkeypatch,
        lambda i, sent: lost(i, sent, 0.04) if deployment.rolling() and i % 5 == 0 else served(i, sent, 0.02),
    )
    budget = replace(Budget.for_device("cpu", 3.0), scenario_s=1.0)  # updated 0.5 s in, then 1 s after the rollout
    target = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=None, budget=budget,
                    max_model_len=0, engine=deployment)  # type: ignore[arg-type]  # fmt: skip
    result = asyncio.run(rolling_update(target, "the runner-up's spec", "to the runner-up's", update_timeout_s=30))
    n = result.numbers
    assert deployment.specs == ["the runner-up's spec"] and n["change"] == "to the runner-up's"
    # the replicas asked once, after the load (not while Serve rolled them over)
    assert len(deployment.asked) == 1 and (n["replicas_after"], n["replicas_on_new"]) == (2, 2)
    assert not result.passed and n["failed"] > 0 and "failed (bound" in result.reason
    assert len(target.records) == n["requests"] and target.errors["rolling_update"]
    # updated half the scenario's time in, on the level's clock: no request failed before it, the rollout took no
    # less than the stand-in's roll time, and the load stopped the scenario's time after it (not at its 30 s cap)
    assert n["updated_at_s"] >= 0 and all(r.ok for r in target.records if r.end < n["updated_at_s"])
    assert any(r.sent < n["updated_at_s"] for r in target.records)
    assert n["update_s"] >= deployment.roll_s - 0.01 and n["held_after"] and n["requests_after"] > 0
    last_sent = max(r.sent for r in target.records)
    assert n["updated_at_s"] + n["update_s"] < last_sent < n["updated_at_s"] + 30


def test_the_scenario_refuses_a_bare_engine_and_says_when_serve_refuses_the_update(monkeypatch):
    from servetune.verify.scenarios import Budget, Target

    budget = replace(Budget.for_device("cpu", 3.0), scenario_s=0.4)
    target = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=None, budget=budget,
                    max_model_len=0, engine=object())  # type: ignore[arg-type]  # fmt: skip
    result = asyncio.run(rolling_update(target))
    assert not result.passed and "not a Serve deployment" in result.reason

    class Refusing(Deployment):
        def update(self, spec=None) -> list[str]:
            raise RuntimeError("DEPLOY_FAILED: bad engine_kwargs")

    stand_in_load(monkeypatch, lambda i, sent: served(i, sent, 0.02))
    target = replace(target, engine=Refusing(0.1), records=[])
    result = asyncio.run(rolling_update(target, update_timeout_s=30))
    assert (
        not result.passed
        and result.reason == "not run: Serve did not take the update (DEPLOY_FAILED: bad engine_kwargs)"
    )
    assert target.records and max(r.sent for r in target.records) < 30  # the load stopped at the refusal, not its cap


def test_checklist_15_23_takes_the_rolling_update_as_its_rollback_half(tmp_path):
    from tests.builders import full_verify, made_trial, make_study, one

    result = made_trial()
    study = make_study(tmp_path / "study", result)
    alone = one(study, result, "15.23", full_verify())
    assert alone.status == "NOT CHECKED" and "rolling update" not in alone.evidence  # not asked for
    clean = [*steady(0, 3), *steady(3, 8, ttft_s=0.3, first=100), *steady(8, 12, first=200)]
    with_update = full_verify()
    with_update["scenarios"]["rolling_update"] = judge_rolling_update(clean, 3.0, 8.0, SLO, 1.0).as_dict()
    item = one(study, result, "15.23", with_update)
    assert item.status == "PASS" and "0 of" in item.evidence and "rolled out in 5 s" in item.evidence
    assert f"trial {result.trial_id} is the hash" in item.evidence  # still linked to its data
    dropped = [*clean, lost(500, 4.0)]
    with_update["scenarios"]["rolling_update"] = judge_rolling_update(dropped, 3.0, 8.0, SLO, 1.0).as_dict()
    item = one(study, result, "15.23", with_update)
    assert item.status == "FAIL" and "1 of" in item.evidence and "failed (bound" in item.evidence
    with_update["scenarios"]["rolling_update"] = judge_rolling_update(clean, 3.0, None, SLO, 1.0).as_dict()
    item = one(study, result, "15.23", with_update)
    assert item.status == "FAIL" and "did not finish the rollout" in item.evidence
    with_update["scenarios"]["rolling_update"] = {"passed": False, "reason": "not run: the engine is not a Serve one"}
    item = one(study, result, "15.23", with_update)
    assert item.status == "NOT CHECKED" and "not run: the engine" in item.evidence


def test_verify_refuses_it_in_one_line_before_starting_anything_on_a_bare_trial(tmp_path, capsys):
    from servetune.cli import main

    study = copy_recorded_study(tmp_path / "study")
    assert main(["verify", str(study), "--scenario", "rolling_update"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--scenario rolling_update: trial e57a166985b8" in err and "ran bare" in err
