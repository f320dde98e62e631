"""Service-level objectives: bounds on level statistics (``ttft_ms.p99 <= 2000``).

A level meets the SLO when every bound holds. For goodput, each request is held to the
tightest bound given for each per-request metric (TTFT, TPOT, E2EL).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from servetune.errors import UserError
from servetune.metrics import LATENCY_METRICS, PER_REQUEST_METRICS, STATS, LevelSummary

SloMetric = Literal["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "error_rate"]


class SloBound(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: SloMetric
    stat: Literal["mean", "p50", "p90", "p95", "p99"] | None = None  # None for error_rate
    max: float = Field(gt=0)

    @property
    def name(self) -> str:
        """The flat metric name the bound applies to, e.g. ``ttft_ms_p99``."""
        return self.metric if self.stat is None else f"{self.metric}_{self.stat}"

    def __str__(self) -> str:
        return f"{self.name} <= {self.max:g}"


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
        return bounds

    def __bool__(self) -> bool:
        return bool(self.bounds)

    def request_bounds_ms(self) -> dict[str, float]:
        """Per-request thresholds for goodput: the tightest bound of each per-request metric."""
        out: dict[str, float] = {}
        for b in self.bounds:
            if b.metric in PER_REQUEST_METRICS:
                out[b.metric] = min(out.get(b.metric, b.max), b.max)
        return out

    def violations(self, summary: LevelSummary) -> list[str]:
        """The bounds a level breaks, as readable strings (empty when it meets the SLO)."""
        flat = summary.flat()
        broken = []
        for b in self.bounds:
            value = flat.get(b.name)
            if value is None:
                broken.append(f"{b.name} not measured")
            elif value > b.max:
                broken.append(f"{b.name} = {value:.4g} > {b.max:g}")
        return broken

    @classmethod
    def parse(cls, text: str, source: str = "--slo") -> Slo:
        """Parse ``ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001``."""
        bounds = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise UserError(f"{source}: '{part}' is not METRIC.STAT=BOUND (e.g. ttft_ms.p99=2000)")
            metric, _, stat = key.strip().partition(".")
            if metric not in (*LATENCY_METRICS, "error_rate"):
                raise UserError(
                    f"{source}: unknown metric '{metric}' (known: {', '.join((*LATENCY_METRICS, 'error_rate'))})"
                )
            if stat and stat not in STATS:
                raise UserError(f"{source}: unknown statistic '{stat}' in '{part}' (known: {', '.join(STATS)})")
            try:
                bound = float(value)
            except ValueError:
                raise UserError(f"{source}: bound '{value}' in '{part}' is not a number") from None
            try:
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
