"""The engine arguments vLLM resolved at start-up, read back from the running server.

A launch that leaves ``max_num_seqs`` or ``max_num_batched_tokens`` to vLLM gets values that
depend on the hardware and on vLLM's version; a configuration that is shipped pins them. vLLM
states its resolved configuration at ``GET /server_info?config_format=json``, a development
endpoint served when the engine runs with ``VLLM_SERVER_DEV_MODE=1`` (servetune's engines bind
127.0.0.1 only). :data:`RESOLVED_FIELDS` says where each core engine argument sits in it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"

#: engine argument -> (section of vLLM's config, field in it).
RESOLVED_FIELDS: dict[str, tuple[str, str]] = {
    "tensor_parallel_size": ("parallel_config", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel_config", "pipeline_parallel_size"),
    "data_parallel_size": ("parallel_config", "data_parallel_size"),
    "dtype": ("model_config", "dtype"),
    "quantization": ("model_config", "quantization"),
    "max_model_len": ("model_config", "max_model_len"),
    "enforce_eager": ("model_config", "enforce_eager"),
    "kv_cache_dtype": ("cache_config", "cache_dtype"),
    "block_size": ("cache_config", "block_size"),
    "gpu_memory_utilization": ("cache_config", "gpu_memory_utilization"),
    "enable_prefix_caching": ("cache_config", "enable_prefix_caching"),
    "max_num_seqs": ("scheduler_config", "max_num_seqs"),
    "max_num_batched_tokens": ("scheduler_config", "max_num_batched_tokens"),
    "enable_chunked_prefill": ("scheduler_config", "enable_chunked_prefill"),
    # ``vllm serve``'s front end: its API server processes (by default one per data-parallel rank)
    "api_server_count": ("parallel_config", "_api_process_count"),
}


def resolved_engine_args(vllm_config: Mapping[str, Any]) -> dict[str, Any]:
    """The core engine arguments as vLLM resolved them (``torch.float32`` written as ``float32``)."""
    out: dict[str, Any] = {}
    for name, (section, field) in RESOLVED_FIELDS.items():
        values = vllm_config.get(section)
        if not isinstance(values, Mapping) or values.get(field) is None:
            continue
        value = values[field]
        if isinstance(value, str) and value.startswith("torch."):
            value = value.removeprefix("torch.")
        if isinstance(value, (str, int, float, bool)):
            out[name] = value
    return out


def fetch_resolved(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """What the server at ``url`` resolved; empty when it does not say (dev mode off, another server)."""
    try:
        with urllib.request.urlopen(f"{url}/server_info?config_format=json", timeout=timeout_s) as response:
            info = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return {}
    config = info.get("vllm_config") if isinstance(info, dict) else None
    return resolved_engine_args(config) if isinstance(config, Mapping) else {}
