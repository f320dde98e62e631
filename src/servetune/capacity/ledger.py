"""The memory ledger of one vLLM replica, per GPU: ``plan_capacity(model, engine_args, hardware)``.

    requested  = ceil(gpu_memory_utilization x GPU memory)
    KV pool    = requested - weights - non-torch - activation peak - CUDA-graph estimate
    KV blocks  = KV pool // (block_size x KV bytes per token on this rank)
    KV tokens  = blocks / ceil(max_model_len / block_size) x max_model_len   (vLLM's own formula)

Models whose layers attend differently (sliding window, chunked local) are laid out in KV-cache
groups as vLLM's hybrid manager does (``servetune.capacity.kvgroups``): a block then holds one
page per layer of a group, and a request needs only its window's blocks in a window group.
Mamba and linear-attention layers (``servetune.capacity.mamba``) keep a fixed state per sequence
in groups of the same pool: the attention block grows until its page holds one state, and every
sequence, however short, holds its state blocks, so the pool bounds the sequences at once.

On vLLM's CPU build the pool is ``VLLM_CPU_KVCACHE_SPACE`` GiB per rank, nothing subtracted.
Pure: no I/O, no vLLM import. See ``servetune.capacity`` for the terms.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from servetune.capacity.advice import advise
from servetune.capacity.arch import ModelArch, WeightQuant
from servetune.capacity.draft import DraftCost, draft_cost, speculative_config
from servetune.capacity.hardware import GIB, Hardware
from servetune.capacity.kvdtype import FP8_DS_MLA_BYTES_PER_LAYER, KV_CACHE_DTYPES, kv_slot_bytes
from servetune.capacity.kvgroups import kv_layout
from servetune.capacity.mamba import aligned_block_size, state_bytes, tp_problem
from servetune.capacity.params import (
    activation_bytes_per_token,
    count_parameters,
    kv_bytes_per_layer_token,
    kv_bytes_per_token,
    weight_bytes_per_rank,
)
from servetune.capacity.profile import VLLM_0_32, EngineProfile, cudagraph_capture_sizes
from servetune.capacity.schema import CapacityArgs, CapacityPlan, DraftPlan, NotPlanned, Settings, read_engine_args
from servetune.errors import UserError

_DTYPES = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}
_MLA_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}
QUANTIZATIONS = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "fp8",
    "int8",
    "compressed-tensors",
    "bitsandbytes",
    "mxfp4",
    "gpt_oss_mxfp4",
    "modelopt",
    "modelopt_fp4",
    "modelopt_mxfp8",
    "fbgemm_fp8",
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _resolve_dtype(arch: ModelArch, args: CapacityArgs, quant: WeightQuant) -> str:
    dtype = _DTYPES[args.dtype]
    if dtype != "auto":
        return dtype
    if quant.method in ("awq", "gptq"):
        return "float16"
    return "bfloat16" if arch.torch_dtype == "float32" else arch.torch_dtype


def resolve_quant(arch: ModelArch, flag: str | None) -> WeightQuant:
    if flag is None:
        return arch.quant
    name = flag.lower()
    if name in ("awq", "awq_marlin"):
        return arch.quant if arch.quant.method == "awq" else WeightQuant(method="awq", bits=4, group_size=128)
    if name in ("gptq", "gptq_marlin"):
        return arch.quant if arch.quant.method == "gptq" else WeightQuant(method="gptq", bits=4, group_size=128)
    if name in ("fp8", "int8"):
        return WeightQuant(method=name, bits=8)
    if name == "w8a8":
        return WeightQuant(method="int8", bits=8)
    if name == "compressed-tensors" and arch.quant.method != "none":
        return arch.quant
    if name == "bitsandbytes":
        return WeightQuant(method="bitsandbytes", bits=4, group_size=64)
    if name in ("mxfp4", "gpt_oss_mxfp4"):
        return WeightQuant(method="mxfp4", bits=4, group_size=32)
    if name == "fbgemm_fp8":
        return WeightQuant(method="fp8", bits=8)
    if name.startswith("modelopt"):
        if arch.quant.method in ("fp8", "nvfp4", "mxfp8"):
            return arch.quant  # the checkpoint's hf_quant_config says which
        if name == "modelopt_fp4":
            return WeightQuant(method="nvfp4", bits=4, group_size=16)
        if name == "modelopt_mxfp8":
            return WeightQuant(method="mxfp8", bits=8, group_size=32)
        return WeightQuant(method="fp8", bits=8)
    raise NotPlanned(f"quantization {flag}: the planner knows {', '.join(QUANTIZATIONS)}")


def _kv_element_bytes(kv_cache_dtype: str, dtype: str, arch: ModelArch) -> float:
    """Bytes per K or V element, averaged over the head's slot (scales and packing included)."""
    if arch.is_mla:
        if kv_cache_dtype == "fp8_ds_mla":
            return FP8_DS_MLA_BYTES_PER_LAYER / ((arch.kv_lora_rank or 0) + arch.qk_rope_head_dim)
        if kv_cache_dtype in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"):
            return (4 if dtype == "float32" else 2) if kv_cache_dtype == "auto" else _MLA_BYTES[kv_cache_dtype]
        raise NotPlanned(f"kv_cache_dtype {kv_cache_dtype}: the planner knows auto, fp8 and fp8_ds_mla for MLA models")
    slot = kv_slot_bytes(kv_cache_dtype, arch.head_dim, 4 if dtype == "float32" else 2)
    if slot is None or kv_cache_dtype == "fp8_ds_mla":
        known = ", ".join(k for k in KV_CACHE_DTYPES if k != "fp8_ds_mla") + ", fp8_ds_mla (MLA models)"
        raise NotPlanned(f"kv_cache_dtype {kv_cache_dtype}: the planner knows {known}")
    return slot / (2 * arch.head_dim)


def _batch_defaults(hardware: Hardware, world_size: int) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that ``vllm serve`` picks (vLLM 0.32 ``get_batch_defaults``)."""
    if hardware.device == "cpu":
        return 2048 * world_size, 128 * world_size
    memory = hardware.memory_gib or 0.0
    if memory >= 160:
        return 16384, 1024
    if memory >= 70 and "a100" not in hardware.name.lower():
        return 8192, 1024
    return 2048, 256


def structural_problem(arch: ModelArch, tp: int, pp: int, quant: WeightQuant) -> str | None:
    """Why vLLM would refuse this parallel layout outright, or None."""
    if arch.num_attention_heads % tp:
        return f"num_attention_heads {arch.num_attention_heads} is not divisible by tensor_parallel_size {tp}"
    kv = arch.num_kv_heads
    if not arch.is_mla and kv % tp and tp % kv:
        return f"num_kv_heads {kv} and tensor_parallel_size {tp}: neither divides the other"
    if pp > arch.num_layers:
        return f"pipeline_parallel_size {pp} exceeds the model's {arch.num_layers} layers"
    if arch.mamba is not None and arch.num_mamba_layers and (problem := tp_problem(arch.mamba, tp)) is not None:
        return problem
    width = arch.moe_intermediate_size if arch.is_moe else arch.intermediate_size
    if quant.method in ("awq", "gptq") and width % tp == 0 and (width // tp) % quant.group_size:
        return (
            f"intermediate size {width} / tensor_parallel_size {tp} = {width // tp} is not a multiple of the "
            f"{quant.method.upper()} group size {quant.group_size}"
        )
    return None


def _cpu_kv_space(env: Mapping[str, str] | None) -> int | None:
    raw = (env or {}).get("VLLM_CPU_KVCACHE_SPACE")
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"VLLM_CPU_KVCACHE_SPACE={raw!r}: vLLM reads it as a whole number of GiB") from None
    if value <= 0:
        raise UserError(f"VLLM_CPU_KVCACHE_SPACE={raw!r}: must be a positive number of GiB")
    return value


def plan_capacity(
    model: ModelArch,
    engine_args: Mapping[str, Any],
    hardware: Hardware,
    env: Mapping[str, str] | None = None,
    request_tokens: int | None = None,
    profile: EngineProfile = VLLM_0_32,
    draft: ModelArch | None = None,
) -> CapacityPlan:
    """The memory ledger and verdict for ``model`` served with ``engine_args`` on ``hardware``.

    ``engine_args`` is a flat dict of vLLM engine arguments (keys the ledger does not read are
    ignored); ``env`` carries ``VLLM_CPU_KVCACHE_SPACE`` for the CPU build. ``request_tokens`` is
    the request length for the concurrency figure (default: max_model_len). Malformed values raise
    :class:`UserError`; a configuration that vLLM would refuse or that leaves no room for one
    request is a plan with ``fits=False``, its reason and advice.

    A ``speculative_config`` adds its drafter (``capacity/draft.py``): ``draft`` is the draft checkpoint's
    architecture for the methods that load one (``draft.load_draft`` reads it), else not planned.
    """
    args = read_engine_args(engine_args)
    spec = speculative_config(engine_args)
    plan = _ledger(model, args, hardware, env, request_tokens, profile, spec, draft)
    evaluate: Callable[[dict[str, Any]], CapacityPlan] = lambda change: _ledger(  # noqa: E731
        model, args.model_copy(update=change), hardware, env, request_tokens, profile, spec, draft
    )
    plan.advice = advise(model, plan, hardware, evaluate)
    return plan


def _settings(
    arch: ModelArch, args: CapacityArgs, hardware: Hardware, env: Mapping[str, str] | None, profile: EngineProfile
) -> tuple[Settings, WeightQuant]:
    """The engine settings with vLLM's defaults filled in."""
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    cpu = hardware.device == "cpu"
    quant = resolve_quant(arch, args.quantization)
    max_model_len = arch.max_position_embeddings if args.max_model_len in (None, -1) else args.max_model_len
    default_tokens, default_seqs = _batch_defaults(hardware, tp * pp)
    chunked = args.enable_chunked_prefill is not False
    if profile.v0_scheduler and not cpu:  # vLLM V0's EngineArgs and SchedulerConfig defaults
        default_tokens, default_seqs = 2048, 256
        chunked = args.enable_chunked_prefill or (args.enable_chunked_prefill is None and max_model_len > 32768)
    max_num_seqs = args.max_num_seqs or default_seqs
    batched = args.max_num_batched_tokens
    if batched is None:
        # Without chunked prefill a whole prompt is one batch: the profiling run is max_model_len tokens.
        batched = default_tokens if chunked else max(max_model_len, default_tokens)
        if not profile.v0_scheduler:
            batched = min(max_num_seqs * max_model_len, batched)
    settings = Settings(
        device=hardware.device,
        gpu=hardware.name,
        gpu_memory_gib=hardware.memory_gib,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        dtype=_resolve_dtype(arch, args, quant),
        quantization=quant.label,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization or profile.default_gpu_memory_utilization,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        block_size=args.block_size or ((16 if arch.is_mla else 128) if cpu else (64 if arch.is_mla else 16)),
        enforce_eager=args.enforce_eager,
        cpu_kvcache_space_gib=_cpu_kv_space(env) if cpu else None,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        profile=profile.name,
    )
    return settings, quant


def _gpu_overheads(
    arch: ModelArch, s: Settings, hardware: Hardware, profile: EngineProfile, query_len: int = 1
) -> tuple[float, float, float]:
    """(non-torch + buffers, activation peak, CUDA graphs) in bytes, as vLLM's profile run charges them.

    ``query_len``: tokens a decode step verifies per request (1 + num_speculative_tokens): the step's logits
    are that many rows per request, within the batched tokens."""
    tp, pp = s.tensor_parallel_size, s.pipeline_parallel_size
    act_bytes = 4 if s.dtype == "float32" else 2
    non_torch = (profile.non_torch_gib(tp, pp) + profile.runtime_buffers_gib) * GIB
    if profile.count_block_table:
        non_torch += s.max_num_seqs * _cdiv(s.max_model_len, s.block_size) * 4
    tokens = s.max_num_batched_tokens
    forward = tokens * activation_bytes_per_token(arch, act_bytes, tp)
    logits = min(s.max_num_seqs * query_len, tokens) * _cdiv(arch.vocab_size, 64) * 64
    sampler = logits * profile.sampler_bytes_per_logit + tokens * arch.hidden_size * act_bytes
    activation = max(forward, sampler) + profile.activation_base_gib * GIB
    cudagraph = 0.0
    if not s.enforce_eager and profile.subtract_cudagraph:
        graphs = len(cudagraph_capture_sizes(s.max_num_seqs, tokens, hardware.blackwell))
        per_layer_graph = profile.cudagraph_mib_per_layer_graph * (1 << 20)
        cudagraph = profile.cudagraph_base_gib * GIB + per_layer_graph * _cdiv(arch.num_layers, pp) * graphs
    return non_torch, activation, cudagraph


def _verdict(
    arch: ModelArch,
    s: Settings,
    quant: WeightQuant,
    hardware: Hardware,
    weights: float,
    requested: float,
    kv_bytes: float,
    overheads: tuple[float, float, float],
    blocks: int,
    tokens: int,
    blocks_per_request: int,
    allow_long: bool,
    draft: DraftCost | None = None,
    mamba_problem: str | None = None,
) -> tuple[bool, str]:
    """Does it fit, and why (vLLM's start-up checks, in the order it makes them)."""
    problem = structural_problem(arch, s.tensor_parallel_size, s.pipeline_parallel_size, quant) or mamba_problem
    if problem is None and s.max_model_len > arch.max_position_embeddings and not allow_long:
        problem = f"max_model_len {s.max_model_len} exceeds the model's max_position_embeddings"
        problem += f" {arch.max_position_embeddings} (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM start anyway)"
    if problem is not None:
        return False, f"vLLM refuses this configuration: {problem}"
    budget = f"{requested / GIB:.2f} GiB"
    split = ""
    if draft is not None and draft.weights > 0:
        split = f" (target {(weights - draft.weights) / GIB:.2f} + {draft.method} draft {draft.weights / GIB:.2f})"
    if s.device == "gpu" and s.kv_cache_memory_bytes is None and weights > requested:
        gpu = f"{s.gpu_memory_utilization:g} x {hardware.memory_gib:g} GiB"
        return False, f"weights need {weights / GIB:.2f} GiB per GPU{split} but vLLM may use only {budget} ({gpu})"
    used = weights + sum(overheads) + kv_bytes
    if s.device == "gpu" and s.kv_cache_memory_bytes is not None and used > hardware.memory_bytes:
        need = f"weights, buffers and kv_cache_memory_bytes need {used / GIB:.2f} GiB"
        return False, f"{need}, more than the GPU's {hardware.memory_gib:g} GiB"
    if kv_bytes <= 0:
        activation, non_torch, cudagraph = (x / GIB for x in overheads)
        spent = f"weights {weights / GIB:.2f}{split} + activations {activation:.2f} + non-torch {non_torch:.2f}"
        return False, f"no memory left for the KV cache: {spent} + CUDA graphs {cudagraph:.2f} GiB exceed {budget}"
    pool = f"KV pool of {kv_bytes / GIB:.2f} GiB holds {tokens:,} tokens"
    if draft is not None and draft.kv_layers:
        pool += f" (with the {draft.method} draft's {draft.kv_layers} KV layer(s))"
    if blocks < blocks_per_request + 1:  # vLLM holds one block back (the null block) before this check
        return False, f"{pool}, not enough for one request of max_model_len {s.max_model_len:,}"
    return True, f"{pool}: {blocks / blocks_per_request:.2f} requests of max_model_len {s.max_model_len:,} at once"


def _longest_fitting(per_request: Callable[[int], int], blocks: int, longest: int) -> int:
    """The longest request whose blocks fit in ``blocks`` (vLLM's auto-fit binary search)."""
    low, high = 1, longest
    while low < high:
        mid = (low + high + 1) // 2
        if per_request(mid) <= blocks:
            low = mid
        else:
            high = mid - 1
    return low


def _ledger(
    arch: ModelArch,
    args: CapacityArgs,
    hardware: Hardware,
    env: Mapping[str, str] | None,
    request_tokens: int | None,
    profile: EngineProfile,
    spec: dict[str, Any] | None = None,
    draft_arch: ModelArch | None = None,
) -> CapacityPlan:
    s, quant = _settings(arch, args, hardware, env, profile)
    tp, pp, cpu = s.tensor_parallel_size, s.pipeline_parallel_size, s.device == "cpu"
    if arch.not_planned:
        raise NotPlanned(arch.not_planned)
    element = _kv_element_bytes(s.kv_cache_dtype, s.dtype, arch)
    state = _mamba_state(arch, args, s, profile)
    if state.page:
        aligned = aligned_block_size(
            s.block_size, 32 if cpu else 16, kv_bytes_per_layer_token(arch, element, tp), state.page
        )
        s = s.model_copy(update={"block_size": aligned})
    request = request_tokens or s.max_model_len
    if request < 1:
        raise UserError(f"--request-tokens {request}: must be >= 1")
    dtype_bytes = 4 if s.dtype == "float32" else 2
    weights = weight_bytes_per_rank(arch, quant, dtype_bytes, tp, pp)
    notes: list[str] = []
    draft = None
    if spec is not None:
        draft_quant = resolve_quant(draft_arch, spec.get("quantization")) if draft_arch is not None else None
        draft = draft_cost(arch, spec, draft_arch, dtype_bytes,
                           lambda a: _kv_element_bytes(s.kv_cache_dtype, s.dtype, a), tp, draft_quant)  # fmt: skip
    query_len = draft.query_len if draft is not None else 1
    drafted = draft.weights if draft is not None else 0.0
    non_torch = activation = cudagraph = 0.0
    if cpu:
        if s.cpu_kvcache_space_gib is not None:
            kv_bytes = float(s.cpu_kvcache_space_gib * GIB)
        elif s.kv_cache_memory_bytes is not None:
            kv_bytes = float(s.kv_cache_memory_bytes)
        else:
            raise UserError("CPU build: set VLLM_CPU_KVCACHE_SPACE (--cpu-kvcache-space-gib), the KV GiB per rank")
        requested = kv_bytes
        notes.append("CPU build: the KV space is reserved per rank; weights and activations live outside it")
    else:
        requested = float(math.ceil(hardware.memory_bytes * s.gpu_memory_utilization))
        non_torch, activation, cudagraph = _gpu_overheads(arch, s, hardware, profile, query_len)
        kv_bytes = requested - weights - drafted - non_torch - activation - cudagraph
        if s.kv_cache_memory_bytes is not None:
            kv_bytes = float(s.kv_cache_memory_bytes)
            notes.append("kv_cache_memory_bytes is set: vLLM skips the utilization budget")

    per_token = kv_bytes_per_token(arch, element, tp, pp)
    hybrid_manager = None if args.disable_hybrid_kv_cache_manager is None else not args.disable_hybrid_kv_cache_manager
    layout = kv_layout(arch, pp, hybrid_manager, mamba_state_blocks=state.blocks)
    page = layout.bytes_per_block(s.block_size, kv_bytes_per_layer_token(arch, element, tp))
    if draft is not None and draft.kv_layers:
        # vLLM groups the drafter's attention layers with the target's: a block holds a page for each.
        page += round(s.block_size * draft.kv_bytes_per_token)
        per_token += round(draft.kv_bytes_per_token)
        if layout.hybrid:
            notes.append("the draft's KV layers are counted as one more page per block; vLLM's grouping of a "
                         "hybrid model's layers with a drafter's is not modelled exactly")  # fmt: skip
    # Tokens scheduled but not yet freed: one batch per concurrent step (async scheduling: PP + 1).
    in_flight = s.max_num_batched_tokens * (pp + 1 if args.async_scheduling is not False else pp)
    blocks = int(kv_bytes // page) if kv_bytes > 0 else 0

    def per_request(length: int) -> int:
        return layout.blocks_per_request(length, s.block_size, in_flight)

    if args.max_model_len == -1 and 1 < blocks <= per_request(s.max_model_len):
        # --max-model-len -1: vLLM fits the longest context one request can hold (minus the null block).
        s = s.model_copy(update={"max_model_len": _longest_fitting(per_request, blocks - 1, s.max_model_len)})
        notes.append(f"max_model_len -1: vLLM would auto-fit it to {s.max_model_len:,} tokens")
    if layout.hybrid:
        notes.append(layout.describe())
    mamba_groups = sum(1 for group in layout.groups if group.kind == "mamba")
    max_sequences = blocks // per_request(1) if state.page else None
    if state.page:
        notes.append(state.describe(s.block_size))
        if max_sequences is not None and max_sequences < s.max_num_seqs:
            notes.append(
                f"the pool holds the state of {max_sequences:,} sequences at once, fewer than max_num_seqs "
                f"{s.max_num_seqs:,}: vLLM queues or preempts the rest however short they are"
            )
    blocks_per_request = per_request(s.max_model_len)
    concurrency = blocks / blocks_per_request  # vLLM: num_blocks / blocks of one max_model_len request
    tokens = int(concurrency * s.max_model_len)
    concurrency_at_request = blocks / per_request(min(request, s.max_model_len))

    allow_long = (env or {}).get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")
    if allow_long and s.max_model_len > arch.max_position_embeddings:
        notes.append(
            f"max_model_len {s.max_model_len:,} is beyond the model's {arch.max_position_embeddings:,} positions: "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM start, and it warns that outputs may be wrong"
        )
    fits, reason = _verdict(
        arch,
        s,
        quant,
        hardware,
        weights + drafted,
        requested,
        kv_bytes,
        (activation, non_torch, cudagraph),
        blocks,
        tokens,
        blocks_per_request,
        allow_long,
        draft,
        state.problem or _removed(arch, profile),
    )
    return CapacityPlan(
        model=arch.name,
        parameters_b=round(count_parameters(arch) / 1e9, 3),
        settings=s,
        requested_gib=round(requested / GIB, 3),
        weights_gib=round(weights / GIB, 3),
        activation_gib=round(activation / GIB, 3),
        non_torch_gib=round(non_torch / GIB, 3),
        cudagraph_gib=round(cudagraph / GIB, 3),
        kv_cache_gib=round(kv_bytes / GIB, 3),
        kv_bytes_per_token=per_token,
        kv_cache_blocks=blocks,
        kv_cache_tokens=tokens,
        kv_gib_per_request=round(blocks_per_request * page / GIB, 4),
        max_concurrency=round(concurrency, 2),
        request_tokens=request,
        max_concurrency_at_request=round(concurrency_at_request, 2),
        max_num_seqs_reachable=concurrency_at_request >= s.max_num_seqs,
        mamba_layers=state.layers,
        mamba_state_bytes_per_sequence=state.bytes_per_sequence,
        mamba_state_blocks_per_sequence=mamba_groups * state.blocks if state.page else 0,
        max_sequences=max_sequences,
        fits=fits,
        reason=reason,
        draft=_draft_plan(draft, s) if draft is not None else None,
        notes=notes + (_draft_notes(draft, s) if draft is not None else []),
    )


def _draft_plan(draft: DraftCost, s: Settings) -> DraftPlan:
    return DraftPlan(
        method=draft.method, num_speculative_tokens=draft.num_speculative_tokens, source=draft.source,
        parameters_b=round(draft.parameters / 1e9, 4), weights_gib=round(draft.weights / GIB, 4),
        kv_layers=draft.kv_layers, kv_bytes_per_token=round(draft.kv_bytes_per_token),
        lookahead_tokens=draft.lookahead_tokens, verify_tokens=s.max_num_seqs * draft.query_len,
        decode_seqs_per_step=min(s.max_num_seqs, s.max_num_batched_tokens // draft.query_len),
    )  # fmt: skip


def _draft_notes(draft: DraftCost, s: Settings) -> list[str]:
    """What the step's extra tokens mean for the batch: requests verified per step within the batched tokens."""
    wanted = s.max_num_seqs * draft.query_len
    if wanted <= s.max_num_batched_tokens:
        return []
    fit = s.max_num_batched_tokens // draft.query_len
    return [
        f"speculative decoding verifies {draft.query_len} tokens per request a step: {s.max_num_seqs} requests need "
        f"{wanted:,} batched tokens, max_num_batched_tokens {s.max_num_batched_tokens:,} verifies {fit} of them a step"
    ]


def _removed(arch: ModelArch, profile: EngineProfile) -> str | None:
    if arch.architecture not in profile.removed_architectures:
        return None
    return f"{arch.architecture} was served by vLLM up to 0.23 and is refused by {profile.name}'s releases"


@dataclass(frozen=True)
class _MambaState:
    """What a model's Mamba layers cost one sequence on one rank (all zero for a model without them)."""

    layers: int = 0
    page: int = 0  # one layer's state, the page the attention block is aligned to
    blocks: int = 1  # blocks a sequence holds per Mamba group
    bytes_per_sequence: int = 0
    problem: str | None = None  # why vLLM refuses the configuration
    kind: str = ""

    def describe(self, block_size: int) -> str:
        mode = (
            f"prefix caching on: mamba_cache_mode align, {self.blocks} state blocks"
            if self.blocks > 1
            else "1 state block"
        )
        return (
            f"{self.layers} {self.kind} layers keep {self.bytes_per_sequence / 2**20:,.2f} MiB of state per "
            f"sequence ({self.page:,} B a layer); the attention block grows to {block_size} tokens so that its "
            f"page holds one state; {mode} per Mamba group"
        )


def _mamba_state(arch: ModelArch, args: CapacityArgs, s: Settings, profile: EngineProfile) -> _MambaState:
    """The Mamba state of one sequence, and the prefix-caching mode vLLM runs it in."""
    layers = arch.stage_kinds(s.pipeline_parallel_size).count("mamba")
    if arch.mamba is None or not layers:
        return _MambaState()
    if profile.v0_scheduler:
        raise NotPlanned(
            "vLLM V0 keeps Mamba state in a cache of its own beside the KV pool; the planner models the V1 "
            "hybrid allocator (vLLM >= 0.8)"
        )
    if not arch.num_attention_layers:
        raise NotPlanned("a model with Mamba layers and no attention layer: the planner models hybrid models only")
    tp = s.tensor_parallel_size
    if tp_problem(arch.mamba, tp) is not None:  # structural_problem says why; no page to size
        return _MambaState(layers=layers)
    page = state_bytes(arch.mamba, s.dtype, tp, args.mamba_cache_dtype, args.mamba_ssm_cache_dtype)
    mode = profile.mamba_prefix_caching
    prefix = args.enable_prefix_caching if args.enable_prefix_caching is not None else mode == "default"
    problem = None
    if prefix and mode == "refused":
        problem = "prefix caching is not supported for Mamba layers before vLLM 0.11.1 (NotImplementedError)"
    elif prefix and args.enable_chunked_prefill is False:
        problem = "prefix caching on Mamba layers (mamba_cache_mode align) requires chunked prefill"
    # MambaSpec.max_memory_usage_bytes: 1 page, or in align mode 2 plus MambaMixer2's prefill checkpoint
    blocks = (3 if arch.mamba.kind == "mamba2" else 2) if prefix else 1
    return _MambaState(layers, page, blocks, page * layers, problem, arch.mamba.kind)
