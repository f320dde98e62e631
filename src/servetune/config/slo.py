"""Service-level objectives: bounds on level statistics (``ttft_ms.p99 <= 2000``).

A level meets the SLO when every bound holds. Latencies and the error rate take upper bounds; the share of
structured answers that parsed as asked (``structured_valid``) takes a lower one (``structured_valid >= 0.99``).
For goodput, each request is held to the tightest bound given for each per-request metric (TTFT, TPOT, E2EL).
"""

from __future__ import annotations

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
