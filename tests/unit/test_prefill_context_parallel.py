"""Prefill-context parallelism counts in an engine's devices wherever servetune places or prices one (issue 38, 12):
vLLM 0.32's world size is tensor x pipeline x prefill-context parallel. A trial's bundle counts it
(tests/unit/test_space.py); so do the Serve deployment serve-check and export write (Ray Serve LLM's own bundles
count TP x PP only), the devices serve-check checks a cluster for, and a Kubernetes server's GPU request."""

from __future__ import annotations

import pytest

from servetune.config.space import engine_devices, engine_ranks
from servetune.errors import UserError
from servetune.report import ReportPoint
from servetune.report.deploy import gpus
from servetune.serve.plan import llm_config, needs
from tests.builders import cpu_study

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")

#: A trial with prefill-context parallelism 2: its engine takes 2 ranks, 2 cores.
PCP = {"prefill_context_parallel_size": 2}


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


def test_a_layout_keeps_the_points_prefill_context_ranks_in_its_devices():
    from servetune.serve.layouts import Layout, beside_tp, budget_layouts, check_layouts, layout_point, layout_run

    p = gpu_point(pipeline_parallel_size=2, prefill_context_parallel_size=2)
    assert beside_tp(p) == 4 and beside_tp(gpu_point(tensor_parallel_size=4)) == 1
    laid = layout_point(p, Layout(2, 2))
    assert laid.devices == 16 == 2 * engine_ranks(laid.engine_args)  # replicas x TP x PP x PCP
    assert needs(laid, llm_config(laid, 2, env={}), 2).devices == 16  # what the fit check counts agrees
    assert budget_layouts(16, beside_tp(p)) == [Layout(4, 1), Layout(2, 2), Layout(1, 4)]
    assert layout_run(Layout(1, 4), beside_tp(p), None, 2.0, error="x").devices == 16
    with pytest.raises(UserError, match=r"2x1 uses 8, 1x1 uses 4, with PP x PCP 4"):
        check_layouts([Layout(2, 1), Layout(1, 1)], beside_tp(p), lambda tp: None)


def test_serve_check_layouts_count_prefill_context_ranks_in_the_budget_and_its_load(tmp_path, monkeypatch):
    import argparse

    from rich.console import Console

    from servetune.cli.serve_check_parts import layout_args
    from servetune.serve.study import read_picked

    monkeypatch.setattr("servetune.serve.check.os.sched_getaffinity", lambda pid: set(range(8)))
    picked = read_picked(cpu_study(tmp_path / "s", PCP), "t1")
    console = Console(file=open(tmp_path / "out.txt", "w"))  # noqa: SIM115 - closed with the test's tmp_path

    def laid(**given):
        return layout_args(argparse.Namespace(**{"layouts": None, "budget": None, "address": None, **given}), picked,
                           console)  # fmt: skip

    # The trial recorded 1 device (before PCP counted), its engine takes 2: its operating point on 2 devices, doubled.
    four = laid(budget=4)
    assert [str(layout) for layout in four.layouts] == ["2x1", "1x2"] and four.budget == 4
    assert four.level.value == picked.operating_level().value * 4 / 2 and [n.devices for n in four.needs] == [4, 4]
    with pytest.raises(
        UserError, match=r"--layouts 2x1 uses 4 devices \(replicas x TP x PP 1 x PCP 2\), not --budget 2"
    ):
        laid(layouts="2x1,1x2", budget=2)
    with pytest.raises(UserError, match="prefill_context_parallel_size 2 does not divide it"):
        laid(budget=3)
    # A Serve trial measured on more (its replicas): scaled from those.
    picked = read_picked(cpu_study(tmp_path / "s4", PCP, devices=4), "t1")
    assert laid(budget=4).level.value == picked.operating_level().value
