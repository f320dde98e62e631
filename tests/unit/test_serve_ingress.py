"""serve-check keeps the application's ingress replica where a step deploys in place with the router already routing
(serve/versions.py ``pin_ingress``: its version is what it is built from and the router its handle routes with), and
starts a new one where the router changes (a handle builds its router once) or the step is deployed fresh."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from servetune.serve.check import Deployer, Layouts, Ramp, Routing, Teardown, run_check
from servetune.serve.layouts import Layout
from servetune.serve.plan import llm_config
from servetune.serve.ramp import RampResult
from servetune.serve.routing import ROUTERS, routed_llm_config, router_config
from servetune.serve.study import read_picked
from servetune.serve.versions import ingress_version, pin_ingress
from tests.builders import cpu_study, level
from tests.unit.test_serve_check import FakeCluster

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")

PREFIX_AWARE = {"request_router_class": ROUTERS["prefix-aware"]}


class Bound:
    """A bound deployment as ``build_openai_app`` makes its ingress: a name, constructor arguments, ``options``."""

    def __init__(self, name: str, init_kwargs: dict[str, Any], version: str | None = None) -> None:
        self.name, self.init_kwargs, self._version = name, init_kwargs, version

    def options(self, version: str, _internal: bool) -> Bound:
        assert _internal  # Ray 2.60 refuses a version on a public options() call
        return Bound(self.name, self.init_kwargs, version)


class App:
    def __init__(self, model: str = "m", handles: object = "handles") -> None:
        self._bound_deployment = Bound("OpenAiIngress", {"model_cards": {model: {"max_model_len": 1024}},
                                                         "llm_deployments": {model: handles}})  # fmt: skip


def pinned(app: App, routed_by: Any = None) -> str | None:
    pin_ingress(app, routed_by)
    return app._bound_deployment._version


def test_the_ingress_version_changes_with_its_model_or_its_router_and_only_with_them():
    default = pinned(App())
    assert default is not None and default.startswith("ingress-")
    assert pinned(App(handles="other handles")) == default  # the LLM deployments' handles name them, not versions
    assert pinned(App(model="n")) != default
    prefix_aware = pinned(App(), PREFIX_AWARE)
    assert prefix_aware != default and pinned(App(), dict(PREFIX_AWARE)) == prefix_aware
    assert pinned(App(), {}) == default  # an empty router config is Serve's default router
    # One function for the pin and for whoever predicts it (the deployer's fake here).
    assert default == ingress_version("OpenAiIngress", {"model_cards": {"m": {"max_model_len": 1024}}})


def test_a_step_in_place_with_the_same_router_keeps_the_ingress_and_another_router_or_engine_starts_one(tmp_path):
    point = read_picked(cpu_study(tmp_path / "s"), "t1").point
    cluster = FakeCluster()
    deployer = Deployer(cluster, "app", 60.0, Teardown(pids=set()))
    one, two = llm_config(point, 1), llm_config(point, 2)
    steps = [
        one,  # fresh: the first ingress
        two,  # in place, Serve's default router still: kept
        routed_llm_config(two, "prefix-aware"),  # in place, another router: a new ingress routes with it
        routed_llm_config(two, "prefix-aware"),  # the same router again: kept
        routed_llm_config(one, "default"),  # back to the default: a new one
        llm_config(dataclasses.replace(point, engine_args={"max_num_seqs": 4}), 1),  # another engine: fresh
    ]
    deployed = [deployer.deploy(config) for config in steps]
    assert [d.ingress_kept for d in deployed] == [None, True, False, True, False, None]
    assert [d.reused for d in deployed] == [None, True, True, True, True, None]  # the engines, as before
    assert cluster.ingress_kept == [False, True, False, True, False, False]  # what the fake Serve did with the pins
    assert cluster.ingresses == 4
    assert router_config(steps[2]) == PREFIX_AWARE and router_config(steps[4]) is None


def test_a_whole_check_as_the_e2e_runs_it_starts_an_ingress_only_where_the_router_or_the_engines_change(tmp_path):
    picked = read_picked(cpu_study(tmp_path / "s"), "t1")
    cluster = FakeCluster()
    autoscaling = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 6}}
    ramp = Ramp(deployment_config=autoscaling, run=lambda url, served: RampResult(
        knee_concurrency=6, autoscaling_config=autoscaling["autoscaling_config"], max_ongoing_requests=8,
        max_queued_requests=4, reasons={}, replicas_before=1, replicas_peak=2))  # fmt: skip
    routing = Routing(routers=["default", "prefix-aware"], replicas=2, workload="rag",
                      measure=lambda url, served, router: level(6, 500, 300))  # fmt: skip
    layouts = Layouts(layouts=[Layout(2, 1), Layout(1, 2)], budget=2, level={"concurrency": 12.0},
                      measure=lambda url, served, layout: level(12, 900, 300))  # fmt: skip
    result = run_check(picked, [1], cluster, "app", lambda url, served, n: [level(8, 380, 320)], Teardown(pids=set()),
                       ramp=ramp, routing=routing, layouts=layouts)  # fmt: skip
    # count 1 (fresh), the ramp and the default router (in place, Serve's router: kept), prefix-aware (a new
    # router), 2x1 (back to the default router: new), 1x2 (another engine: fresh). Unpinned, all six started one.
    assert cluster.ingress_kept == [False, True, True, False, False, False] and cluster.ingresses == 4
    assert result.ramp is not None and result.ramp.engines_reused is True
    assert [r.engines_reused for r in result.routing.runs] == [True, True]
    assert [r.engines_reused for r in result.layouts.runs] == [True, False]
