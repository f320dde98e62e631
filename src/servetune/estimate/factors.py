"""Efficiency factors: the fraction of a GPU's peak each phase reaches, fitted on public measurements.

``data/factors.json`` is written by :func:`servetune.estimate.calibrate.fit` (``bench/estimate_accuracy.py
--write``) with the date of the fit, the SHA-256 of the data set it was fitted on and the held-out errors.
"""

from __future__ import annotations

import functools
import json
from importlib import resources

from pydantic import BaseModel, ConfigDict, Field


class Efficiency(BaseModel):
    """How close one GPU class comes to its peaks in vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decode_bandwidth: float = Field(0.7, gt=0, le=1, description="fraction of HBM bandwidth a decode step reaches")
    prefill_flops: float = Field(
        0.5, gt=0, le=1, description="fraction of peak FLOP/s prefill (and compute-bound decode) reaches"
    )
    step_overhead_ms: float = Field(2.0, ge=0, description="fixed cost of one engine step: scheduling, launches")
    sequence_overhead_ms: float = Field(0.05, ge=0, description="cost per sequence in a step: sampling, bookkeeping")
    allreduce_us: float = Field(10.0, ge=0, description="latency of one tensor-parallel all-reduce")
    closed_loop_waves: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of a closed loop's prompts that arrive in waves and prefill together (clients that "
        "finish together send again together) instead of spread over the running decodes' steps",
    )
    host_cpu_ms_per_token: float = Field(
        0.0,
        ge=0,
        description="host CPU ms one streamed output token costs, engine and front end together (the CPU build: "
        "its cores, DeviceRates.cores, stream at most cores / this tokens a second; 0: no such bound, as on GPUs)",
    )


class MetricError(BaseModel):
    """Median and 90th percentile of |predicted / measured - 1| over the held-out points."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    median: float
    p90: float
    points: int


class Factors(BaseModel):
    """The shipped fit: factors per GPU class, a pooled default, and what the fit was made on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fit_date: str = ""
    data_sha256: str = ""
    split: str = ""
    default: Efficiency = Efficiency()
    per_gpu_class: dict[str, Efficiency] = {}
    held_out_error: dict[str, MetricError] = {}

    def for_class(self, gpu_class: str) -> Efficiency:
        return self.per_gpu_class.get(gpu_class, self.default)

    def with_class(self, gpu_class: str, efficiency: Efficiency) -> Factors:
        """These factors with ``gpu_class``'s replaced (a study's refit on its own trials, estimate/refit.py)."""
        return self.model_copy(update={"per_gpu_class": {**self.per_gpu_class, gpu_class: efficiency}})


def load_factors() -> Factors:
    """The factors shipped in ``servetune/estimate/data/factors.json`` (parsed once)."""
    return _shipped()


@functools.cache
def _shipped() -> Factors:
    text = resources.files("servetune.estimate").joinpath("data/factors.json").read_text(encoding="utf-8")
    return Factors(**json.loads(text))
