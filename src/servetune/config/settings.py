"""The settings sections of a search space: how a trial measures (``load``), on what hardware, what the search
optimises and how (``search``, its ``verify`` and ``estimate``), and the SLO (``slo``). The space itself, its
parameters and constraints, is config/space.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servetune.capacity.startup import LOAD_GBPS
from servetune.config.slo import Slo, SloBound
from servetune.metrics import COST_METRIC, ENERGY_METRICS, metric_names


class LoadProtocol(BaseModel):
    """How a trial measures: the load ladder on one engine launch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["concurrency", "rate"] | None = None  # default: from the workload's arrival
    levels: tuple[float, ...] | None = None  # default: the workload's levels
    # Measured requests per level; "auto": 8 per client in flight (30 s of a rate), 32 to 500.
    requests_per_level: int | Literal["auto"] | None = "auto"
    seconds_per_level: float | None = Field(default=None, gt=0)
    # Runs of each level on the same engine; the level reports the median run, so its SLO verdict
    # is the majority's (a stall of a shared host breaks one run, not the level). 1: run once.
    repeats: int = Field(default=1, ge=1, le=9)
    warmup_requests: int | None = Field(default=None, ge=0)  # default: one per client, at most 32
    request_timeout_s: float = Field(default=300.0, gt=0)
    # "auto": sized from the checkpoint's bytes, read at ``weights_load_gbps``, and the compile and CUDA-graph
    # allowances (capacity/startup.py); a number: that many seconds, whatever the model.
    startup_timeout_s: Annotated[float, Field(gt=0)] | Literal["auto"] = "auto"
    weights_load_gbps: float = Field(default=LOAD_GBPS, gt=0)  # the nodes' storage read rate the budget assumes
    stop_on_slo_break: bool = True
    # Closed loops: stop climbing below this gain of output tok/s with every client busy. An open loop
    # stops once the engine falls behind its rate, beyond the level's noise (trial/ladder.py).
    min_throughput_gain: float = Field(default=0.03, ge=0)
    # The capacity search (trial/capacity.py): after the ladder, up to this many more levels on the same
    # engine bisect toward the highest load meeting the SLO, until the bracket is within
    # ``capacity_tolerance`` (relative). 0: the ladder alone, as before.
    capacity_levels: int = Field(default=4, ge=0, le=16)
    capacity_tolerance: float = Field(default=0.10, gt=0, lt=1)
    # The knee (results/limits.py find_knee): the lowest load past which output throughput grows by less than this
    # share of proportional growth with load (0.5: doubling the load adds less than half).
    knee_fraction: float = Field(default=0.5, gt=0, lt=1)
    # Stop at a level where a finished trial was cheaper and had a lower P99 TTFT there
    # (study/early_stop.py). Default: on for Bayesian search (tpe, nsga2, gp), off for grid and random.
    stop_when_dominated: bool | None = None
    # Client processes a level's load is split across (load/shard.py): 1 reads every stream in this process, as
    # before; "auto" sizes each level from its expected token rate and ``hardware.cpus_per_trial``.
    client_processes: int | Literal["auto"] = 1

    @field_validator("client_processes", mode="before")
    @classmethod
    def _client_processes(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f'expected a whole number of client processes (at least 1) or "auto", got {value!r}')

    @field_validator("requests_per_level", mode="before")
    @classmethod
    def _requests(cls, value: object) -> object:
        if value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError(f'expected a whole number of requests (at least 1), "auto" or null, got {value!r}')

    @model_validator(mode="after")
    def _ends(self) -> LoadProtocol:
        if self.requests_per_level is None and self.seconds_per_level is None:
            raise ValueError("a level needs requests_per_level or seconds_per_level")
        if self.levels is not None and (not self.levels or min(self.levels) <= 0):
            raise ValueError("levels must be positive numbers")
        return self


class Hardware(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    devices_per_node: int = Field(default=1, ge=1)  # GPUs per node (cores on the CPU stand-in)
    cpus_per_trial: int = Field(default=1, ge=1)  # CPUs reserved beside the GPUs of a trial
    gpu: str | None = None  # GPU model for the capacity check (e.g. H100-SXM); default: detected
    gpu_memory_gib: float | None = Field(default=None, gt=0)


class Objective(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str
    mode: Literal["min", "max"]

    @field_validator("metric")
    @classmethod
    def _known(cls, metric: str) -> str:
        known = [*metric_names(), COST_METRIC, *ENERGY_METRICS]
        if metric not in known:
            raise ValueError(f"unknown metric '{metric}'")
        return metric


class VerifyTop(BaseModel):
    """``search.verify``: at the study's end, ``servetune verify``'s scenarios on its ``top`` best
    points (the recommendation first, then the other candidates cheapest first), each on devices
    reserved through Ray as a trial's are (study/verify_top.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    top: int = Field(ge=1)  # how many points, at most (fewer when fewer meet the SLO)
    duration_s: float | None = Field(default=None, gt=0)  # the soak; default: verify's own (600 s on GPUs, 60 on CPU)


class SearchEstimate(BaseModel):
    """What the study does with the estimate (servetune.estimate) before it measures (study/prune.py, study/forecast.py).

    ``prune``: skip a trial, recorded as PRUNED, when its optimistic estimate widened by the estimate's expected
    error misses the SLO at every level of the ladder, or a finished trial's measured point dominates it.
    ``seed``: a Bayesian study (tpe, nsga2, gp) proposes the estimate's likely winners first (``seed_trials`` of
    them; None: min(4, a quarter of the trials)).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prune: bool = False
    seed: bool = True
    seed_trials: int | None = Field(default=None, ge=0)


class Search(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm: Literal["grid", "random", "tpe", "nsga2", "gp"] = "grid"
    num_trials: int | None = Field(default=None, ge=1)  # grid: all points unless capped
    # Trials at once; "auto": fill the cluster's GPUs (study/packing.py resolve_max_concurrent), one on CPU.
    max_concurrent: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    objectives: tuple[Objective, ...] = (Objective(metric="goodput", mode="max"),)
    seed: int = 0
    baseline: bool = True  # run vLLM's defaults (only the fixed engine arguments) too: first, or in packing order
    verify: VerifyTop | None = None  # verify the best points once the trials are done
    estimate: SearchEstimate = SearchEstimate()  # prune by the estimate, seed Bayesian search with it
    # Draw each integer range of an argument in vLLM's compile-cache key (max_num_seqs, max_num_batched_tokens,
    # max_model_len...: config/graphs.py) at the grid's values, powers of two for a log range, so that trials
    # share compiled graphs through their node's compile cache instead of each compiling its own.
    graph_steps: bool = False

    @model_validator(mode="after")
    def _objectives(self) -> Search:
        if not self.objectives:
            raise ValueError("objectives: give at least one")
        if self.algorithm in ("tpe", "gp") and len(self.objectives) > 1 and self.algorithm == "gp":
            raise ValueError("gp optimizes a single objective; use nsga2 or tpe for several")
        return self


class SloFloor(BaseModel):
    """A lower bound: ``{min: 0.99}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: float = Field(gt=0, le=1)


class SloSpec(BaseModel):
    """``ttft_ms: {p95: 800, p99: 2000}``, ``error_rate: 0.001``, ``structured_valid: {min: 0.99}`` (the share of
    structured answers that parsed as asked; the workload must ask for structured output)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: dict[Literal["mean", "p50", "p90", "p95", "p99"], float] = {}
    tpot_ms: dict[Literal["mean", "p50", "p90", "p95", "p99"], float] = {}
    itl_ms: dict[Literal["mean", "p50", "p90", "p95", "p99"], float] = {}
    e2el_ms: dict[Literal["mean", "p50", "p90", "p95", "p99"], float] = {}
    error_rate: float | None = Field(default=None, gt=0, le=1)
    # A floor on the share of structured answers that parsed as asked (the workload must ask for structured output).
    structured_valid: SloFloor | None = None

    def to_slo(self) -> Slo:
        bounds = []
        for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            for stat, bound in getattr(self, metric).items():
                bounds.append(SloBound(metric=metric, stat=stat, max=bound))
        if self.error_rate is not None:
            bounds.append(SloBound(metric="error_rate", max=self.error_rate))
        if self.structured_valid is not None:
            bounds.append(SloBound(metric="structured_valid", min=self.structured_valid.min))
        return Slo(bounds=tuple(bounds))
