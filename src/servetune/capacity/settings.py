"""The engine settings a capacity plan is made for: vLLM's defaults filled in where the engine arguments leave
them, the dtype and the weights' quantization resolved, and the parallel layouts vLLM refuses outright.

Pure: no I/O, no vLLM import. The ledger (``servetune.capacity.ledger``) plans these settings.
"""

from __future__ import annotations

from collections.abc import Mapping

from servetune.capacity.arch import ModelArch, WeightQuant
from servetune.capacity.hardware import Hardware
from servetune.capacity.kvdtype import DS_MLA_BYTES_PER_LAYER, KV_CACHE_DTYPES, kv_slot_bytes
from servetune.capacity.mamba import tp_problem
from servetune.capacity.params import MoeShards
from servetune.capacity.profile import EngineProfile
from servetune.capacity.schema import CapacityArgs, NotPlanned, Settings
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
    "gguf",
)


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
    if name == "gguf":
        if arch.quant.method == "gguf":
            return arch.quant  # capacity/gguf.py: the file's own tensor types
        raise NotPlanned("quantization gguf: vLLM reads GGUF weights from a .gguf file; give it as --model FILE.gguf")
    if name.startswith("modelopt"):
        if arch.quant.method in ("fp8", "nvfp4", "mxfp8"):
            return arch.quant  # the checkpoint's hf_quant_config says which
        if name == "modelopt_fp4":
            return WeightQuant(method="nvfp4", bits=4, group_size=16)
        if name == "modelopt_mxfp8":
            return WeightQuant(method="mxfp8", bits=8, group_size=32)
        return WeightQuant(method="fp8", bits=8)
    raise NotPlanned(f"quantization {flag}: the planner knows {', '.join(QUANTIZATIONS)}")


def kv_element_bytes(kv_cache_dtype: str, dtype: str, arch: ModelArch) -> float:
    """Bytes per K or V element, averaged over the head's slot (scales and packing included).

    A combination vLLM refuses (``kv_dtype_problem``) gets a nominal size: the verdict refuses it."""
    if arch.is_mla:
        if kv_cache_dtype in DS_MLA_BYTES_PER_LAYER:
            return DS_MLA_BYTES_PER_LAYER[kv_cache_dtype] / ((arch.kv_lora_rank or 0) + arch.qk_rope_head_dim)
        if kv_cache_dtype in ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"):
            return (4 if dtype == "float32" else 2) if kv_cache_dtype == "auto" else _MLA_BYTES[kv_cache_dtype]
        if kv_cache_dtype in ("nvfp4", "nvfp4_4over6"):
            return 0.5  # refused: VllmConfig.validate_nvfp4_kv_cache_with_mla
        raise NotPlanned(
            f"kv_cache_dtype {kv_cache_dtype}: the planner knows auto, fp8, fp8_ds_mla and nvfp4_ds_mla for MLA models"
        )
    if kv_cache_dtype in DS_MLA_BYTES_PER_LAYER:
        return 1.0  # refused: no attention backend for a model without MLA takes it
    slot = kv_slot_bytes(kv_cache_dtype, arch.head_dim, 4 if dtype == "float32" else 2)
    if slot is None:
        known = ", ".join(k for k in KV_CACHE_DTYPES if k not in DS_MLA_BYTES_PER_LAYER)
        raise NotPlanned(f"kv_cache_dtype {kv_cache_dtype}: the planner knows {known}, fp8_ds_mla and nvfp4_ds_mla")
    return slot / (2 * arch.head_dim)


def resolve_kv_cache_dtype(arch: ModelArch, kv_cache_dtype: str, hardware: Hardware) -> str:
    """The cache dtype vLLM 0.32 ends up with: on a sparse MLA model below SM100, ``fp8`` is served by
    FLASHMLA_SPARSE, which stores it as ``fp8_ds_mla`` (``_canonicalize_sparse_mla_kv_cache_dtype``); SM100
    prefers FLASHINFER_MLA_SPARSE, which keeps plain fp8 (``cuda._get_backend_priorities``). ``fp8_e4m3`` is not
    in FLASHMLA_SPARSE's list: FLASHINFER_MLA_SPARSE_SM90 serves it as plain fp8."""
    if arch.is_sparse_mla and kv_cache_dtype == "fp8" and hardware.device == "gpu":
        return kv_cache_dtype if hardware.blackwell else "fp8_ds_mla"
    return kv_cache_dtype


def kv_dtype_problem(arch: ModelArch, kv_cache_dtype: str, hardware: Hardware) -> str | None:
    """Why vLLM 0.32 refuses this KV cache dtype for this model on this GPU, or None.

    The ``*_ds_mla`` layouts are listed only by the sparse MLA backends (FLASHMLA_SPARSE,
    FLASHINFER_MLA_SPARSE_SM120, DeepSeek-V4's), which take sparse layers only (``validate_configuration``:
    "non-sparse not supported"); ``get_attn_backend_cls`` then finds no valid backend. FLASHMLA_SPARSE takes
    ``nvfp4_ds_mla`` on SM100 only (``supports_combination``), and the plain nvfp4 layout never with MLA."""
    if kv_cache_dtype in DS_MLA_BYTES_PER_LAYER:
        if not arch.is_mla:
            return f"kv_cache_dtype {kv_cache_dtype} is DeepSeek sparse MLA's layout; no backend takes it without MLA"
        if not arch.is_sparse_mla:
            return (
                f"kv_cache_dtype {kv_cache_dtype}: only the sparse MLA backends take it (DeepSeek Sparse Attention, "
                "index_topk in the config); no attention backend serves this dense MLA model with it"
            )
        if kv_cache_dtype == "nvfp4_ds_mla" and hardware.device == "gpu" and not hardware.blackwell:
            return (
                "kv_cache_dtype nvfp4_ds_mla: FLASHMLA_SPARSE takes it on SM100 (compute capability 10.x: "
                f"B200, GB200, B300, GB300) only, not on {hardware.name}"
            )
    if arch.is_mla and kv_cache_dtype in ("nvfp4", "nvfp4_4over6"):
        return f"kv_cache_dtype {kv_cache_dtype} is not supported with MLA (use fp8, auto or nvfp4_ds_mla)"
    return None


def dcp_problem(arch: ModelArch, tp: int, pcp: int, dcp: int) -> str | None:
    """Why vLLM 0.32 refuses this decode context parallel size (``ParallelConfig``, ``ModelConfig``), or None.

    DCP reuses the TP ranks (or spans PCP): it adds no GPU; it shards every KV-cache token over its ranks."""
    if dcp == 1:
        return None
    if pcp == 1 and tp % dcp:
        return f"tensor_parallel_size {tp} is not divisible by decode_context_parallel_size {dcp}"
    if pcp > 1 and dcp not in (pcp, tp * pcp):
        return f"decode_context_parallel_size {dcp} with prefill_context_parallel_size {pcp}: must be 1, {pcp} or {tp * pcp}"
    if arch.is_mla:
        return None
    kv = arch.num_kv_heads
    if tp <= kv:
        return f"decode context parallelism for GQA/MQA needs tensor_parallel_size {tp} > the model's {kv} KV heads"
    if dcp > tp // kv:
        return f"decode_context_parallel_size {dcp} exceeds tensor_parallel_size {tp} / {kv} KV heads = {tp // kv}"
    if (arch.num_attention_heads // kv) % dcp:
        return f"query heads per KV head ({arch.num_attention_heads // kv}) are not divisible by decode_context_parallel_size {dcp}"
    return None


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


def _moe_wna16_group(width: int, hidden: int, group: int) -> int | None:
    """The group size vLLM 0.32's MoE WNA16 fallback runs experts of this per-rank width with: it halves the
    checkpoint's until both widths are whole groups, and asserts it stays >= 32 (``MoeWNA16Method.create_weights``).
    None: no such group, vLLM fails while creating the weights."""
    while group >= 32 and (width % group or hidden % group):
        group //= 2
    return group if group >= 32 else None


def _quant_group_problem(arch: ModelArch, tp: int, quant: WeightQuant, moe: MoeShards) -> str | None:
    """An AWQ/GPTQ layer whose per-rank input width is not whole quantization groups, as vLLM 0.32 refuses it.

    Row-parallel linear layers (the dense MLP's and a shared expert's down projection) hold ``width / TP`` input
    columns a rank: AutoAWQ's fallback linear method raises unless that is a multiple of the group size, and a
    GPTQ kernel cannot split a group between ranks. Routed experts hold ``moe_intermediate_size / split`` a rank
    (``split`` TP x DP x PCP without expert parallelism, 1 with it): Marlin MoE takes a multiple of the group
    size; anything else falls back to MoE WNA16 (``auto_awq``/``auto_gptq`` ``get_quant_method``), which halves
    the group down to 32 (``_moe_wna16_group``) and fails below it.
    """
    group, name = quant.group_size, quant.method.upper()
    dense_layers = arch.num_layers - arch.num_moe_layers if arch.is_moe else arch.num_layers
    rows: list[tuple[str, int, int, str]] = []  # (field, width, ways split, how)
    if arch.intermediate_size and dense_layers:
        rows.append(("intermediate_size" if arch.is_moe else "intermediate size", arch.intermediate_size, tp,
                     f"tensor_parallel_size {tp}"))  # fmt: skip
    if arch.is_moe and arch.shared_expert_intermediate_size:
        split = 1 if moe.replicate_shared else tp
        rows.append(("shared_expert_intermediate_size", arch.shared_expert_intermediate_size, split,
                     f"tensor_parallel_size {tp}" if split > 1 else "1 (replicated by sequence-parallel MoE)"))  # fmt: skip
    for field, width, split, how in rows:
        if width % split == 0 and (width // split) % group:
            return f"{field} {width} / {how} = {width // split} is not a multiple of the {name} group size {group}"
    if arch.is_moe and arch.moe_intermediate_size % moe.expert_split == 0:
        width = arch.moe_intermediate_size // moe.expert_split
        if width % group and _moe_wna16_group(width, arch.hidden_size, group) is None:
            how = "(whole experts under expert parallelism)" if moe.expert_parallel else f"split over {moe.layout}"
            return (
                f"moe_intermediate_size {arch.moe_intermediate_size} {how} is {width} a rank, not a multiple of the "
                f"{name} group size {group} nor of 32 (vLLM's MoE WNA16 fallback halves the group to 32 at least)"
            )
    return None


def structural_problem(
    arch: ModelArch, tp: int, pp: int, quant: WeightQuant, shards: MoeShards | None = None
) -> str | None:
    """Why vLLM would refuse this parallel layout outright, or None. ``shards``: how MoE layers lay over
    TP x DP x PCP (default TP alone)."""
    if arch.num_attention_heads % tp:
        return f"num_attention_heads {arch.num_attention_heads} is not divisible by tensor_parallel_size {tp}"
    kv = arch.num_kv_heads
    if not arch.is_mla and kv % tp and tp % kv:
        return f"num_kv_heads {kv} and tensor_parallel_size {tp}: neither divides the other"
    if pp > arch.num_layers:
        return f"pipeline_parallel_size {pp} exceeds the model's {arch.num_layers} layers"
    if arch.mamba is not None and arch.num_mamba_layers and (problem := tp_problem(arch.mamba, tp)) is not None:
        return problem
    moe = shards or MoeShards.of(arch, tp)
    if arch.is_moe and arch.moe_intermediate_size % moe.expert_split:
        return (  # FusedMoEConfig.__post_init__ asserts it
            f"moe_intermediate_size {arch.moe_intermediate_size} does not split over the MoE layers' "
            f"{moe.layout or f'TP {tp} ({tp} ranks)'}: vLLM's FusedMoEConfig asserts it divides"
        )
    if quant.method in ("awq", "gptq") and not quant.channelwise:
        return _quant_group_problem(arch, tp, quant, moe)
    return None


def moe_shards(arch: ModelArch, s: Settings) -> MoeShards:
    """How the settings lay an MoE model's experts: over TP x DP x PCP ranks, whole experts under EP."""
    return MoeShards.of(
        arch,
        s.tensor_parallel_size,
        s.data_parallel_size,
        s.enable_expert_parallel,
        s.prefill_context_parallel_size,
        eplb=s.enable_eplb,
        redundant=s.num_redundant_experts,
    )


def _redundant_experts(args: CapacityArgs) -> int:
    """``eplb_config.num_redundant_experts``, refused where vLLM 0.32's ``ParallelConfig`` refuses it."""
    raw = (args.eplb_config or {}).get("num_redundant_experts", 0)
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise UserError(f"engine argument eplb_config: num_redundant_experts {raw!r} is not a whole number >= 0")
    if raw and not args.enable_eplb:
        raise UserError(f"engine argument eplb_config: num_redundant_experts {raw} needs enable_eplb (vLLM refuses it)")
    if args.enable_eplb and not args.enable_expert_parallel:
        raise UserError("engine argument enable_eplb needs enable_expert_parallel (vLLM refuses it)")
    return raw


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


def engine_settings(
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
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel and arch.is_moe,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        enable_eplb=args.enable_eplb and arch.is_moe,
        num_redundant_experts=_redundant_experts(args) if arch.is_moe else 0,
        dtype=_resolve_dtype(arch, args, quant),
        quantization=quant.label,
        kv_cache_dtype=resolve_kv_cache_dtype(arch, args.kv_cache_dtype, hardware),
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
