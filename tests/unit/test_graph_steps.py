"""Which engine arguments share a compiled graph (config/graphs.py), and ``search.graph_steps``, which draws
the graph arguments' ranges at the grid's values so that trials share graphs."""

from __future__ import annotations

import optuna
import pytest

from servetune.config.graphs import GRAPH_ARGS, graph_key
from servetune.config.space import Range, SearchSpace
from servetune.study.searcher import distributions

SPACE = {
    "name": "steps",
    "model": "tiny",
    "device": "cpu",
    "workload": "cpu-tiny",
    "params": {
        "max_num_seqs": {"low": 16, "high": 64, "log": True},
        "max_num_batched_tokens": {"low": 2048, "high": 8192, "log": True},
        "max_model_len": {"low": 2048, "high": 4096, "step": 1024},
        "gpu_memory_utilization": {"low": 0.88, "high": 0.92},
        "env.VLLM_CPU_KVCACHE_SPACE": {"low": 1, "high": 40},
    },
    "search": {"algorithm": "random", "num_trials": 40},
}


def space(graph_steps: bool, **params) -> SearchSpace:
    return SearchSpace.model_validate(
        {**SPACE, "params": {**SPACE["params"], **params}, "search": {**SPACE["search"], "graph_steps": graph_steps}}
    )


def test_the_graph_key_holds_the_batch_limits_but_not_the_memory_fraction_or_prefix_caching():
    args = {"model": "m", "max_num_seqs": 16, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.9}
    assert graph_key(args) == graph_key({**args, "gpu_memory_utilization": 0.88, "enable_prefix_caching": False})
    assert graph_key(args) == graph_key({**args, "enable_chunked_prefill": False})
    assert graph_key(args) != graph_key({**args, "max_num_seqs": 17})
    assert graph_key(args) != graph_key({**args, "max_num_batched_tokens": 2049})
    assert graph_key(args) != graph_key({**args, "kv_cache_dtype": "fp8"})
    assert graph_key(args) != graph_key({**args, "tensor_parallel_size": 2})


def test_a_points_graph_key_holds_its_checkpoint_and_fixed_engine_arguments():
    s = SearchSpace.model_validate({**SPACE, "engine_args": {"dtype": "bfloat16"}, "params": {"model": ["a", "b"]}})
    assert ("model", repr("a")) in s.graph_key({"model": "a"}) and ("dtype", repr("bfloat16")) in s.graph_key(
        {"model": "a"}
    )
    assert s.graph_key({"model": "a"}) != s.graph_key({"model": "b"})
    assert ("model", repr("tiny")) in space(False).graph_key({"max_num_seqs": 16})  # the space's own model


def test_graph_args_agree_with_the_installed_vllms_own_hashes():
    """What config/graphs.py read in vLLM 0.32's source, asked of the installed vLLM: the scheduler's hash holds
    both batch limits (not chunked prefill), the cache's holds the KV dtype and block size (not the memory
    fraction or prefix caching), the parallel config's the parallel sizes."""
    vllm_config = pytest.importorskip("vllm.config")

    def scheduler(**kw):
        base = {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "max_model_len": 2048, "is_encoder_decoder": False}
        return vllm_config.SchedulerConfig(**{**base, **kw}).compute_hash()

    def cache(**kw):
        return vllm_config.CacheConfig(**kw).compute_hash()

    def parallel(**kw):
        return vllm_config.ParallelConfig(**kw).compute_hash()

    assert scheduler() != scheduler(max_num_seqs=32) and "max_num_seqs" in GRAPH_ARGS
    assert scheduler() != scheduler(max_num_batched_tokens=4096) and "max_num_batched_tokens" in GRAPH_ARGS
    assert scheduler() == scheduler(enable_chunked_prefill=False) and "enable_chunked_prefill" not in GRAPH_ARGS
    assert cache() != cache(cache_dtype="fp8") and "kv_cache_dtype" in GRAPH_ARGS
    assert cache() != cache(block_size=32) and "block_size" in GRAPH_ARGS
    assert cache() == cache(gpu_memory_utilization=0.8, enable_prefix_caching=False)
    assert not {"gpu_memory_utilization", "enable_prefix_caching"} & set(GRAPH_ARGS)
    assert parallel() != parallel(tensor_parallel_size=2) and "tensor_parallel_size" in GRAPH_ARGS
    assert parallel() != parallel(data_parallel_size=2) and "data_parallel_size" in GRAPH_ARGS


def test_graph_steps_draw_graph_arguments_at_the_grids_values_and_leave_the_rest_as_ranges():
    stepped = space(True)
    assert stepped.params["max_num_seqs"] == [16, 32, 64]
    assert stepped.params["max_num_batched_tokens"] == [2048, 4096, 8192]
    assert stepped.params["max_model_len"] == [2048, 3072, 4096]
    assert isinstance(stepped.params["gpu_memory_utilization"], Range)  # not in the key: drawn as before
    assert isinstance(stepped.params["env.VLLM_CPU_KVCACHE_SPACE"], Range)
    assert all(isinstance(v, Range) for v in space(False).params.values())  # off by default
    assert "graph_steps" not in SearchSpace.model_validate(SPACE).search.model_fields_set


def test_a_random_search_with_graph_steps_shares_graphs_and_one_without_does_not():
    def graphs_and_draws(s: SearchSpace) -> tuple[int, set]:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        draws = [study.ask(distributions(s)).params for _ in range(40)]
        return len({s.graph_key(d) for d in draws}), {d["max_num_seqs"] for d in draws}

    graphs_on, seqs_on = graphs_and_draws(space(True))
    graphs_off, seqs_off = graphs_and_draws(space(False))
    assert seqs_on <= {16, 32, 64} and graphs_on <= 3 * 3 * 3
    assert graphs_off == 40 > graphs_on  # integers drawn between: each draw its own graph
    assert len(seqs_off) > 3


@pytest.mark.parametrize(
    "param, why",
    [
        ({"max_num_seqs": {"low": 16, "high": 64}}, "log: true"),  # a wide integer range has no grid values
        ({"max_model_len": {"low": 2048.5, "high": 4096}}, "whole-number"),
    ],
)
def test_graph_steps_refuse_a_graph_range_without_steps_naming_it(param, why):
    with pytest.raises(ValueError, match=rf"params\.{next(iter(param))}: search\.graph_steps.*") as caught:
        space(True, **param)
    assert why in str(caught.value)
    space(False, **param)  # without graph_steps the range is fine
