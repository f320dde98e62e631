"""Checks under load and of the service around vLLM (section 15: items 6, 11, 14-23).

Most read verify's scenarios (the module docstring of :mod:`servetune.verify.checklist` names
every number); the ones about the deployment in front of vLLM say what to set and where.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from servetune.report.autoscale import bound_ttft_ms, tolerable_wait_s
from servetune.report.autoscale_policy import wait_left
from servetune.report.points import level_label, outline, trial_points
from servetune.report.recommend import KV_USAGE_THIN, margin_signals
from servetune.tracking.fields import engine_setting
from servetune.verify.context import (
    FAIL,
    NOT_CHECKED,
    PASS,
    Context,
    Status,
    amount,
    flag,
    number,
    pct,
    verdict,
)

#: Section 1's SLO example: 5xx below 0.1 %.
ERROR_RATE_5XX_LIMIT = 0.001
#: Dropped streams whose generation must stop for cancellation to count as working (1 in 100 may be
#: a request that finished on its own between the drop and the next scrape).
MIN_CANCELLATION_SUCCESS = 0.99
#: A soak window is steady when its P99 TTFT is at most this times the later windows' median.
STABLE_RATIO = 1.5


def long_short_pools_decided(ctx: Context) -> tuple[Status, str]:
    mix, why = ctx.scenario("mix")
    if mix is None:
        return NOT_CHECKED, f"needs the long/short mix scenario: {why}"
    numbers = (f"{pct(number(mix, 'long_share'))} long requests of {amount(number(mix, 'long_input_tokens'))} tokens "
               f"took short requests' TTFT P99 to {amount(number(mix, 'short_ttft_p99_ms'), ' ms')} "
               f"({amount(number(mix, 'baseline_ttft_p99_ms'), ' ms')} without them), {verdict(mix)}")  # fmt: skip
    passed = flag(mix, "passed")
    if passed is None:
        return NOT_CHECKED, f"the mix scenario gave no verdict: {numbers}"
    if passed:
        return PASS, f"one pool serves both at this level: {numbers}"
    return FAIL, f"long prompts hurt short ones: {numbers}; serve them from separate pools or cap their share"


def chunked_prefill_long_prompts(ctx: Context) -> tuple[Status, str]:
    enabled = engine_setting(ctx.result, "enable_chunked_prefill")
    state = "off" if enabled is False else "on" if enabled else "left to vLLM (on by default)"
    mix, why = ctx.scenario("mix")
    if mix is None:
        return NOT_CHECKED, f"chunked prefill {state}; needs the long/short mix scenario: {why}"
    long_tokens, budget = number(mix, "long_input_tokens"), engine_setting(ctx.result, "max_num_batched_tokens")
    split = ""
    if long_tokens is not None and isinstance(budget, int) and budget > 0:
        chunks = math.ceil(long_tokens / budget)
        split = (f"; each long prompt took {chunks} steps of max_num_batched_tokens {budget}" if chunks > 1
                 else f"; a long prompt fits one step's budget ({budget} tokens)")  # fmt: skip
    text = (f"chunked prefill {state}; long prompts of {amount(long_tokens)} tokens among short ones: short TTFT P99 "
            f"{amount(number(mix, 'short_ttft_p99_ms'), ' ms')} against {amount(number(mix, 'baseline_ttft_p99_ms'), ' ms')}, "
            f"{verdict(mix)}{split}")  # fmt: skip
    passed = flag(mix, "passed")
    if passed is None:
        return NOT_CHECKED, text
    return (PASS, text) if passed else (FAIL, text)


def cancellation_frees_work(ctx: Context) -> tuple[Status, str]:
    drops, why = ctx.scenario("disconnects")
    if drops is None:
        return NOT_CHECKED, f"needs the disconnect scenario: {why}"
    fell_back = flag(drops, "running_fell_back")
    rate = number(drops, "cancellation_success_rate")
    if rate is None:
        rate = number(ctx.stability(), "cancellation_success_rate")
    late = number(drops, "released_late_s")
    held = (f"fell back only after {late:.1f} s, beyond the allowance" if late is not None
            else "did not fall back within the watch")  # fmt: skip
    text = (f"{amount(number(drops, 'dropped'))} streams dropped after their first tokens; vLLM's running requests "
            f"{'fell back in ' + amount(number(drops, 'fallback_s'), ' s') if fell_back else held if fell_back is False else '(not seen)'}"
            f"; cancellation success rate {pct(rate)}; {verdict(drops)}")  # fmt: skip
    if fell_back is None:
        return NOT_CHECKED, text
    if not fell_back or flag(drops, "passed") is False:
        return FAIL, text
    if rate is not None and rate < MIN_CANCELLATION_SUCCESS:
        return FAIL, text + f" (below {MIN_CANCELLATION_SUCCESS:.0%})"
    return PASS, text


def hard_queue_limit(ctx: Context) -> tuple[Status, str]:
    overloaded, _ = ctx.scenario("overload")  # run when the configuration sets vLLM's admission bound
    if overloaded is not None:
        passed = flag(overloaded, "passed")
        text = f"overload scenario: {overloaded.get('reason', '')}"
        return (PASS, text) if passed else (FAIL, text)
    peak, _ = ctx.scenario("peak")
    waiting = number(peak, "requests_waiting_max")
    seen = f"; at 1.25x the level {waiting:g} requests waited in its queue" if waiting is not None else ""
    size = ""
    level = ctx.level
    if level is not None and level.summary.request_throughput > 0:
        # Sized as `export --format ray-serve` sizes it (report/autoscale.py), for one replica: the wait the SLO's
        # TTFT bound leaves after the TTFT measured at the level (at the bound's percentile)
        wait_s, why = tolerable_wait_s(ctx.result.slo)
        bound, ttft_ms = bound_ttft_ms(ctx.result.slo, level.summary.flat())
        left_s, left_why = wait_left(wait_s, why, ttft_ms, bounded=bound is not None)
        queue = max(1, math.ceil(level.summary.request_throughput * left_s - 1e-9))
        size = (f", about {level.summary.request_throughput:.2f} req/s x {left_s:g} s of queue wait "
                f"= {queue} a replica ({left_why}; section 10); `servetune export --format ray-serve` writes it "
                "for the replicas it derives")  # fmt: skip
    return FAIL, (f"vLLM has no bound on its waiting queue: it queues every request until the client gives up{seen}. "
                  "Set vLLM's max_num_queued_reqs and max_num_queued_tokens (503 beyond them; `servetune export "
                  "--format vllm` sizes them from the capacity, and verify then runs its overload scenario), or put "
                  f"one in front: Ray Serve's max_queued_requests in the deployment config{size}")  # fmt: skip


def per_user_limits(ctx: Context) -> tuple[Status, str]:
    return NOT_CHECKED, ("per-user RPS, concurrency and token limits belong to the API gateway in front of the "
                         "service; neither vLLM nor Ray Serve has per-user limits")  # fmt: skip


def latency_monitored(ctx: Context) -> tuple[Status, str]:
    if ctx.level is None:
        return NOT_CHECKED, "no measured level"
    server = ctx.level.server_metrics
    if not server:
        return NOT_CHECKED, f"no /metrics counters recorded at {level_label(ctx.level.summary.level)}"
    families = {"TTFT": "server_ttft_ms_mean", "TPOT/ITL": "server_itl_ms_mean", "queue time": "server_queue_ms_mean"}
    missing = [name for name, key in families.items() if key not in server]
    found = "; ".join(f"{name} mean {amount(server[key], ' ms')}" for name, key in families.items() if key in server)
    p99 = (
        f"; TTFT P99 {amount(server['server_ttft_ms_p99'], ' ms')} from its histogram"
        if "server_ttft_ms_p99" in server
        else ""
    )
    if missing:
        return FAIL, f"vLLM's /metrics lacked {', '.join(missing)} histograms" + (f" (read: {found})" if found else "")
    return PASS, f"vLLM's /metrics histograms read at {level_label(ctx.level.summary.level)}: {found}{p99}"


#: GPU telemetry that monitoring needs (telemetry.py names).
GPU_SIGNALS = {"memory": "gpu_memory_used_gib_max", "utilization": "gpu_util_mean",
               "temperature": "gpu_temperature_c_max", "power": "gpu_power_w_mean"}  # fmt: skip


def device_monitored(ctx: Context) -> tuple[Status, str]:
    if not ctx.gpu:
        return (
            NOT_CHECKED,
            "no GPU: the CPU stand-in samples host CPU and memory; temperature, power and hardware errors are GPU signals",
        )
    if ctx.level is None:
        return NOT_CHECKED, "no measured level"
    telemetry = ctx.level.telemetry
    if not telemetry:
        return NOT_CHECKED, f"no telemetry sampled at {level_label(ctx.level.summary.level)}"
    missing = [name for name, key in GPU_SIGNALS.items() if key not in telemetry]
    if missing:
        return FAIL, f"NVML gave no {', '.join(missing)} during the level"
    return PASS, (f"NVML sampled memory peak {telemetry['gpu_memory_used_gib_max']:.1f} GiB, utilization "
                  f"{telemetry['gpu_util_mean']:.0f} %, temperature {telemetry['gpu_temperature_c_max']:.0f} C, power "
                  f"{telemetry['gpu_power_w_mean']:.0f} W; hardware errors (ECC, Xid) need DCGM's exporter")  # fmt: skip


#: What servetune's derived autoscaling scales on, per policy (report/autoscale_policy.py): never GPU utilization.
SCALES_ON = {
    "inflight": "ongoing requests per replica (target_ongoing_requests)",
    "predictive": "ongoing requests, queue wait, KV-cache usage and TTFT",
}


def _ramps(ctx: Context) -> tuple[list[Mapping[str, Any]], str]:
    """serve-check's ramps of this trial (serve-check.json), or none and why."""
    file = ctx.study.serve_check if ctx.study is not None else None
    if file is None or file.content is None:
        return [], "serve-check has not run (servetune serve-check STUDY_DIR --ramp tests the derived autoscaling)"
    data = file.content
    if str(data.get("trial_id", "")) != ctx.result.trial_id:
        return [], f"serve-check ramped trial {data.get('trial_id', '?')}, not this one"
    ramps = [r for r in (data.get("ramps") or [data.get("ramp")]) if isinstance(r, Mapping)]
    return ramps, "" if ramps else "serve-check ran without a ramp (--ramp)"


def autoscaling_signals(ctx: Context) -> tuple[Status, str]:
    """15.19 from serve-check's ramp of the derived autoscaling: it scales on requests (and, predictive, queue wait,
    KV usage and TTFT), never GPU utilization; it passes where the ramp's 3x phase brought up more replicas, and fails
    where Serve never added one though the config allowed it."""
    ramps, why = _ramps(ctx)
    if not ramps:
        return NOT_CHECKED, (f"{why}; servetune export --format ray-serve scales on {SCALES_ON['inflight']}, with "
                             f"--autoscaling-policy predictive on {SCALES_ON['predictive']}: not GPU utilization")  # fmt: skip
    said, scaled, stuck = [], False, False
    for ramp in ramps:
        policy = str(ramp.get("policy", "inflight"))
        config = ramp.get("autoscaling_config") if isinstance(ramp.get("autoscaling_config"), Mapping) else {}
        before, peak = number(ramp, "replicas_before"), number(ramp, "replicas_peak")
        most = number(config, "max_replicas")
        up = before is not None and peak is not None and peak > before
        scaled |= up
        stuck |= not up and most is not None and before is not None and most > before
        label = f"{policy} (round {ramp['round']})" if isinstance(ramp.get("round"), int) else policy
        said.append(f"{label}: scales on {SCALES_ON.get(policy, policy)}; replicas {amount(before)} -> "
                    f"{amount(peak)} at 3x" + (f" in {amount(number(ramp, 'time_to_scale_up_s'), ' s')}" if up else "")
                    + f", SLO attainment {pct(number(ramp, 'slo_attainment'))}, "
                    f"{amount(number(ramp, 'replica_seconds'), ' replica-s')}")  # fmt: skip
    evidence = "serve-check's ramp: " + "; ".join(said)
    if scaled:
        return PASS, evidence
    if stuck:
        return FAIL, f"{evidence}: Serve added no replica at three times the ramp's one-replica load though it could"
    return NOT_CHECKED, f"{evidence}: max_replicas allowed no scale-out"


def warm_before_traffic(ctx: Context) -> tuple[Status, str]:
    """The soak's first windows (the instance verify started), and where verify ran the replica_lost scenario
    (``--scenario replica_lost``) the replacement Serve started for a lost replica: a new instance that took traffic
    before it was warm shows as windows past the SLO after the count was whole again. Either failing fails it."""
    status, evidence = _warm_from_soak(ctx)
    lost, _ = ctx.scenario("replica_lost")
    if lost is None:
        return status, evidence
    second, why = replaced_replica_warm(lost)
    if second == NOT_CHECKED:
        return status, f"{evidence}; replica lost: {why}"
    both = FAIL if FAIL in (status, second) else PASS if status == PASS else status
    return both, f"{evidence}; replica lost: {why}"


def replaced_replica_warm(lost: Mapping[str, Any]) -> tuple[Status, str]:
    """The replica_lost scenario's part of 15.20 (verify/replica_lost.py's numbers)."""
    replaced = flag(lost, "replaced")
    if replaced is None:
        return NOT_CHECKED, "the scenario recorded no replacement (not run?)"
    failed, burst = number(lost, "failed"), number(lost, "error_burst_s")
    lost_text = f"{amount(failed)} requests failed" + (f" over {amount(burst, ' s')}" if burst is not None else "")
    if not replaced:
        return FAIL, f"{lost_text}; Serve did not bring the replica count back within the run"
    took, recovery = number(lost, "replaced_s"), number(lost, "recovery_s")
    survivors, bound = number(lost, "survivor_ttft_ms_p99"), number(lost, "ttft_bound_ms")
    held = survivors is None or bound is None or survivors <= bound
    facts = (f"{lost_text}; replaced {amount(took, ' s')} after the kill; back within the SLO "
             f"{amount(recovery, ' s') if recovery is not None else 'never'}; survivors' TTFT P99 "
             f"{amount(survivors, ' ms')}" + (f" (bound {amount(bound, ' ms')})" if bound is not None else ""))  # fmt: skip
    if flag(lost, "recovered") is not True:
        return FAIL, f"{facts}: after the replacement the load never came back within the SLO"
    if not held:
        return FAIL, f"{facts}: the surviving replicas broke the TTFT bound while one was lost"
    # Back within the SLO more than a window after the count was whole: the replacement took traffic before it was
    # warm (the survivors' overload ends when it takes its share).
    if took is not None and recovery is not None and recovery > took + (number(lost, "window_s") or 0.0):
        return FAIL, f"{facts}: the SLO came back only after the replacement took traffic cold"
    return PASS, f"{facts}"


def _warm_from_soak(ctx: Context) -> tuple[Status, str]:
    soak, why = ctx.scenario("soak")
    if soak is None:
        return NOT_CHECKED, f"needs the soak scenario: {why}"
    windows = soak.get("p99_ttft_ms_windows")
    width = number(soak, "window_s")
    if not isinstance(windows, list) or len(windows) < 3 or width is None:
        return NOT_CHECKED, "the soak scenario has fewer than 3 windows of P99 TTFT (p99_ttft_ms_windows, window_s)"
    values = [float(w) for w in windows if isinstance(w, (int, float)) and not isinstance(w, bool)]
    if len(values) != len(windows):
        return NOT_CHECKED, "p99_ttft_ms_windows holds values that are not numbers"
    steady = statistics.median(values[len(values) // 2 :])
    first_steady = next((i for i in range(len(values)) if all(v <= STABLE_RATIO * steady for v in values[i:])), None)
    startup = (
        f"/health answered {ctx.result.startup_s:.0f} s after start"
        if ctx.result.startup_s
        else "startup time not recorded"
    )
    first = f"first {width:g} s window's P99 TTFT {values[0]:,.0f} ms, steady {steady:,.0f} ms"
    if first_steady is None:  # the last window itself is above the steady level: latency never settled
        return FAIL, (f"{startup}; latency never settled over the soak ({first}, last {values[-1]:,.0f} ms): "
                      "no warm-up length can be read from it")  # fmt: skip
    if first_steady == 0:
        return PASS, f"{startup}; latency was steady from the first window ({first}): ready meant warm"
    settle = first_steady * width
    return FAIL, (f"{startup}; latency settled only {settle:g} s after traffic began ({first}): hold traffic "
                  f"back that long after /health (warm-up requests, or a readiness check that sends them)")  # fmt: skip


#: The stress scenarios item 15.21 names.
STRESS_SCENARIOS = ("peak", "burst", "mix", "disconnects")


def stress_scenarios_passed(ctx: Context) -> tuple[Status, str]:
    if ctx.verify is None:
        return NOT_CHECKED, "verify did not run (servetune verify STUDY_DIR)"
    parts, missing, failed = [], [], []
    for name in STRESS_SCENARIOS:
        values, why = ctx.scenario(name)
        if values is None:
            missing.append(why)
            continue
        parts.append(f"{name} {verdict(values)}")
        if flag(values, "passed") is False:
            failed.append(name)
        elif flag(values, "passed") is None:
            missing.append(f"{name} gave no verdict")
    stability = ctx.stability()
    oom, errors = flag(stability, "oom"), number(stability, "error_rate_5xx")
    if oom is not None:
        parts.append("out of memory" if oom else "no OOM")
    if errors is not None:
        parts.append(f"5xx rate {errors:.2%}")
    if oom:
        failed.append("OOM")
    if errors is not None and errors > ERROR_RATE_5XX_LIMIT:
        failed.append(f"5xx above {ERROR_RATE_5XX_LIMIT:.1%}")
    text = "; ".join(parts + missing)
    if failed:
        return FAIL, f"failed: {', '.join(failed)}; {text}"
    if missing:
        return NOT_CHECKED, text
    return PASS, text


def oom_notch_back(ctx: Context) -> tuple[Status, str]:
    if ctx.level_index is None:
        return NOT_CHECKED, "no measured level"
    point = trial_points(ctx.result)[ctx.level_index]
    signals = margin_signals(point, [outline(t) for t in ctx.trials])
    headroom, why = ctx.scenario("headroom")
    kv, preemptions = number(headroom, "kv_usage_peak"), number(headroom, "preemptions")
    if kv is not None and kv >= KV_USAGE_THIN:
        signals.append(f"under peak load KV cache usage reached {kv:.0%} (>= {KV_USAGE_THIN:.0%})")
    if preemptions:
        signals.append(f"the server preempted {preemptions:g} requests under peak load")
    if flag(ctx.stability(), "oom"):
        signals.append("the engine ran out of memory during verify")
    if signals:
        return FAIL, "; ".join(signals)
    under_load = (f"under peak load KV peaked at {pct(kv)}, {amount(preemptions)} preemptions" if headroom is not None
                  else f"not checked under load ({why})")  # fmt: skip
    return PASS, (f"no out-of-memory neighbour among the study's {len(ctx.trials)} trials for "
                  f"max_num_seqs, gpu_memory_utilization or max_num_batched_tokens; {under_load}")  # fmt: skip


def changes_canary_rollback(ctx: Context) -> tuple[Status, str]:
    """Linked to its data by construction (the trial id is its configuration's hash); the canary half, where verify
    ran the canary scenario (``--scenario canary``: the runner-up beside the verified point, each measured on its own
    share, verify/canary.py), and the rollback half, where it ran the rolling_update scenario (``--scenario
    rolling_update``): a configuration change rolled out through Serve under load, the path a rollback takes back.
    Either failing fails it; NOT CHECKED where neither was judged."""
    linked = (f"servetune links a configuration to its data: trial {ctx.result.trial_id} is the hash of its "
              f"configuration, trials/{ctx.result.trial_id}/result.json holds both, and servetune verify exits 1 on a "
              "rejected one so CI can gate a change")  # fmt: skip
    halves = []
    found, _ = ctx.scenario("canary")
    if found is not None:
        halves.append((*canary_verdict(found), "canary"))
    update, _ = ctx.scenario("rolling_update")
    if update is not None:
        halves.append((*rolled_update(update), "rolling update"))
    if not halves:
        return NOT_CHECKED, f"canary and rollback are the deployment's. {linked}"
    statuses = [status for status, _, _ in halves]
    status = FAIL if FAIL in statuses else PASS if PASS in statuses else NOT_CHECKED
    return status, "; ".join(f"{name}: {why}" for _, why, name in halves) + f"; {linked}"


def canary_verdict(found: Mapping[str, Any]) -> tuple[Status, str]:
    """The canary scenario's part of 15.23 (verify/canary.py's numbers)."""
    reason = str(found.get("reason") or "")
    if flag(found, "judged") is not True:
        return NOT_CHECKED, f"not judged: {reason or 'no verdict recorded'}"
    listed = found.get("regressed")
    regressed = [str(name) for name in listed] if isinstance(listed, list) else []
    if flag(found, "passed") is True and not regressed:
        return PASS, reason
    return FAIL, f"regressed {', '.join(regressed) or '?'}: {reason}"


def rolled_update(update: Mapping[str, Any]) -> tuple[Status, str]:
    """The rolling_update scenario's part of 15.23 (verify/rolling_update.py's numbers)."""
    rolled = flag(update, "rolled_out")
    if rolled is None:
        return NOT_CHECKED, f"the scenario recorded no rollout ({verdict(update)})"
    change = update.get("change") if isinstance(update.get("change"), str) else "a new configuration"
    failed, during = number(update, "failed"), number(update, "requests_during")
    worst, p99 = number(update, "ttft_ms_max_during"), number(update, "ttft_ms_p99_during")
    bound = number(update, "ttft_bound_ms")
    facts = (f"updated {change} under load, {amount(failed)} of {amount(during)} requests failed during it, TTFT "
             f"worst {amount(worst, ' ms')} and P99 {amount(p99, ' ms')}"
             + (f" (bound {amount(bound, ' ms')})" if bound is not None else ""))  # fmt: skip
    if not rolled:
        return FAIL, f"{facts}; Serve did not finish the rollout within the run"
    facts += f", rolled out in {amount(number(update, 'update_s'), ' s')}"
    if flag(update, "ingress_replaced") is True:  # requests sent meanwhile waited for its successor at the proxy
        facts += " (Serve replaced the ingress replica too)"
    if flag(update, "passed") is not True:
        reason = update.get("reason")
        return FAIL, facts + (f": {reason}" if isinstance(reason, str) and reason else "")
    return PASS, facts + f"; the SLO held after it (TTFT P99 {amount(number(update, 'ttft_ms_p99_after'), ' ms')})"
