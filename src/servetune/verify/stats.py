"""The pure arithmetic of verification: windows of a soak, jitter and drift, growth of a gauge,
bootstrap confidence intervals and whether a lead is real, paired differences of two configurations measured
round by round, and the cancellation success rate.

Nothing here does I/O; the scenarios (``scenarios.py``) measure, these functions judge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from servetune.metrics import RequestRecord
from servetune.summary import summarize


@dataclass(frozen=True)
class Window:
    """One slice of a soak, by send time: its requests' P99 TTFT and TPOT (ms), and the requests (warm-up ones too)
    in flight across the whole slice, sent before it and not ended before its end. A window of a closed loop sends
    nothing only while every client waits on a request (a slow server, or a host that stalled the client): then
    some are in flight across it; none sent and none in flight is a pause in the load."""

    index: int
    start_s: float
    end_s: float
    requests: int
    ttft_ms_p99: float | None
    tpot_ms_p99: float | None
    in_flight: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def windows(records: Sequence[RequestRecord], count: int, level: dict[str, float]) -> list[Window]:
    """Cut the measured requests into ``count`` equal spans of send time and summarize each."""
    measured = [r for r in records if not r.warmup]
    if not measured or count < 1:
        return []
    start = min(r.sent for r in measured)
    span = max(max(r.sent for r in measured) - start, 1e-9)
    width = span / count
    out = []
    for index in range(count):
        lo, hi = start + index * width, start + (index + 1) * width
        inside = [r for r in measured if lo <= r.sent < hi or (index == count - 1 and r.sent == hi)]
        summary = summarize(inside, level)
        across = sum(r.sent < lo and (r.end is None or r.end >= hi) for r in records)
        out.append(Window(index, lo, hi, len(inside), summary.ttft_ms.p99, summary.tpot_ms.p99, across))
    return out


def jitter(values: Sequence[float | None]) -> float | None:
    """Max over min of the positive values (1.0 = perfectly steady); None with fewer than two."""
    kept = [v for v in values if v is not None and v > 0]
    return max(kept) / min(kept) if len(kept) >= 2 else None


def drift(values: Sequence[float | None]) -> float | None:
    """Last over first of the values that were measured (above 1: it got worse as the soak went on)."""
    kept = [v for v in values if v is not None and v > 0]
    return kept[-1] / kept[0] if len(kept) >= 2 else None


def window_samples(records: Sequence[RequestRecord], count: int) -> list[list[float]]:
    """The TTFTs (ms) of each window's completed requests, cut as :func:`windows` cuts them."""
    measured = [r for r in records if not r.warmup]
    if not measured or count < 1:
        return []
    start = min(r.sent for r in measured)
    width = max(max(r.sent for r in measured) - start, 1e-9) / count
    out: list[list[float]] = [[] for _ in range(count)]
    for r in measured:
        if r.ok and r.ttft_s is not None:
            out[min(int((r.sent - start) / width), count - 1)].append(r.ttft_s * 1000.0)
    return out


def chance_of_spread(samples: Sequence[Sequence[float]], observed: float | None, statistic=jitter,
                     rounds: int = 1000, seed: int = 0) -> float | None:  # fmt: skip
    """How often windows as different as observed arise by chance alone: the share of ``rounds``
    random reassignments of the same requests to windows of the same sizes whose windowed P99s
    give ``statistic`` (jitter, drift) at least ``observed``. A P99 of a few dozen requests is
    close to their maximum, so one slow request makes a window look bad; a small chance (under
    5%) says the soak's latency really moved, not its sampling. None when it cannot be judged."""
    sizes = [len(s) for s in samples]
    if observed is None or sum(1 for n in sizes if n) < 2:
        return None
    pooled = np.concatenate([np.asarray(s, dtype=float) for s in samples])
    cuts = np.cumsum(sizes)[:-1]
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(rounds):
        parts = np.split(rng.permutation(pooled), cuts)
        value = statistic([float(np.percentile(p, 99)) if len(p) else None for p in parts])
        hits += value is not None and value >= observed - 1e-12
    return hits / rounds


def growth(samples: Sequence[tuple[float, float]], share: float = 0.2) -> float | None:
    """How much a sampled value grew: the mean of its last ``share`` of samples (by time) minus the
    mean of its first; None with fewer than two samples."""
    if len(samples) < 2:
        return None
    ordered = sorted(samples)
    n = max(1, int(len(ordered) * share))
    first = [v for _, v in ordered[:n]]
    last = [v for _, v in ordered[-n:]]
    return float(np.mean(last) - np.mean(first))


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float

    def as_dict(self) -> dict:
        return asdict(self)


def _finite(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)


def _statistic(q: float | None):
    """The mean (``q`` None), else the ``q``-th percentile, as scipy's vectorized ``bootstrap`` calls it."""
    if q is None:
        return np.mean
    return lambda x, axis=-1: np.percentile(x, q, axis=axis)


def _batch(q: float | None) -> int | None:
    """Resamples drawn at once: all for a mean of a few runs; 500 for a percentile over requests, so that a
    share of many thousand requests is not resampled 4000 times in one array."""
    return None if q is None else 500


def _bootstrap_one(values: Sequence[float | None], q: float | None, confidence: float, seed: int) -> Interval | None:
    from scipy.stats import bootstrap

    data = _finite(values)
    if len(data) < 2:
        return None
    stat = _statistic(q)
    value = float(stat(data, axis=-1))
    if np.ptp(data) == 0:
        return Interval(value, value, value)
    res = bootstrap((data,), stat, confidence_level=confidence, n_resamples=4000, method="percentile",
                    vectorized=True, batch=_batch(q), random_state=np.random.default_rng(seed))  # fmt: skip
    ci = res.confidence_interval
    return Interval(value, float(ci.low), float(ci.high))


def _bootstrap_two(a: Sequence[float | None], b: Sequence[float | None], q: float | None, confidence: float,
                   seed: int) -> Interval | None:  # fmt: skip
    from scipy.stats import bootstrap

    x, y = _finite(a), _finite(b)
    if len(x) < 2 or len(y) < 2:
        return None
    one = _statistic(q)
    diff = float(one(x, axis=-1) - one(y, axis=-1))
    if np.ptp(x) == 0 and np.ptp(y) == 0:
        return Interval(diff, diff, diff)

    def stat(u, v, axis):
        return one(u, axis=axis) - one(v, axis=axis)

    res = bootstrap((x, y), stat, confidence_level=confidence, n_resamples=4000, method="percentile",
                    vectorized=True, batch=_batch(q), random_state=np.random.default_rng(seed))  # fmt: skip
    ci = res.confidence_interval
    return Interval(diff, float(ci.low), float(ci.high))


def bootstrap_mean(values: Sequence[float], confidence: float = 0.95, seed: int = 0) -> Interval | None:
    """The mean of repeated runs with a bootstrap confidence interval (scipy's ``bootstrap``, percentile)."""
    return _bootstrap_one(values, None, confidence, seed)


def bootstrap_difference(
    a: Sequence[float], b: Sequence[float], confidence: float = 0.95, seed: int = 0
) -> Interval | None:
    """mean(a) - mean(b) with a bootstrap interval, the two samples resampled independently."""
    return _bootstrap_two(a, b, None, confidence, seed)


def bootstrap_percentile(values: Sequence[float], q: float, confidence: float = 0.95, seed: int = 0) -> Interval | None:
    """The ``q``-th percentile of per-request values (P99 TTFT of a canary's share) with a bootstrap interval over
    the requests, as :func:`bootstrap_mean` (``mean`` holds the percentile)."""
    return _bootstrap_one(values, q, confidence, seed)


def bootstrap_percentile_difference(
    a: Sequence[float], b: Sequence[float], q: float, confidence: float = 0.95, seed: int = 0
) -> Interval | None:
    """percentile(a, q) - percentile(b, q) with a bootstrap interval, the two sets of requests resampled
    independently."""
    return _bootstrap_two(a, b, q, confidence, seed)


@dataclass(frozen=True)
class Lead:
    """Whether the winner is ahead of the runner-up by more than run-to-run noise."""

    verdict: str  # "real" | "within noise" | "runner-up ahead" | "not compared"
    reason: str

    @property
    def real(self) -> bool:
        return self.verdict == "real"


def lead(winner: Sequence[float], runner_up: Sequence[float], metric: str, higher_is_better: bool = True) -> Lead:
    """Real when the two confidence intervals do not overlap, or the bootstrap of the difference
    excludes 0, in the winner's favour."""
    a, b = bootstrap_mean(winner), bootstrap_mean(runner_up)
    diff = bootstrap_difference(winner, runner_up)
    if a is None or b is None or diff is None:
        return Lead("not compared", f"{metric}: fewer than two runs of one of them")
    sign = 1.0 if higher_is_better else -1.0
    ahead = (a.low > b.high) if higher_is_better else (a.high < b.low)
    behind = (b.low > a.high) if higher_is_better else (b.high < a.low)
    lo, hi = sorted((sign * diff.low, sign * diff.high))
    text = (f"{metric}: winner {a.mean:.4g} [{a.low:.4g}, {a.high:.4g}], runner-up {b.mean:.4g} [{b.low:.4g}, "
            f"{b.high:.4g}], difference {diff.mean:.4g} [{diff.low:.4g}, {diff.high:.4g}] (95% bootstrap)")  # fmt: skip
    if ahead or lo > 0:
        return Lead("real", text)
    if behind or hi < 0:
        return Lead("runner-up ahead", text)
    return Lead("within noise", text)


@dataclass(frozen=True)
class StreamTimes:
    """One stream of a drop round, in seconds from the round's start (to the millisecond): its first and
    second content chunks, its end (None: still open when the round ended), how it ended (``finished``: the server
    ended it; ``dropped``: by the round's drop; ``closed``: by verify at the round's end; else the
    client's error kind, and ``error`` its message), the content chunks it received and the output tokens the
    server reported."""

    first_s: float | None
    second_s: float | None
    end_s: float | None
    ended: str
    chunks: int
    tokens: int | None = None
    error: str | None = None

    @classmethod
    def of(cls, r: RequestRecord, ended: str) -> StreamTimes:
        def to_the_ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds, 3)

        times = r.chunk_times
        error = (r.error or "")[:160] or None if ended not in ("finished", "dropped", "closed", "open") else None
        return cls(to_the_ms(times[0] if times else None), to_the_ms(times[1] if len(times) > 1 else None),
                   to_the_ms(r.end), ended, len(times), r.output_tokens, error)  # fmt: skip


@dataclass(frozen=True)
class DropRound:
    """One round of the disconnect scenario, as the client and vLLM's ``/metrics`` saw it.

    ``before``: requests running or waiting in vLLM just before the drop; ``settled``: the same
    gauge when it first fell to the survivors vLLM should still hold (``survivors``: :func:`survivors_running`, those
    it had not finished by its own count, ``survivors_finished``; None where it gives none: those the client still
    held open) within the allowed time (``allowed_s``), else at its last sample in that time; ``fell_back_s``: how
    long that took (None: not within the allowance). ``released_s``: when the gauge fell back at
    all, within the longer watch (later than ``allowed_s``: a late release; None: still held at
    the watch's end, a leak). ``server_tokens`` / ``client_tokens``: tokens vLLM generated, and the
    survivors received, in the same span after the fall-back (None when a survivor ended first).
    In seconds from the round's start: ``first_tokens_s`` when every stream had its first tokens (or
    the wait for them ended), ``gauge_s`` the read that gave ``before``, ``drop_s`` the drop (None:
    given up before it, ``given_up`` says why); ``stream_times`` each stream's.
    """

    dropped: int
    survivors: int
    before: float
    settled: float
    fell_back_s: float | None
    server_tokens: float | None = None
    client_tokens: int | None = None
    streams: int = 0
    released_s: float | None = None
    allowed_s: float | None = None
    first_tokens_s: float | None = None
    gauge_s: float | None = None
    drop_s: float | None = None
    stream_times: tuple[StreamTimes, ...] = ()
    given_up: str | None = None
    survivors_finished: float | None = None

    @property
    def observed(self) -> bool:
        """Whether the round can judge cancellation: vLLM's gauge showed every stream before the
        drop, and at the end some were still running on the server (the survivors, as long as the
        dropped ones): had every request already ended there, a fall-back would prove nothing. A round
        given up before its drop (``given_up``: a stream ended first) judges nothing."""
        return (
            self.given_up is None
            and not math.isnan(self.before)
            and self.before >= self.dropped + self.survivors
            and self.settled > 0
        )

    @property
    def unobserved(self) -> str | None:
        """Why the round judges nothing (None: it is observed)."""
        if self.observed:
            return None
        if self.given_up is not None:
            return self.given_up
        if math.isnan(self.before):
            return "vLLM's gauges could not be read before the drop"
        if self.before < self.dropped + self.survivors:
            return f"vLLM's gauge showed {self.before:g} in flight before the drop, not every stream"
        return "every request had ended on the server by the allowance: no survivor left to tell a release by"

    @property
    def leaked(self) -> int:
        """Dropped requests vLLM still held after the allowed time."""
        return int(min(self.dropped, max(0.0, self.settled - self.survivors)))

    @property
    def extra_tokens(self) -> float | None:
        if self.server_tokens is None or self.client_tokens is None:
            return None
        return max(0.0, self.server_tokens - self.client_tokens)

    def as_dict(self) -> dict:
        return {**asdict(self), "observed": self.observed, "unobserved": self.unobserved, "leaked": self.leaked,
                "extra_tokens": self.extra_tokens}  # fmt: skip


def step_s(chunk_times: Sequence[Sequence[float]]) -> float:
    """The engine's step as streams show it: per stream, the mean gap between its chunks (from the
    first on, so the prefill is left out), the median over streams; 0 when none has two."""
    gaps = [(times[-1] - times[0]) / (len(times) - 1) for times in chunk_times if len(times) >= 2]
    return float(np.median(gaps)) if gaps else 0.0


def survivors_running(survivors: int, finished: float | None, open_by_client: int) -> int:
    """The survivors vLLM should still hold, against which its gauge of requests in flight tells a release: those it
    has not finished by its own count (``finished``: vLLM's ``request_success`` since the round began, read in the
    same scrape as the gauge, so neither runs ahead of the other). Where vLLM gives no such count, the client's count
    of survivors still open (``open_by_client``): that one lags the engine by as much as the client reads behind it, and
    a survivor the engine finished but the client had not yet read to its end would let a dropped stream still held
    pass for released."""
    if finished is None:
        return open_by_client
    return max(0, survivors - round(finished))


def cancellation_success_rate(rounds: Sequence[DropRound]) -> float | None:
    """Share of dropped streams that vLLM released in time, over the rounds its gauge observed
    (None when it observed none)."""
    seen = [r for r in rounds if r.observed]
    dropped = sum(r.dropped for r in seen)
    if not dropped:
        return None
    return sum(r.dropped - r.leaked for r in seen) / dropped


def tokens_stopped(rounds: Sequence[DropRound], share: float = 0.5, per_stream: int = 16) -> bool:
    """Whether, after each fall-back, vLLM generated no more than the survivors received, give or
    take ``share`` of it plus ``per_stream`` tokens per survivor (a client on a loaded host reads
    behind, by up to a fifth of the span seen on two cores); dropped requests it still ran would
    add as many tokens as the survivors received."""
    for r in rounds:
        extra = r.extra_tokens
        if extra is not None and extra > share * (r.client_tokens or 0) + per_stream * r.survivors:
            return False
    return True


@dataclass(frozen=True)
class PairedDifference:
    """How configuration B stands against A over rounds that measured both back to back.

    Per round, the relative difference ``(B - A) / mean(A, B)``: a slowdown of the host that scales both sides of
    a round by one factor cancels in it (and it stays finite where one side is 0). ``change``: the median of
    those; ``ratio``: the median of the rounds' B / A where both were positive (None else); ``noise``: the paired
    noise, how far one round's difference strays from the median (:func:`paired_noise`), at least the floor it was
    judged with; ``low``/``high``: a 95% interval of their mean, the wider of a bootstrap (rounds resampled as
    pairs) and Student's t (:func:`mean_interval`). ``b_ahead``: rounds in which B was the better side. The
    verdict: ``"A better"``/``"B better"`` where the interval lies wholly on one side of 0 and the median lies
    beyond the noise, the same way; else ``"tie"``. More rounds narrow the interval and leave the noise where it
    is, so a real difference larger than the noise is settled once enough rounds are measured."""

    rounds: int
    change: float
    ratio: float | None
    noise: float
    low: float | None
    high: float | None
    b_ahead: int
    verdict: str  # "A better" | "B better" | "tie"

    def as_dict(self) -> dict:
        return asdict(self)


def paired_difference(a: Sequence[float], b: Sequence[float], higher_is_better: bool = True, floor: float = 0.05,
                      seed: int = 0) -> PairedDifference | None:  # fmt: skip
    """B against A from per-round pairs ``a[i]``, ``b[i]`` (see :class:`PairedDifference`); rounds where either is
    missing or both are 0 are left out; None with fewer than two rounds left."""
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y) and x + y > 0]
    if len(pairs) < 2:
        return None
    diffs = [(y - x) / ((x + y) / 2) for x, y in pairs]
    change = float(np.median(diffs))
    ratios = [y / x for x, y in pairs if x > 0 and y > 0]
    ratio = float(np.median(ratios)) if len(ratios) == len(pairs) else None
    noise = max(floor, paired_noise(diffs))
    interval = mean_interval(diffs, seed=seed)
    low, high = (interval.low, interval.high) if interval is not None else (None, None)
    sign = 1.0 if higher_is_better else -1.0
    b_ahead = sum(1 for d in diffs if sign * d > 0)
    verdict = "tie"
    if low is not None and high is not None and abs(change) > noise:
        if sign * low > 0 and sign * high > 0 and sign * change > 0:
            verdict = "B better"
        elif sign * low < 0 and sign * high < 0 and sign * change < 0:
            verdict = "A better"
    return PairedDifference(len(pairs), change, ratio, noise, low, high, b_ahead, verdict)


def paired_noise(diffs: Sequence[float]) -> float:
    """How far one round's paired difference strays from their median: half their interquartile range.

    Half the full spread (max - min) / 2 follows the two most extreme rounds, and the extremes of more draws lie
    further out: from one distribution of rounds it nearly doubles from 3 rounds to 12 (±57% at 6 rounds of a
    drifting two-core host), so more rounds could never settle a tie. The quartiles converge instead: half the
    interquartile range is the probable error of one round (half of them lie within it of the median; 0.67 of
    the standard deviation for normal rounds) and stays where it is as rounds are added, and one wild round
    moves it little. The median absolute deviation estimates the same 0.67 sigma, but with three rounds it is
    the smaller of the two gaps to the middle round, near 0 whenever two rounds agree. The quartiles are Hyndman
    and Fan's median-unbiased ones (numpy's ``median_unbiased``): the default linear ones read the spread of
    three rounds at 0.42 sigma; these stay near 0.69 from 3 rounds to 30. With two rounds it is half their
    spread, as before."""
    if len(diffs) < 2:
        return 0.0
    low, high = np.percentile(np.asarray(diffs, dtype=float), [25, 75], method="median_unbiased")
    return float(high - low) / 2


def mean_interval(values: Sequence[float], confidence: float = 0.95, seed: int = 0) -> Interval | None:
    """The mean of ``values`` with the wider of its bootstrap interval (:func:`bootstrap_mean`) and Student's t
    interval. A percentile bootstrap cannot reach beyond the values themselves: with three rounds its 95% interval
    is their range, and three rounds of a difference that is not there fall on one side of 0 one time in four.
    Student's t widens it where there are few values; with many, the two agree, and the bootstrap keeps a skewed
    spread (a side that carried nothing in some rounds) honest."""
    boot = bootstrap_mean(values, confidence, seed)
    data = _finite(values)
    if boot is None or np.ptp(data) == 0:
        return boot
    from scipy.stats import t

    half = float(t.ppf((1 + confidence) / 2, len(data) - 1) * np.std(data, ddof=1) / math.sqrt(len(data)))
    return Interval(boot.mean, min(boot.low, boot.mean - half), max(boot.high, boot.mean + half))
