"""One load level's requests, summarized: the latency statistics, throughputs and goodput of a level
(:class:`LevelSummary`, :func:`summarize`), and what else a level's records tell (how synchronized its clients
were, whether its tokens came in bursts, the shape of its TTFTs, and what the ladder judges saturation on).
The names and the per-request definitions are :mod:`servetune.metrics`'.

Per level: throughputs over the measured window (first measured send -> last measured end),
goodput = requests per second that met every per-request SLO bound.

That window holds the level's ramp-up and its drain (the last answers after the last send), so
its throughput understates a short level's. What the ladder judges saturation on leaves them out
(:func:`busy_window` for closed loops, :func:`ttft_growth` for open loops), a level's
cost is priced at the busy rate where it was measured (:attr:`LevelSummary.steady_output_throughput`),
and its goodput is counted over that same window (:func:`goodput_in`; ``whole_level_goodput`` keeps the
whole window's, as ``vllm bench serve`` divides).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, computed_field

from servetune.metrics import (
    CONVERSATION_METRICS,
    DISTRIBUTION_PERCENTILES,
    LATENCY_METRICS,
    PERCENTILES,
    RATE_METRICS,
    STATS,
    STRUCTURED_VALID,
    RequestRecord,
    not_honoured_metric,
    turn_cache_hit_rate,
    turn_prompt_tokens,
)


class LatencyStats(BaseModel):
    """Mean and percentiles of one latency metric, in milliseconds (None with no samples)."""

    model_config = ConfigDict(extra="ignore")  # a record: see results.RECORD

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    count: int = 0

    @classmethod
    def of(cls, values_ms: Sequence[float]) -> LatencyStats:
        if not len(values_ms):
            return cls()
        arr = np.asarray(values_ms, dtype=float)
        pct = np.percentile(arr, list(PERCENTILES.values()))
        return cls(
            mean=float(arr.mean()), count=len(arr), **{k: float(v) for k, v in zip(PERCENTILES, pct, strict=True)}
        )


class TurnStats(BaseModel):
    """One turn position of a level's conversations (``turn`` 0 is the first; reports number them from 1): its
    completed requests, their mean prompt tokens and TTFT, and their prefix-cache hit rate."""

    model_config = ConfigDict(extra="ignore")

    turn: int
    requests: int
    ttft_ms_mean: float | None
    # cached over prompt tokens of the requests whose answers said what they had cached (vLLM with
    # --enable-prompt-tokens-details); None: none said, the hit rate was not reported (never estimated)
    cache_hit_rate: float | None
    prompt_tokens_mean: float | None = None
    cache_reported: int = 0  # of ``requests``, those whose answers reported their cached tokens


class ConversationStats(BaseModel):
    """A multi-turn level's numbers per conversation, and per turn position.

    A conversation counts when every turn it sent was measured and completed (one with a warm-up or failed turn
    is left out, and counted in ``left_out``; one the level's end cut short counts the turns it sent). Its TTFT
    is told twice: the mean of its turns' (what its user sat through on average) and its worst turn's (what they
    remember); its E2E runs from its first turn sent to its last turn's end, so the think times between turns
    are included (``think_ms_mean`` says how much of it they were, with the client's own gaps). Each is given as
    mean and percentiles over the level's conversations. ``by_turn`` holds every measured, completed turn.
    """

    model_config = ConfigDict(extra="ignore")

    conversations: int
    ttft_ms: LatencyStats
    e2el_ms: LatencyStats
    by_turn: list[TurnStats]
    ttft_worst_ms: LatencyStats = Field(default_factory=LatencyStats)
    think_ms_mean: float | None = None  # per conversation: its turns' starts after the previous turn's end
    left_out: int = 0

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> ConversationStats | None:
        """Over ``records`` (warm-up included) that belong to a conversation (None: none does)."""
        sessions: dict[int, list[RequestRecord]] = {}
        for r in records:
            if r.session is not None:
                sessions.setdefault(r.session, []).append(r)
        if not sessions:
            return None
        whole = [
            sorted(rs, key=lambda r: r.turn) for rs in sessions.values() if all(_done(r) and not r.warmup for r in rs)
        ]
        ttfts = [[(r.ttft_s or 0.0) * 1000.0 for r in rs] for rs in whole]
        thinks = [sum(b.sent - (a.end or a.sent) for a, b in itertools.pairwise(rs)) * 1000.0 for rs in whole]
        turns = [r for r in records if r.session is not None and not r.warmup and _done(r)]
        by_turn = []
        for turn in sorted({r.turn for r in turns}):
            at = [r for r in turns if r.turn == turn]
            told = [r for r in at if r.cached_tokens is not None and r.prompt_tokens]
            hit = sum(r.cached_tokens or 0 for r in told) / sum(r.prompt_tokens or 0 for r in told) if told else None
            prompts = [r.prompt_tokens for r in at if r.prompt_tokens is not None]
            by_turn.append(TurnStats(
                turn=turn, requests=len(at), ttft_ms_mean=float(np.mean([r.ttft_s or 0.0 for r in at])) * 1000.0,
                cache_hit_rate=hit, prompt_tokens_mean=float(np.mean(prompts)) if prompts else None,
                cache_reported=len(told),
            ))  # fmt: skip
        return cls(
            conversations=len(whole),
            ttft_ms=LatencyStats.of([float(np.mean(t)) for t in ttfts]),
            ttft_worst_ms=LatencyStats.of([max(t) for t in ttfts]),
            e2el_ms=LatencyStats.of([((rs[-1].end or 0.0) - rs[0].sent) * 1000.0 for rs in whole]),
            think_ms_mean=float(np.mean(thinks)) if thinks else None,
            left_out=sum(any(not r.warmup for r in rs) for rs in sessions.values()) - len(whole),
            by_turn=by_turn,
        )

    def flat(self) -> dict[str, float]:
        """``conversation_ttft_ms_p99``... and per turn ``conversation_turn1_cache_hit_rate``... (metrics.py)."""
        out: dict[str, float] = {}
        for name, stats in zip(CONVERSATION_METRICS, (self.ttft_ms, self.ttft_worst_ms, self.e2el_ms), strict=True):
            out.update({f"{name}_{k}": v for k in STATS if (v := getattr(stats, k)) is not None})
        for t in self.by_turn:
            if t.prompt_tokens_mean is not None:
                out[turn_prompt_tokens(t.turn + 1)] = t.prompt_tokens_mean
            if t.cache_hit_rate is not None:
                out[turn_cache_hit_rate(t.turn + 1)] = t.cache_hit_rate
        return out


def _done(r: RequestRecord) -> bool:
    return r.ok and r.ttft_s is not None and r.end is not None


class LevelSummary(BaseModel):
    """One load level, measured: the operating point's numbers."""

    model_config = ConfigDict(extra="ignore")  # a record: see results.RECORD

    level: dict[str, float]  # {"concurrency": 16} or {"rate": 8.0}
    duration_s: float
    completed: int
    failed: int
    warmup_excluded: int
    errors_by_kind: dict[str, int]
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    input_throughput: float
    total_token_throughput: float
    # over the window the level's cost is priced at (goodput_window); None when no per-request SLO was given
    goodput: float | None
    error_rate: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2el_ms: LatencyStats
    # What the ladder judges saturation on, free of the level's ramp-up and drain (None for the
    # other kind of level, a level too short to tell, or a record from before they were kept):
    busy_output_throughput: float | None = None  # closed loops: output tok/s with every client busy
    send_span_s: float | None = None  # open loops: first measured send -> last
    ttft_growth: float | None = None  # open loops: s of TTFT gained per s of sending (see ttft_growth)
    ttft_growth_low: float | None = None  # the low end of its 95% confidence interval
    # Goodput over the whole measured window, drain included, as vllm bench serve's request_goodput (None without a
    # per-request SLO, or in a record from before it was kept, whose goodput is over that window)
    whole_level_goodput: float | None = None
    # Of the completed requests that asked for structured output (a JSON schema, choices, a regex), the share
    # whose answers parsed as asked (None: none asked, or only for grammars)
    structured_valid: float | None = None
    # Of the completed requests that asked for n > 1 choices or for logprobs, those whose answers lacked them, per
    # ask (``n``, ``logprobs``; load/client.py): the engine took the request and did not do what it asked
    # (None: every answer carried what it asked, or none asked)
    not_honoured: dict[str, int] | None = None
    conversations: ConversationStats | None = None  # workloads with sessions: per-conversation numbers
    requests_by_adapter: dict[str, int] | None = None  # workloads with LoRA adapters: completed requests per adapter
    # Vision-language workloads: the images the level's measured requests carried, and their pixels in all
    # (None: no request carried one)
    images_sent: int | None = None
    image_pixels: int | None = None
    # Why requests failed, beside ``errors_by_kind``: the first error text of each kind, and the failed requests per
    # request class where the workload names classes (a structured class failing alone points at its backend);
    # None where none failed, or in a record from before they were kept
    error_examples: dict[str, str] | None = None
    failed_by_class: dict[str, int] | None = None

    @property
    def steady_output_throughput(self) -> float:
        """Output tok/s with every client busy where it was measured (``busy_output_throughput``), else over the
        whole level (open loops, levels too short to tell, records from before it was kept): what the level's
        ``cost_per_mtok_usd`` is priced at and the ladder judges saturation on. The whole level's
        ``output_throughput`` (as ``vllm bench serve`` divides) includes the last wave's drain, which prices a
        short closed loop at high concurrency up to ~1.5x its steady cost."""
        return self.busy_output_throughput if self.busy_output_throughput is not None else self.output_throughput

    @computed_field  # type: ignore[prop-decorator]
    @property
    def priced_by(self) -> Literal["busy_output_throughput", "output_throughput"]:
        """Which throughput ``steady_output_throughput`` (and so the level's cost) is: written into the record,
        worked out again from the record when read."""
        return "busy_output_throughput" if self.busy_output_throughput is not None else "output_throughput"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def goodput_window(self) -> Literal["every_client_busy", "whole_level"] | None:
        """Which window ``goodput`` counts over: a closed loop's with every client busy, the cost's, where it was
        measured, else the whole level's (as in records from before ``whole_level_goodput`` was kept)."""
        if self.goodput is None:
            return None
        busy = self.busy_output_throughput is not None and self.whole_level_goodput is not None
        return "every_client_busy" if busy else "whole_level"

    def flat(self) -> dict[str, float]:
        """``{"ttft_ms_p99": ..., "output_throughput": ...}`` with every metric that has a value."""
        out: dict[str, float] = {}
        for metric in LATENCY_METRICS:
            stats: LatencyStats = getattr(self, metric)
            for stat in STATS:
                value = getattr(stats, stat)
                if value is not None:
                    out[f"{metric}_{stat}"] = value
        for name in RATE_METRICS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.structured_valid is not None:
            out[STRUCTURED_VALID] = self.structured_valid
        if self.conversations is not None:
            out.update(self.conversations.flat())
        out.update({not_honoured_metric(ask): float(n) for ask, n in (self.not_honoured or {}).items()})
        return out


def meets_request_slo(record: RequestRecord, bounds_ms: Mapping[str, float]) -> bool:
    """True when a finished request is within every per-request bound (``{"ttft_ms": 2000}``)."""
    if not record.ok:
        return False
    values = {"ttft_ms": _ms(record.ttft_s), "tpot_ms": _ms(record.tpot_s), "e2el_ms": _ms(record.e2el_s)}
    for metric, bound in bounds_ms.items():
        value = values[metric]
        if metric == "tpot_ms" and value is None:  # a one-token answer has no TPOT to break
            continue
        if value is None or value > bound:
            return False
    return True


def measured_window(records: Iterable[RequestRecord]) -> tuple[float, float] | None:
    """The level's measured window on its clock: the first measured send -> the last measured end (a request
    that never ended counts at its send). What throughputs and energy per token are over; None when nothing
    was measured."""
    measured = [r for r in records if not r.warmup]
    if not measured:
        return None
    return min(r.sent for r in measured), max((r.end if r.end is not None else r.sent) for r in measured)


def summarize(
    records: Iterable[RequestRecord],
    level: Mapping[str, float],
    request_slo_ms: Mapping[str, float] | None = None,
    saturation: bool = True,
) -> LevelSummary:
    """Summarize one level; warm-up requests are left out of every number.

    ``saturation``: also what the ladder judges saturation on (``busy_output_throughput``, and goodput over its
    window; ``ttft_growth``...); a judgement in the middle of a level, in the client's event loop, leaves
    them out (the growth's fit takes tens of ms that would delay the token timestamps it records).
    """
    all_records = list(records)
    measured = [r for r in all_records if not r.warmup]
    ok = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    window = measured_window(all_records)
    duration = max(window[1] - window[0], 1e-9) if window is not None else 0.0
    total_in = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_tokens for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else 0.0

    whole_goodput = None
    if request_slo_ms:
        whole_goodput = rate(sum(meets_request_slo(r, request_slo_ms) for r in ok))
    itls = [gap * 1000.0 for r in ok for gap in r.itls_s()]
    checked = [r.structured_valid for r in ok if r.structured_valid is not None]
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(r.error_kind or "unknown", (r.error or "")[:300])
    busy = span = growth = busy_at = None
    if saturation and "concurrency" in level:
        busy_at = busy_window(all_records, int(level["concurrency"]))
    elif saturation and "rate" in level and measured:
        span = max(r.sent for r in measured) - min(r.sent for r in measured)
        growth = ttft_growth(measured)
    goodput = whole_goodput
    if busy_at is not None:  # the window the level's cost is priced at: its goodput too
        busy = output_rate_in(all_records, busy_at)
        goodput = goodput_in(all_records, busy_at, request_slo_ms) if request_slo_ms else None
    return LevelSummary(
        level=dict(level),
        duration_s=duration,
        completed=len(ok),
        failed=len(failed),
        warmup_excluded=len(all_records) - len(measured),
        errors_by_kind=dict(Counter(r.error_kind or "unknown" for r in failed)),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=rate(len(ok)),
        output_throughput=rate(total_out),
        input_throughput=rate(total_in),
        total_token_throughput=rate(total_in + total_out),
        goodput=goodput,
        error_rate=len(failed) / len(measured) if measured else 0.0,
        ttft_ms=LatencyStats.of([r.ttft_s * 1000.0 for r in ok if r.ttft_s is not None]),
        tpot_ms=LatencyStats.of([r.tpot_s * 1000.0 for r in ok if r.tpot_s is not None]),
        itl_ms=LatencyStats.of(itls),
        e2el_ms=LatencyStats.of([r.e2el_s * 1000.0 for r in ok if r.e2el_s is not None]),
        busy_output_throughput=busy,
        whole_level_goodput=whole_goodput,
        send_span_s=span,
        ttft_growth=None if growth is None else growth[0],
        ttft_growth_low=None if growth is None else growth[1],
        structured_valid=float(np.mean(checked)) if checked else None,
        not_honoured=dict(Counter(ask for r in ok for ask in r.not_honoured or ())) or None,
        conversations=ConversationStats.of(all_records),
        requests_by_adapter=dict(Counter(r.adapter for r in ok if r.adapter is not None)) or None,
        images_sent=sum(r.images for r in measured) or None,
        image_pixels=sum(r.image_pixels for r in measured) or None,
        error_examples=examples or None,
        failed_by_class=dict(Counter(r.request_class for r in failed if r.request_class)) or None,
    )


def send_sync_share(records: Iterable[RequestRecord], window_s: float = 0.010) -> float | None:
    """How synchronized a level's clients were: the share of measured requests sent within
    ``window_s`` of another request (any, warm-up included). Near 1: the clients move in waves."""
    everything = sorted(records, key=lambda r: r.sent)
    sends = [r.sent for r in everything]
    measured = [i for i, r in enumerate(everything) if not r.warmup]
    if len(sends) < 2 or not measured:
        return None
    close = sum(
        (i > 0 and sends[i] - sends[i - 1] <= window_s) or (i + 1 < len(sends) and sends[i + 1] - sends[i] <= window_s)
        for i in measured
    )
    return close / len(measured)


#: A gap between two chunks of one stream shorter than this was not an engine step: the chunks
#: came together (the server sent them in one go, or the client read them late). vLLM's CPU
#: build with the tiny model does this for about half its gaps even at concurrency 1.
BURST_GAP_S = 0.001
#: From this share of burst gaps on, a level's ITL is flagged (``itl_note``).
BURST_NOTE_SHARE = 0.2


def itl_burst_share(records: Iterable[RequestRecord], gap_s: float = BURST_GAP_S) -> float | None:
    """Share of the measured, finished requests' token gaps shorter than ``gap_s`` (None without gaps)."""
    gaps = [g for r in records if not r.warmup and r.ok for g in r.itls_s()]
    return sum(g < gap_s for g in gaps) / len(gaps) if gaps else None


def itl_note(share: float | None) -> str | None:
    """What a level says when its tokens were read in bursts (None when they were not)."""
    if share is None or share < BURST_NOTE_SHARE:
        return None
    return (
        f"tokens read in bursts: {share:.0%} of token gaps under {BURST_GAP_S * 1000:g} ms (sent together by the "
        "server, or read late by the client): ITL percentiles understate the engine's step, TPOT does not"
    )


#: How a level's note names each ask an answer lacked (``LevelSummary.not_honoured``).
_LACKED = {"n": "fewer choices than n", "logprobs": "no logprobs"}


def asks_note(summary: LevelSummary) -> str | None:
    """What a level says of what its requests asked beyond text: the share of structured answers that parsed as
    asked, and the answers that lacked an ask (None when the workload asked for neither)."""
    parts = []
    if summary.structured_valid is not None:
        parts.append(f"{summary.structured_valid:.0%} of structured answers parsed as asked")
    if summary.not_honoured:
        lacked = ", ".join(
            f"{count} with {_LACKED.get(ask, ask)}" for ask, count in sorted(summary.not_honoured.items())
        )
        parts.append(f"answers without what they asked: {lacked}")
    return "; ".join(parts) or None


def ttft_distribution_ms(records: Iterable[RequestRecord]) -> list[float] | None:
    """The measured requests' TTFT in ms at :data:`DISTRIBUTION_PERCENTILES`: the whole shape
    (waves show as a step), not just P50/P99. None without a measured first token."""
    ttfts = [r.ttft_s * 1000.0 for r in records if not r.warmup and r.ok and r.ttft_s is not None]
    if not ttfts:
        return None
    return [float(v) for v in np.percentile(ttfts, DISTRIBUTION_PERCENTILES)]


#: The fewest measured requests with a first token that :func:`ttft_growth` fits a slope to, and
#: the most (evenly picked by send time): the fit compares every pair, 35 ms for 500 on two cores.
MIN_GROWTH_SAMPLES = 8
MAX_GROWTH_SAMPLES = 500


def ttft_growth(records: Iterable[RequestRecord]) -> tuple[float, float] | None:
    """Open loops: how fast TTFT grew through the level, in seconds per second of sending, and the
    low end of its 95% confidence interval (Theil-Sen slope of TTFT against send time, measured
    requests only; None with fewer than :data:`MIN_GROWTH_SAMPLES`).

    Arrivals do not wait for answers, so an engine that keeps up with ``r`` req/s holds TTFT level
    (about 0, whatever the level's drain), and one that finishes only ``m`` req/s queues the rest:
    each request waits ``r/m - 1`` seconds longer per second sent.
    """
    points = sorted((r.sent, r.ttft_s) for r in records if not r.warmup and r.ok and r.ttft_s is not None)
    if len(points) < MIN_GROWTH_SAMPLES or points[-1][0] <= points[0][0]:
        return None
    if len(points) > MAX_GROWTH_SAMPLES:
        points = [points[int(i)] for i in np.linspace(0, len(points) - 1, MAX_GROWTH_SAMPLES)]
    from scipy.stats import theilslopes  # imported here: only open loops need it

    sent, ttft = zip(*points, strict=True)
    fit = theilslopes(ttft, sent, alpha=0.95)
    return float(fit.slope), float(fit.low_slope)


def busy_window(records: Iterable[RequestRecord], clients: int) -> tuple[float, float] | None:
    """Closed loops: the window while all ``clients`` had a request in flight, on the level's clock.

    It opens once every client has sent (the staggered start is over), not before the first measured
    send, and closes at the last send: from then on a client that finishes has nothing left to send
    and the last wave drains with ever fewer requests in flight. None when the level never had every
    client busy, or for less than one request per client finished in it (too short to tell).
    """
    everything = list(records)
    measured = [r.sent for r in everything if not r.warmup]
    if clients < 1 or not measured:
        return None
    events = sorted([(r.sent, 1) for r in everything] + [(r.end, -1) for r in everything if r.end is not None],
                    key=lambda event: (event[0], event[1]))  # an end before a send at the same moment  # fmt: skip
    in_flight, full_at = 0, None
    for moment, step in events:
        in_flight += step
        if in_flight >= clients:
            full_at = moment
            break
    if full_at is None:
        return None
    start, end = max(full_at, min(measured)), max(r.sent for r in everything)
    finished = sum(1 for r in everything if r.end is not None and start < r.end <= end)
    return None if end <= start or finished < clients else (start, end)


def share_in(record: RequestRecord, window: tuple[float, float]) -> float:
    """The share of a finished request's content chunks (of one without chunks, its end) that arrived in ``window``:
    how much of it a rate over the window counts."""
    times = record.chunk_times or [t for t in (record.end,) if t is not None]
    return sum(1 for t in times if window[0] <= t <= window[1]) / len(times) if record.ok and times else 0.0


def output_rate_in(records: Iterable[RequestRecord], window: tuple[float, float]) -> float:
    """Output tok/s inside ``window``: each request's tokens counted by its chunks' arrival in it."""
    tokens = sum(share_in(r, window) * r.output_tokens for r in records if r.output_tokens and r.chunk_times)
    return tokens / (window[1] - window[0])


def goodput_in(records: Iterable[RequestRecord], window: tuple[float, float], bounds_ms: Mapping[str, float]) -> float:
    """Goodput over ``window``: the requests a second served in it, counted as :func:`output_rate_in` counts their
    tokens (warm-up included), times the share of the measured ones among them that met every bound (weighted the
    same way; a warm-up request is served in the window but held to no bound)."""
    shares = [(share_in(r, window), r) for r in records]
    judged = [(share, meets_request_slo(r, bounds_ms)) for share, r in shares if share > 0 and not r.warmup]
    met = sum(share for share, good in judged if good) / (sum(share for share, _ in judged) or 1.0)
    return sum(share for share, _ in shares) * met / (window[1] - window[0])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0
