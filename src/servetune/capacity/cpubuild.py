"""What vLLM's CPU build refuses at start-up for the CPU it runs on: a quantized KV cache on a CPU without the
instructions its kernels need.

vLLM 0.32's CPU attention backend (``vllm/v1/attention/backends/cpu_attn.py``) takes ``auto``, ``fp8``, ``fp8_e4m3``
and ``fp8_e5m2``. ``_get_attn_isa``, run as each attention group's metadata builder is made (before the server
answers, so the engine fails to start), raises ``NotImplementedError`` for a quantized KV cache
(``is_quantized_kv_cache``: ``fp8*``, ``*per_token_head``, ``nvfp4*``):

- with a head size that is a multiple of 16 but not of 32: "FP8 KV cache requires head_size divisible by 32 on
  CPU", whatever the CPU;
- on a CPU with neither AMX tiles (``torch.cpu._is_amx_tile_supported()``: ``amx_tile``) nor AVX-512
  (``torch.cpu._is_avx512_supported()``, ATen's ``is_avx512_supported``: ``avx512f``, ``avx512bw``, ``avx512dq`` and
  ``avx512vl`` all present): "FP8 KV cache on CPU requires x86 with AVX-512 or AMX". An ARM, POWER or RISC-V host
  has neither, nor has an x86 CPU with AVX2 only (the AMD EPYC of DESIGN.md's measured facts). AVX-512 BF16 is not
  asked for.

The same check and message are in a public start-up log of vLLM 0.26.0 on an ARM64 host (Apple M4 under Docker;
github.com/kimun608/k8s-llm-serving, ``feature/model-compare``, whose follow-up started the same ``--kv-cache-dtype
fp8`` on an AMD Ryzen 7 7800X3D, a CPU with AVX-512). The profiles that apply it say so
(``EngineProfile.cpu_fp8_kv_isa``: 0.25 and later); for older releases, whose CPU attention was another backend,
the plan notes what 0.32 would refuse, unchecked.

MLA models run on the CPU MLA backends, not this one: not checked here. Pure; no vLLM import.
"""

from __future__ import annotations

from servetune.capacity.arch import ModelArch
from servetune.capacity.hardware import AVX512_FLAGS, Hardware
from servetune.capacity.profile import VLLM_0_32, EngineProfile


def quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """vLLM's ``is_quantized_kv_cache``: the dtypes the CPU backend's ISA check applies to."""
    return kv_cache_dtype.startswith(("fp8", "nvfp4")) or kv_cache_dtype.endswith("per_token_head")


def _checked(arch: ModelArch, kv_cache_dtype: str, hardware: Hardware) -> bool:
    return hardware.device == "cpu" and not arch.is_mla and quantized_kv_cache(kv_cache_dtype)


def cpu_kv_cache_problem(
    arch: ModelArch, kv_cache_dtype: str, hardware: Hardware, profile: EngineProfile
) -> str | None:
    """Why vLLM's CPU build (of ``profile``'s releases) refuses ``kv_cache_dtype`` for ``arch`` on ``hardware``'s CPU,
    or None: it takes it, or this is not the CPU build, or the release is not checked (:func:`cpu_kv_cache_note`)."""
    if not _checked(arch, kv_cache_dtype, hardware) or not profile.cpu_fp8_kv_isa:
        return None
    what = f"kv_cache_dtype {kv_cache_dtype} on {profile.name}'s CPU build"
    if arch.head_dim % 32 and arch.head_dim % 16 == 0:
        return f"{what} needs a head size divisible by 32, and the model's is {arch.head_dim}"
    if hardware.avx512 or hardware.amx:
        return None
    missing = [flag for flag in AVX512_FLAGS if flag not in hardware.cpu_flags]
    return (
        f"{what} needs AVX-512 ({', '.join(AVX512_FLAGS)}) or AMX (amx_tile): {hardware.describe_cpu()} lacks "
        f"{', '.join(missing)} and amx_tile"
    )


def cpu_kv_cache_note(arch: ModelArch, kv_cache_dtype: str, hardware: Hardware, profile: EngineProfile) -> str | None:
    """A note where vLLM 0.32 would refuse it but ``profile``'s releases are not known to (not checked), else None."""
    if profile.cpu_fp8_kv_isa or (problem := cpu_kv_cache_problem(arch, kv_cache_dtype, hardware, VLLM_0_32)) is None:
        return None
    return f"not checked for {profile.name}, whose CPU attention backend was another: {problem}"
