"""A GPU twin for the fake engine: its pace taken from the estimate for the configuration it stands for.

The fake engine (:mod:`servetune.testing.fake_openai`) serves at a set TTFT and ITL. With a twin it
serves at the pace :mod:`servetune.estimate` predicts for a GPU, a model and vLLM's engine arguments
(TP, DP, ``max_num_seqs``, ``max_num_batched_tokens``, chunked prefill, the KV capacity the memory
ledger plans), so a bench's answers depend on the configuration as a GPU's do:

- TTFT of a request admitted with ``in_flight`` requests in the deployment: the replica's prefill
  (in chunks beside the running decodes, :func:`servetune.estimate.queueing.steady`), plus, past
  what a replica runs at once (``max_num_seqs``, or fewer where the KV pool runs out at the
  request's length), the time the requests queued ahead of it take to drain at the replica's
  completion rate (Little's law);
- ITL: the decode step's time at the batch running now (re-read for every token);
- noise: one multiplicative factor per engine run, lognormal with :data:`RUN_SPREAD_SIGMA`,
  clipped at three sigma, seeded;
- factors: the shipped efficiency factors of the GPU's class, or, with ``factor_scale``, those scaled
  per term: a GPU the fit does not describe, so a bench can show the online refit correcting it.

Switched on by ``SERVETUNE_FAKE_TWIN`` (JSON of :class:`TwinConfig`); the model and engine
arguments the fake is launched with (``--model DIR --max-num-seqs 32 ...``) fill what it leaves out.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.errors import UserError
from servetune.estimate import Efficiency, load_factors, replica_from_plan
from servetune.estimate.queueing import capacity, steady
from servetune.estimate.specs import gpu_class

#: Run-to-run spread of a level's throughput on one engine: half the spread of three repeats over
#: their median is 5.6% at the median of 160 levels (bench/README.md, knee_noise.py, on the
#: surfaces bench/data/cpu-tiny-grid-r3.json and -r4.json). Half the range of three normal draws
#: is 0.846 sigma on average, so sigma = 0.056 / 0.846.
RUN_SPREAD_SIGMA = round(0.056 / 0.846, 4)
NOISE_CLIP_SIGMAS = 3.0


class TwinConfig(BaseModel):
    """What the twin stands for: ``SERVETUNE_FAKE_TWIN``'s JSON."""

    model_config = ConfigDict(extra="forbid")

    gpu: str = Field(description="a GPU of the capacity catalogue, e.g. H100-SXM")
    model: str | None = Field(None, description="catalogue id or model directory (default: the fake's --model)")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments, snake_case; the fake's own flags add to them"
    )
    spread: float = Field(RUN_SPREAD_SIGMA, ge=0, description="sigma of the run's lognormal pace factor")
    seed: int | None = Field(0, description="seeds the run's factor (None: a fresh draw)")
    factor_scale: dict[str, float] = Field(
        default_factory=dict,
        description="multipliers of the shipped efficiency factors of the GPU's class, per term (e.g. "
        "{decode_bandwidth: 0.7, step_overhead_ms: 2}): a GPU unlike the fit, which a study's refit has something "
        "to correct on; empty: the shipped factors",
    )

    @field_validator("factor_scale")
    @classmethod
    def _known_terms(cls, scale: dict[str, float]) -> dict[str, float]:
        for term, value in scale.items():
            if term not in Efficiency.model_fields:
                raise ValueError(f"{term}: not an efficiency factor ({', '.join(Efficiency.model_fields)})")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{term}: its multiplier {value} is not a positive number")
        return scale

    def efficiency(self, shipped: Efficiency) -> Efficiency:
        """``shipped`` with each term of :attr:`factor_scale` multiplied; one past its bounds is a UserError."""
        if not self.factor_scale:
            return shipped
        scaled = {term: getattr(shipped, term) * value for term, value in self.factor_scale.items()}
        try:
            return Efficiency(**{**shipped.model_dump(), **scaled})
        except ValidationError as exc:
            err = exc.errors()[0]
            term = ".".join(str(p) for p in err["loc"])
            raise UserError(
                f"SERVETUNE_FAKE_TWIN: factor_scale: {term}: {getattr(shipped, term)} x {self.factor_scale[term]} "
                f"= {scaled[term]:.4g}: {err['msg']}"
            ) from None


@dataclass(frozen=True)
class Pace:
    """How the twin serves a request admitted now."""

    ttft_s: float  # admission to the first token: queueing for a slot plus prefill
    itl_s: float  # one decode step at the batch running now
    running: float  # requests per replica generating
    queued: float  # requests per replica waiting for a slot
    saturated: bool  # more requests in flight than the deployment runs at once


def engine_args_from_argv(argv: Sequence[str]) -> dict[str, Any]:
    """vLLM's command-line engine arguments as a snake_case dict: ``--max-num-seqs 32`` -> 32,
    ``--enable-chunked-prefill`` -> True, ``--no-enable-chunked-prefill`` -> False."""
    out: dict[str, Any] = {}
    items = list(argv)
    for i, arg in enumerate(items):
        if not arg.startswith("--"):
            continue
        name, eq, raw = arg[2:].partition("=")
        value: Any
        if eq:
            value = _number(raw)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            value = _number(items[i + 1])
        elif name.startswith("no-"):
            name, value = name[3:], False
        else:
            value = True
        out[name.replace("-", "_")] = value
    return out


def _number(raw: str) -> Any:
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


class Twin:
    """The estimate's pace for one configuration; :meth:`pace` is pure given the run's factor."""

    def __init__(self, config: TwinConfig, launch_args: Mapping[str, Any] | None = None) -> None:
        args = {**(launch_args or {}), **config.engine_args}
        model = config.model or args.get("model")
        if not model:
            raise UserError("SERVETUNE_FAKE_TWIN: model: give a catalogue id, or launch the fake with --model")
        self.arch = load_model_arch(str(model))
        self.engine_args = {k: v for k, v in args.items() if k != "model"}
        plan = plan_capacity(self.arch, self.engine_args, resolve_hardware("gpu", config.gpu))
        if not plan.fits:
            raise UserError(f"SERVETUNE_FAKE_TWIN: {self.arch.name} does not fit on {config.gpu}: {plan.reason}")
        self.replica = replica_from_plan(self.arch, plan, self.engine_args)
        self.efficiency = config.efficiency(load_factors().for_class(gpu_class(self.replica.rates.gpu)))
        self.dp = int(self.engine_args.get("data_parallel_size") or 1)
        self.factor = noise_factor(config.spread, config.seed)

    def slots(self, input_tokens: int, output_tokens: int) -> int:
        """Requests the deployment runs at once at this request length (all replicas)."""
        return capacity(self.replica, input_tokens, output_tokens) * self.dp

    def pace(self, in_flight: int, input_tokens: int, output_tokens: int) -> Pace:
        """The pace with ``in_flight`` requests in the deployment (this one included)."""
        ttft, itl, running, queued = self._pace(max(in_flight, 1), max(input_tokens, 1), max(output_tokens, 2))
        return Pace(ttft * self.factor, itl * self.factor, running, queued, saturated=queued > 0)

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (one twin per engine run; the cache dies with it)
    def _pace(self, in_flight: int, input_tokens: int, output_tokens: int) -> tuple[float, float, float, float]:
        per_replica = in_flight / self.dp
        cap = capacity(self.replica, input_tokens, output_tokens)
        running = min(per_replica, cap)
        queued = max(per_replica - cap, 0.0)
        s = steady(self.replica, self.efficiency, running, input_tokens, output_tokens)
        wait = queued / s.request_rate(output_tokens)
        return s.ttft_s + wait, s.tpot_s, running, queued


def noise_factor(sigma: float, seed: int | None) -> float:
    """One run's multiplicative pace factor: lognormal(0, sigma), clipped to within 3 sigma."""
    if sigma == 0:
        return 1.0
    z = float(np.random.default_rng(seed).standard_normal())
    return math.exp(sigma * max(-NOISE_CLIP_SIGMAS, min(NOISE_CLIP_SIGMAS, z)))


def twin_from_env(raw: str, launch_argv: Sequence[str]) -> Twin:
    """The twin ``SERVETUNE_FAKE_TWIN`` asks for; a bad value is one :class:`UserError` line."""
    try:
        config = TwinConfig.model_validate(json.loads(raw))
    except json.JSONDecodeError as exc:
        raise UserError(f"SERVETUNE_FAKE_TWIN: not JSON: {exc.msg} at column {exc.colno}") from None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top)"
        raise UserError(f"SERVETUNE_FAKE_TWIN: {where}: {err['msg']}") from None
    return Twin(config, engine_args_from_argv(launch_argv))
