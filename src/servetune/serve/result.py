"""``serve-check.json``: what serve-check measured, per replica count, and the rows it draws.

A :class:`ScalingRow` is one (replica count, load level) set against the bare engine the study
measured for the same trial at the same level (the router's overhead) and against one replica
(scaling efficiency = throughput at N replicas / (N x throughput at 1)).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from servetune.report.serving import SERVE_CHECK_FILE  # noqa: F401  (defined where the report reads it)
from servetune.results import RECORD, ClaimedCores, LevelResult, WeightsPrefetch
from servetune.serve.layouts import LayoutResult
from servetune.serve.plan import find_level, ratio
from servetune.serve.ramp import RampResult
from servetune.serve.ramp_rounds import RampComparison
from servetune.serve.routing import RoutingResult


class ReplicaRun(ClaimedCores, BaseModel):
    """One replica count: its levels as measured through Serve's ingress."""

    model_config = RECORD

    replicas: int
    ready_s: float | None = None  # serve.run until the application was RUNNING
    engines_reused: bool | None = (
        None  # True: on the engines of the count before (kept, prefix caches reset) and any added
    )
    levels: list[LevelResult] = []
    requests_per_replica: dict[str, int] = {}  # Serve replica id -> requests it handled (Serve's own counter)


class ScalingRow(BaseModel):
    model_config = RECORD

    replicas: int
    level: dict[str, float]
    goodput: float | None = None
    request_throughput: float
    output_throughput: float
    ttft_ms_p50: float | None = None
    ttft_ms_p99: float | None = None
    tpot_ms_p50: float | None = None
    tpot_ms_p99: float | None = None
    meets_slo: bool
    bare_output_throughput: float | None = None  # the study's own measurement of this trial, same level
    bare_ttft_ms_p50: float | None = None
    ttft_p50_overhead_ms: float | None = None  # through Serve minus bare (per replica, same offered load)
    scaling_efficiency: float | None = None  # output tok/s at N / (N x output tok/s at 1 replica)


class ServeCheckResult(BaseModel):
    model_config = RECORD

    servetune_version: str
    created: str
    study: str
    trial_id: str
    picked_level: dict[str, float]
    # The trial's operating point (report/operating.py as_dict: the load, the headroom, the capacity and knee it
    # rests on): the load the routers and layouts were offered and the ramp's knee. None: no level met the SLO.
    operating_point: dict[str, Any] | None = None
    model: str
    app_name: str
    url: str
    address: str | None  # the Ray cluster given with --address; None: a local Ray serve-check started
    llm_config: dict[str, Any]  # what was deployed (secrets masked), at one replica
    slo: list[str]
    runs: list[ReplicaRun] = []
    rows: list[ScalingRow] = []
    replica_pids: list[int] = []  # the replicas' processes (actors and vLLM's engines), gone at the end
    ramp: RampResult | None = None  # --ramp: the derived autoscaling under 1x, 3x and 1x the knee
    ramps: list[RampResult] = []  # --ramp-policy A,B / --ramp-rounds N: every ramp, in the order run (ramp: the first)
    ramp_orders: list[list[str]] = []  # each round's order of the policies, as planned (serve/ramp_rounds.py)
    # the policies over the rounds: every ramp's numbers and a winner only beyond the spread between rounds; None: one
    # ramp, or a check stopped before every ramp ran
    ramp_verdict: RampComparison | None = None
    routing: RoutingResult | None = None  # --routers: each router on a shared-prefix workload
    layouts: LayoutResult | None = None  # --layouts / --budget: replicas x TP under one device budget, at one load
    stopped: str | None = None  # why the check ended before every part ran; what is here finished (None: it all ran)
    # the model's download where the replicas run, before the first deployment (servetune/prefetch.py); [] none
    prefetch: list[WeightsPrefetch] = []


def scaling_rows(runs: list[ReplicaRun], bare_levels: list[LevelResult]) -> list[ScalingRow]:
    """Every (replica count, level) measured, with the bare engine's numbers and the scaling efficiency.

    The bare engine's overhead is read at the same offered load; scaling is against the one-replica
    run at the same level (None when 1 replica was not measured).
    """
    one = next((run for run in runs if run.replicas == 1), None)
    rows = []
    for run in runs:
        for level in run.levels:
            s = level.summary
            bare = find_level(bare_levels, s.level)
            single = find_level(one.levels, s.level) if one is not None else None
            bare_ttft = bare.summary.ttft_ms.p50 if bare is not None else None
            rows.append(
                ScalingRow(
                    replicas=run.replicas,
                    level=dict(s.level),
                    goodput=s.goodput,
                    request_throughput=s.request_throughput,
                    output_throughput=s.output_throughput,
                    ttft_ms_p50=s.ttft_ms.p50,
                    ttft_ms_p99=s.ttft_ms.p99,
                    tpot_ms_p50=s.tpot_ms.p50,
                    tpot_ms_p99=s.tpot_ms.p99,
                    meets_slo=level.meets_slo,
                    bare_output_throughput=bare.summary.output_throughput if bare is not None else None,
                    bare_ttft_ms_p50=bare_ttft,
                    ttft_p50_overhead_ms=None
                    if bare_ttft is None or s.ttft_ms.p50 is None
                    else s.ttft_ms.p50 - bare_ttft,
                    scaling_efficiency=ratio(
                        s.output_throughput, run.replicas * single.summary.output_throughput if single else None
                    ),
                )
            )
    return rows
