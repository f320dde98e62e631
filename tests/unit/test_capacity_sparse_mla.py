"""DeepSeek Sparse Attention (DeepSeek-V3.2) and its ``*_ds_mla`` KV layouts, and decode context parallelism,
planned as vLLM 0.32 plans them.

Page sizes, from vLLM 0.32's source (``vllm/model_executor/layers/attention/mla_attention.py``
``MLAAttention.get_kv_cache_spec``; the layouts are documented in
``vllm/v1/attention/backends/mla/flashmla_sparse.py``):

- a sparse MLA layer registers ``MLAAttentionSpec(num_kv_heads=1, head_size=576, state_content_bytes=...)``:
  ``fp8_ds_mla`` 656 B a token (512 fp8 NoPE + 4 fp32 scales x 4 B + 64 bf16 RoPE x 2 B), ``nvfp4_ds_mla``
  352 B (512 e2m1 NoPE packed 2 a byte = 256 + 64 fp8 RoPE + 512 / 16 = 32 fp8 block scales), ``auto``
  (576 x 2 B) 1,152 B; no padding (``alignment`` is DeepSeek-V4's only);
- its indexer (``vllm/model_executor/models/deepseek_v2.py`` ``DeepseekV32IndexerCache.get_kv_cache_spec``)
  registers one more ``MLAAttentionSpec`` per layer, ``head_size = index_head_dim + index_head_dim // 128 x 4``
  uint8 = 128 + 4 = 132 B a token, whatever the kv_cache_dtype (fp8 keys and an fp32 scale per 128);
- both are full-attention MLA specs of one block size: ``get_kv_cache_groups`` puts them in one
  ``UniformTypeKVCacheSpecs`` group whose page is the sum of the layers' pages, so DeepSeek-V3.2 (61 layers,
  an indexer on each, ``index_topk_freq`` 1) keeps 61 x (352 + 132) = 29,524 B a token with ``nvfp4_ds_mla``.

With ``decode_context_parallel_size`` D a rank keeps ceil(len / D) of a request's tokens
(``AttentionSpec.max_num_blocks_per_req``: ceil(len / (block_size x D)); ``FullAttentionSpec.max_memory_usage_bytes``:
ceil(ceil(len / D) / block_size) pages), so with the same blocks on a rank the pool holds D times the tokens.
The tests run vLLM's own grouping and capacity functions on the specs vLLM registers; vLLM is imported, never
started.

DeepSeek-V3.2's config.json (``deepseek-ai/DeepSeek-V3.2-Exp``) is not in this repository: ``V32`` below is written
from the published file's fields as recalled (the DeepSeek-V3 geometry plus ``index_head_dim`` 128,
``index_n_heads`` 64, ``index_topk`` 2048); the page sizes depend only on ``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, ``index_head_dim`` 128 and the 61 layers.
"""

from __future__ import annotations

import pytest

from servetune.capacity import arch_from_hf_config, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.arch import ModelArch
from servetune.capacity.params import count_parameters
from tests.unit.test_capacity_kvgroups import vllm_config

torch = pytest.importorskip("torch")
kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
MultipleOf = pytest.importorskip("vllm.v1.attention.backend").MultipleOf

GIB = 1 << 30
V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "num_nextn_predict_layers": 1,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}  # fmt: skip
# the bytes per token per layer derived in the module docstring
LATENT_BYTES = {"nvfp4_ds_mla": 256 + 64 + 512 // 16, "fp8_ds_mla": 512 + 4 * 4 + 64 * 2, "auto": 576 * 2}
INDEXER_BYTES = 128 + 128 // 128 * 4


@pytest.fixture(scope="module")
def v32() -> ModelArch:
    return arch_from_hf_config(V32, "deepseek-ai/DeepSeek-V3.2-Exp")


def _v32_specs(kv_cache_dtype: str, layers: int = 61) -> dict[str, object]:
    """The specs DeepSeek-V3.2's layers register: the sparse latent (MLAAttention.get_kv_cache_spec, with the
    state_content_bytes its code maps *_ds_mla to) and the indexer's key cache (DeepseekV32IndexerCache), as the
    backends customise them on SM100: FLASHMLA_SPARSE aligns a quantized latent's blocks to whole rows
    (``align_blocks_to_rows``), DEEPSEEK_V32_INDEXER's only kernel block size 64 makes MultipleOf(64)
    (``customize_attention_spec``)."""
    latent_bytes = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}.get(kv_cache_dtype)
    specs: dict[str, object] = {}
    for i in range(layers):
        specs[f"layers.{i}.self_attn.attn"] = kv_interface.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576,
            dtype=torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8, cache_dtype_str=kv_cache_dtype,
            kv_quant_mode=kv_interface.get_kv_quant_mode(kv_cache_dtype), state_content_bytes=latent_bytes,
            is_index_group_leader=True, block_stride_alignment=latent_bytes,
        )  # fmt: skip
        specs[f"layers.{i}.self_attn.indexer.k_cache"] = kv_interface.MLAAttentionSpec(
            block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=128 + 128 // 128 * 4, dtype=torch.uint8,
            cache_role=kv_interface.SparseCacheRole.INDEXER, block_stride_alignment=MultipleOf(64),
        )  # fmt: skip
    return specs


def _vllm_capacity(specs: dict[str, object], pool: int, max_model_len: int, dcp: int) -> tuple[int, int]:
    config = vllm_config(max_model_len, 16384, hybrid=True, dcp=dcp)
    groups = kv_cache_utils.get_kv_cache_groups(config, specs)
    kv_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, pool)
    tokens, _ = kv_cache_utils.get_kv_cache_capacity(config, kv_config)
    return kv_config.num_blocks, tokens


def test_the_config_reads_as_mla_with_an_indexer_on_every_layer(v32: ModelArch) -> None:
    assert v32.not_planned is None and v32.is_sparse_mla
    assert (v32.index_head_dim, v32.index_n_heads, v32.indexer_layers, v32.indexer_key_bytes) == (128, 64, 61, 132)
    # the indexers' weights, one a layer (DeepseekV32Indexer): wq_b 1536 x 64 x 128 + wk_weights_proj
    # 7168 x (128 + 64) + k_norm 2 x 128, beside DeepSeek-V3's (the same config read as deepseek_v3)
    v3 = {k: v for k, v in V32.items() if not k.startswith("index_")}
    dense = arch_from_hf_config({**v3, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "v3")
    assert not dense.is_sparse_mla
    assert count_parameters(v32) - count_parameters(dense) == 61 * (1536 * 64 * 128 + 7168 * 192 + 256)


@pytest.mark.parametrize("kv_cache_dtype", ["nvfp4_ds_mla", "fp8_ds_mla", "auto"])
def test_ds_mla_pages_and_tokens_equal_vllms(v32: ModelArch, kv_cache_dtype: str) -> None:
    pool, max_model_len = 61 * GIB + 12345, 32768
    args = {"tensor_parallel_size": 8, "max_model_len": max_model_len, "kv_cache_dtype": kv_cache_dtype,
            "kv_cache_memory_bytes": pool}  # fmt: skip
    plan = plan_capacity(v32, args, resolve_hardware(gpu="B200"))
    assert plan.fits and plan.settings.kv_cache_dtype == kv_cache_dtype
    assert plan.kv_bytes_per_token == 61 * (LATENT_BYTES[kv_cache_dtype] + INDEXER_BYTES)
    assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == _vllm_capacity(
        _v32_specs(kv_cache_dtype), pool, max_model_len, 1
    )
    if kv_cache_dtype == "nvfp4_ds_mla":  # 61 GiB + 12345 B // (64 x 29,524 B a block)
        assert plan.kv_bytes_per_token == 29524 and plan.kv_cache_blocks == (61 * GIB + 12345) // (64 * 29524)


def test_fp8_on_a_sparse_mla_model_below_sm100_is_stored_as_fp8_ds_mla(v32: ModelArch) -> None:
    """On H200 FLASHMLA_SPARSE serves fp8 and rewrites the cache dtype to fp8_ds_mla (656 B); on B200 vLLM prefers
    FLASHINFER_MLA_SPARSE, which keeps plain fp8 (576 B): cuda._get_backend_priorities,
    mla_attention._canonicalize_sparse_mla_kv_cache_dtype."""
    args = {"tensor_parallel_size": 8, "max_model_len": 32768, "kv_cache_dtype": "fp8"}
    hopper = plan_capacity(v32, args, resolve_hardware(gpu="H200"))
    blackwell = plan_capacity(v32, args, resolve_hardware(gpu="B200"))
    assert hopper.settings.kv_cache_dtype == "fp8_ds_mla" and hopper.kv_bytes_per_token == 61 * (656 + 132)
    assert any("FLASHMLA_SPARSE stores it as fp8_ds_mla" in note for note in hopper.notes)
    assert blackwell.settings.kv_cache_dtype == "fp8" and blackwell.kv_bytes_per_token == 61 * (576 + 132)
    # fp8_e4m3 is not in FLASHMLA_SPARSE's list: FLASHINFER_MLA_SPARSE_SM90 keeps it as plain fp8
    e4m3 = plan_capacity(v32, {**args, "kv_cache_dtype": "fp8_e4m3"}, resolve_hardware(gpu="H200"))
    assert e4m3.settings.kv_cache_dtype == "fp8_e4m3" and e4m3.kv_bytes_per_token == 61 * (576 + 132)


def test_what_vllm_refuses_with_the_ds_mla_layouts(v32: ModelArch) -> None:
    args = {"tensor_parallel_size": 8, "max_model_len": 32768}
    hopper = plan_capacity(v32, {**args, "kv_cache_dtype": "nvfp4_ds_mla"}, resolve_hardware(gpu="H200"))
    assert not hopper.fits and "nvfp4_ds_mla: FLASHMLA_SPARSE takes it on SM100" in hopper.reason
    dense_mla = load_model_arch("deepseek-ai/DeepSeek-V3")
    for dtype in ("fp8_ds_mla", "nvfp4_ds_mla"):
        plan = plan_capacity(dense_mla, {**args, "kv_cache_dtype": dtype}, resolve_hardware(gpu="B200"))
        assert not plan.fits and "only the sparse MLA backends take it" in plan.reason
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    plan = plan_capacity(llama, {"kv_cache_dtype": "nvfp4_ds_mla"}, resolve_hardware(gpu="B200"))
    assert not plan.fits and "no backend takes it without MLA" in plan.reason
    plan = plan_capacity(v32, {**args, "kv_cache_dtype": "nvfp4"}, resolve_hardware(gpu="B200"))
    assert not plan.fits and "not supported with MLA" in plan.reason  # VllmConfig.validate_nvfp4_kv_cache_with_mla


@pytest.mark.parametrize("dcp", [2, 8])
def test_decode_context_parallelism_shards_the_tokens_as_vllm_does(v32: ModelArch, dcp: int) -> None:
    pool, max_model_len = 61 * GIB + 12345, 100000
    args = {"tensor_parallel_size": 8, "max_model_len": max_model_len, "kv_cache_dtype": "nvfp4_ds_mla",
            "kv_cache_memory_bytes": pool}  # fmt: skip
    one = plan_capacity(v32, args, resolve_hardware(gpu="B200"))
    plan = plan_capacity(v32, {**args, "decode_context_parallel_size": dcp}, resolve_hardware(gpu="B200"))
    assert plan.fits and plan.kv_cache_blocks == one.kv_cache_blocks  # the same blocks on each rank ...
    expected = _vllm_capacity(_v32_specs("nvfp4_ds_mla"), pool, max_model_len, dcp)
    assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == expected  # ... hold DCP times the tokens
    assert plan.kv_cache_tokens > (dcp - 0.1) * one.kv_cache_tokens


def test_decode_context_parallelism_on_a_gqa_model_and_what_vllm_refuses() -> None:
    """Llama-3.1-8B (8 KV heads) at TP 16 keeps one KV head a rank, two ranks per head: DCP 2 shards the tokens
    over those two (ModelConfig: TP > KV heads, DCP <= TP / KV heads, query heads per KV head % DCP == 0)."""
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    pool, max_model_len = 20 * GIB, 65536
    args = {"tensor_parallel_size": 16, "max_model_len": max_model_len, "kv_cache_memory_bytes": pool,
            "max_num_batched_tokens": 8192}  # fmt: skip
    plan = plan_capacity(llama, {**args, "decode_context_parallel_size": 2}, resolve_hardware(gpu="H100-SXM"))
    specs = {
        f"layers.{i}": kv_interface.FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=128, dtype=torch.bfloat16
        )
        for i in range(32)
    }
    assert plan.fits and (plan.kv_cache_blocks, plan.kv_cache_tokens) == _vllm_capacity(specs, pool, max_model_len, 2)
    h100 = resolve_hardware(gpu="H100-SXM")
    refused = {
        (8, 2): "needs tensor_parallel_size 8 > the model's 8 KV heads",
        (16, 4): "decode_context_parallel_size 4 exceeds tensor_parallel_size 16 / 8 KV heads = 2",
        (32, 3): "tensor_parallel_size 32 is not divisible by decode_context_parallel_size 3",
    }
    for (tp, dcp), why in refused.items():
        bad = plan_capacity(llama, {**args, "tensor_parallel_size": tp, "decode_context_parallel_size": dcp}, h100)
        assert not bad.fits and why in bad.reason, bad.reason
    gemma = load_model_arch("google/gemma-3-27b-it")  # 16 KV heads, sliding-window layers
    bad = plan_capacity(
        gemma, {"tensor_parallel_size": 32, "decode_context_parallel_size": 2, "max_model_len": 8192}, h100
    )
    assert not bad.fits and "sliding-window layers" in bad.reason
