"""Bytes one token's K and V take per KV head for every ``--kv-cache-dtype`` vLLM 0.32 accepts.

From vLLM 0.32's KV-cache specs and the backends' ``customize_spec`` (the page is
``heads x slot bytes`` per token):

- ``auto`` / ``float16`` / ``bfloat16``: 2 x head_dim x the element size;
- ``fp8``, ``fp8_e4m3``, ``fp8_e5m2``, ``fp8_inc``: one byte per element (per-tensor scales);
- ``int8_per_token_head`` / ``fp8_per_token_head``: one byte per element plus an fp32 scale per
  K and per V (Triton backend); ``int4_per_token_head``: two elements a byte plus the scales;
- ``nvfp4`` / ``nvfp4_4over6``: per side head_dim / 2 fp4 bytes + head_dim / 16 fp8 block scales
  (FlashInfer ``nvfp4_kv_cache_full_dim``);
- ``turboquant_*``: key MSE indices + an fp16 norm (or fp8 keys), values at their bits + fp16 scale
  and zero, rounded up to an even size (``TurboQuantConfig.slot_size_aligned``);
- ``ultraquant_4bit``: fp4 K and V codes + one E8M0 scale per 32 elements each;
- ``fp8_ds_mla``: DeepSeek sparse MLA's 656-byte latent: 512 fp8 NoPE + 4 fp32 scales + 64 bf16 RoPE;
- ``nvfp4_ds_mla``: its 352-byte NVFP4 latent: 512 e2m1 NoPE packed 2 a byte + 64 fp8 RoPE + 32 fp8 scales
  (one per 16 NoPE values). Both are ``MLAAttention.get_kv_cache_spec``'s ``state_content_bytes``, one head,
  unpadded; only the sparse MLA backends take them (``capacity/settings.py:kv_dtype_problem``).

Pure; tests/unit/test_capacity_kvdtype.py checks each against vLLM's own functions.
"""

from __future__ import annotations

import math

FP8_DS_MLA_BYTES_PER_LAYER = 656  # 512 fp8 latent + 4 fp32 scales + 64 bf16 rope dims
NVFP4_DS_MLA_BYTES_PER_LAYER = 352  # 512 fp4 latent (256 B) + 64 fp8 rope dims + 32 fp8 block scales
DS_MLA_BYTES_PER_LAYER = {"fp8_ds_mla": FP8_DS_MLA_BYTES_PER_LAYER, "nvfp4_ds_mla": NVFP4_DS_MLA_BYTES_PER_LAYER}
ULTRAQUANT_GROUP = 32
# (key bits, value bits) of vLLM's TurboQuant presets (TQ_PRESETS); 8-bit keys are stored as fp8.
TURBOQUANT_BITS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}
_ONE_BYTE = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")
_PER_TOKEN_HEAD = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")
KV_CACHE_DTYPES = (
    "auto",
    "float16",
    "bfloat16",
    *_ONE_BYTE,
    *_PER_TOKEN_HEAD,
    "nvfp4",
    "nvfp4_4over6",
    *TURBOQUANT_BITS,
    "ultraquant_4bit",
    *DS_MLA_BYTES_PER_LAYER,
)


def kv_slot_bytes(kv_cache_dtype: str, head_dim: int, model_dtype_bytes: int) -> int | None:
    """Bytes of one token's K and V for one KV head, or None when vLLM 0.32 has no such dtype."""
    if kv_cache_dtype == "auto":
        return 2 * head_dim * model_dtype_bytes
    if kv_cache_dtype in ("float16", "bfloat16"):
        return 2 * head_dim * 2
    if kv_cache_dtype in _ONE_BYTE:
        return 2 * head_dim
    if kv_cache_dtype in _PER_TOKEN_HEAD:
        data = head_dim if kv_cache_dtype == "int4_per_token_head" else 2 * head_dim
        return data + 2 * 4
    if kv_cache_dtype in ("nvfp4", "nvfp4_4over6"):
        return 2 * (head_dim // 2 + head_dim // 16)
    if kv_cache_dtype in TURBOQUANT_BITS:
        key_bits, value_bits = TURBOQUANT_BITS[kv_cache_dtype]
        key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
        value = math.ceil(head_dim * value_bits / 8) + 4
        slot = key + value
        return slot + slot % 2
    if kv_cache_dtype == "ultraquant_4bit":
        return 2 * (head_dim // 2 + head_dim // ULTRAQUANT_GROUP)
    return None
