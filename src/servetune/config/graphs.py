"""Which engine arguments shape vLLM's compiled graph, and drawing them at fewer values.

vLLM names a compiled graph's directory in its compile cache by a hash of four hashes: the
environment's, the config's, the traced code's and the compiler's (vLLM 0.32,
``vllm/compilation/backends.py:1038-1075``: ``VLLM_CACHE_ROOT/torch_compile_cache/<key>``). Of these,
only the config's depends on a trial's engine arguments: ``VllmConfig.compute_hash``
(``vllm/config/vllm.py:449-563``) hashes each sub-config's own ``compute_hash``:

- ``ModelConfig`` (``vllm/config/model.py:453-503``): every field but a list of ignored ones (the
  tokenizer, the seed, the served name, ``enforce_eager``, multimodal processor settings...). So
  ``model``, ``dtype``, ``quantization`` and ``max_model_len`` are in the key.
- ``CacheConfig`` (``vllm/config/cache.py:277-320``): every field but runtime knobs, among them
  ``gpu_memory_utilization`` (line 290) and ``enable_prefix_caching`` (line 294). So
  ``kv_cache_dtype`` (its ``cache_dtype``) and ``block_size`` are in; memory fractions are not.
- ``ParallelConfig`` (``vllm/config/parallel.py:887-941``): every field but ranks, ports and launch
  details. So ``tensor_parallel_size``, ``pipeline_parallel_size`` and ``data_parallel_size`` are in.
- ``SchedulerConfig`` (``vllm/config/scheduler.py:255-284``): exactly two factors,
  ``max_num_batched_tokens`` (line 277: Inductor's 32- or 64-bit indexing, LoRA's static buffers)
  and ``max_num_seqs`` (line 281: per-request static buffers captured in the graph). Not
  ``enable_chunked_prefill``. So ``max_num_seqs`` is in the Inductor key itself, not only
  through the CUDA-graph capture sizes it sets.
- ``CompilationConfig`` (``vllm/config/compilation.py:790-820``): every field but paths and timings,
  so its capture sizes and compile ranges too, which vLLM derives from ``max_num_seqs`` and
  ``max_num_batched_tokens`` (``vllm/config/vllm.py:2296-2330``): nothing new beyond the two.
- ``SpeculativeConfig`` (``vllm/config/speculative.py:612-658``): whether the method returns
  auxiliary hidden states and the draft model's own config: a speculative choice is taken here as
  a graph of its own (an upper bound on the keys; ``ngram`` and ``none`` may share one).

So of what servetune's spaces search, :data:`GRAPH_ARGS` are in the key and
``gpu_memory_utilization``, ``enable_prefix_caching`` and ``enable_chunked_prefill`` are not.
Two trials whose arguments agree on :data:`GRAPH_ARGS` load one compiled graph from their node's cache
(engine/compile_cache.py): tens of seconds of a GPU start instead of a compile. A random or Bayesian
draw of an integer range gives every trial its own ``max_num_seqs`` and ``max_num_batched_tokens``,
so no two share a graph; ``search.graph_steps`` draws these ranges at the grid's values instead
(``SearchSpace`` reads it: powers of two for a log range, as the tuning guides list them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Engine arguments in vLLM 0.32's compile-cache key (module docstring: where each is hashed).
GRAPH_ARGS = (
    "model", "dtype", "quantization", "kv_cache_dtype", "block_size", "max_model_len",
    "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
    "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "speculative_config",
)  # fmt: skip


def graph_key(engine_args: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """The part of a trial's engine arguments vLLM's compile cache is keyed on: equal keys, one graph.
    An argument left out is vLLM's default, the same for every trial that leaves it out."""
    return tuple((name, repr(engine_args[name])) for name in GRAPH_ARGS if name in engine_args)
