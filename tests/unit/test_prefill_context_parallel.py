"""Prefill-context parallelism counts in an engine's devices wherever servetune places or prices one (issue 38, 12):
vLLM 0.32's world size is tensor x pipeline x prefill-context parallel. A trial's bundle counts it
(tests/unit/test_space.py); so do the Serve deployment serve-check and export write (Ray Serve LLM's own bundles
count TP x PP only), the devices serve-check checks a cluster for, and a Kubernetes server's GPU request."""

from __future__ import annotations

import pytest

from servetune.config.space import engine_devices, engine_ranks
from servetune.report import ReportPoint
from servetune.report.deploy import gpus
from servetune.serve.plan import llm_config, needs


def gpu_point(**sizes: int) -> ReportPoint:
    return ReportPoint(trial_id="t", level={"concurrency": 8.0}, engine_args=dict(sizes), env={}, model="/m/tiny",
                       device="gpu", metrics={})  # fmt: skip


def test_an_engines_ranks_are_its_world_size_and_its_devices_those_of_every_data_parallel_rank():
    sizes = {"tensor_parallel_size": 2, "pipeline_parallel_size": 3, "prefill_context_parallel_size": 2}
    assert engine_ranks(sizes) == 12
    assert engine_devices({**sizes, "data_parallel_size": 2}) == 24
    assert engine_ranks({"tensor_parallel_size": None}) == 1  # null passes no flag: vLLM's 1


@pytest.mark.parametrize("sizes, bundles, strategy", [
    ({"tensor_parallel_size": 2, "prefill_context_parallel_size": 2}, 4, "STRICT_PACK"),  # one node, as TP alone
    ({"pipeline_parallel_size": 2, "prefill_context_parallel_size": 2}, 4, "PACK"),  # stages may span nodes
    ({"pipeline_parallel_size": 2}, 2, None),  # Ray Serve LLM's own bundles (TP x PP) are right
])  # fmt: skip
def test_a_serve_replica_holds_every_rank_of_its_engine(sizes, bundles, strategy):
    pytest.importorskip("ray.serve.llm")
    from ray.serve.llm import LLMConfig

    point = gpu_point(**sizes)
    config = llm_config(point, 2, env={})
    asked = LLMConfig(**config).get_engine_config()  # what Ray Serve LLM asks Ray for, per replica
    assert len(asked.placement_bundles) == bundles and all(b.get("GPU") == 1 for b in asked.placement_bundles)
    assert (config.get("placement_group_config") or {}).get("strategy") == strategy
    need = needs(point, config, 2)
    assert need.devices_per_replica == bundles and need.devices == 2 * bundles  # what the fit check counts


def test_a_kubernetes_server_asks_for_its_prefill_context_ranks_too():
    assert gpus(gpu_point(tensor_parallel_size=2, prefill_context_parallel_size=2, data_parallel_size=2)) == 8
