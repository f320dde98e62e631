"""Routers compared: Ray Serve's default router against Ray Serve LLM's prefix-cache-aware one, on a
shared-prefix workload, at the same replica count and the same offered load.

Per replica: the requests it handled (Serve's own counter), the tokens it served (vLLM's prompt and
generated tokens) and its prefix-cache queries and hits (vLLM's counters, in tokens). Ray Serve LLM
exports vLLM's metrics through Ray's metrics agent (``log_engine_metrics``), each sample labelled
with its replica (``ReplicaId``, the same id as Serve's ``replica`` label); :func:`read_replica_counters`
reads that text with prometheus_client's parser. From the counters: the hit rate per replica and
overall, and the load imbalance, max over mean of tokens served across the replicas deployed (a
replica that served nothing counts, as zero).

:func:`verdict` says which router to ship, only when the difference stands above noise (rule in its
docstring). Everything here is pure; ``serve/cluster.py`` reads the agent and ``serve/check.py`` deploys.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, computed_field

from servetune.engine.metrics import COUNTERS, lines_of
from servetune.errors import UserError
from servetune.results import RECORD, ClaimedCores, LevelResult

#: Router names users give (``--routers``) -> the request router class Serve is told to use
#: (None: leave ``request_router_config`` unset, Serve's default, power of two choices by queue length).
ROUTERS: dict[str, str | None] = {
    "default": None,
    "prefix-aware": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
}
#: Serve's per-replica request counter, as Ray's metrics agent exports it.
SERVE_REQUESTS = "ray_serve_deployment_request_counter"
#: vLLM's counters read per replica (our name -> vLLM's name), from engine/metrics.py.
ENGINE_COUNTERS = ("prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits")

#: The verdict's margins: a TTFT P50 difference counts above max(TTFT_MARGIN_MS, TTFT_MARGIN_SHARE x
#: the baseline's P50) -- the run-to-run spread of a level's P50 on a shared host is tens of ms and
#: up to ~10%; a hit-rate difference counts from HIT_RATE_MARGIN (absolute); a goodput drop from GOODPUT_MARGIN.
TTFT_MARGIN_MS = 20.0
TTFT_MARGIN_SHARE = 0.15
HIT_RATE_MARGIN = 0.05
GOODPUT_MARGIN = 0.10


def parse_routers(text: str) -> list[str]:
    """``default,prefix-aware`` -> the router names in the order given (no repeats); unknown names refused."""
    names = list(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise UserError(f"--routers '{text}': unknown router '{unknown[0] if unknown else ''}' "
                        f"(known: {', '.join(ROUTERS)})")  # fmt: skip
    return names


def routed_llm_config(config: Mapping[str, Any], router: str) -> dict[str, Any]:
    """``config`` (an LLMConfig as a dict) with its deployment told to use ``router``."""
    routed = copy.deepcopy(dict(config))
    deployment = routed.setdefault("deployment_config", {})
    deployment.pop("request_router_config", None)
    if ROUTERS[router] is not None:
        deployment["request_router_config"] = {"request_router_class": ROUTERS[router]}
    return routed


def router_config(config: Mapping[str, Any]) -> Any:
    """The request router ``config`` (an LLMConfig as a dict) deploys with: its ``request_router_config``, None for
    Serve's default. The ingress routes with it (serve/versions.py ``pin_ingress``)."""
    return (config.get("deployment_config") or {}).get("request_router_config") or None


#: LLM deployment options Serve applies to the running replicas (Ray 2.60's ``DeploymentConfig`` marks them
#: light-weight or reconfigured in place): a redeploy of the same version that changes only these keeps the engines.
IN_PLACE_OPTIONS = (
    "num_replicas",
    "autoscaling_config",
    "max_ongoing_requests",
    "max_queued_requests",
    "request_router_config",
)


def engine_version(config: Mapping[str, Any]) -> str:
    """The version serve-check pins the LLM deployment to: a hash of ``config`` (an LLMConfig as a dict)
    without the deployment options Serve applies in place (``IN_PLACE_OPTIONS``: the replica count, the
    autoscaling, the request router). Serve keeps a deployment's replicas when a redeploy changes only such
    options and not its version, so replica counts, the ramp's autoscaling and the routers all run on the
    engines already up (adding or stopping replicas as the count says), while any other change to the
    configuration still starts new ones."""
    deployment = {k: v for k, v in (config.get("deployment_config") or {}).items() if k not in IN_PLACE_OPTIONS}
    engine = {**config, "deployment_config": deployment}
    return hashlib.sha256(json.dumps(engine, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _engine_sample_names(ours: str) -> tuple[str, ...]:
    """Ray's names for one of vLLM's counters (``vllm:prompt_tokens`` -> ``ray_vllm_prompt_tokens_total``)."""
    return tuple("ray_" + name.replace(":", "_") + "_total" for name in COUNTERS[ours])


def read_replica_counters(
    text: str, app_name: str, deployment_prefix: str = "LLMServer"
) -> dict[str, dict[str, float]]:
    """Per replica id: ``requests`` (Serve's counter for the application's LLM deployment) and vLLM's
    ``prompt_tokens``, ``generation_tokens``, ``prefix_cache_queries``, ``prefix_cache_hits`` --
    everything Ray's metrics agent holds now (counters since each replica started), for the replicas
    Serve counted requests for in ``app_name``'s LLM deployment. Counters whose lines do not parse give nothing.

    Only the lines of these counters are parsed (``engine.metrics.lines_of``): an agent's text holds thousands of
    lines of Ray's, Serve's and vLLM's other metrics, which prometheus_client's parser reads at about 0.1 ms of a core
    each, and serve-check's ramp reads Serve's counter every second beside the engines it measures."""
    engine = {name: ours for ours in ENGINE_COUNTERS for name in _engine_sample_names(ours)}
    wanted = (SERVE_REQUESTS, *(name.removesuffix("_total") for name in engine))  # families as # TYPE names them
    found: dict[str, dict[str, float]] = {}
    try:
        families = list(text_string_to_metric_families(lines_of(text, wanted)))
    except ValueError:
        return {}
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            if sample.name in (SERVE_REQUESTS + "_total", SERVE_REQUESTS):
                if labels.get("application") != app_name or not labels.get("deployment", "").startswith(
                    deployment_prefix
                ):
                    continue
                replica, key = labels.get("replica") or labels.get("WorkerId", "?"), "requests"
            elif sample.name in engine and labels.get("ReplicaId"):
                replica, key = labels["ReplicaId"], engine[sample.name]
            else:
                continue
            counts = found.setdefault(replica, {})
            counts[key] = counts.get(key, 0.0) + float(sample.value)
    # vLLM's samples carry no application: a replica is the application's when Serve counted requests for it there.
    return {replica: counts for replica, counts in found.items() if "requests" in counts}


def merge_counters(per_node: Sequence[Mapping[str, Mapping[str, float]]]) -> dict[str, dict[str, float]]:
    """The counters of several metrics agents (one per node) as one: a replica's counts add up."""
    merged: dict[str, dict[str, float]] = {}
    for counters in per_node:
        for replica, counts in counters.items():
            into = merged.setdefault(replica, {})
            for key, value in counts.items():
                into[key] = into.get(key, 0.0) + value
    return merged


class ReplicaTraffic(BaseModel):
    """What one replica did during a router's run (counter differences)."""

    model_config = RECORD

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # ... and found there

    @computed_field  # type: ignore[prop-decorator]  # as pydantic documents; mypy rejects decorators on @property
    @property
    def tokens_served(self) -> int:
        return self.prompt_tokens + self.generation_tokens

    @computed_field  # type: ignore[prop-decorator]  # as pydantic documents; mypy rejects decorators on @property
    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries > 0 else None


def traffic_between(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, ReplicaTraffic]:
    """Per replica, what its counters grew by between two reads; replicas whose counters did not grow are left out."""
    out: dict[str, ReplicaTraffic] = {}
    for replica, counts in after.items():
        old = before.get(replica, {})
        grown = {key: round(value - old.get(key, 0.0)) for key, value in counts.items()}
        if any(v > 0 for v in grown.values()):
            out[replica] = ReplicaTraffic(**{k: max(v, 0) for k, v in grown.items()})
    return out


def imbalance(tokens_per_replica: Sequence[float], replicas: int) -> float | None:
    """Max over mean of tokens served across ``replicas`` replicas (those not in the list served
    nothing): 1.0 is even, ``replicas`` is everything on one. None when nothing was served."""
    total = sum(tokens_per_replica)
    if replicas < 1 or total <= 0:
        return None
    return max(tokens_per_replica) / (total / replicas)


def hit_rate(traffic: Sequence[ReplicaTraffic]) -> float | None:
    """Prefix-cache hits over queries, all replicas together (in tokens)."""
    queries = sum(t.prefix_cache_queries for t in traffic)
    return sum(t.prefix_cache_hits for t in traffic) / queries if queries > 0 else None


class RouterRun(ClaimedCores, BaseModel):
    """One router at ``replicas`` replicas, the workload at one level: the first on a fresh deployment,
    the next ones switched to on the same engines (prefix caches reset before the run)."""

    model_config = RECORD

    router: str
    router_class: str | None  # None: Serve's default
    replicas: int
    ready_s: float | None = None
    # None: deployed fresh; True: on engines the step before left running (Serve kept them, and added any the
    # count needs); False: meant to keep them, Serve restarted them.
    engines_reused: bool | None = None
    engine_replicas: list[str] = []  # the LLM deployment's replica actors during the run
    level: LevelResult
    per_replica: dict[str, ReplicaTraffic] = {}  # Serve replica id -> its traffic during the level

    @computed_field  # type: ignore[prop-decorator]  # as pydantic documents; mypy rejects decorators on @property
    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return hit_rate(list(self.per_replica.values()))

    @computed_field  # type: ignore[prop-decorator]  # as pydantic documents; mypy rejects decorators on @property
    @property
    def imbalance(self) -> float | None:
        return imbalance([t.tokens_served for t in self.per_replica.values()], self.replicas)

    @property
    def ttft_ms_p50(self) -> float | None:
        return self.level.summary.ttft_ms.p50

    @property
    def ttft_ms_p99(self) -> float | None:
        return self.level.summary.ttft_ms.p99

    @property
    def goodput(self) -> float | None:
        return self.level.summary.goodput


class Verdict(BaseModel):
    model_config = RECORD

    ship: str | None  # the router to ship; None: no difference above noise
    reason: str
    margins: dict[str, float]


def verdict(runs: Sequence[RouterRun]) -> Verdict | None:
    """Which router to ship, against the first router run (the baseline, normally ``default``).

    The rule, per other router: its TTFT P50 differs from the baseline's beyond the margin
    (max(TTFT_MARGIN_MS, TTFT_MARGIN_SHARE x the baseline's P50)), or its goodput is lower by more than
    GOODPUT_MARGIN, or its hit rate is higher by HIT_RATE_MARGIN or more at a TTFT P50 within the margin.
    A router that is worse beyond a margin loses; one better beyond a margin (lower TTFT P50, or a higher
    hit rate at no latency cost) wins; otherwise no router is named. With a failed request in either
    run, or a run missing TTFT, no verdict.
    """
    if len(runs) < 2:
        return None
    base = runs[0]
    margins = {"ttft_p50_ms": TTFT_MARGIN_MS, "ttft_p50_share": TTFT_MARGIN_SHARE, "hit_rate": HIT_RATE_MARGIN,
               "goodput_share": GOODPUT_MARGIN}  # fmt: skip
    best, reasons = base.router, []
    for run in runs[1:]:
        if run.level.summary.failed or base.level.summary.failed:
            return Verdict(ship=None, reason="requests failed in a run: no verdict", margins=margins)
        if run.ttft_ms_p50 is None or base.ttft_ms_p50 is None:
            return Verdict(ship=None, reason="a run has no TTFT: no verdict", margins=margins)
        margin = max(TTFT_MARGIN_MS, TTFT_MARGIN_SHARE * base.ttft_ms_p50)
        d_ttft = run.ttft_ms_p50 - base.ttft_ms_p50
        h_run, h_base = run.prefix_cache_hit_rate, base.prefix_cache_hit_rate
        d_hit = (h_run - h_base) if h_run is not None and h_base is not None else None
        hits = "" if d_hit is None else f", prefix-cache hit rate {h_run:.0%} against {h_base:.0%}"
        said = f"TTFT P50 {run.ttft_ms_p50:.0f} ms against {base.ttft_ms_p50:.0f} ms (margin {margin:.0f} ms){hits}"
        goodput_drop = (base.goodput is not None and run.goodput is not None and base.goodput > 0
                        and run.goodput < (1 - GOODPUT_MARGIN) * base.goodput)  # fmt: skip
        if d_ttft > margin or goodput_drop:
            worse = f"goodput {run.goodput:.2f} against {base.goodput:.2f} req/s" if goodput_drop else said
            reasons.append(f"{run.router} is worse than {base.router}: {worse}")
        elif d_ttft < -margin:
            best = run.router
            reasons.append(f"{run.router} is faster than {base.router}: {said}")
        elif d_hit is not None and d_hit >= HIT_RATE_MARGIN:
            best = run.router
            reasons.append(f"{run.router} reuses more of the prefix cache at no latency cost: {said}")
        else:
            return Verdict(ship=None, reason=f"no difference above noise between {run.router} and {base.router}: {said}",
                           margins=margins)  # fmt: skip
    imb = next(r.imbalance for r in runs if r.router == best)
    tail = f"; {best}'s load imbalance {imb:.2f}" if imb is not None and math.isfinite(imb) else ""
    return Verdict(ship=best, reason="; ".join(reasons) + tail, margins=margins)


class RoutingResult(BaseModel):
    """``--routers``: every router's run and the verdict."""

    model_config = RECORD

    workload: str
    replicas: int
    level: dict[str, float]
    runs: list[RouterRun] = []
    verdict: Verdict | None = None
