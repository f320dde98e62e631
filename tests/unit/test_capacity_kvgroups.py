"""The ledger's KV-cache groups against vLLM 0.32's own grouping and capacity code.

For each model the test builds the per-layer KV-cache specs that vLLM's model code registers
(full attention, sliding window, chunked local), runs vLLM's ``get_kv_cache_groups``,
``get_kv_cache_config_from_groups`` and ``get_kv_cache_capacity`` on the same pool, and checks the
ledger's block count and KV tokens against them. vLLM is imported, never started.
"""

from __future__ import annotations

import types

import pytest

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.arch import ModelArch
from servetune.capacity.kvgroups import kv_layout

torch = pytest.importorskip("torch")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
vllm_cache = pytest.importorskip("vllm.config.cache")

GIB = 1 << 30


def _vllm_specs(arch: ModelArch, block_size: int, tp: int) -> dict[str, object]:
    """The spec each layer registers in vLLM (Attention / sliding window / ChunkedLocalAttention)."""
    common = {
        "block_size": block_size,
        "num_kv_heads": max(1, arch.num_kv_heads // tp),
        "head_size": arch.head_dim,
        "dtype": torch.bfloat16,
    }
    specs: dict[str, object] = {}
    for i, kind in enumerate(arch.layer_kinds):
        if kind == "sliding_attention":
            specs[f"layers.{i}"] = kv_interface.SlidingWindowSpec(sliding_window=arch.sliding_window, **common)
        elif kind == "chunked_attention":
            specs[f"layers.{i}"] = kv_interface.ChunkedLocalAttentionSpec(
                attention_chunk_size=arch.attention_chunk_size, **common
            )
        else:
            specs[f"layers.{i}"] = kv_interface.FullAttentionSpec(**common)
    return specs


def vllm_config(max_model_len: int, in_flight_tokens: int, hybrid: bool, dcp: int = 1) -> types.SimpleNamespace:
    """The attributes of VllmConfig that vLLM's grouping and capacity functions read (``dcp``: decode context
    parallelism's size)."""
    cache = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: vllm_cache._layout_from_name("NHD"),
        prefix_cache_retention_interval=None,
        mamba_cache_mode="none",
        num_gpu_blocks_override=None,
    )
    return types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid),
        attention_config=types.SimpleNamespace(hisparse_config=None),
        cache_config=cache,
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp, pipeline_parallel_size=1),
        speculative_config=None,
        max_in_flight_tokens=in_flight_tokens,
    )


def _vllm_capacity(arch: ModelArch, pool: int, max_model_len: int, batched: int, hybrid: bool, tp: int):
    config = vllm_config(max_model_len, 2 * batched, hybrid)  # async scheduling: two batches in flight
    groups = kv_cache_utils.get_kv_cache_groups(config, _vllm_specs(arch, 16, tp))
    kv_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, pool)
    tokens, _ = kv_cache_utils.get_kv_cache_capacity(config, kv_config)
    return kv_config.num_blocks, tokens, len(groups)


CASES = [
    # (model, TP, max_model_len, max_num_batched_tokens, hybrid manager on)
    ("google/gemma-3-27b-it", 1, 131072, 8192, True),
    ("google/gemma-3-27b-it", 2, 32768, 2048, True),
    ("google/gemma-3-27b-it", 1, 131072, 8192, False),
    ("openai/gpt-oss-120b", 1, 131072, 8192, True),
    ("openai/gpt-oss-20b", 1, 8192, 8192, True),
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 16000, 8192, True),
]


@pytest.mark.parametrize("hub_id, tp, max_model_len, batched, hybrid", CASES)
def test_blocks_and_tokens_equal_vllms_own_computation(
    hub_id: str, tp: int, max_model_len: int, batched: int, hybrid: bool
) -> None:
    arch = load_model_arch(hub_id)
    pool = 37 * GIB + 12345
    args = {
        "tensor_parallel_size": tp,
        "max_model_len": max_model_len,
        "max_num_batched_tokens": batched,
        "kv_cache_memory_bytes": pool,
        "disable_hybrid_kv_cache_manager": not hybrid,
    }
    plan = plan_capacity(arch, args, resolve_hardware(gpu="H100-SXM"))
    blocks, tokens, groups = _vllm_capacity(arch, pool, max_model_len, batched, hybrid, tp)
    assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == (blocks, tokens)
    assert len(kv_layout(arch, hybrid_manager=hybrid).groups) == groups


def test_mistral_style_window_on_every_layer_and_llama4_chunks_match_vllm() -> None:
    base = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    every = base.model_copy(update={"layer_types": ("sliding_attention",) * 32, "sliding_window": 4096})
    chunked = base.model_copy(
        update={
            "layer_types": tuple("full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(32)),
            "attention_chunk_size": 8192,
        }
    )
    for arch, hybrid in ((every, True), (chunked, True), (chunked, False)):
        pool = 20 * GIB
        args = {
            "max_model_len": 65536,
            "max_num_batched_tokens": 4096,
            "kv_cache_memory_bytes": pool,
            "disable_hybrid_kv_cache_manager": not hybrid,
        }
        plan = plan_capacity(arch, args, resolve_hardware(gpu="H100-SXM"))
        blocks, tokens, _ = _vllm_capacity(arch, pool, 65536, 4096, hybrid, 1)
        assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == (blocks, tokens)


def test_window_layers_hold_only_their_window_so_gemma3_holds_more_tokens() -> None:
    arch = load_model_arch("google/gemma-3-27b-it")
    h100 = resolve_hardware(gpu="H100-SXM")
    for batched, gain in ((8192, 1.3), (2048, 3.0)):  # a window layer also holds the in-flight batches
        args = {"max_model_len": 32768, "max_num_batched_tokens": batched}
        hybrid = plan_capacity(arch, args, h100)
        promoted = plan_capacity(arch, {**args, "disable_hybrid_kv_cache_manager": True}, h100)
        assert hybrid.fits and promoted.kv_cache_gib == hybrid.kv_cache_gib
        assert hybrid.kv_cache_tokens > gain * promoted.kv_cache_tokens
        assert any("KV cache groups of 10 layers: 6 x sliding 1024, 1 x full" in note for note in hybrid.notes)


def test_chunked_local_attention_is_promoted_by_default_as_vllm_does() -> None:
    """vLLM 0.32 turns the hybrid manager off for chunked local attention unless an env var allows it."""
    base = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    kinds = tuple("full_attention" if (i + 1) % 4 == 0 else "chunked_attention" for i in range(32))
    chunked = base.model_copy(update={"layer_types": kinds, "attention_chunk_size": 8192})
    assert len(kv_layout(chunked).groups) == 1
    assert len(kv_layout(chunked, hybrid_manager=True).groups) == 4
