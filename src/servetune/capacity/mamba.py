"""The per-sequence state of Mamba and linear-attention layers, as vLLM 0.32 sizes and pages it.

A Mamba (SSM) or gated-DeltaNet layer keeps no per-token KV cache: each sequence holds one
fixed-size state per layer, a convolution window plus the recurrent (SSM) state. vLLM 0.32 gives
such layers a ``MambaSpec`` (``vllm/v1/kv_cache_interface.py``) whose page is that state, and the
hybrid allocator draws attention pages and Mamba pages from one block pool. The numbers here
follow, per layer and per tensor-parallel rank:

- ``MambaStateShapeCalculator`` (``vllm/model_executor/layers/mamba/mamba_utils.py``):
  mamba1 (Jamba): conv ``(kernel - 1, I / TP)``, SSM ``(I / TP, d_state)``;
  mamba2 (Nemotron-H, Granite-4.0-H): conv ``(kernel - 1, (I + 2 G' d_state) / TP)``,
  SSM ``(heads / TP, head_dim, d_state)``, ``G'`` the groups padded up to TP when TP does not divide them;
  gated DeltaNet (Qwen3-Next): conv ``(kernel - 1, (2 k_heads k_dim + v_heads v_dim) / TP)``,
  SSM ``(v_heads / TP, v_dim, k_dim)``; lightning (linear) attention (MiniMax-Text-01, served up to vLLM
  0.23): one state ``(heads / TP, head_dim, head_dim)`` in the model dtype (``linear_attention_state_shape``).
- ``MambaStateDtypeCalculator``: the conv state in ``mamba_cache_dtype`` (auto: the model dtype),
  the SSM state in ``mamba_ssm_cache_dtype`` (auto: the conv state's); Nemotron-H's config hook
  (``vllm/model_executor/models/config.py``) makes ``auto`` float32 unless its config says otherwise.
- ``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py``): on a CPU with AVX-512 BF16 the SSM state
  is float32 unless a half dtype is asked for a model its accelerated GDN backend takes (:func:`cpu_ssm_dtype`).
- ``Platform._align_hybrid_block_size`` (``vllm/platforms/interface.py``): the attention block size
  grows to the smallest multiple of the kernel alignment whose page holds one Mamba state, and the
  Mamba page is padded to exactly that attention page.
- ``MambaSpec.max_memory_usage_bytes``: a sequence holds one page per Mamba group; under prefix
  caching (``mamba_cache_mode`` ``align``, which vLLM picks when prefix caching is on) two, plus
  one prefill checkpoint for Mamba-2 layers (``MambaMixer2.get_kv_cache_spec``): three.

Pure; no vLLM import.
"""

from __future__ import annotations

from math import prod

from servetune.capacity.arch import MambaMixer
from servetune.capacity.arith import cdiv


def _extra_groups(groups: int, tp: int) -> int:
    """``extra_groups_for_head_shards``: groups replicated so every head shard has its own."""
    return 0 if groups % tp == 0 else tp - groups


def tp_problem(mixer: MambaMixer, tp: int) -> str | None:
    """Why vLLM's ``divide`` would fail sharding this mixer's state over ``tp`` ranks, or None."""
    if mixer.kind == "linear_attention":
        sharded = {"linear attention heads": mixer.num_heads}
    elif mixer.kind == "gated_delta_net":
        sharded = {"linear_num_value_heads": mixer.num_v_heads, "conv dim": _conv_dim(mixer, 1)}
    elif mixer.kind == "mamba2":
        sharded = {"mamba heads": mixer.num_heads, "conv dim": _conv_dim(mixer, tp)}
    else:
        sharded = {"mamba intermediate size": mixer.intermediate_size}
    for what, size in sharded.items():
        if size % tp:
            return f"{what} {size} is not divisible by tensor_parallel_size {tp}"
    return None


def _conv_dim(mixer: MambaMixer, tp: int) -> int:
    if mixer.kind == "gated_delta_net":
        return 2 * mixer.num_k_heads * mixer.head_k_dim + mixer.num_v_heads * mixer.head_v_dim
    if mixer.kind == "mamba2":
        groups = mixer.n_groups + _extra_groups(mixer.n_groups, tp)
        return mixer.intermediate_size + 2 * groups * mixer.state_size
    return mixer.intermediate_size


def state_shapes(mixer: MambaMixer, tp: int = 1, num_spec: int = 0) -> tuple[tuple[int, ...], ...]:
    """(conv state, SSM state) shapes of one layer on one rank, in vLLM's default SD layout (linear attention:
    its one state)."""
    if mixer.kind == "linear_attention":
        return ((mixer.num_heads // tp, mixer.head_dim, mixer.head_dim),)
    conv = (mixer.conv_kernel - 1 + (num_spec if mixer.kind != "mamba1" else 0), _conv_dim(mixer, tp) // tp)
    if mixer.kind == "gated_delta_net":
        return conv, (mixer.num_v_heads // tp, mixer.head_v_dim, mixer.head_k_dim)
    if mixer.kind == "mamba2":
        return conv, (mixer.num_heads // tp, mixer.head_dim, mixer.state_size)
    return conv, (mixer.intermediate_size // tp, mixer.state_size)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def state_dtype_bytes(
    mixer: MambaMixer, model_dtype: str, mamba_cache_dtype: str = "auto", mamba_ssm_cache_dtype: str = "auto"
) -> tuple[int, ...]:
    """Bytes per element of the (conv, SSM) states (linear attention: of its one state, in mamba_cache_dtype)."""
    conv = _DTYPE_BYTES[model_dtype if mamba_cache_dtype == "auto" else mamba_cache_dtype]
    if mixer.kind == "linear_attention":
        return (conv,)
    ssm_dtype = mixer.ssm_state_dtype if mamba_ssm_cache_dtype == "auto" else mamba_ssm_cache_dtype
    return conv, conv if ssm_dtype == "auto" else _DTYPE_BYTES[ssm_dtype]


def cpu_ssm_dtype(asked: str, mixer: MambaMixer, linear_attention_layers: bool, avx512_bf16: bool) -> str:
    """The SSM state's dtype on vLLM 0.32's CPU build (``CpuPlatform.check_and_update_config``).

    ``asked``: ``mamba_ssm_cache_dtype`` after the model's config hook (Nemotron-H's ``auto``: its config's, else
    float32). On a CPU without AVX-512 BF16 (``torch.cpu._is_avx512_bf16_supported()``) it stays as asked (``auto``:
    the conv state's dtype). With it, anything but float32 becomes float32, except float16 or bfloat16 where the
    model's state backend is the accelerated GDN one (``_cpu_mamba_backend``): its config lists those layers as
    ``linear_attention`` in ``layer_types`` (``linear_attention_layers``: transformers' name for every Mamba,
    Mamba-2 and gated-DeltaNet layer; not Falcon-H1's ``hybrid`` layers) and its state dtypes are a (conv, SSM)
    pair, which lightning attention's one state is not.
    """
    if not avx512_bf16 or asked == "float32":
        return asked
    gdn_backend = linear_attention_layers and mixer.kind != "linear_attention"
    return asked if asked in ("float16", "bfloat16") and gdn_backend else "float32"


def state_bytes(
    mixer: MambaMixer,
    model_dtype: str,
    tp: int = 1,
    mamba_cache_dtype: str = "auto",
    mamba_ssm_cache_dtype: str = "auto",
    num_spec: int = 0,
) -> int:
    """One layer's state for one sequence on one rank: ``MambaSpec.page_size_bytes`` before padding."""
    shapes = state_shapes(mixer, tp, num_spec)
    dtypes = state_dtype_bytes(mixer, model_dtype, mamba_cache_dtype, mamba_ssm_cache_dtype)
    return sum(prod(shape) * size for shape, size in zip(shapes, dtypes, strict=True))


def aligned_block_size(block_size: int, kernel_block: int, attention_page_per_token: float, mamba_page: int) -> int:
    """The attention block size vLLM settles on so that one attention page holds one Mamba state.

    ``kernel_block``: the attention backend's smallest kernel block (16 for FlashAttention on GPUs,
    32 for the CPU backend). vLLM rounds ``max(kernel_block, block_size)`` times
    ``ceil(mamba_page / (that x page per token))`` up to a multiple of ``kernel_block``, and keeps
    the configured block size if it is already larger.
    """
    alignment = max(kernel_block, block_size)
    needed = alignment * cdiv(mamba_page, round(alignment * attention_page_per_token))
    needed = kernel_block * cdiv(needed, kernel_block)
    return max(block_size, needed)
