"""The ledger's typed inputs and outputs: the engine arguments it reads and the plan it returns."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from servetune.errors import UserError


class NotPlanned(UserError):
    """A configuration the ledger cannot size (a KV cache dtype, quantization or context it does not model):
    no verdict. vLLM may well run it, so a trial starts and records vLLM's own numbers; ``plan`` says so."""


class CapacityArgs(BaseModel):
    """The vLLM engine arguments the ledger reads (snake_case, as in vLLM's ``EngineArgs``)."""

    model_config = ConfigDict(extra="forbid")

    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    # MoE layers shard over TP x DP x PCP ranks (capacity/params.py MoeShards); attention and dense layers over TP
    data_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    prefill_context_parallel_size: int = Field(1, ge=1)
    # DCP shards every KV token over its ranks (the TP ranks, or PCP's): a rank holds ceil(len / DCP) of a request
    decode_context_parallel_size: int = Field(1, ge=1)
    # Expert-parallel load balancing: E + R physical experts over the EP ranks, and a transfer buffer (params.py)
    enable_eplb: bool = False
    eplb_config: dict[str, Any] | None = None
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="None: the profile's (vLLM's) default")
    max_model_len: int | None = Field(None, ge=-1, description="-1: the longest that fits (vLLM's auto-fit)")
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    enforce_eager: bool = False
    enable_chunked_prefill: bool | None = None
    kv_cache_memory_bytes: int | None = Field(None, ge=0)
    async_scheduling: bool | None = None
    disable_hybrid_kv_cache_manager: bool | None = None
    enable_prefix_caching: bool | None = None
    mamba_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    mamba_ssm_cache_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enable_lora: bool = False
    max_loras: int | None = Field(None, ge=1)
    max_lora_rank: int | None = Field(None, ge=1)
    fully_sharded_loras: bool = False
    # Vision-language models: items per prompt per modality (0 turns one off), the processor's options
    # (``max_pixels``...), and whether vLLM skips profiling the encoder (capacity/encoder.py)
    limit_mm_per_prompt: dict[str, int | dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    skip_mm_profiling: bool = False
    # Merged into the model's Hugging Face config before planning, as vLLM merges it (capacity/hfconfig.py)
    hf_overrides: dict[str, Any] | None = None

    @field_validator("limit_mm_per_prompt", "mm_processor_kwargs", "hf_overrides", "eplb_config", mode="before")
    @classmethod
    def _json(cls, value: Any) -> Any:
        """A JSON string, as on vLLM's command line, is its object."""
        return json.loads(value) if isinstance(value, str) else value


def read_engine_args(engine_args: Mapping[str, Any]) -> CapacityArgs:
    """Pick the keys the ledger reads from a flat engine-args dict; other keys are ignored."""
    picked = {k: v for k, v in engine_args.items() if k in CapacityArgs.model_fields and v is not None}
    try:
        return CapacityArgs(**picked)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        raise UserError(f"engine argument {key}={err.get('input')!r}: {err['msg']}") from None


class Settings(BaseModel):
    """The engine settings the plan was made for, defaults resolved as vLLM resolves them."""

    model_config = ConfigDict(extra="forbid")

    device: Literal["gpu", "cpu"]
    gpu: str
    gpu_memory_gib: float | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    dtype: str
    quantization: str
    kv_cache_dtype: str
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enforce_eager: bool
    cpu_kvcache_space_gib: int | None
    kv_cache_memory_bytes: int | None = None
    profile: str


class DraftPlan(BaseModel):
    """What speculative decoding adds to the ledger (``capacity/draft.py``), per GPU (per CPU rank)."""

    model_config = ConfigDict(extra="forbid")

    method: str
    num_speculative_tokens: int
    source: str = Field(description="what the drafter is and what it shares with the target")
    parameters_b: float = Field(description="the drafter's own parameters, shared embeddings and heads excluded")
    weights_gib: float
    kv_layers: int = Field(description="attention layers whose KV the drafter keeps in the pool")
    kv_bytes_per_token: int = Field(description="the drafter's share of the KV bytes per token")
    lookahead_tokens: int = Field(description="KV slots a request's drafter writes past the verified tokens")
    verify_tokens: int = Field(description="tokens one decode step verifies for max_num_seqs requests: seqs x (1 + k)")
    decode_seqs_per_step: int = Field(description="requests one decode step can verify within max_num_batched_tokens")


class CapacityPlan(BaseModel):
    """The ledger for one replica, per GPU (per CPU rank on the CPU build), and the verdict."""

    model_config = ConfigDict(extra="forbid")

    model: str
    parameters_b: float
    settings: Settings
    requested_gib: float = Field(description="gpu_memory_utilization x GPU memory (CPU: the KV space)")
    weights_gib: float = Field(description="the target model's weights (the drafter's are in draft.weights_gib)")
    activation_gib: float
    non_torch_gib: float = Field(description="non-torch memory plus persistent runtime buffers")
    cudagraph_gib: float
    kv_cache_gib: float
    kv_bytes_per_token: int
    kv_cache_blocks: int
    kv_cache_tokens: int
    kv_gib_per_request: float = Field(description="KV one max_model_len request holds, in whole blocks")
    max_concurrency: float = Field(description="requests of max_model_len the pool holds at once")
    request_tokens: int
    max_concurrency_at_request: float
    max_num_seqs_reachable: bool
    mamba_layers: int = Field(0, description="Mamba / linear-attention layers on this rank (state per sequence)")
    mamba_state_bytes_per_sequence: int = Field(
        0, description="one sequence's conv + SSM state over this rank's Mamba layers, before page padding"
    )
    mamba_state_blocks_per_sequence: int = Field(
        0, description="pool blocks one sequence holds for its Mamba state, however short it is"
    )
    max_sequences: int | None = Field(
        None, description="Mamba models: sequences whose state and first KV blocks the pool holds at once"
    )
    fits: bool
    reason: str
    draft: DraftPlan | None = None  # speculative decoding's drafter, where the configuration has one
    lora_gib: float = Field(0.0, description="enable_lora: the adapter slots and buffers vLLM preallocates")
    encoder_cache_tokens: int = Field(0, description="vision-language models: the encoder cache vLLM sets up")
    encoder_cache_gib: float = Field(
        0.0, description="the profiled items' embeddings, held through the decoder's dummy batch (in activation_gib)"
    )
    advice: list[str] = []
    notes: list[str] = []
