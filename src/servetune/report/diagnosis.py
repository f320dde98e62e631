"""What limited a trial, and the next lever: a pure function of its recorded result.

Each rule is a small function over a :class:`~servetune.results.TrialResult` that returns a :class:`Finding`
(the symptom with its numbers, and the lever the tuning checklist's section 13 pulls for it) or None. The rules
run in that section's order: the GPU idle, the front end's CPU near a full core, memory to spare but the batch full, out of KV cache, prefix-cache hits
lost under load, TTFT high with TPOT normal, TPOT high with TTFT normal, P99 far from the median. Before them, a
level whose load client fell behind (load/pace.py): its numbers are the client's, so every other finding waits on it;
and a limit level whose SLO miss the client's own stall accounts for (``client_stalled``): its verdict is unsettled,
so no engine lever is named for it; then a level whose requests vLLM's admission bounds refused (its own count,
by bound): the bound set what was served.

A trial is judged at its *limit level*: the first level that broke the SLO, or, when none did, the highest
load it measured. Trends ("TTFT grows with load") compare the lowest load measured with the limit level.
A rule reads only what a trial records (the server's ``/metrics`` per level: engine/metrics.py; device
telemetry: telemetry.py; the client's summary: summary.py); where its inputs were not recorded it finds
nothing rather than guessing. Not recorded, so not diagnosed: whether the workload's prompts share prefixes, so a
prefix cache that never hits cannot be told from prompts that share none; only hits that *fell* with load are read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from servetune.engine.metrics import refused_text, rejected_by, rejections
from servetune.report.points import level_label, violated_metrics
from servetune.results import LevelResult, TrialResult, level_load

#: KV-cache usage (a share of the pool) from which the cache counts as full (the checklist's scale-out rule: 85%).
KV_FULL = 0.90
#: The API server's share of a core (``frontend_cpu_share``, engine/frontend.py) from which the front end counts as
#: CPU-bound: it tokenizes, answers HTTP and streams on one event loop, so about 1.0 is its ceiling. Measured on the
#: shared two-core host (bench/README.md, "The front end's CPU"): vLLM's CPU build with the tiny model, the engine
#: the limit, used 0.08-0.27 of a core at 1 to 64 in flight (7-84 req/s); the fake engine answering at once
#: (660-1430 req/s), 0.20-0.67, the load client beside it on the same cores. So 0.85 is a front end with little left.
#: A Serve trial's front-end processes (serve/frontend.py: its proxy, ingress and LLM replicas) are each one event loop
#: too, so the same bar holds: the LLM replica's loop also runs vLLM's engine client (detokenizing, streaming), as
#: vLLM's API server's does; Ray's threads beside it may take a process a little past 1.0.
FRONTEND_BUSY = 0.85
#: For a Serve trial (``frontend_process``): what the busiest front-end process was, and the lever for it.
SERVE_FRONT_ENDS = {
    "proxy": ("Serve's HTTP proxy", "spread the load over more of Serve's proxies: Serve runs one per node, so "
              "replicas on more nodes, the client sending to each node's proxy"),
    "ingress": ("Serve's ingress replica (the OpenAI routes)", "more ingress replicas: the ingress deployment's "
                "num_replicas in the application's Serve config"),
    "replica": ("the LLM replica's process (Ray Serve LLM's server and vLLM's engine client)", "more replicas "
                "(serve.num_replicas), each with its share of the devices: each replica's process serves its own "
                "streams"),
}  # fmt: skip
#: KV-cache usage under which memory counts as plentiful while the batch is full.
KV_PLENTY = 0.50
#: Mean GPU utilization (%) under which the GPUs count as idle.
GPU_IDLE_PERCENT = 40.0
#: A latency "grew with load" when the limit level's mean is this many times the lowest load's...
GREW = 2.0
#: ...and "stayed flat" while it grew less than this.
FLAT = 1.5
#: A P99 this many times its P50 is a tail, not the body of the distribution.
TAIL = 4.0
#: A mean SM clock this share under the highest the trial saw: the GPU slowed its clock (power or heat).
CLOCK_DROP = 0.85
#: A prefix-cache hit rate at the lowest load from which the prompts count as sharing prefixes...
HITS_SHARED = 0.2
#: ...and the share of it left at the limit level under which the cache lost them to the load (evicted).
HITS_LOST = 0.5


@dataclass(frozen=True)
class Finding:
    """One thing that limited a trial: what was seen, the numbers it was seen in, and what to change."""

    rule: str  # a short name: ``kv_bound``
    symptom: str  # ``preemptions at concurrency 32: 14, KV cache peak 97%``
    lever: str  # ``more KV cache: raise gpu_memory_utilization, ...``
    level: str  # the level it was seen at: ``concurrency 32``
    evidence: Mapping[str, float] = field(default_factory=dict)  # the recorded numbers, by their recorded names

    @property
    def line(self) -> str:
        return f"{self.symptom} → {self.lever}"


def limit_level(trial: TrialResult) -> int | None:
    """The level a trial is diagnosed at: the first that broke the SLO, else the highest load (None: no level
    completed a request)."""
    measured = [i for i, lv in enumerate(trial.levels) if lv.summary.completed > 0]
    if not measured:
        return None
    broken = [i for i in measured if trial.levels[i].slo_violations]
    if broken:
        return broken[0]
    return max(measured, key=lambda i: level_load(trial.levels[i]))


def _lowest(trial: TrialResult, limit: int) -> LevelResult | None:
    """The lowest load measured below the limit level's (None: the limit level is the lowest)."""
    below = [lv for lv in trial.levels if lv.summary.completed > 0 and level_load(lv) < level_load(trial.levels[limit])]
    return min(below, key=level_load) if below else None


def _engine_arg(trial: TrialResult, name: str) -> object:
    """An engine argument as launched, else as vLLM resolved it (None: not recorded)."""
    value = trial.engine_args.get(name)
    return value if value is not None else trial.resolved_engine_args.get(name)


def _count(value: object) -> int:
    """A positive whole number recorded, else 1."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _batch_limit(trial: TrialResult) -> int | None:
    """Sequences the server runs at once, every engine together: max_num_seqs x data_parallel_size, times the
    replicas of a deployment through Ray Serve (whose gauges are its replicas' added up: engine/metrics.py)."""
    seqs = _engine_arg(trial, "max_num_seqs")
    if not isinstance(seqs, int) or isinstance(seqs, bool):
        return None
    replicas = (trial.serve or {}).get("replicas")
    return seqs * _count(_engine_arg(trial, "data_parallel_size")) * _count(replicas)


def _ratio(high: float | None, low: float | None) -> float | None:
    return high / low if high is not None and low is not None and low > 0 else None


Rule = Callable[[TrialResult, int], "Finding | None"]


def client_bound(trial: TrialResult, limit: int) -> Finding | None:
    """The load client fell behind (load/pace.py): the lowest load at which it did, whatever the limit level, since
    from there on the numbers measured the client as much as the server."""
    behind = [lv for lv in trial.levels if lv.client_bound is not None and lv.summary.completed > 0]
    if not behind:
        return None
    level = min(behind, key=level_load)
    label = level_label(level.summary.level)
    evidence = _recorded(level, "client_cpu_share", "send_lag_ms_p50", "send_lag_ms_p99")
    return Finding(
        "client_bound",
        f"the load client fell behind at {label}: {level.client_bound}",
        "measure again with more client processes (load.client_processes: auto, or more) or more cores for the "
        "client: a level it fell behind at decides no SLO verdict",
        label,
        evidence,
    )


def _recorded(level: LevelResult, *names: str) -> dict[str, float]:
    """The client's numbers ``names`` that ``level`` recorded (None: not recorded, left out), as a finding's evidence."""
    return {name: value for name in names if (value := getattr(level, name)) is not None}


def client_stalled(trial: TrialResult, limit: int) -> Finding | None:
    """The limit level broke the SLO by a margin the load client's longest stall accounts for
    (``LevelResult.client_stalled``, results ``stall_unsettled``): the client's process was not running, so its
    answers waited to be read, and what reads as queueing or a slow decode may be the client's alone. No engine
    lever then: the verdict is unsettled."""
    level = trial.levels[limit]
    if level.client_stalled is None:
        return None
    label = level_label(level.summary.level)
    evidence = _recorded(level, "client_stall_ms_max", "client_stalled_s")
    return Finding(
        "client_stalled",
        f"unsettled at {label}: {level.client_stalled}",
        "measure again on a quieter host, or with the load client on cores the engine does not use: a miss the "
        "client's own stall accounts for names no engine lever",
        label,
        evidence,
    )


def admission_refused(trial: TrialResult, limit: int) -> Finding | None:
    """vLLM's admission bounds (``max_num_queued_reqs`` / ``max_num_queued_tokens``) refused requests at the limit
    level, by its own count (engine/metrics.py ``rejections``): the bound, not the engine, set how much was served."""
    level = trial.levels[limit]
    by_reason = rejections(level.server_metrics)
    if not sum(by_reason.values()):
        return None
    label = level_label(level.summary.level)
    most = max(by_reason, key=lambda reason: by_reason[reason])
    if latency := [m for m in violated_metrics(level.slo_violations) if not m.startswith("error_rate")]:
        lever = (f"the bounds admit more than the engine serves within the SLO ({', '.join(latency)} broke all the "
                 f"same): tighten them, {most} first")  # fmt: skip
    else:
        lever = (f"past the capacity that is the bound working (more replicas for more load); below it, loosen {most}"
                 " (`servetune export --format vllm` sizes the bounds from the capacity)")  # fmt: skip
    evidence = {rejected_by(reason): float(n) for reason, n in by_reason.items()}
    return Finding("admission_refused", f"vLLM's admission bounds {refused_text(by_reason)} at {label}", lever, label,
                   evidence)  # fmt: skip


def gpu_idle(trial: TrialResult, limit: int) -> Finding | None:
    """GPU utilization low: too little load, or the CPU front end (tokenizer, HTTP, streaming) cannot feed it."""
    level = trial.levels[limit]
    util = level.telemetry.get("gpu_util_mean")
    if trial.device != "gpu" or util is None or util >= GPU_IDLE_PERCENT:
        return None
    waiting = level.server_metrics.get("requests_waiting_max")
    running = level.server_metrics.get("requests_running_max")
    evidence = {"gpu_util_mean": util}
    if waiting is not None:
        evidence["requests_waiting_max"] = waiting
    if running is not None:
        evidence["requests_running_max"] = running
    if waiting is not None and waiting > 0:
        lever = ("requests queue while the GPU idles: raise max_num_seqs or max_num_batched_tokens; then check the "
                 "CPU front end (more API servers: api_server_count) and that TP is not larger than needed")  # fmt: skip
    else:
        lever = ("nothing queued: check the load is enough (a higher level), then the CPU front end: tokenizer, "
                 "HTTP and streaming (api_server_count)")  # fmt: skip
    label = level_label(level.summary.level)
    return Finding("gpu_idle", f"GPU utilization {util:.0f}% at {label}", lever, label, evidence)


def frontend_bound(trial: TrialResult, limit: int) -> Finding | None:
    """The API server near a full core while the engine had room: nothing waited in it, sequence slots were free
    (where the batch limit is known), no preemption and the KV cache under full; requests were held in the front end."""
    level = trial.levels[limit]
    share = level.frontend_cpu_share
    waiting = level.server_metrics.get("requests_waiting_max")
    running = level.server_metrics.get("requests_running_max")
    if share is None or share < FRONTEND_BUSY or waiting is None or running is None or waiting > 0:
        return None
    seqs = _batch_limit(trial)
    kv = level.server_metrics.get("kv_cache_usage_max")
    if (seqs is not None and running >= seqs) or (kv is not None and kv >= KV_FULL):
        return None
    if level.server_metrics.get("preemptions", 0.0) > 0:
        return None
    servers = _engine_arg(trial, "api_server_count")
    label = level_label(level.summary.level)
    evidence = {"frontend_cpu_share": share, "requests_running_max": running, "requests_waiting_max": waiting}
    process, lever = (
        "the API server",
        f"raise --api-server-count (api_server_count, now {servers if servers is not None else 'vLLM default'}): "
        "more API server processes to tokenize, answer HTTP and stream",
    )
    if level.frontend_process in SERVE_FRONT_ENDS:  # a Serve trial: which of its front-end processes
        process, lever = SERVE_FRONT_ENDS[level.frontend_process]
    slots = f" of {seqs}" if seqs is not None else ""
    return Finding(
        "frontend_bound",
        f"front end CPU-bound at {label}: {process} used {share:.0%} of a core while the engine ran "
        f"{running:.0f}{slots} and nothing waited",
        lever,
        label,
        evidence,
    )


def batch_full(trial: TrialResult, limit: int) -> Finding | None:
    """Memory to spare but the batch full: every sequence slot ran while the KV cache stayed mostly empty."""
    level = trial.levels[limit]
    running = level.server_metrics.get("requests_running_max")
    kv = level.server_metrics.get("kv_cache_usage_max")
    seqs = _batch_limit(trial)
    if running is None or kv is None or seqs is None or running < seqs or kv >= KV_PLENTY:
        return None
    label = level_label(level.summary.level)
    return Finding(
        "batch_full",
        f"decode-bound at {label}: {running:.0f} running = max_num_seqs {seqs} with KV cache at {kv:.0%}",
        "raise max_num_seqs (memory allows a larger batch)",
        label,
        {"requests_running_max": running, "max_num_seqs": float(seqs), "kv_cache_usage_max": kv},
    )


def scheduler_budget(trial: TrialResult, limit: int) -> Finding | None:
    """Requests waited while sequence slots and KV cache were free (no preemption): the per-step token budget held
    them back."""
    level = trial.levels[limit]
    running = level.server_metrics.get("requests_running_max")
    waiting = level.server_metrics.get("requests_waiting_max")
    kv = level.server_metrics.get("kv_cache_usage_max")
    seqs = _batch_limit(trial)
    if running is None or waiting is None or kv is None or seqs is None:
        return None
    preempted = level.server_metrics.get("preemptions", 0.0) > 0
    if waiting <= 0 or running >= seqs or kv >= KV_FULL or preempted:  # a full cache is kv_bound's
        return None
    budget = _engine_arg(trial, "max_num_batched_tokens")
    label = level_label(level.summary.level)
    return Finding(
        "scheduler_budget",
        f"requests waiting at {label} (up to {waiting:.0f}) while {running:.0f} of {seqs} ran, KV cache at {kv:.0%}",
        f"the scheduler's token budget: raise max_num_batched_tokens (now {budget if budget is not None else 'not recorded'})",
        label,
        {"requests_waiting_max": waiting, "requests_running_max": running, "max_num_seqs": float(seqs),
         "kv_cache_usage_max": kv},
    )  # fmt: skip


def kv_bound(trial: TrialResult, limit: int) -> Finding | None:
    """Out of KV cache: requests preempted, or the cache near full."""
    level = trial.levels[limit]
    preemptions = level.server_metrics.get("preemptions")
    kv = level.server_metrics.get("kv_cache_usage_max")
    if not (preemptions is not None and preemptions > 0) and not (kv is not None and kv >= KV_FULL):
        return None
    label = level_label(level.summary.level)
    said = []
    evidence: dict[str, float] = {}
    if preemptions is not None:
        said.append(f"{preemptions:.0f} preemptions")
        evidence["preemptions"] = preemptions
    if kv is not None:
        said.append(f"KV cache peak {kv:.0%}")
        evidence["kv_cache_usage_max"] = kv
    return Finding(
        "kv_bound",
        f"KV-bound at {label}: {', '.join(said)}",
        "more KV cache: raise gpu_memory_utilization, kv_cache_dtype fp8, a smaller max_model_len; or fewer "
        "max_num_seqs",
        label,
        evidence,
    )


def prefix_hits_lost(trial: TrialResult, limit: int) -> Finding | None:
    """Prefix-cache hits that fell with load: the prompts share prefixes (hits at the lowest load) and the cache lost
    them to the load's other blocks (evicted before their next use), or the replicas' caches split them."""
    level, low = trial.levels[limit], _lowest(trial, limit)
    if low is None:
        return None
    hits_low = low.server_metrics.get("prefix_cache_hit_rate")
    hits = level.server_metrics.get("prefix_cache_hit_rate")
    if hits_low is None or hits is None or hits_low < HITS_SHARED or hits >= HITS_LOST * hits_low:
        return None
    label, from_label = level_label(level.summary.level), level_label(low.summary.level)
    evidence = {"prefix_cache_hit_rate": hits, "prefix_cache_hit_rate_lowest_load": hits_low}
    if (kv := level.server_metrics.get("kv_cache_usage_max")) is not None:
        evidence["kv_cache_usage_max"] = kv
    full = f", KV cache peak {kv:.0%}" if kv is not None else ""
    return Finding(
        "prefix_hits_lost",
        f"prefix-cache hits fell from {hits_low:.0%} at {from_label} to {hits:.0%} at {label}{full}",
        "keep shared prefixes cached: more KV cache (gpu_memory_utilization, kv_cache_dtype fp8) or fewer "
        "max_num_seqs; across replicas, route requests by prefix (serve-check --routers)",
        label,
        evidence,
    )


def _slo_broke(level: LevelResult, prefixes: tuple[str, ...]) -> bool:
    return any(metric.startswith(prefixes) for metric in violated_metrics(level.slo_violations))


def prefill_queueing(trial: TrialResult, limit: int) -> Finding | None:
    """TTFT high, TPOT normal: prompts wait for prefill while decoding keeps its pace."""
    level, low = trial.levels[limit], _lowest(trial, limit)
    if low is None or not _slo_broke(level, ("ttft", "e2el")):
        return None
    ttft = _ratio(level.summary.ttft_ms.mean, low.summary.ttft_ms.mean)
    tpot = _ratio(level.summary.tpot_ms.mean, low.summary.tpot_ms.mean)
    if ttft is None or tpot is None or ttft < GREW or tpot >= FLAT:
        return None
    chunked = _engine_arg(trial, "enable_chunked_prefill")
    lever = "enable chunked prefill, then " if chunked is False else ""
    lever += "more prefill per step (max_num_batched_tokens), prefix caching, shorter prompts or another replica"
    label, from_label = level_label(level.summary.level), level_label(low.summary.level)
    evidence = {"ttft_growth": ttft, "tpot_growth": tpot}
    if (queue := level.server_metrics.get("server_queue_ms_mean")) is not None:
        evidence["server_queue_ms_mean"] = queue
    return Finding(
        "prefill_queueing",
        f"prefill queueing: TTFT mean grew {ttft:.1f}x from {from_label} to {label} while TPOT grew {tpot:.1f}x",
        lever,
        label,
        evidence,
    )


def decode_slowdown(trial: TrialResult, limit: int) -> Finding | None:
    """TPOT high, TTFT normal: the decode batch, or prefills inserted into it, slow every token."""
    level, low = trial.levels[limit], _lowest(trial, limit)
    if low is None or not _slo_broke(level, ("tpot", "itl", "e2el")):
        return None
    ttft = _ratio(level.summary.ttft_ms.mean, low.summary.ttft_ms.mean)
    tpot = _ratio(level.summary.tpot_ms.mean, low.summary.tpot_ms.mean)
    if ttft is None or tpot is None or tpot < GREW or ttft >= FLAT:
        return None
    label, from_label = level_label(level.summary.level), level_label(low.summary.level)
    return Finding(
        "decode_slowdown",
        f"decode slowdown: TPOT mean grew {tpot:.1f}x from {from_label} to {label} while TTFT grew {ttft:.1f}x",
        "a smaller decode batch (max_num_seqs) or smaller prefill chunks (max_num_batched_tokens); then memory "
        "bandwidth and TP communication",
        label,
        {"tpot_growth": tpot, "ttft_growth": ttft},
    )


def tail_latency(trial: TrialResult, limit: int) -> Finding | None:
    """P99 far from the median while a P99 bound broke: a few requests, not the load as a whole, broke the SLO."""
    level = trial.levels[limit]
    if not _slo_broke(level, ("ttft_ms_p99", "tpot_ms_p99", "itl_ms_p99", "e2el_ms_p99")):
        return None
    tails = {}
    for metric in ("ttft_ms", "e2el_ms"):
        stats = getattr(level.summary, metric)
        if (ratio := _ratio(stats.p99, stats.p50)) is not None and ratio >= TAIL:
            tails[f"{metric}_p99_over_p50"] = ratio
    if not tails:
        return None
    label = level_label(level.summary.level)
    evidence = dict(tails)
    preemptions, kv = level.server_metrics.get("preemptions"), level.server_metrics.get("kv_cache_usage_max")
    kv_ruled_out = preemptions == 0 and kv is not None and kv < KV_FULL  # recorded, and neither happened
    causes = "long and short requests mixed, output caps, " + (
        "" if kv_ruled_out else "KV cache near full and preemption, "
    )
    causes += "CPU or network jitter"
    clocks = [lv.telemetry["gpu_sm_clock_mhz_mean"] for lv in trial.levels if "gpu_sm_clock_mhz_mean" in lv.telemetry]
    clock = level.telemetry.get("gpu_sm_clock_mhz_mean")
    if clock is not None and clocks and clock < CLOCK_DROP * max(clocks):
        evidence["gpu_sm_clock_mhz_mean"] = clock
        causes = f"GPU clock down to {clock:.0f} MHz (from {max(clocks):.0f}), then " + causes
    shown = ", ".join(f"{name.split('_')[0].upper()} P99/P50 {r:.1f}" for name, r in tails.items())
    return Finding("tail_latency", f"tail latency at {label}: {shown}", f"check {causes}", label, evidence)


#: The rules, in the order of the tuning checklist's section 13.
RULES: tuple[Rule, ...] = (
    client_bound,
    client_stalled,
    admission_refused,
    gpu_idle,
    frontend_bound,
    batch_full,
    scheduler_budget,
    kv_bound,
    prefix_hits_lost,
    prefill_queueing,
    decode_slowdown,
    tail_latency,
)


def diagnose(trial: TrialResult) -> list[Finding]:
    """Every rule's finding for a complete trial, in the checklist's order (empty: nothing recorded limited it,
    or the trial did not complete)."""
    if trial.outcome != "COMPLETE":
        return []
    limit = limit_level(trial)
    if limit is None:
        return []
    return [finding for rule in RULES if (finding := rule(trial, limit)) is not None]


def limited_by(trial: TrialResult) -> str:
    """One line: the first finding (``symptom → lever``), why there is none, or that nothing was found."""
    if trial.outcome != "COMPLETE":
        return f"not diagnosed: {trial.outcome}"
    limit = limit_level(trial)
    if limit is None:
        return "not diagnosed: no level completed a request"
    return limited_at(trial, limit)


def limited_at(trial: TrialResult, limit: int, ladder: bool = True) -> str:
    """:func:`limited_by`'s line for ``trial`` judged at its level ``limit`` (verify judges a scenario's level so,
    verify/diagnosis.py): the first finding, why no rule could read the level, or that nothing was found.
    ``ladder`` False: the levels are not a ladder a lower load could be added to (verify's scenarios), so a broken
    SLO no rule matched is said with the bounds it broke, not as a call for a lower load."""
    findings = [finding for rule in RULES if (finding := rule(trial, limit)) is not None]
    if findings:
        return findings[0].line
    level = trial.levels[limit]
    label = level_label(level.summary.level)
    if (why := unread(level)) is not None:
        return f"not diagnosed: {why}"
    if level.slo_violations and not ladder:
        return f"SLO broken at {label} ({'; '.join(level.slo_violations)}), no rule matched what was recorded there"
    if level.slo_violations and _lowest(trial, limit) is None:
        return f"SLO broken at the lowest load measured ({label}), no rule matched: a lower load would show the trend"
    return f"no limit found in what was recorded at {label}"


#: What the rules read of the engine at a level, beside the client's latencies: vLLM's gauges and counters
#: (``server_metrics``), the API server's CPU, the GPUs' utilization.
ENGINE_READINGS = ("requests_running_max", "requests_waiting_max", "kv_cache_usage_max", "preemptions")


def unread(level: LevelResult) -> str | None:
    """Why the rules could not tell what held a level back, where none found anything in its latencies: none of what
    they read of the engine was recorded there (None: some was)."""
    if any(name in level.server_metrics for name in ENGINE_READINGS) or level.frontend_cpu_share is not None:
        return None
    if "gpu_util_mean" in level.telemetry:
        return None
    return (f"at {level_label(level.summary.level)} nothing was read of the engine: no vLLM gauges or counters "
            "(requests running and waiting, KV cache usage, preemptions: /metrics), no front-end CPU, no GPU "
            "utilization")  # fmt: skip
