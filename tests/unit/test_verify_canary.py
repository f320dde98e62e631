"""The canary scenario's verdict over two shares' request records (verify/canary.py ``judge_canary``) with bootstrap
intervals over the requests, the load split, its refusal, checklist 15.23, and the scenario driven against a
stand-in candidate deployment (the real one through Serve is run by hand: see docs/concepts/verify.md)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import numpy as np

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.verify.canary import MIN_REQUESTS, Deploy, canary, judge_canary, refusal, split
from servetune.verify.stats import bootstrap_percentile, bootstrap_percentile_difference
from tests.builders import copy_recorded_study, edit_result

SLO = Slo.parse("ttft_ms.p99=400,tpot_ms.p99=80")


def request(i: int, ttft_s: float, tpot_s: float, ok: bool = True, tokens: int = 17) -> RequestRecord:
    sent = 0.05 * i
    if not ok:
        return RequestRecord(index=i, sent=sent, input_tokens=16, max_tokens=tokens, end=sent + 0.01,
                             error_kind="http_5xx", error="HTTP 503: busy")  # fmt: skip
    first = sent + ttft_s
    return RequestRecord(index=i, sent=sent, input_tokens=16, max_tokens=tokens, chunk_times=[first],
                         end=first + tpot_s * (tokens - 1), output_tokens=tokens, ok=True)  # fmt: skip


def share(n: int, ttft_ms: float, tpot_ms: float = 40.0, seed: int = 0, failed: int = 0) -> list[RequestRecord]:
    """``n`` requests whose TTFT and TPOT scatter around the given medians (lognormal, as latencies do)."""
    rng = np.random.default_rng(seed)
    ttft = ttft_ms / 1000 * rng.lognormal(0.0, 0.25, n)
    tpot = tpot_ms / 1000 * rng.lognormal(0.0, 0.15, n)
    return [request(i, float(a), float(b), ok=i >= failed) for i, (a, b) in enumerate(zip(ttft, tpot, strict=True))]


def test_a_percentile_interval_over_requests_holds_the_sample_percentile_and_narrows_with_more_requests():
    rng = np.random.default_rng(1)
    few, many = rng.lognormal(5, 0.3, 60), rng.lognormal(5, 0.3, 600)
    a, b = bootstrap_percentile(few, 99), bootstrap_percentile(many, 99)
    assert a is not None and b is not None
    assert a.mean == np.percentile(few, 99) and a.low <= a.mean <= a.high
    assert (b.high - b.low) < (a.high - a.low)
    same = bootstrap_percentile_difference(many, rng.lognormal(5, 0.3, 600), 99)
    assert same is not None and same.low < 0 < same.high  # one distribution: the difference's interval holds 0
    slower = bootstrap_percentile_difference(many * 1.5, many, 99)
    assert slower is not None and slower.low > 0
    assert bootstrap_percentile([3.0], 99) is None


def test_a_candidate_like_the_incumbent_passes_with_each_shares_p50_p99_and_intervals():
    result = judge_canary(share(400, 150, seed=1), share(100, 150, seed=2), SLO, 0.2, "inc", "cand")
    n = result.numbers
    assert result.passed, result.reason
    assert n["judged"] and n["regressed"] == [] and abs(n["candidate_share"] - 100 / 500) < 1e-9
    for who in ("incumbent", "candidate"):
        for metric in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"):
            i = n[who][metric]
            assert i["low"] <= i["mean"] <= i["high"], (who, metric)
        assert n[who]["error_rate"]["mean"] == 0.0
    assert n["incumbent"]["ttft_ms_p50"]["mean"] < n["incumbent"]["ttft_ms_p99"]["mean"]
    d = n["differences"]["ttft_ms_p99"]
    assert d["low"] <= 0  # not worse beyond the interval
    assert "candidate trial cand took 20% of the load" in result.reason and "TTFT P99 difference" in result.reason


def test_a_slower_candidate_past_the_slo_fails_naming_the_metric_and_its_interval():
    result = judge_canary(share(400, 150, seed=1), share(150, 450, seed=2), SLO, 0.14, "inc", "cand")
    n = result.numbers
    assert not result.passed and n["regressed"] == ["ttft_ms_p99"]
    d = n["differences"]["ttft_ms_p99"]
    assert d["low"] > 0 and n["candidate"]["ttft_ms_p99"]["mean"] > 400
    assert "TTFT P99 regressed" in result.reason and "it breaks the SLO (ttft_ms_p99 " in result.reason
    assert f"[{d['low']:.3g}, {d['high']:.3g}]" in result.reason  # the interval is named
    assert "TPOT P99 regressed" not in result.reason


def test_slower_within_the_slo_passes_and_says_so_and_a_metric_without_a_bound_fails_on_the_interval_alone():
    inc, cand = share(400, 100, tpot_ms=30, seed=1), share(150, 200, tpot_ms=30, seed=2)
    within = judge_canary(inc, cand, SLO, 0.14)
    assert within.passed and within.numbers["differences"]["ttft_ms_p99"]["low"] > 0
    assert "slower, within the SLO (ttft_ms_p99)" in within.reason
    unbounded = judge_canary(inc, cand, Slo.parse("tpot_ms.p99=80"), 0.14)
    # a bound at another statistic is judged at that statistic of the candidate's share
    p50 = judge_canary(inc, cand, Slo.parse("ttft_ms.p50=150"), 0.14)
    assert not p50.passed and p50.numbers["slo_broken"]["ttft_ms_p99"][0].startswith("ttft_ms_p50 ")
    assert judge_canary(inc, cand, Slo.parse("ttft_ms.p50=250"), 0.14).passed
    assert not unbounded.passed and unbounded.numbers["regressed"] == ["ttft_ms_p99"]
    assert "the SLO does not bound it" in unbounded.reason


def test_errors_on_the_candidate_beyond_the_bound_fail_it_and_too_few_requests_are_not_judged():
    failing = judge_canary(share(400, 150, seed=1), share(150, 150, seed=2, failed=20), SLO, 0.14)
    assert not failing.passed and "error_rate" in failing.numbers["regressed"]
    assert failing.numbers["candidate"]["failed"] == 20 and failing.numbers["differences"]["error_rate"]["low"] > 0
    few = judge_canary(share(400, 150, seed=1), share(MIN_REQUESTS - 1, 150, seed=2), SLO, 0.02)
    assert not few.passed and few.numbers["judged"] is False
    assert f"candidate {MIN_REQUESTS - 1}" in few.reason and "--canary-share" in few.reason


def test_the_split_keeps_the_levels_load_and_gives_each_share_at_least_one_client():
    mine, theirs = split(Level("rate", 10.0, "poisson", max_concurrency=20), 0.1)
    assert abs(mine.value + theirs.value - 10.0) < 1e-9 and abs(theirs.value - 1.0) < 1e-9
    assert mine.process == theirs.process == "poisson" and theirs.max_concurrency == 2
    mine, theirs = split(Level("concurrency", 8.0), 0.1)
    assert (mine.value, theirs.value) == (7.0, 1.0)
    mine, theirs = split(Level("concurrency", 10.0), 0.3)
    assert (mine.value, theirs.value) == (7.0, 3.0)


def test_it_runs_only_through_serve_and_with_a_candidate():
    assert "ran bare" in (refusal(None, "abc") or "")
    assert "no runner-up" in (refusal(2, None) or "")
    assert refusal(1, "abc") is None


class Candidate:
    """A stand-in candidate deployment: entering deploys it, leaving deletes it."""

    url = "http://candidate"
    server_metrics = None

    def __init__(self) -> None:
        self.entered = self.left = False

    def __enter__(self) -> Candidate:
        self.entered = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.left = True

    def alive(self) -> bool:
        return True

    def failure_reason(self) -> str:
        return ""

    def log_tail(self, lines: int = 40) -> str:
        return ""

    def reset_prefix_cache(self) -> bool:
        return True


def test_the_scenario_splits_the_level_between_the_two_deployments_and_keeps_only_the_incumbents_records(monkeypatch):
    from servetune.verify import canary as module
    from servetune.verify.scenarios import Budget, ScenarioResult, Target

    candidate = Candidate()
    sent_to: dict[str, Level] = {}

    async def fake_level(client, url, workload, prompts, plan, *, stream, slo, watch, reset_cache, metrics, **_):
        sent_to[url] = plan.level
        assert client.base_url == url  # each share's client talks to its own deployment
        slow = 450 if url == candidate.url else 150
        return None, share(max(int(plan.level.value * plan.duration_s), 2), slow, seed=stream)

    monkeypatch.setattr(module, "measure_level", fake_level)
    budget = replace(Budget.for_device("cpu", 20.0), scenario_s=10.0)

    async def main() -> tuple[Target, ScenarioResult]:
        from servetune.load.client import StreamingClient

        async with StreamingClient("http://incumbent", "tiny") as client:
            t = Target(client=client, url="http://incumbent", workload=None, prompts=None, slo=SLO,  # type: ignore[arg-type]
                       level=Level("rate", 50.0), budget=budget, max_model_len=0, measured_rate=50.0)  # fmt: skip
            return t, await canary(t, Deploy("cand", "tiny", lambda incumbent: candidate), 0.2, "inc")

    t, result = asyncio.run(main())
    assert candidate.entered and candidate.left
    assert sent_to["http://incumbent"].value == 40.0 and sent_to[candidate.url].value == 10.0
    assert not result.passed and result.numbers["regressed"] == ["ttft_ms_p99"]
    assert result.numbers["candidate_trial"] == "cand" and result.numbers["incumbent_trial"] == "inc"
    # verify's stability counts the verified point's requests, not the candidate's
    assert len(t.records) == result.numbers["incumbent"]["requests"] != result.numbers["candidate"]["requests"]


def test_a_candidate_that_does_not_start_is_a_failed_unjudged_canary():
    from servetune.verify.scenarios import Budget, Target

    @contextlib.contextmanager
    def broken(incumbent):
        raise RuntimeError("the Serve application servetune-x-cand is DEPLOY_FAILED")
        yield

    t = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=Level("rate", 4.0),  # type: ignore[arg-type]
               budget=Budget.for_device("cpu", 20.0), max_model_len=0)  # fmt: skip
    result = asyncio.run(canary(t, Deploy("cand", "tiny", broken), 0.1))
    assert not result.passed and result.numbers["judged"] is False and "DEPLOY_FAILED" in result.reason


def test_checklist_15_23_takes_the_canarys_verdict_and_the_canary_does_not_reject_the_verified_point(tmp_path):
    from servetune.verify.document import EngineRun, Timeouts, document
    from servetune.verify.scenarios import Budget, ScenarioResult
    from tests.builders import full_verify, made_trial, make_study, one

    result = made_trial()
    study = make_study(tmp_path / "study", result)
    assert one(study, result, "15.23", full_verify()).status == "NOT CHECKED"
    good = judge_canary(share(400, 150, seed=1), share(100, 150, seed=2), SLO, 0.1, "t32", "t16")
    with_canary = full_verify()
    with_canary["scenarios"]["canary"] = good.as_dict()
    item = one(study, result, "15.23", with_canary)
    assert item.status == "PASS" and "candidate trial t16" in item.evidence and "bootstrap" in item.evidence
    bad = judge_canary(share(400, 150, seed=1), share(150, 450, seed=2), SLO, 0.14, "t32", "t16")
    with_canary["scenarios"]["canary"] = bad.as_dict()
    item = one(study, result, "15.23", with_canary)
    assert item.status == "FAIL" and "regressed ttft_ms_p99" in item.evidence and "TTFT P99 regressed" in item.evidence
    few = judge_canary(share(400, 150, seed=1), share(3, 150, seed=2), SLO, 0.01)
    with_canary["scenarios"]["canary"] = few.as_dict()
    assert one(study, result, "15.23", with_canary).status == "NOT CHECKED"

    class Info:
        name = "s"

    class Winner:
        trial_id, point, operating, admission = "t32", type("P", (), {"level": {"rate": 1.0}})(), None, None
        result = made_trial()

    selection = type("S", (), {"winner": Winner, "info": Info})()
    rolled = ScenarioResult("rolling_update", True, "rolled out", {"rolled_out": True})
    scenarios = {"soak": ScenarioResult("soak", True, "ok"), "canary": bad, "rolling_update": rolled}
    doc = document(selection, Budget.for_device("cpu"), Timeouts(1, 1, 1), EngineRun("t32", tmp_path / "e.log"),  # type: ignore[arg-type]
                   scenarios, [])  # fmt: skip
    assert doc["accepted"] and doc["scenarios"]["canary"]["passed"] is False
    assert doc["scenarios"]["rolling_update"]["rolled_out"]  # every opt-in scenario reaches verify.json


def test_verify_refuses_it_in_one_line_before_starting_anything(tmp_path, capsys):
    from servetune.cli import main

    study = copy_recorded_study(tmp_path / "study")
    assert main(["verify", str(study), "--scenario", "canary"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--scenario canary: trial e57a166985b8" in err and "ran bare" in err
    assert main(["verify", str(study), "--scenario", "canary", "--canary-share", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--canary-share must be between 0 and 1" in err
    assert main(["verify", str(study), "--canary-share", "0.2"]) == 2
    assert "--scenario canary, which was not asked for" in capsys.readouterr().err


def test_the_candidate_is_the_runner_up_as_a_serve_application_of_its_own_with_room_on_a_local_ray(tmp_path):
    from servetune.serve.trial import ServeEngine, app_name
    from servetune.verify.choose import select
    from servetune.verify.run import canary_candidate

    study = copy_recorded_study(tmp_path / "study")
    # it broke the SLO only just: made to meet it, so there is a runner-up
    edit_result(study, "8aede7346995", lambda result: result["levels"][0].update(slo_violations=[]))
    selection = select(study, "best")
    runner_up = selection.runner_up
    assert runner_up is not None and runner_up.spec.serve_replicas is None  # it ran bare
    deploy, resources = canary_candidate(runner_up, tmp_path / "verify" / runner_up.trial_id / "canary")
    engine = deploy.open(None)  # built, not entered: nothing is deployed
    assert isinstance(engine, ServeEngine) and engine.spec.serve_replicas == 1
    assert engine.name.startswith("servetune-cpu-tiny-") and engine.name != app_name(selection.winner.spec)
    assert deploy.trial_id == runner_up.trial_id
    assert engine.trial_dir.is_dir()  # its replicas' log has somewhere to go
    assert resources["CPU"] > 1  # its replica and its ingress, declared beside the incumbent's


def test_stopped_while_the_candidate_deploys_it_is_deleted_once_deployed():
    import time

    from servetune.verify.scenarios import Budget, Target

    class Slow(Candidate):
        def __enter__(self) -> Slow:
            time.sleep(0.3)
            return super().__enter__()

    candidate = Slow()
    t = Target(client=None, url="", workload=None, prompts=None, slo=SLO, level=Level("rate", 4.0),  # type: ignore[arg-type]
               budget=Budget.for_device("cpu", 20.0), max_model_len=0)  # fmt: skip

    async def main() -> None:
        task = asyncio.ensure_future(canary(t, Deploy("cand", "tiny", lambda incumbent: candidate), 0.1))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert candidate.entered and candidate.left
