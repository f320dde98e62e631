"""The rolling-update scenario's arithmetic over request records (verify/rolling_update.py ``judge_rolling_update``),
its refusal and the configuration it moves to (a runner-up passed over where its replicas could not be placed during
the rollout), the stability rate it stays out of, and the scenario driven against a stand-in deployment whose rollout
makes some requests fail and slow until it is done (the real rollout through Serve, to a runner-up of other engine
arguments: tests/integration/test_rolling_update_serve.py; on vLLM, by hand: docs/concepts/verify.md)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from pytest import approx

from servetune.config.slo import Slo
from servetune.serve.trial import trial_llm_config
from servetune.verify.document import EngineRun, stability
from servetune.verify.rolling_update import (
    SAME_CONFIGURATION,
    ReplicaChange,
    judge_rolling_update,
    new_configuration,
    placement_problem,
    refusal,
    replica_changes,
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


def test_the_stall_is_told_against_each_replica_serve_replaced_and_whether_the_ingress_was_among_them():
    """An update at 3 s whose rollout replaced the ingress replica (stopped at 3.75 s, its successor up at 5.5 s):
    the request sent at 4 s waited at the proxy until 6 s. Told against each change, and as the ingress replaced."""
    records = [*steady(0, 3), *steady(3, 3.7, first=100), served(900, 4.0, ttft_s=2.0), *steady(6, 12, first=200)]
    changes = [ReplicaChange("LLMServer:m", "l1", True, "stopped", 3.5), ReplicaChange("OpenAiIngress", "i1", False,
               "stopped", 3.75), ReplicaChange("LLMServer:m", "l2", True, "started", 4.5),
               ReplicaChange("OpenAiIngress", "i2", False, "started", 5.5)]  # fmt: skip
    result = judge_rolling_update(records, 3.0, 8.0, SLO, 1.0, changes=changes)
    n = result.numbers
    assert n["ttft_ms_max_during"] == 2000.0 and n["ingress_replaced"] is True
    assert n["worst_sent_after_update_s"] == 1.0 and n["worst_answered_after_update_s"] == 3.0
    table = [(c["replica"], c["what"], c["after_update_s"], c["worst_sent_after_s"]) for c in n["replica_changes"]]
    assert table == [("l1", "stopped", 0.5, 0.5), ("i1", "stopped", 0.75, 0.25), ("l2", "started", 1.5, -0.5),
                     ("i2", "started", 2.5, -1.5)]  # fmt: skip
    assert "the worst sent 1 s after the update call, 0.25 s after ingress replica i1 stopped" in result.reason
    assert "answered 0.5 s after ingress replica i2 started" in result.reason
    assert "LLM replicas 1 stopped, 1 started, the ingress replaced" in result.reason
    # the ingress kept: said so; the changes not read: no word on replicas, the worst's times still told
    kept = judge_rolling_update(records, 3.0, 8.0, SLO, 1.0, changes=[c for c in changes if c.engine])
    assert kept.numbers["ingress_replaced"] is False and "started, the ingress kept" in kept.reason
    unread = judge_rolling_update(records, 3.0, 8.0, SLO, 1.0)
    assert unread.numbers["replica_changes"] is None and unread.numbers["ingress_replaced"] is None
    assert unread.numbers["worst_sent_after_update_s"] == 1.0 and "ingress" not in unread.reason


def test_replica_changes_are_the_starts_and_ends_within_the_window_on_the_levels_clock():
    wall = 1_000_000.0  # the level's start on the wall clock
    lives = [
        {"deployment": "OpenAiIngress", "replica": "i1", "engine": False, "started_s": wall - 30, "ended_s": None},
        {"deployment": "LLMServer:m", "replica": "a", "engine": True, "started_s": wall - 30, "ended_s": wall + 4},
        {"deployment": "LLMServer:m", "replica": "b", "engine": True, "started_s": wall + 3.5, "ended_s": None},
        {"deployment": "LLMServer:m", "replica": "c", "engine": True, "started_s": wall + 20, "ended_s": None},
    ]
    changes = replica_changes(lives, wall, since_s=3.0, until_s=12.0)
    assert [(c.replica, c.what, c.at_s, c.engine) for c in changes] == [("b", "started", 3.5, True),
                                                                         ("a", "stopped", 4.0, True)]  # fmt: skip


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
        self.updated_wall: float | None = None
        self.specs: list[object] = []
        self.asked: list[float] = []  # when the replicas were asked what they run

    def update(self, spec=None) -> list[str]:
        self.updated, self.updated_wall = time.monotonic(), time.time()
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

    def replica_lifetimes(self) -> list[dict]:
        """On the wall clock: the new replica started just after the update, the old one gone ``roll_s`` after it; the ingress
        and the old replica started long before the level."""
        assert self.updated_wall is not None
        long_ago = self.updated_wall - 600
        return [
            {"deployment": "OpenAiIngress", "replica": "i", "engine": False, "started_s": long_ago, "ended_s": None},
            {"deployment": "LLMServer:m", "replica": "old", "engine": True, "started_s": long_ago,
             "ended_s": self.updated_wall + self.roll_s},
            {"deployment": "LLMServer:m", "replica": "new", "engine": True, "started_s": self.updated_wall + 0.01,
             "ended_s": None},
        ]  # fmt: skip


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
    # the replicas' lifetimes (the wall clock) on the level's clock: only what changed from the update call on, the
    # new replica's start before the old one's end, by the stand-in's roll time; the worst request told against each
    changes = n["replica_changes"]
    assert [(c["replica"], c["what"]) for c in changes] == [("new", "started"), ("old", "stopped")]
    assert changes[1]["after_update_s"] - changes[0]["after_update_s"] == approx(deployment.roll_s - 0.01, abs=1e-3)
    assert n["ingress_replaced"] is False and all(
        c["worst_sent_after_s"] == approx(n["worst_sent_after_update_s"] - c["after_update_s"]) for c in changes
    )


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
    assert "ingress" not in item.evidence  # the replicas Serve changed not read: no word on the ingress
    replaced = [ReplicaChange("OpenAiIngress", "i1", False, "stopped", 4.0)]
    with_update["scenarios"]["rolling_update"] = judge_rolling_update(clean, 3.0, 8.0, SLO, 1.0,
                                                                      changes=replaced).as_dict()  # fmt: skip
    item = one(study, result, "15.23", with_update)
    assert "rolled out in 5 s (Serve replaced the ingress replica too)" in item.evidence
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
