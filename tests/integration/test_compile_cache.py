"""The trials of a node share vLLM's compile cache: a later trial whose graph is the same loads it.

The fake engine stands in for vLLM on a GPU (the CPU stand-in runs eager, without compiling):
it compiles for ``SERVETUNE_FAKE_COMPILE_S`` unless the cache under vLLM's cache root holds the
graph its arguments shape, and logs as vLLM does. The engines are real processes started by the
trial runner, with the environment the study gives them."""

from __future__ import annotations

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.trial.runner import TrialSpec, run_trial

COMPILE_S = 3.0


def spec(tmp_path, python, engine_args):
    return TrialSpec(
        study="compile-cache", trials_dir=tmp_path / "trials", params=dict(engine_args), engine_args=dict(engine_args),
        env={"SERVETUNE_FAKE_COMPILE_S": str(COMPILE_S), "SERVETUNE_FAKE_COMPILE_HIT_S": "0.2"},
        model="fake-model", device="cpu", devices=1, price_per_device_hour=1.0, workload=load_workload("cpu-tiny"),
        levels=(Level("concurrency", 1),), requests_per_level=2, seconds_per_level=None, warmup_requests=0,
        request_timeout_s=30, startup_timeout_s=60, stop_on_slo_break=False, min_throughput_gain=0.0,
        slo=Slo.parse("ttft_ms.p99=5000"), python=python, capacity_levels=0,
    )  # fmt: skip


def test_a_later_trial_with_the_same_graph_loads_it_and_one_with_another_compiles(
    tmp_path, tiny_tokenizer, fake_python, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # vLLM's default root, node-local here
    python = str(fake_python)
    first, same_graph, other_graph = (
        run_trial(spec(tmp_path, python, args), lambda report: None, lambda: PromptFactory(tiny_tokenizer))
        for args in ({"max_num_seqs": 8}, {"max_num_seqs": 8, "enable_prefix_caching": False}, {"max_num_seqs": 16})
    )
    assert [r.outcome for r in (first, same_graph, other_graph)] == ["COMPLETE"] * 3
    assert first.startup_phases["compile_cache_hit"] == 0.0 and first.startup_phases["compile_s"] == COMPILE_S, (
        first.startup_phases
    )
    assert same_graph.startup_phases["compile_cache_hit"] == 1.0, same_graph.startup_phases
    assert same_graph.startup_phases["compile_s"] < 1.0, same_graph.startup_phases  # loaded, not compiled
    assert other_graph.startup_phases["compile_cache_hit"] == 0.0, (
        other_graph.startup_phases
    )  # max_num_seqs shapes the graph
    graphs = list((tmp_path / "cache" / "vllm" / "torch_compile_cache").glob("*/fake-graph"))
    assert len(graphs) == 2, graphs
    assert "vllm_cache_root" not in first.environment  # vLLM's own default served: servetune chose nothing
