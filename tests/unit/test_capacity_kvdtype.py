"""Every --kv-cache-dtype vLLM 0.32 accepts, priced as vLLM's own KV-cache specs price it.

The page of one token and one KV head is built the way vLLM builds it: the attention layer's
``FullAttentionSpec`` with the cache dtype's torch dtype and quant mode, passed through the
backend that serves the dtype (``customize_spec``); vLLM is imported, never started.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from servetune.capacity import NotPlanned, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.kvdtype import KV_CACHE_DTYPES, kv_slot_bytes

torch = pytest.importorskip("torch")
vllm_cache = pytest.importorskip("vllm.config.cache")
kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
torch_utils = pytest.importorskip("vllm.utils.torch_utils")


def _backend(kv_cache_dtype: str):
    if kv_cache_dtype.startswith("turboquant"):
        from vllm.v1.attention.backends.turboquant_attn import TurboQuantAttentionBackend

        return TurboQuantAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return TritonAttentionBackend


def _vllm_slot_bytes(kv_cache_dtype: str, head_dim: int) -> int:
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch_utils.STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
    spec = kv_interface.FullAttentionSpec(
        block_size=1,
        num_kv_heads=1,
        head_size=head_dim,
        dtype=dtype,
        kv_quant_mode=kv_interface.get_kv_quant_mode(kv_cache_dtype),
    )
    if kv_cache_dtype.startswith("nvfp4"):
        # FlashInferBackend.customize_spec (flashinfer itself is not installed on the CPU build):
        # K and V as separate head slots of nvfp4_kv_cache_full_dim bytes.
        full_dim = torch_utils.nvfp4_kv_cache_full_dim(head_dim)
        return dataclasses.replace(spec, num_head_slots=2, state_content_bytes=full_dim).page_size_bytes
    if kv_cache_dtype.startswith("ultraquant"):
        # UltraQuantAttentionBackend.customize_spec (its kernels need Triton's GPU build): one slot of
        # ultraquant.format.slot_size bytes per head.
        from vllm.v1.attention.ops.ultraquant.format import slot_size

        return dataclasses.replace(spec, state_content_bytes=slot_size(head_dim)).page_size_bytes
    return _backend(kv_cache_dtype).customize_spec(spec).page_size_bytes


def test_the_planner_knows_every_cache_dtype_vllm_accepts() -> None:
    accepted = set(typing.get_args(vllm_cache.CacheDType))
    assert set(KV_CACHE_DTYPES) == accepted  # the *_ds_mla layouts: test_capacity_sparse_mla.py


@pytest.mark.parametrize("kv_cache_dtype", [d for d in KV_CACHE_DTYPES if not d.endswith("_ds_mla")])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_slot_bytes_equal_vllms_page(kv_cache_dtype: str, head_dim: int) -> None:
    assert kv_slot_bytes(kv_cache_dtype, head_dim, 2) == _vllm_slot_bytes(kv_cache_dtype, head_dim)


def test_quantized_kv_holds_more_tokens_and_unknown_dtype_is_one_line() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(gpu="H100-SXM")
    base = plan_capacity(arch, {"max_model_len": 8192}, h100)
    for dtype, ratio in (("fp8", 2.0), ("int4_per_token_head", 512 / 136), ("nvfp4", 512 / 144)):
        plan = plan_capacity(arch, {"max_model_len": 8192, "kv_cache_dtype": dtype}, h100)
        assert plan.kv_bytes_per_token * ratio == pytest.approx(base.kv_bytes_per_token)
        assert plan.kv_cache_tokens == pytest.approx(base.kv_cache_tokens * ratio, rel=0.01)
    with pytest.raises(NotPlanned, match=r"kv_cache_dtype int3: the planner knows auto, float16"):
        plan_capacity(arch, {"kv_cache_dtype": "int3"}, h100)
