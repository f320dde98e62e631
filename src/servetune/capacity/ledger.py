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
``servetune.capacity.settings`` fills in vLLM's defaults for the settings planned.
Pure: no I/O, no vLLM import. See ``servetune.capacity`` for the terms.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from servetune.capacity.advice import advise
from servetune.capacity.arch import MambaMixer, ModelArch, WeightQuant
from servetune.capacity.arith import cdiv
from servetune.capacity.cpubuild import cpu_kv_cache_note, cpu_kv_cache_problem
from servetune.capacity.draft import DraftCost, draft_cost, speculative_config
from servetune.capacity.encoder import EncoderBudget, encoder_budget
from servetune.capacity.hardware import GIB, Hardware
from servetune.capacity.hfconfig import with_hf_overrides
from servetune.capacity.kvgroups import KVLayout, kv_layout
from servetune.capacity.lora import lora_cost
from servetune.capacity.mamba import aligned_block_size, cpu_ssm_dtype, state_bytes, tp_problem
from servetune.capacity.params import (
    activation_bytes_per_token,
    count_parameters,
    kv_bytes_per_layer_token,
    kv_bytes_per_token,
    weight_bytes_per_rank,
)
from servetune.capacity.profile import VLLM_0_32, EngineProfile, cudagraph_capture_sizes
from servetune.capacity.schema import CapacityArgs, CapacityPlan, DraftPlan, NotPlanned, Settings, read_engine_args
from servetune.capacity.settings import (
    dcp_problem,
    engine_settings,
    kv_dtype_problem,
    kv_element_bytes,
    moe_shards,
    resolve_quant,
    structural_problem,
)
from servetune.errors import UserError


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
    ``enable_lora`` takes the adapter slots vLLM preallocates (``max_loras`` x ``max_lora_rank``,
    ``capacity/lora.py``) out of the GPU's pool.
    """
    args = read_engine_args(engine_args)
    model = with_hf_overrides(model, args.hf_overrides)
    spec = speculative_config(engine_args)
    plan = _ledger(model, args, hardware, env, request_tokens, profile, spec, draft)
    evaluate: Callable[[dict[str, Any]], CapacityPlan] = lambda change: _ledger(  # noqa: E731
        model, args.model_copy(update=change), hardware, env, request_tokens, profile, spec, draft
    )
    plan.advice = advise(model, plan, hardware, evaluate)
    return plan


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
        non_torch += s.max_num_seqs * cdiv(s.max_model_len, s.block_size) * 4
    tokens = s.max_num_batched_tokens
    shards = moe_shards(arch, s)
    if not profile.moe_dp_gathers_batch:  # chunked by VLLM_MOE_DP_CHUNK_SIZE: a few hundred tokens a rank
        shards = dataclasses.replace(shards, gathered=1)
    forward = tokens * activation_bytes_per_token(arch, act_bytes, tp, profile.forward_hidden_states, shards)
    logits = min(s.max_num_seqs * query_len, tokens) * cdiv(arch.vocab_size, 64) * 64
    sampler = logits * profile.sampler_bytes_per_logit + tokens * arch.hidden_size * act_bytes
    activation = max(forward, sampler) + profile.activation_base_gib * GIB
    cudagraph = 0.0
    if not s.enforce_eager and profile.subtract_cudagraph:
        graphs = len(cudagraph_capture_sizes(s.max_num_seqs, tokens, hardware.blackwell))
        per_layer_graph = profile.cudagraph_mib_per_layer_graph * (1 << 20)
        cudagraph = profile.cudagraph_base_gib * GIB + per_layer_graph * cdiv(arch.num_layers, pp) * graphs
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
    lora: float = 0.0,
) -> tuple[bool, str]:
    """Does it fit, and why (vLLM's start-up checks, in the order it makes them)."""
    problem = structural_problem(arch, s.tensor_parallel_size, s.pipeline_parallel_size, quant, moe_shards(arch, s))
    problem = problem or mamba_problem
    if problem is None and s.max_model_len > arch.max_position_embeddings and not allow_long:
        problem = f"max_model_len {s.max_model_len} exceeds the model's max_position_embeddings"
        problem += f" {arch.max_position_embeddings} (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 lets vLLM start anyway)"
    if problem is not None:
        return False, f"vLLM refuses this configuration: {problem}"
    budget = f"{requested / GIB:.2f} GiB"
    parts = []
    if draft is not None and draft.weights > 0:
        parts.append(f"{draft.method} draft {draft.weights / GIB:.2f}")
    if lora > 0:
        parts.append(f"LoRA slots {lora / GIB:.2f}")
    target = weights - (draft.weights if draft is not None else 0.0) - lora
    split = f" (target {target / GIB:.2f} + {' + '.join(parts)})" if parts else ""
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
    s, quant = engine_settings(arch, args, hardware, env, profile)
    tp, pp, cpu = s.tensor_parallel_size, s.pipeline_parallel_size, s.device == "cpu"
    if arch.not_planned:
        raise NotPlanned(arch.not_planned)
    element = kv_element_bytes(s.kv_cache_dtype, s.dtype, arch)
    state = _mamba_state(arch, args, s, profile, hardware, int((spec or {}).get("num_speculative_tokens") or 0))
    if state.page:
        aligned = aligned_block_size(
            s.block_size, 32 if cpu else 16, kv_bytes_per_layer_token(arch, element, tp), state.page
        )
        s = s.model_copy(update={"block_size": aligned})
    request = request_tokens or s.max_model_len
    if request < 1:
        raise UserError(f"--request-tokens {request}: must be >= 1")
    dtype_bytes = 4 if s.dtype == "float32" else 2
    shards = moe_shards(arch, s)
    weights = weight_bytes_per_rank(arch, quant, dtype_bytes, tp, pp, shards)
    notes: list[str] = []
    draft = None
    if spec is not None:
        draft_quant = resolve_quant(draft_arch, spec.get("quantization")) if draft_arch is not None else None
        draft = draft_cost(arch, spec, draft_arch, dtype_bytes,
                           lambda a: kv_element_bytes(s.kv_cache_dtype, s.dtype, a), tp, draft_quant, shards)  # fmt: skip
    query_len = draft.query_len if draft is not None else 1
    drafted = draft.weights if draft is not None else 0.0
    lora = 0.0
    if args.enable_lora:
        cost = lora_cost(arch, dtype_bytes, args.max_loras, args.max_lora_rank, tp, pp, s.max_num_batched_tokens,
                         s.max_num_seqs, args.fully_sharded_loras)  # fmt: skip
        lora = float(cost.total)
        notes.append(cost.describe() + (": they live outside the CPU build's KV space" if cpu else ""))
    encoder = _encoder(arch, args, s, dtype_bytes, notes)
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
        if encoder is not None:  # the profile run: the tower's peak, then its embeddings held beside the decoder's
            activation = max(
                activation + encoder.cache_bytes, encoder.encoder_peak_bytes + profile.activation_base_gib * GIB
            )
        kv_bytes = requested - weights - drafted - lora - non_torch - activation - cudagraph
        if s.kv_cache_memory_bytes is not None:
            kv_bytes = float(s.kv_cache_memory_bytes)
            notes.append("kv_cache_memory_bytes is set: vLLM skips the utilization budget")

    per_token = kv_bytes_per_token(arch, element, tp, pp)
    hybrid_manager = None if args.disable_hybrid_kv_cache_manager is None else not args.disable_hybrid_kv_cache_manager
    # MTP layers are full-attention layers of the target's own kind: vLLM groups them as the target's
    mtp = draft.kv_layers if draft is not None and draft.method == "mtp" else 0
    layout = kv_layout(arch, pp, hybrid_manager, mamba_state_blocks=state.blocks, drafter_layers=mtp)
    page = layout.bytes_per_block(s.block_size, kv_bytes_per_layer_token(arch, element, tp))
    if draft is not None and mtp:
        per_token += round(draft.kv_bytes_per_token)
    elif draft is not None and draft.kv_layers:
        # vLLM groups the drafter's attention layers with the target's: a block holds a page for each.
        page += round(s.block_size * draft.kv_bytes_per_token)
        per_token += round(draft.kv_bytes_per_token)
        if layout.hybrid:
            notes.append("the draft's KV layers are counted as one more page per block; vLLM's grouping of a "
                         "hybrid model's layers with a drafter's is not modelled exactly")  # fmt: skip
    # Tokens scheduled but not yet freed: one batch per concurrent step (async scheduling: PP + 1). The CPU build
    # turns async scheduling off whatever was asked (vLLM 0.32 CpuPlatform.check_and_update_config).
    in_flight = s.max_num_batched_tokens * (pp + 1 if args.async_scheduling is not False and not cpu else pp)
    blocks = int(kv_bytes // page) if kv_bytes > 0 else 0

    def per_request(length: int) -> int:
        return layout.blocks_per_request(length, s.block_size, in_flight, s.decode_context_parallel_size)

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
        if cpu and state.ssm_dtype:
            conv = s.dtype if args.mamba_cache_dtype == "auto" else args.mamba_cache_dtype
            notes.append(
                f"CPU build on a CPU {'with' if hardware.avx512_bf16 else 'without'} AVX-512 BF16: the SSM state in "
                f"{conv if state.ssm_dtype == 'auto' else state.ssm_dtype}"
            )
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
    if s.kv_cache_dtype != args.kv_cache_dtype:
        notes.append(f"kv_cache_dtype {args.kv_cache_dtype}: vLLM's FLASHMLA_SPARSE stores it as {s.kv_cache_dtype}")
    if s.decode_context_parallel_size > 1:
        notes.append(
            f"decode context parallelism {s.decode_context_parallel_size}: each rank keeps 1/"
            f"{s.decode_context_parallel_size} of every request's KV tokens (no extra GPU: DCP reuses the TP ranks)"
        )
    if (unchecked := cpu_kv_cache_note(arch, s.kv_cache_dtype, hardware, profile)) is not None:
        notes.append(unchecked)
    fits, reason = _verdict(
        arch,
        s,
        quant,
        hardware,
        weights + drafted + (0.0 if cpu else lora),
        requested,
        kv_bytes,
        (activation, non_torch, cudagraph),
        blocks,
        tokens,
        blocks_per_request,
        allow_long,
        draft,
        state.problem
        or _removed(arch, profile)
        or cpu_kv_cache_problem(arch, s.kv_cache_dtype, hardware, profile)
        or kv_dtype_problem(arch, s.kv_cache_dtype, hardware)
        or _dcp_problem(arch, s, layout),
        0.0 if cpu else lora,
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
        lora_gib=round(lora / GIB, 4),
        encoder_cache_tokens=encoder.budget_tokens if encoder is not None else 0,
        encoder_cache_gib=round(encoder.cache_bytes / GIB, 4) if encoder is not None and not cpu else 0.0,
        notes=notes + (_draft_notes(draft, s) if draft is not None else []),
    )


def _encoder(
    arch: ModelArch, args: CapacityArgs, s: Settings, act_bytes: int, notes: list[str]
) -> EncoderBudget | None:
    """A vision-language model's encoder cache as vLLM sizes and profiles it (capacity/encoder.py), noted."""
    if arch.vision is None:
        if arch.vision_parameters:
            notes.append(
                "the encoder cache of this vision-language model is not planned (its processor is not modelled)"
            )
        return None
    encoder = encoder_budget(
        arch.vision, max_model_len=s.max_model_len, max_num_batched_tokens=s.max_num_batched_tokens,
        max_num_seqs=s.max_num_seqs, chunked_prefill=args.enable_chunked_prefill is not False, act_bytes=act_bytes,
        tp=s.tensor_parallel_size, limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
    )  # fmt: skip
    if encoder is None:
        notes.append("limit_mm_per_prompt turns every modality off: no encoder cache")
        return None
    if args.skip_mm_profiling:
        notes.append(encoder.describe().split(";")[0] + "; skip_mm_profiling: vLLM does not profile the encoder, "
                     "so its embeddings come out of the KV pool only at run time")  # fmt: skip
        return None
    notes.append(
        encoder.describe() + ("; on the CPU build they live outside the KV space" if s.device == "cpu" else "")
    )
    return encoder


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


def _dcp_problem(arch: ModelArch, s: Settings, layout: KVLayout) -> str | None:
    dcp = s.decode_context_parallel_size
    problem = dcp_problem(arch, s.tensor_parallel_size, s.prefill_context_parallel_size, dcp)
    if problem is None and dcp > 1 and any(g.kind == "sliding_attention" for g in layout.groups):
        problem = f"decode_context_parallel_size {dcp} with sliding-window layers (SlidingWindowSpec asserts DCP 1)"
    return problem


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
    speculative: int = 0  # of them, the blocks for draft tokens (MambaSpec.num_speculative_blocks)
    bytes_per_sequence: int = 0
    problem: str | None = None  # why vLLM refuses the configuration
    kind: str = ""
    ssm_dtype: str = ""  # mamba_ssm_cache_dtype as vLLM settles it ("": no SSM state)

    def describe(self, block_size: int) -> str:
        own = self.blocks - self.speculative
        mode = f"prefix caching on: mamba_cache_mode align, {own} state blocks" if own > 1 else "1 state block"
        mode += f" and {self.speculative} for draft tokens" if self.speculative else ""
        return (
            f"{self.layers} {self.kind} layers keep {self.bytes_per_sequence / 2**20:,.2f} MiB of state per "
            f"sequence ({self.page:,} B a layer); the attention block grows to {block_size} tokens so that its "
            f"page holds one state; {mode} per Mamba group"
        )


def _mamba_state(
    arch: ModelArch, args: CapacityArgs, s: Settings, profile: EngineProfile, hardware: Hardware, num_spec: int = 0
) -> _MambaState:
    """The Mamba state of one sequence, and the prefix-caching mode vLLM runs it in. With ``num_spec`` draft tokens
    the convolution state keeps that many more columns and a sequence holds that many more state blocks."""
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
    ssm_dtype = _ssm_dtype(arch, arch.mamba, args, s, hardware)
    page = state_bytes(arch.mamba, s.dtype, tp, args.mamba_cache_dtype, ssm_dtype, num_spec)
    mode = profile.mamba_prefix_caching
    prefix = args.enable_prefix_caching if args.enable_prefix_caching is not None else mode == "default"
    problem = None
    if prefix and mode == "refused":
        problem = "prefix caching is not supported for Mamba layers before vLLM 0.11.1 (NotImplementedError)"
    elif prefix and args.enable_chunked_prefill is False:
        problem = "prefix caching on Mamba layers (mamba_cache_mode align) requires chunked prefill"
    # MambaSpec.max_memory_usage_bytes: 1 page, or in align mode 2 plus MambaMixer2's prefill checkpoint, plus one
    # per draft token (num_speculative_blocks)
    blocks = ((3 if arch.mamba.kind == "mamba2" else 2) if prefix else 1) + num_spec
    ssm = "" if arch.mamba.kind == "linear_attention" else ssm_dtype
    return _MambaState(layers, page, blocks, num_spec, page * layers, problem, arch.mamba.kind, ssm)


def _ssm_dtype(arch: ModelArch, mixer: MambaMixer, args: CapacityArgs, s: Settings, hardware: Hardware) -> str:
    """The SSM state's dtype as vLLM settles it: the model's config hook (``mixer.ssm_state_dtype`` for ``auto``),
    then on the CPU build its platform's rule for the CPU's flags (:func:`~servetune.capacity.mamba.cpu_ssm_dtype`).
    Measured: ``bench/arch_vllm.py``'s granite-4.0-h-bf16 case."""
    asked = mixer.ssm_state_dtype if args.mamba_ssm_cache_dtype == "auto" else args.mamba_ssm_cache_dtype
    if s.device != "cpu":
        return asked
    return cpu_ssm_dtype(asked, mixer, "mamba" in arch.layer_types, hardware.avx512_bf16)
