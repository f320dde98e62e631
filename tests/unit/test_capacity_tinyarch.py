"""The planner on servetune's tiny checkpoints of gemma-3, granite-4.0-h, Jamba, Qwen3-Next and a sliding-window
Mistral (``servetune.models.tinyarch``), against what vLLM 0.32's CPU build allocated for them (``bench/arch_vllm.py``)
and against vLLM's CPU scheduling rules, worked from the configs alone.
"""

from __future__ import annotations

from typing import Any

import pytest

from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.capacity.arith import cdiv
from servetune.capacity.kvgroups import kv_layout
from servetune.models.tinyarch import TINY_ARCHS

pytest.importorskip("transformers")  # the configs are read through transformers' own config classes

GIB = 1 << 30
#: The CPU the numbers below were measured on (one with AVX-512 BF16), whatever host runs the tests.
CPU = resolve_hardware(device="cpu", cpu_flags=("avx512f", "avx512_bf16"))
KV_SPACE = {"VLLM_CPU_KVCACHE_SPACE": "1"}
#: What bench/arch_vllm.py gives every engine (the CPU build's `vllm serve` batch defaults).
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_num_seqs": 128,
    "max_num_batched_tokens": 2048,
}


def _plan(name: str, env: dict[str, str] | None = None, **engine: Any):
    arch = arch_from_hf_config(TINY_ARCHS[name], f"tiny-{name}")
    return plan_capacity(arch, {**ENGINE, **engine}, CPU, env={**KV_SPACE, **(env or {})})


def test_the_tiny_gemma3_is_five_window_layers_to_one_global() -> None:
    arch = arch_from_hf_config(TINY_ARCHS["gemma3"], "tiny-gemma3")
    assert arch.sliding_window == 512
    assert [i for i, kind in enumerate(arch.layer_kinds) if kind == "full_attention"] == [5, 11]
    layout = kv_layout(arch)
    assert layout.group_size == 2 and len(layout.groups) == 6  # 5 window groups and 1 global, 2 layers each


def _gemma3_tokens(max_model_len: int, in_flight: int) -> tuple[int, int]:
    """(blocks, KV tokens) of the tiny gemma-3 in 1 GiB: 128-token blocks of 2 layers x 2 KV heads x 64 x 2 x 4 B,
    5 window groups holding the window and the tokens in flight, 1 global group holding the whole request."""
    blocks = GIB // (2 * 128 * 2 * 2 * 64 * 4)
    window = cdiv(min(512 - 1 + in_flight, max_model_len), 128) + 1
    per_request = 5 * window + cdiv(max_model_len, 128)
    return blocks, int(blocks / per_request * max_model_len)


@pytest.mark.parametrize("max_model_len", [1024, 4096, 8192])
def test_the_cpu_build_holds_one_batch_in_flight(max_model_len: int) -> None:
    """vLLM's CPU build turns async scheduling off, so a window group holds the window and one batch of 2048 tokens
    in flight, not two."""
    plan = _plan("gemma3", max_model_len=max_model_len)
    assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == _gemma3_tokens(max_model_len, 2048)
    if max_model_len > 512 + 2048:  # where a second batch would have cost the window groups blocks
        assert plan.kv_cache_tokens > _gemma3_tokens(max_model_len, 2 * 2048)[1]
    asked = _plan("gemma3", max_model_len=max_model_len, async_scheduling=True)
    assert asked.kv_cache_tokens == plan.kv_cache_tokens  # asked for or not: the CPU build runs without


def test_two_cpu_ranks_chunk_prefills_in_one_batch() -> None:
    """Two ranks run the multiprocessing executor: chunked prefill stays on, with the CPU default of 2048 tokens a
    rank (4096), one batch in flight."""
    plan = _plan("gemma3", tensor_parallel_size=2, max_model_len=8192, max_num_batched_tokens=None)
    blocks = GIB // (2 * 128 * 1 * 2 * 64 * 4)  # one KV head a rank
    window = cdiv(512 - 1 + 4096, 128) + 1
    assert plan.kv_cache_blocks == blocks
    assert plan.kv_cache_tokens == int(blocks / (5 * window + 64) * 8192)


def test_the_cpu_build_keeps_the_ssm_state_in_float32() -> None:
    """A bfloat16 granite-4.0-h on the CPU build: the convolution state in bfloat16, the SSM state in float32
    (vLLM's CPU platform on an AVX-512 BF16 host), so the attention block grows to hold that larger state."""
    plan = _plan("granite-4.0-h", dtype="bfloat16", max_model_len=4096)
    state = 3 * (512 + 2 * 64) * 2 + 8 * 64 * 64 * 4  # conv (3, 640) in bf16 + SSM (8, 64, 64) in fp32
    assert plan.mamba_state_bytes_per_sequence == 6 * state
    block = 128 * cdiv(state, 128 * 2 * 2 * 64 * 2)  # the smallest 128-multiple whose bf16 page holds one state
    assert plan.settings.block_size == block == 384
    blocks = GIB // (2 * block * 2 * 2 * 64 * 2)  # groups of 2 layers
    assert plan.kv_cache_blocks == blocks
    assert plan.kv_cache_tokens == int(blocks / (cdiv(4096, block) + 3 * 3) * 4096)  # align mode: 3 blocks a group
    gpu = plan_capacity(
        arch_from_hf_config(TINY_ARCHS["granite-4.0-h"], "tiny"), {"dtype": "bfloat16"}, resolve_hardware("gpu", "H100")
    )
    assert gpu.mamba_state_bytes_per_sequence == 6 * (3 * 640 * 2 + 8 * 64 * 64 * 2)  # on a GPU: as asked (auto)


# What vLLM 0.32.0's CPU build (vllm-cpu 0.32.0, torch 2.13 CPU, on the 2-core Intel Xeon development host with
# AVX-512 BF16) logged for the tiny checkpoints, served by `PYTHONPATH=src .venv/bin/python bench/arch_vllm.py` on
# 2026-12-06 (VLLM_CPU_KVCACHE_SPACE=1, --enforce-eager --max-num-seqs 128 --max-num-batched-tokens 2048, float32
# unless given): "CPU KV cache size: N tokens, Maximum concurrency for L tokens per request: X", and for the Mamba
# hybrids "Setting attention block size to B tokens". Each engine then answered a greedy 8-token request. gpt-oss
# and the Mistral ran with the engine core in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, an earlier case list of the
# script); the gemma-3 logged the same numbers both ways. Jamba and Qwen3-Next sized their KV cache, then failed
# on their first request (the CPU build has no Mamba-1 prefill kernel, `selective_scan_fwd`; its gated-DeltaNet
# kernel refused the 32-dim heads Qwen3-Next had then: "Unexpected head dim size, 32"), so theirs are KV numbers only.
# The Qwen3-Next with 128-dim heads (as built now) served, in a third run at 00:53 UTC.
MEASURED = [
    # case, tiny architecture, engine arguments, KV tokens, concurrency, block size
    ("gemma3", "gemma3", {"max_model_len": 8192}, 198546, 24.24, 128),
    ("granite-4.0-h", "granite-4.0-h", {"max_model_len": 4096}, 335544, 81.92, 256),
    ("granite-4.0-h-no-prefix", "granite-4.0-h", {"max_model_len": 4096, "enable_prefix_caching": False},
     441505, 107.79, 256),
    ("granite-4.0-h-bf16", "granite-4.0-h", {"max_model_len": 4096, "dtype": "bfloat16"}, 559104, 136.5, 384),
    ("gpt-oss-bf16", "gpt-oss", {"max_model_len": 8192, "dtype": "bfloat16"}, 818400, 99.9, 128),
    ("mistral-sliding", "mistral-sliding", {"max_model_len": 8192}, 798915, 97.52, 128),
    ("jamba", "jamba", {"max_model_len": 4096}, 441505, 107.79, 128),
    ("qwen3-next-bf16", "qwen3-next", {"max_model_len": 4096, "dtype": "bfloat16"}, 1032192, 252.0, 640),
    # session 34, 03:52-03:55 UTC, on a 2-core AMD EPYC with avx512f and avx512_bf16: vLLM logged "Using bfloat16
    # SSM state storage for the CPU accelerated GDN backend" and served the request
    ("granite-4.0-h-bf16-ssm-bf16", "granite-4.0-h",
     {"max_model_len": 4096, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}, 671088, 163.84, 256),
]  # fmt: skip


@pytest.mark.parametrize(
    "arch, engine, tokens, concurrency, block", [case[1:] for case in MEASURED], ids=[case[0] for case in MEASURED]
)
def test_the_tiny_checkpoints_plan_as_vllm_allocated(
    arch: str, engine: dict[str, Any], tokens: int, concurrency: float, block: int
) -> None:
    plan = _plan(arch, **engine)
    assert (plan.kv_cache_tokens, plan.max_concurrency, plan.settings.block_size) == (tokens, concurrency, block)


def test_the_qwen3_next_with_32_dim_heads_plans_as_vllm_allocated() -> None:
    """The tiny Qwen3-Next as first built (gated-DeltaNet heads of 32), in bfloat16 (the CPU GDN kernel's only
    dtype): vLLM logged 1,766,022 tokens, 431.16x, blocks of 128 (the SSM state in float32: 35,840 B a layer)."""
    config = {**TINY_ARCHS["qwen3-next"], "linear_key_head_dim": 32, "linear_value_head_dim": 32,
              "linear_num_key_heads": 4, "linear_num_value_heads": 8}  # fmt: skip
    arch = arch_from_hf_config(config, "tiny-qwen3-next-32")
    plan = plan_capacity(arch, {**ENGINE, "max_model_len": 4096, "dtype": "bfloat16"}, CPU, env=KV_SPACE)
    assert plan.mamba_state_bytes_per_sequence == 3 * (3 * 512 * 2 + 8 * 32 * 32 * 4)
    assert (plan.kv_cache_tokens, plan.max_concurrency, plan.settings.block_size) == (1766022, 431.16, 128)
