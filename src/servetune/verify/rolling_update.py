"""The rolling-update scenario (opt-in, ``servetune verify --scenario rolling_update``): a Serve deployment moved to
a new configuration under load, and what its clients saw while Serve rolled its replicas over.

The load runs at the verified level; half the scenario's time in, the application is deployed again under its own
name and route through Serve's update path (``serve.run`` of the new application, :class:`Rollout` ``update``):
with the runner-up's configuration where verify has a runner-up measured through Serve on the same model that fits
in what the winner's deployment holds, else the same configuration as a new version (Serve gives every unpinned deployment a new version, so it replaces every
replica all the same). Serve's status is read twice a second; the rollout is done when the application is
RUNNING, every deployment HEALTHY, and none of the replicas from before the update is alive. The load goes on the
scenario's time after that (the new replicas measured serving), at most the trial's start-up timeout and that
after the update.

:func:`judge_rolling_update` is a pure function of the requests' records and those times (the level's clock):

- **during the change**: the requests in flight at some point from the update call until the rollout was done
  (sent before it ended, ended after the call), the ones that failed, and their error rate; the TTFT of those sent
  during it that succeeded: the worst and the P99;
- **the time it took**: ``update_s``, from the update call until the rollout was done (None: not within the run);
- **after**: the requests sent after it, their error rate and TTFT P99, and the same in windows of ``window_s``
  (verify/under_load.py).

Passes when the rollout was done within the run, the failed share of the requests during it is within the SLO's
error-rate bound (``error_rate``, else 0.1%), their TTFT P99 within the SLO's TTFT bound (P99, else the highest
bound), and the load after it held both. It gives checklist item 15.23 its rollback half: a rollback is the same
update path back to the configuration before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from servetune.config.slo import Slo
from servetune.metrics import RequestRecord
from servetune.serve.trial import trial_llm_config, trial_needs
from servetune.trial.runner import TrialSpec
from servetune.verify.scenarios import ScenarioResult, Target, error_bound, fmt
from servetune.verify.under_load import after_windows, around_event, done_at, error_kinds, p99_ms, ttft_bound_s

NAME = ROLLING_UPDATE = "rolling_update"
STREAM = 32_000  # its arrivals' seed (replica_lost's is 31_000)
SAME_CONFIGURATION = "the same configuration as a new version"


class Rollout(Protocol):
    """A deployment that can be moved to a new configuration under load (``serve.trial.ServeEngine``)."""

    def update(self, llm_config: Mapping[str, Any] | None = None) -> list[str]:
        """Deploy ``llm_config`` (None: the same configuration, a new version) without waiting; the replicas before."""
        ...

    def rolled_out(self, old: list[str]) -> bool:
        """Whether the rollout is done: every replica runs the new version, none of ``old`` is alive."""
        ...


def refusal(replicas: int | None) -> str | None:
    """Why the scenario cannot run on a trial of ``replicas`` through Serve (None: not through Serve), or None."""
    if replicas is None:
        return "rolling_update needs a trial measured through Ray Serve (serve.num_replicas); this one ran bare"
    return None


def new_configuration(winner: TrialSpec, runner_up: TrialSpec | None) -> tuple[dict[str, Any] | None, str]:
    """What the deployment is moved to: the runner-up's ``LLMConfig`` (its engine arguments and replica count) where
    it was measured through Serve on the same model and takes no more of the cluster than the winner's (what a local
    Ray is started with: more would leave its new replicas pending), else None (the same configuration, a new
    version); and the change in words."""
    if runner_up is None or runner_up.serve_replicas is None or runner_up.model != winner.model:
        return None, SAME_CONFIGURATION
    room, wanted = trial_needs(winner).resources(), trial_needs(runner_up).resources()
    if any(amount > room.get(resource, 0.0) for resource, amount in wanted.items()):
        return None, f"{SAME_CONFIGURATION} (the runner-up, trial {runner_up.trial_id}, needs more of the cluster)"
    return trial_llm_config(runner_up), f"to the runner-up's configuration (trial {runner_up.trial_id})"


def judge_rolling_update(records: Sequence[RequestRecord], updated_at: float, done_at_s: float | None, slo: Slo,
                         window_s: float, change: str = SAME_CONFIGURATION) -> ScenarioResult:  # fmt: skip
    """The verdict on a run whose deployment was updated at ``updated_at`` (the level's clock), the rollout done at
    ``done_at_s`` (None: not within the run); see the module docstring."""
    sent = list(records)
    records = [r for r in sent if not r.warmup]
    ttft_s, errors_max = ttft_bound_s(slo), error_bound(slo)
    bound_ms = None if ttft_s is None else ttft_s * 1000.0
    until = done_at_s if done_at_s is not None else max((done_at(r) for r in records), default=updated_at)
    during = [r for r in records if r.sent < until and done_at(r) >= updated_at]  # in flight during the change
    failed = [r for r in during if not r.ok]
    rate = len(failed) / len(during) if during else None
    ttfts = [r.ttft_s for r in during if r.ok and r.ttft_s is not None and r.sent >= updated_at]
    worst = max(ttfts) * 1000.0 if ttfts else None
    during_p99 = p99_ms(ttfts)
    after = [r for r in records if done_at_s is not None and r.sent >= done_at_s]
    after_failed = sum(not r.ok for r in after)
    after_p99 = p99_ms([r.ttft_s for r in after if r.ok and r.ttft_s is not None])
    after_rate = after_failed / len(after) if after else None
    held_after = (after_rate is not None and after_rate <= errors_max
                  and (bound_ms is None or (after_p99 is not None and after_p99 <= bound_ms)))  # fmt: skip
    windows = after_windows(records, done_at_s, window_s, ttft_s, errors_max) if done_at_s is not None else []
    numbers: dict[str, Any] = {
        "change": change, "updated_at_s": updated_at, "rolled_out": done_at_s is not None,
        "update_s": None if done_at_s is None else done_at_s - updated_at,
        # every request sent and its 5xx (warm-up too): the update's, left out of verify's stability 5xx rate
        "requests": len(sent), "http_5xx": sum(r.error_kind == "http_5xx" for r in sent),
        "requests_during": len(during), "failed": len(failed), "errors_by_kind": error_kinds(failed),
        "error_rate_during": rate, "ttft_ms_max_during": worst, "ttft_ms_p99_during": during_p99,
        "requests_after": len(after), "failed_after": after_failed, "ttft_ms_p99_after": after_p99,
        "held_after": held_after, "ttft_bound_ms": bound_ms, "error_rate_bound": errors_max,
        "window_s": window_s, "windows": [w.as_dict() for w in windows],
    }  # fmt: skip
    took = f"rolled out in {fmt(numbers['update_s'], ' s')}" if done_at_s is not None else "not rolled out"
    head = (f"updated {change} under load: {took}; {len(failed)} of {len(during)} requests failed during it, TTFT "
            f"worst {fmt(worst, ' ms')}, P99 {fmt(during_p99, ' ms')}"
            + (f" (bound {fmt(bound_ms, ' ms')})" if bound_ms is not None else ""))  # fmt: skip
    problems = []
    if done_at_s is None:
        problems.append("Serve did not finish the rollout within the run")
    if rate is not None and rate > errors_max:
        problems.append(f"{rate:.2%} of the requests during the change failed (bound {errors_max:.2%})")
    if not during:
        problems.append("no request was in flight during the change")
    if bound_ms is not None and during_p99 is not None and during_p99 > bound_ms:
        problems.append(f"TTFT P99 during the change {fmt(during_p99, ' ms')} broke the bound")
    if done_at_s is not None and not held_after:
        problems.append(
            "no request was sent after the rollout" if not after else
            f"after the rollout the SLO did not hold ({after_failed} of {len(after)} failed, TTFT P99 "
            f"{fmt(after_p99, ' ms')})"
        )  # fmt: skip
    if problems:
        return ScenarioResult(NAME, False, head + "; " + "; ".join(problems), numbers)
    tail = f"; after it {len(after)} requests, TTFT P99 {fmt(after_p99, ' ms')}, {after_failed} failed"
    return ScenarioResult(NAME, True, head + tail, numbers)


async def rolling_update(t: Target, new_config: Mapping[str, Any] | None = None, change: str = SAME_CONFIGURATION,
                         update_timeout_s: float | None = None) -> ScenarioResult:  # fmt: skip
    """Run the load, update the deployment ``scenario_s / 2`` in, follow Serve's rollout, and judge. The load goes
    on until the rollout is done and ``scenario_s`` more, at most ``update_timeout_s`` (the trial's start-up
    timeout; default the scenario's time) and that after the update."""
    deployment = t.engine
    if not (hasattr(deployment, "update") and hasattr(deployment, "rolled_out")):
        return ScenarioResult(NAME, False, "not run: the engine is not a Serve deployment")
    run = await around_event(t, NAME, STREAM, lambda: deployment.update(new_config), deployment.rolled_out,  # type: ignore[union-attr]
                             "the new configuration was measured for the scenario's time: stopped", update_timeout_s)  # fmt: skip
    if run.ended_early:
        return ScenarioResult(NAME, False, f"not run: the load ended before the update ({len(run.records)} requests)")
    if run.error is not None or run.called_at is None:
        return ScenarioResult(NAME, False, f"not run: Serve did not take the update ({run.error})")
    verdict = judge_rolling_update(run.records, run.called_at, run.settled_at, t.slo,
                                   max(t.budget.scenario_s / 10, 1.0), change)  # fmt: skip
    verdict.numbers["level"] = run.level
    return verdict
