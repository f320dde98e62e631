"""vLLM's ``/metrics`` (Prometheus text) read with prometheus_client's parser into named values.

A :class:`MetricsSnapshot` is one scrape. The difference of two snapshots gives what happened
during a load level: preemptions, prefix-cache queries and hits, tokens, and vLLM's own TTFT,
ITL and queue-time histograms (mean and bucket-interpolated percentiles), and speculative decoding's
drafts, drafted and accepted tokens (per draft position too), with the acceptance rate and mean
accepted length they give, and the requests vLLM's admission bounds refused, by the bound that refused them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from servetune.metrics import (
    SPEC_ACCEPTANCE_RATE,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    SPEC_MEAN_ACCEPTED_LENGTH,
    spec_acceptance_at,
    spec_accepted_at,
)

#: Gauges: our name -> vLLM family names (newest first).
GAUGES = {
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
#: Gauges that are a share of one engine's capacity: several engines' do not add up.
SHARE_GAUGES = ("kv_cache_usage",)
#: The ``finished_reason`` of a request vLLM aborted: not counted among ``requests_finished``.
ABORTED = "abort"
#: Counters (family names, without ``_total``).
COUNTERS = {
    "preemptions": ("vllm:num_preemptions",),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits"),
    "prompt_tokens": ("vllm:prompt_tokens",),
    "generation_tokens": ("vllm:generation_tokens",),
    # Requests vLLM finished, by any reason but ``abort`` (label ``finished_reason``: stop, length, abort, and in newer
    # releases error; every reason's sample is written from the start): those run to their end or failed there. A
    # request aborted because its client went away is not counted by vLLM v1 (``OutputProcessor.abort_requests``
    # records no finished stats); where one is, it is left out, so the count stays what ran to its end.
    "requests_finished": ("vllm:request_success",),
    # Only a server with --speculative-config has these (vllm/v1/spec_decode/metrics.py, SpecDecodingProm).
    SPEC_DRAFTS: ("vllm:spec_decode_num_drafts",),
    SPEC_DRAFT_TOKENS: ("vllm:spec_decode_num_draft_tokens",),
    SPEC_ACCEPTED_TOKENS: ("vllm:spec_decode_num_accepted_tokens",),
}
#: What a light read (``gauges_only``) parses: the gauges, and the requests finished (a few lines, one per finish
#: reason and engine), which the disconnect scenario reads in the same scrape as the gauge it judges
#: (verify/disconnects.py: the survivors the engine finished, told by the engine rather than by a client that may
#: read behind it).
LIGHT_FAMILIES = (*(name for names in GAUGES.values() for name in names), *COUNTERS["requests_finished"])
#: Accepted tokens per draft position: one sample per position (label ``position``), per engine.
SPEC_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
#: The requests vLLM 0.32's admission bounds refused with a 503 (``AsyncLLM.check_admission`` counts each before it
#: raises), one sample per reason (label ``reason``: the engine argument whose bound refused it,
#: vllm/v1/metrics/loggers.py ``ADMISSION_REASONS``; the front end's, so no ``engine`` label).
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
REJECTED_PREFIX = "admission_rejections_"


def rejected_by(reason: str) -> str:
    """The counter (and a level's server metric) of the requests refused by ``reason``'s bound."""
    return REJECTED_PREFIX + reason


#: Histograms in seconds.
HISTOGRAMS = {
    "server_ttft": ("vllm:time_to_first_token_seconds",),
    "server_itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "server_queue": ("vllm:request_queue_time_seconds",),
    "server_e2el": ("vllm:e2e_request_latency_seconds",),
}

#: Histograms whose buckets are fine enough for interpolated percentiles.
FINE_BUCKETS = ("server_ttft", "server_itl")


@dataclass
class Histogram:
    sum: float = 0.0
    count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count

    def minus(self, other: Histogram) -> Histogram:
        return Histogram(
            self.sum - other.sum,
            self.count - other.count,
            {le: c - other.buckets.get(le, 0.0) for le, c in self.buckets.items()},
        )

    def quantile(self, q: float) -> float | None:
        """Linear interpolation inside the bucket holding quantile ``q`` (as Prometheus does)."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):
                    return lower_bound
                span = count - lower_count
                frac = (rank - lower_count) / span if span > 0 else 1.0
                return lower_bound + (le - lower_bound) * frac
            lower_bound, lower_count = le, count
        return lower_bound


@dataclass
class MetricsSnapshot:
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    @classmethod
    def parse_gauges(cls, text: str) -> MetricsSnapshot:
        """Only the gauges and the finished requests (:data:`LIGHT_FAMILIES`), from their own lines: what the
        sampler reads twice a second.

        The full text runs to thousands of histogram lines; parsing them all in the load
        client's event loop, twice a second, would delay the very token timestamps it records.
        """
        return cls.parse(lines_of(text, LIGHT_FAMILIES))

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        # Index samples by their own names: a family's declared name varies between vLLM
        # versions (``x`` or ``x_total`` for counters), the samples' names do not.
        samples: dict[str, list] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample)
        return cls.from_samples(samples)

    @classmethod
    def from_samples(cls, samples: dict[str, list]) -> MetricsSnapshot:
        """One server's snapshot from its samples (prometheus_client's), indexed by vLLM's sample names."""
        snap = cls()
        for ours, names in GAUGES.items():
            if (found := _first(samples, names)) is not None:
                # A DP>1 server has a sample per engine (label ``engine``): requests add up, and KV-cache usage,
                # each engine's share of its own cache, is the fullest engine's (as in :meth:`combined`).
                values = [s.value for s in found]
                snap.gauges[ours] = max(values) if ours in SHARE_GAUGES else sum(values)
        for ours, names in COUNTERS.items():
            if (found := _first(samples, tuple(n + "_total" for n in names))) is not None:
                snap.counters[ours] = sum(s.value for s in found if s.labels.get("finished_reason") != ABORTED)
        for s in samples.get(SPEC_PER_POSITION, []):
            at_position = spec_accepted_at(int(s.labels["position"]))
            snap.counters[at_position] = snap.counters.get(at_position, 0.0) + s.value
        for s in samples.get(ADMISSION_REJECTIONS, []):
            reason = rejected_by(s.labels.get("reason", "unknown"))
            snap.counters[reason] = snap.counters.get(reason, 0.0) + s.value
        for ours, names in HISTOGRAMS.items():
            name = next((n for n in names if n + "_count" in samples), None)
            if name is None:
                continue
            hist = Histogram(
                sum=sum(s.value for s in samples.get(name + "_sum", [])),
                count=sum(s.value for s in samples[name + "_count"]),
            )
            for s in samples.get(name + "_bucket", []):
                le = float(s.labels["le"])
                hist.buckets[le] = hist.buckets.get(le, 0.0) + s.value
            snap.histograms[ours] = hist
        return snap

    @classmethod
    def combined(cls, snaps: list[MetricsSnapshot]) -> MetricsSnapshot:
        """Several engines (a deployment's replicas) as one server: counters, histograms and request
        gauges add up; KV-cache usage is the fullest engine's (its share of its own cache)."""
        out = cls()
        for snap in snaps:
            for name, value in snap.gauges.items():
                out.gauges[name] = (
                    max(out.gauges.get(name, 0.0), value) if name in SHARE_GAUGES else out.gauges.get(name, 0.0) + value
                )
            for name, value in snap.counters.items():
                out.counters[name] = out.counters.get(name, 0.0) + value
            for name, hist in snap.histograms.items():
                into = out.histograms.setdefault(name, Histogram())
                into.sum += hist.sum
                into.count += hist.count
                for le, count in hist.buckets.items():
                    into.buckets[le] = into.buckets.get(le, 0.0) + count
        return out


def lines_of(text: str, names: tuple[str, ...]) -> str:
    """Only the lines of Prometheus ``text`` about metrics whose names start with one of ``names``:
    their samples, and their ``# TYPE``/``# HELP`` lines."""
    # A sample line starts with its name; "# TYPE name ..." and "# HELP name ..." name it third.
    kept = [
        line
        for line in text.splitlines()
        if (line.split(" ", 3)[2] if line.startswith("# ") and line.count(" ") >= 2 else line).startswith(names)
    ]
    return "\n".join(kept) + "\n"


def _first(samples: dict[str, list], names: tuple[str, ...]) -> list | None:
    for name in names:
        if name in samples:
            return samples[name]
    return None


def speculation(counted: dict[str, float]) -> dict[str, float]:
    """Acceptance from a level's speculative decoding counters (none without drafts): accepted / drafted tokens,
    1 + accepted tokens / drafts, and per draft position the share of drafts accepted there (vLLM's PromQL)."""
    drafts, drafted = counted.get(SPEC_DRAFTS), counted.get(SPEC_DRAFT_TOKENS)
    accepted = counted.get(SPEC_ACCEPTED_TOKENS, 0.0)
    if not drafts or not drafted:
        return {}
    out = {SPEC_ACCEPTANCE_RATE: accepted / drafted, SPEC_MEAN_ACCEPTED_LENGTH: 1.0 + accepted / drafts}
    position = 0
    while (at := counted.get(spec_accepted_at(position))) is not None:
        out[spec_acceptance_at(position)] = at / drafts
        position += 1
    return out


def rejections(values: Mapping[str, float]) -> dict[str, int]:
    """The requests refused by each admission bound in a level's server metrics (:func:`level_delta`), by reason
    (empty: the server counted none of its refusals there, or has no such counter)."""
    return {
        name.removeprefix(REJECTED_PREFIX): round(v) for name, v in values.items() if name.startswith(REJECTED_PREFIX)
    }


def refused_text(by_reason: Mapping[str, int]) -> str:
    """``refused 53: 41 by max_num_queued_tokens, 12 by max_num_queued_reqs`` (most first; reasons that refused
    none left out)."""
    total = sum(by_reason.values())
    parts = [f"{n} by {reason}" for reason, n in sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    return f"refused {total}" + (f": {', '.join(parts)}" if parts else "")


def level_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> dict[str, float]:
    """What the server counted between two scrapes, as flat named values."""
    out: dict[str, float] = {}
    for name, value in after.counters.items():
        out[name] = value - before.counters.get(name, 0.0)
    queries, hits = out.get("prefix_cache_queries"), out.get("prefix_cache_hits")
    if queries:
        out["prefix_cache_hit_rate"] = (hits or 0.0) / queries
    out.update(speculation(out))
    for name, hist in after.histograms.items():
        delta = hist.minus(before.histograms.get(name, Histogram()))
        if delta.count <= 0:
            continue
        out[f"{name}_ms_mean"] = delta.sum / delta.count * 1000.0
        if name not in FINE_BUCKETS:
            continue  # coarse buckets: interpolated percentiles would mislead
        for label, q in (("p50", 0.5), ("p99", 0.99)):
            quantile = delta.quantile(q)
            if quantile is not None:
                out[f"{name}_ms_{label}"] = quantile * 1000.0
    return out
