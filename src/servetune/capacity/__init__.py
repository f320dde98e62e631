"""Capacity planning: will a vLLM configuration fit, and how many tokens of KV cache will it get?

The memory ledger, per GPU (checklist section 4 and the vllm-parameters doc)::

    requested   = ceil(gpu_memory_utilization x GPU memory)          # what vLLM may use
    weights     = params on this rank x bytes per weight (+ rope cache) # TP/PP split, quantization
    activation  = max(tokens x per-token peak,                          # the profiled dummy run of
                      seqs x vocab x sampler bytes) + base              #   max_num_batched_tokens
    non_torch   = CUDA context / NCCL (larger at TP >= 2) + runtime buffers
    cudagraph   = vLLM's CUDA-graph estimate (0 with enforce_eager)
    KV pool     = requested - weights - activation - non_torch - cudagraph
    KV/token    = 2 x layers x KV heads on this rank x head_dim x KV dtype bytes
                  (MLA: layers x (kv_lora_rank + qk_rope_head_dim) x bytes, on every rank)
    KV blocks   = KV pool // (block_size x KV/token)
    KV tokens   = blocks / ceil(max_model_len / block_size) x max_model_len
    concurrency = blocks / ceil(request tokens / block_size)

On vLLM's CPU build the KV pool is exactly ``VLLM_CPU_KVCACHE_SPACE`` GiB per rank.

Use :func:`load_model_arch` (a directory or a catalogue id), :func:`resolve_hardware` (a GPU name
or a memory size), then :func:`plan_capacity`; :func:`compare_kv` scores a plan against the token
count vLLM logs (read by :class:`servetune.engine.server.KvCapacity`).
"""

from servetune.capacity.arch import ModelArch, WeightQuant, arch_from_hf_config, load_catalog, load_model_arch
from servetune.capacity.compare import compare_kv
from servetune.capacity.hardware import Hardware, find_gpu, gpu_hardware, load_gpu_catalog, resolve_hardware
from servetune.capacity.ledger import plan_capacity
from servetune.capacity.params import count_parameters, kv_bytes_per_token
from servetune.capacity.profile import (
    PROFILES,
    VLLM_0_11,
    VLLM_0_32,
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
    EngineProfile,
)
from servetune.capacity.schema import CapacityArgs, CapacityPlan, NotPlanned, Settings, read_engine_args

__all__ = [
    "PROFILES",
    "VLLM_0_11",
    "VLLM_0_32",
    "VLLM_DEFAULT_GPU_MEMORY_UTILIZATION",
    "CapacityArgs",
    "CapacityPlan",
    "EngineProfile",
    "Hardware",
    "ModelArch",
    "NotPlanned",
    "Settings",
    "WeightQuant",
    "arch_from_hf_config",
    "compare_kv",
    "count_parameters",
    "find_gpu",
    "gpu_hardware",
    "kv_bytes_per_token",
    "load_catalog",
    "load_gpu_catalog",
    "load_model_arch",
    "plan_capacity",
    "read_engine_args",
    "resolve_hardware",
]
