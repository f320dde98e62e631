"""The estimate of one configuration under one load: :func:`estimate`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from servetune.capacity import VLLM_0_32, CapacityPlan, EngineProfile, Hardware, ModelArch, plan_capacity
from servetune.capacity.settings import resolve_quant
from servetune.errors import UserError
from servetune.estimate.encoder import encode_s
from servetune.estimate.expert_parallel import ExpertExchange, read_layout
from servetune.estimate.factors import Factors, load_factors
from servetune.estimate.kvread import KVRead
from servetune.estimate.pipeline import stage_exchange
from servetune.estimate.queueing import closed_loop, knee, open_loop
from servetune.estimate.roofline import Replica
from servetune.estimate.specs import DeviceRates, device_rates, gpu_class
from servetune.estimate.speculative import speculation

if TYPE_CHECKING:
    from servetune.config.workload import Workload
    from servetune.summary import LevelSummary


class Load(BaseModel):
    """Requests of ``input_tokens`` in and ``output_tokens`` out, from C clients (closed) or at R req/s (open).

    A vision-language workload's requests count their images' tokens in ``input_tokens``, and the vision tower's
    FLOPs to encode them in ``encoder_flops`` (estimate/encoder.py ``mean_encoder_flops``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input_tokens: int = Field(ge=1)
    output_tokens: int = Field(ge=2)
    concurrency: int | None = Field(None, ge=1)
    rate: float | None = Field(None, gt=0)
    encoder_flops: float = Field(0.0, ge=0, description="the vision tower's FLOPs a request needs on average")
    burstiness: float = Field(
        1.0, gt=0, description="open loop: the gaps' gamma shape (1: Poisson); the arrivals' squared CV is 1 / it"
    )
    requests: int | None = Field(
        None, ge=1, description="open loop: the level's requests, sent into an empty queue (None: the long run)"
    )

    @classmethod
    def at_level(
        cls,
        kind: str,
        value: float,
        input_tokens: int,
        output_tokens: int,
        encoder_flops: float = 0.0,
        burstiness: float = 1.0,
        requests: int | None = None,
    ) -> Load:
        """A ladder level's load: ``kind`` concurrency is ``value`` clients (rounded, at least one), else ``value``
        requests/s arriving with ``burstiness`` (:func:`arrival_burstiness`), ``requests`` of them in the level."""
        closed = kind == "concurrency"
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, encoder_flops=encoder_flops,
                   concurrency=max(1, round(value)) if closed else None, rate=None if closed else value,
                   burstiness=burstiness, requests=None if closed else requests)  # fmt: skip

    @classmethod
    def measured(cls, summary: LevelSummary, encoder_flops: float = 0.0, burstiness: float = 1.0) -> Load | None:
        """The load a measured level served: its clients or rate, its requests' mean lengths as vLLM counted them
        (an image workload's image tokens among the input tokens), and the tower's ``encoder_flops`` a request's
        images need (estimate/encoder.py ``workload_images``). None for a level that completed no request, or
        another kind of load (conversations/s): the model has none. Every estimate of a measured level takes its
        load from here: each trial's levels (trial/estimated.py) and the report's estimated GPUs (report/gpus.py)."""
        done = summary.completed
        if done <= 0:
            return None
        lengths = (max(1, round(summary.total_input_tokens / done)), max(2, round(summary.total_output_tokens / done)))
        if "concurrency" in summary.level:
            return cls.at_level("concurrency", summary.level["concurrency"], *lengths, encoder_flops)
        if summary.level.get("rate", 0.0) > 0:
            measured = done + summary.failed  # the level's requests after its warm-up, sent into an empty queue
            return cls.at_level("rate", summary.level["rate"], *lengths, encoder_flops, burstiness, measured)
        return None

    @model_validator(mode="after")
    def _one_loop(self) -> Load:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give either concurrency (closed loop) or rate (open loop)")
        return self


def arrival_burstiness(workload: Workload | None) -> float:
    """The open loop's burstiness a workload's arrivals have: its gamma shape, 1 for Poisson (and for a trace,
    whose gaps' spread the model does not read)."""
    if workload is None or workload.arrival.process != "gamma":
        return 1.0
    return workload.arrival.burstiness


class Estimate(BaseModel):
    """What a measurement of this configuration under this load should find (whole deployment, all DP replicas)."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(description="None: saturated open loop, the queue grows without bound")
    tpot_ms: float
    itl_ms: float
    output_throughput: float
    request_throughput: float
    saturated: bool
    knee: int = Field(description="concurrency (all replicas) past which throughput grows < 10 % more")
    in_flight_per_replica: float
    kv_preemption: bool
    gpu_class: str
    accepted_length: float | None = Field(
        None, description="speculative decoding: tokens a decode step yields per request (None: no drafter)"
    )
    acceptance_source: str | None = Field(None, description="whether the drafter's acceptance was measured or assumed")
    encoder_ms: float | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="the vision tower's time for a request's images, in its TTFT (absent: no images)",
    )
    slot_wait: Literal["level", "long_run"] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description="open loop: TTFT's wait for a slot is a level's of `level_requests` sent into an empty queue "
        "('level'), or the long run's where the level's length is not known ('long_run'); absent: a closed loop",
    )
    level_requests: int | None = Field(
        None, exclude_if=lambda value: value is None, description="open loop: the level's requests (all replicas)"
    )


def replica_from_plan(
    arch: ModelArch,
    plan: CapacityPlan,
    engine_args: Mapping[str, Any],
    rates: DeviceRates | None = None,
    acceptance: float | None = None,
) -> Replica:
    """The roofline's view of a replica, with the settings and KV capacity the memory ledger resolved.

    ``rates`` default to the catalogue GPU's; the CPU build needs them given (:func:`cpu_rates`). A drafter
    (``speculative_config``) is modelled with ``acceptance`` per draft position, or the method's assumed one.
    With ``pipeline_parallel_size`` p the replica is one stage of the planner's (estimate/pipeline.py), its step a
    micro-batch's through all p. An MoE model's experts (and an MoE MTP drafter's) are read as the memory ledger
    lays them over TP x DP, for every DP engine's tokens; over DP
    the MoE layers' exchange is the ``all2all_backend`` engine argument's under EP (vLLM's default where it is not
    given), the all-gather's without (estimate/expert_parallel.py).
    """
    s = plan.settings
    experts = read_layout(arch, s)
    spec = speculation(arch, plan, acceptance, tp=s.tensor_parallel_size, experts=experts)
    drafter_kv = plan.draft.kv_bytes_per_token if plan.draft is not None else 0
    quant = resolve_quant(arch, engine_args.get("quantization"))
    chunked = engine_args.get("enable_chunked_prefill")
    return Replica(
        arch=arch,
        rates=rates or device_rates(s.gpu, quant),
        quant=quant,
        tp=s.tensor_parallel_size,
        pp=s.pipeline_parallel_size,
        dtype_bytes=4 if s.dtype == "float32" else 2,
        kv=KVRead.of(arch, plan, plan.kv_bytes_per_token - drafter_kv),
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        chunked_prefill=True if chunked is None else bool(chunked),
        kv_cache_tokens=plan.kv_cache_tokens,
        speculation=spec,
        exchange=stage_exchange(
            ExpertExchange.of(
                arch,
                s.tensor_parallel_size,
                s.data_parallel_size,
                s.prefill_context_parallel_size,
                s.enable_expert_parallel,
                engine_args.get("all2all_backend"),
            ),
            arch,
            s.pipeline_parallel_size,
        ),
        experts=experts,
    )


def estimate(
    arch: ModelArch,
    engine_args: Mapping[str, Any],
    hardware: Hardware,
    load: Load,
    factors: Factors | None = None,
    env: Mapping[str, str] | None = None,
    rates: DeviceRates | None = None,
    profile: EngineProfile = VLLM_0_32,
    acceptance: float | None = None,
    draft: ModelArch | None = None,
) -> Estimate:
    """Predict TTFT, TPOT, throughput, saturation and the knee of ``arch`` served with ``engine_args``.

    ``engine_args`` is the trial config (vLLM engine arguments; ``data_parallel_size`` replicas
    share the load evenly). On vLLM's CPU build, ``env`` carries ``VLLM_CPU_KVCACHE_SPACE`` and
    ``rates`` the cores' FLOP/s and memory bandwidth (:func:`measure_cpu_rates` or :func:`cpu_rates`).
    ``profile`` is the vLLM release's memory profile the KV capacity is planned with (capacity/profile.py).
    A ``speculative_config`` is modelled as estimate/speculative.py says: ``acceptance`` is the drafter's
    measured acceptance per draft position (default: the method's assumed one), ``draft`` the draft checkpoint's
    architecture where the method loads one. The load's ``encoder_flops`` are encoded as estimate/encoder.py
    says, before each request's prefill. A configuration that does not fit raises :class:`UserError`.
    """
    if hardware.device == "cpu" and rates is None:
        raise UserError("the estimate on the CPU build needs the cores' rates (measure_cpu_rates or cpu_rates)")
    tokens = load.input_tokens + load.output_tokens
    plan = plan_capacity(arch, engine_args, hardware, env=env, request_tokens=tokens, profile=profile, draft=draft)
    if not plan.fits:
        raise UserError(f"{arch.name} does not fit: {plan.reason}")
    rep = replica_from_plan(arch, plan, engine_args, rates, acceptance)
    cls = gpu_class(rep.rates.gpu)
    eff = (factors or load_factors()).for_class(cls)
    dp = int(engine_args.get("data_parallel_size") or 1)
    encode = encode_s(rep, eff, load.encoder_flops)
    if load.concurrency is not None:
        point = closed_loop(rep, eff, load.concurrency / dp, load.input_tokens, load.output_tokens, encode)
    else:
        assert load.rate is not None
        per_replica = None if load.requests is None else load.requests / dp
        point = open_loop(rep, eff, load.rate / dp, load.input_tokens, load.output_tokens, encode, 1 / load.burstiness,
                          per_replica)  # fmt: skip
    tpot_ms = point.tpot_s * 1e3
    return Estimate(
        ttft_ms=None if point.ttft_s is None else point.ttft_s * 1e3,
        tpot_ms=tpot_ms,
        itl_ms=tpot_ms,
        output_throughput=point.request_rate * dp * load.output_tokens,
        request_throughput=point.request_rate * dp,
        saturated=point.saturated,
        knee=knee(rep, eff, load.input_tokens, load.output_tokens, encode) * dp,
        in_flight_per_replica=point.in_flight,
        kv_preemption=point.preempting,
        gpu_class=cls,
        accepted_length=None if rep.speculation is None else rep.speculation.accepted_length,
        acceptance_source=None if rep.speculation is None else rep.speculation.acceptance_source,
        encoder_ms=encode * 1e3 if load.encoder_flops > 0 else None,
        slot_wait=None if load.rate is None else "long_run" if load.requests is None else "level",
        level_requests=None if load.rate is None else load.requests,
    )
