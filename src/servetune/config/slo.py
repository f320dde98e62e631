"""Service-level objectives: bounds on level statistics (``ttft_ms.p99 <= 2000``).

A level meets the SLO when every bound holds. Latencies and the error rate take upper bounds; the share of
structured answers that parsed as asked (``structured_valid``) takes a lower one (``structured_valid >= 0.99``).
For goodput, each request is held to the tightest bound given for each per-request metric (TTFT, TPOT, E2EL).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from servetune.errors import UserError
from servetune.metrics import LATENCY_METRICS, PER_REQUEST_METRICS, STATS, STRUCTURED_VALID
from servetune.summary import LevelSummary

SloMetric = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "error_rate", "structured_valid"]
#: Metrics bounded from below (``min``): more is better. The others take an upper bound (``max``).
LOWER_BOUNDED = (STRUCTURED_VALID,)
#: The metrics an SLO may bound, as ``--slo`` names them.
SLO_METRICS = (*LATENCY_METRICS, "error_rate", *LOWER_BOUNDED)


class SloBound(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: SloMetric
    stat: Literal["mean", "p50", "p90", "p95", "p99"] | None = None  # None for error_rate and structured_valid
    max: float | None = Field(default=None, gt=0)  # latencies and error_rate: the level breaks it above
    min: float | None = Field(default=None, gt=0, le=1)  # structured_valid: the level breaks it below

    @model_validator(mode="after")
    def _one_side(self) -> SloBound:
        if self.metric in LOWER_BOUNDED:
            if self.min is None or self.max is not None:
                raise ValueError(f"{self.metric} takes a lower bound: {self.metric}.min=0.99")
        elif self.max is None or self.min is not None:
            raise ValueError(f"{self.metric} takes an upper bound, not a lower one")
        return self

    @model_serializer(mode="wrap")
    def _one_side_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """Written without the side it does not bound: ``{metric, stat, max}`` as before floors existed."""
        data = handler(self)
        return {k: v for k, v in data.items() if k not in ("min", "max") or v is not None}

    @property
    def name(self) -> str:
        """The flat metric name the bound applies to, e.g. ``ttft_ms_p99``."""
        return self.metric if self.stat is None else f"{self.metric}_{self.stat}"

    @property
    def lower(self) -> bool:
        """Whether the bound is a floor (``structured_valid >= 0.99``) rather than a ceiling."""
        return self.min is not None

    @property
    def limit(self) -> float:
        """The bound's value, whichever side it bounds."""
        value = self.min if self.min is not None else self.max
        assert value is not None  # (the validator gives every bound one side)
        return value

    def breaks(self, value: float) -> bool:
        """Whether a measured ``value`` breaks the bound."""
        return value < self.limit if self.lower else value > self.limit

    def slack(self, value: float) -> float:
        """How far ``value`` is past the bound, relative to it: <= 0 within it, > 0 beyond."""
        return 1.0 - value / self.limit if self.lower else value / self.limit - 1.0

    def __str__(self) -> str:
        return f"{self.name} {'>=' if self.lower else '<='} {self.limit:g}"


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bounds: tuple[SloBound, ...] = ()

    @field_validator("bounds")
    @classmethod
    def _stat_matches_metric(cls, bounds: tuple[SloBound, ...]) -> tuple[SloBound, ...]:
        for b in bounds:
            if b.metric in LATENCY_METRICS and b.stat is None:
                raise ValueError(f"{b.metric} needs a statistic, e.g. {b.metric}.p99")
            if b.metric == "error_rate" and b.stat is not None:
                raise ValueError("error_rate takes no statistic: error_rate=0.001")
            if b.metric in LOWER_BOUNDED and b.stat is not None:
                raise ValueError(f"{b.metric} takes no statistic: {b.metric}.min=0.99")
        return bounds

    def __bool__(self) -> bool:
        return bool(self.bounds)

    def request_bounds_ms(self) -> dict[str, float]:
        """Per-request thresholds for goodput: the tightest bound of each per-request metric."""
        out: dict[str, float] = {}
        for b in self.bounds:
            if b.metric in PER_REQUEST_METRICS:
                out[b.metric] = min(out.get(b.metric, b.limit), b.limit)
        return out

    def violations(self, summary: LevelSummary) -> list[str]:
        """The bounds a level breaks, as readable strings (empty when it meets the SLO)."""
        flat = summary.flat()
        broken = []
        for b in self.bounds:
            value = flat.get(b.name)
            if value is None:
                broken.append(f"{b.name} not measured")
            elif b.breaks(value):
                broken.append(f"{b.name} = {value:.4g} {'<' if b.lower else '>'} {b.limit:g}")
        return broken

    def noise_breaks(self, summary: LevelSummary, noise: float, stall_ms: float = 0.0,
                     latency_only: bool = False) -> NoiseBreaks:  # fmt: skip
        """:func:`noise_breaks` of this SLO's bounds (only its latency bounds with ``latency_only``) over a summary."""
        bounds = [b for b in self.bounds if b.metric in LATENCY_METRICS] if latency_only else self.bounds
        per = summary.total_output_tokens / summary.completed if summary.completed else None
        return noise_breaks(bounds, summary.flat(), noise, stall_ms, per)

    @classmethod
    def parse(cls, text: str, source: str = "--slo") -> Slo:
        """Parse ``ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001,structured_valid.min=0.99``."""
        bounds = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise UserError(f"{source}: '{part}' is not METRIC.STAT=BOUND (e.g. ttft_ms.p99=2000)")
            metric, _, stat = key.strip().partition(".")
            if metric not in SLO_METRICS:
                raise UserError(f"{source}: unknown metric '{metric}' (known: {', '.join(SLO_METRICS)})")
            lower = metric in LOWER_BOUNDED
            if lower and stat != "min":
                raise UserError(f"{source}: '{part}': {metric} takes a lower bound: {metric}.min=0.99")
            if stat and not lower and stat not in STATS:
                raise UserError(f"{source}: unknown statistic '{stat}' in '{part}' (known: {', '.join(STATS)})")
            try:
                bound = float(value)
            except ValueError:
                raise UserError(f"{source}: bound '{value}' in '{part}' is not a number") from None
            try:
                if lower:
                    bounds.append(SloBound(metric=metric, min=bound))
                else:
                    bounds.append(SloBound(metric=metric, stat=stat or None, max=bound))
            except ValueError as exc:
                raise UserError(f"{source}: '{part}': {_first_error(exc)}") from None
        try:
            return cls(bounds=tuple(bounds))
        except ValueError as exc:
            raise UserError(f"{source}: {_first_error(exc)}") from None


def _first_error(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", exc))
    return str(exc)


@dataclass(frozen=True)
class NoiseBreaks:
    """The bounds a measurement breaks, as readable strings, split by the verdict noise (:func:`noise_breaks`)."""

    beyond: list[str] = field(default_factory=list)  # broken beyond the noise (or not measured): a failure
    within: list[str] = field(default_factory=list)  # broken, but within the noise: no evidence of a failure

    def __bool__(self) -> bool:
        return bool(self.beyond or self.within)


def stall_off(bound: SloBound, value: float, stall_ms: float, tokens_per_request: float | None = None) -> float:
    """``value`` of ``bound``'s metric less what the load client's longest stall (``stall_ms``, load/pace.py
    ``LoopStalls``) could have added to it. A stall delays the reading of every answer in flight by up to its length,
    so a request's TTFT, end-to-end latency and one of its token gaps (ITL) by at most ``stall_ms``, and any
    percentile of them too; its TPOT (the gaps' mean) by ``stall_ms / (tokens - 1)``, over the mean output tokens per
    request where given (else the whole stall). Other metrics (error rate, structured answers) are the server's."""
    if bound.metric not in LATENCY_METRICS or stall_ms <= 0:
        return value
    if bound.metric == "tpot_ms" and tokens_per_request is not None:
        return value - stall_ms / max(tokens_per_request - 1.0, 1.0)
    return value - stall_ms


def noise_breaks(bounds: Iterable[SloBound], flat: Mapping[str, float | None], noise: float, stall_ms: float = 0.0,
                 tokens_per_request: float | None = None) -> NoiseBreaks:  # fmt: skip
    """Which ``bounds`` the measured ``flat`` numbers break beyond the verdict ``noise`` and which within it.

    A bound is broken *within the noise* when its value, less what the load client's longest stall could have added
    (:func:`stall_off`; none without ``stall_ms``), is over it by at most ``noise`` of it (relative: ``value <=
    bound * (1 + noise)``, or ``>= bound * (1 - noise)`` for a floor), the boundary included. One broken further, or
    not measured, is *beyond* it. A bound the value meets is in neither. The one rule verify's checks of a summary
    against the SLO with the noise take: the burst's admitted requests (verify/admitted.py), the overload's admitted
    TTFT (verify/overload.py), and a level whose SLO miss the client's stall accounts for (results ``stall_unsettled``).
    """
    out = NoiseBreaks()
    for b in bounds:
        value = flat.get(b.name)
        if value is None:
            out.beyond.append(f"{b.name} not measured")
            continue
        if not b.breaks(value):
            continue
        off = stall_off(b, value, stall_ms, tokens_per_request)
        within = off >= b.limit * (1.0 - noise) if b.lower else off <= b.limit * (1.0 + noise)
        (out.within if within else out.beyond).append(f"{b.name} = {value:.4g} {'<' if b.lower else '>'} {b.limit:g}")
    return out
