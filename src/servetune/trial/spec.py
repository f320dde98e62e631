"""A trial's spec: everything one trial needs, resolved by the study, and the hash of what decides its measurement
(its id, naming its directory). Plain data: the runner (trial/runner.py) runs it, the study builds it
(trial/context.py), and nothing here starts anything."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from servetune.capacity.prices import Pricing
from servetune.config.slo import Slo
from servetune.config.space import GPU_PARAM
from servetune.config.workload import Workload
from servetune.estimate import Efficiency
from servetune.load.runner import Level
from servetune.quality.probe import QualityPlan
from servetune.results import KNEE_FRACTION
from servetune.trial.capacity import CAPACITY_LEVELS, CAPACITY_TOLERANCE


@dataclass(frozen=True)
class TrialSpec:
    """Everything one trial needs, resolved by the study (picklable, no Ray types)."""

    study: str
    trials_dir: Path
    params: dict[str, Any]
    engine_args: dict[str, Any]
    env: dict[str, str]
    model: str
    device: str  # gpu | cpu
    devices: int
    price_per_device_hour: float
    workload: Workload
    levels: tuple[Level, ...]
    requests_per_level: int | Literal["auto"] | None
    seconds_per_level: float | None
    warmup_requests: int | None
    request_timeout_s: float
    startup_timeout_s: float
    stop_on_slo_break: bool
    min_throughput_gain: float
    slo: Slo
    capacity_levels: int = CAPACITY_LEVELS  # the capacity search's budget of levels beyond the ladder (0: none)
    capacity_tolerance: float = CAPACITY_TOLERANCE  # it stops once its bracket is this close (relative)
    knee_fraction: float = KNEE_FRACTION  # the knee: throughput gain per load increase below this share (results.py)
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    repeats: int = 1  # runs of each level; the level reports the median run
    python: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)  # placement (CUDA_VISIBLE_DEVICES, binding)
    quality: QualityPlan | None = None  # the quality probe, run before the ladder (quality/probe.py)
    node_id: str | None = None  # the Ray node the trial runs on, recorded in its environment (not in its id)
    serve_replicas: int | None = None  # run through Ray Serve LLM with this many replicas (None: the bare engine)
    pricing: Pricing | None = None  # prices by GPU type (None: price_per_device_hour as it is)
    stream_batching_ms: float | None = (
        None  # through Serve: the replicas' stream batching interval (None: Ray's default)
    )
    gpu_type: str | None = None  # the Ray accelerator type its devices are pinned to (trial/context.py pinned_gpu_type)
    # the factors its levels are estimated with (trial/estimated.py): the study's refit, None for the shipped ones
    estimate_efficiency: Efficiency | None = None
    # how ``startup_timeout_s`` was sized (capacity/startup.py StartupBudget.describe), said when a start times out
    startup_expected: str | None = None
    client_processes: int | Literal["auto"] = 1  # load.client_processes: the load client split across processes
    client_cpus: int = 1  # hardware.cpus_per_trial: what "auto" client processes may use at most

    @property
    def trial_id(self) -> str:
        """A hash of everything that decides the measurement: names the trial directory."""
        key = {
            "model": self.model, "engine_args": self.engine_args, "env": self.env,
            "workload": self.workload.model_dump(mode="json"), "levels": [str(lv) for lv in self.levels],
            "requests": self.requests_per_level, "seconds": self.seconds_per_level, "slo": [str(b) for b in self.slo.bounds],
        }  # fmt: skip
        if self.repeats != 1:  # absent when 1, so trials measured before repeats existed keep their ids
            key["repeats"] = self.repeats
        if self.quality is not None:  # likewise absent without a quality probe
            key["quality"] = self.quality.digest_key()
        if self.serve_replicas is not None:  # likewise absent for the bare engine
            key["serve_replicas"] = self.serve_replicas
        if self.stream_batching_ms is not None:  # likewise absent at Ray's default
            key["stream_batching_ms"] = self.stream_batching_ms
        if GPU_PARAM in self.params:  # the GPU type as a search dimension: one engine on another type is another trial
            key["gpu"] = self.gpu
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:12]

    @property
    def trial_dir(self) -> Path:
        return self.trials_dir / self.trial_id

    @property
    def tokenizer(self) -> str:
        """What the engine tokenizes with, so prompts are counted as it counts them: its
        ``tokenizer`` argument when the trial sets one, else the model's own."""
        return str(self.engine_args.get("tokenizer") or self.model)
