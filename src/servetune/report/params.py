"""A configuration in words: every parameter a trial set (:func:`config_label`), or only those the study
varied, by short names (:func:`short_config`).

``{"max_num_seqs": 32, "max_num_batched_tokens": 4096, "enable_chunked_prefill": False}`` reads
``max_num_seqs=32, max_num_batched_tokens=4096, enable_chunked_prefill=false`` in full and
``seqs=32 mbt=4096 chunk=off`` in short. A trial that set nothing runs on :data:`BASELINE`, which both
return bare: a sentence or a table that wants it set apart adds its own punctuation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from servetune.config.space import GPU_PARAM

#: How servetune names a trial that sets no parameter (the search's baseline): one wording everywhere, the
#: report's, MLflow's and the console's.
BASELINE = "vLLM defaults"

#: Short names of the engine arguments and environment variables searches vary.
SHORT_NAMES = {
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "mbt",
    "enable_chunked_prefill": "chunk",
    "enable_prefix_caching": "prefix",
    "gpu_memory_utilization": "gpu-mem",
    "tensor_parallel_size": "tp",
    "pipeline_parallel_size": "pp",
    "data_parallel_size": "dp",
    "max_model_len": "len",
    "block_size": "block",
    "kv_cache_dtype": "kv-dtype",
    "quantization": "quant",
    "dtype": "dtype",
    "env.VLLM_CPU_KVCACHE_SPACE": "kvGiB",
    "speculative.method": "spec",
    "speculative.num_speculative_tokens": "spec-k",
    "speculative.prompt_lookup_max": "lookup-max",
    "speculative.prompt_lookup_min": "lookup-min",
    "speculative.model": "draft",
}


def tuned(params: Mapping[str, Any]) -> dict[str, Any]:
    """What a trial tuned: its parameters but the GPU type it ran on (a trial that tuned nothing ran vLLM's
    defaults, on its GPU type when the study compares types)."""
    return {k: v for k, v in params.items() if k != GPU_PARAM}


def config_label(params: Mapping[str, Any], sep: str = ", ") -> str:
    """``max_num_seqs=32, gpu_memory_utilization=0.9`` (every value the trial set), else :data:`BASELINE`."""
    if not tuned(params) and GPU_PARAM in params:
        return f"{BASELINE} on {params[GPU_PARAM]}"
    return sep.join(f"{k}={_full_value(v)}" for k, v in params.items()) or BASELINE


def _full_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, bool):
        return str(value).lower()  # as YAML writes it
    return str(value)


def short_name(param: str) -> str:
    """``max_num_seqs`` -> ``seqs``; an unknown name is kept (``env.`` dropped)."""
    return SHORT_NAMES.get(param, param.removeprefix("env."))


def short_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def varied_params(configs: Iterable[Mapping[str, Any]]) -> list[str]:
    """The parameters that take two or more values among the trials that set them, in first-seen order.

    A trial that leaves a parameter unset (the baseline) does not make it varied. When nothing
    varies (one trial, or every trial alike) every parameter is returned, so a configuration
    is never shown empty.
    """
    values: dict[str, set[str]] = {}
    for config in configs:
        for name, value in config.items():
            values.setdefault(name, set()).add(repr(value))
    varied = [name for name, seen in values.items() if len(seen) > 1]
    return varied or list(values)


def short_config(params: Mapping[str, Any], varied: Sequence[str] | None = None) -> str:
    """``seqs=32 mbt=4096 chunk=off``: the varied parameters the trial set (all it set when none of them varies)."""
    names = [n for n in (varied if varied is not None else params) if n in params] or list(params)
    return " ".join(f"{short_name(n)}={short_value(params[n])}" for n in names) or BASELINE
