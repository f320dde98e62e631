"""serve-check --layouts / --budget without Ray: parsing, enumeration, refusals before anything is
deployed, what each layout deploys, the verdict (noise ties included), and where the result shows."""

from __future__ import annotations

import json

import pytest

from servetune.cli import main
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.report import ReportPoint
from servetune.results import LevelRun
from servetune.serve.check import Layouts, Teardown, run_check
from servetune.serve.layouts import (
    Layout,
    budget_layouts,
    budget_level,
    check_layouts,
    layout_point,
    layout_run,
    layout_verdict,
    parse_layouts,
)
from servetune.serve.plan import llm_config, needs
from servetune.serve.routing import engine_version
from servetune.serve.study import read_picked
from tests.builders import cpu_study, level
from tests.unit.test_serve_check import FakeCluster

# the hub ids these tests name are made up (org/tiny-chat): none is asked of a hub (tests/conftest.py no_hub)
pytestmark = pytest.mark.usefixtures("no_hub")


def point(engine_args: dict, env: dict | None = None, device: str = "cpu", devices: int = 1) -> ReportPoint:
    return ReportPoint(trial_id="abc", level={"concurrency": 8.0}, engine_args=engine_args, env=env or {},
                       model="/m/tiny", device=device, devices=devices, metrics={})  # fmt: skip


def test_layouts_parse_as_replicas_x_tp_in_the_order_given():
    assert parse_layouts("2x1, 1X2,2x1,4\N{MULTIPLICATION SIGN}1") == [Layout(2, 1), Layout(1, 2), Layout(4, 1)]
    assert str(Layout(4, 2)) == "4x2" and Layout(4, 2).devices(beside_tp=2) == 16
    for bad in ("", "2", "2x", "0x2", "2x0", "2*1", "1x2,x"):
        with pytest.raises(UserError, match="REPLICASxTP"):
            parse_layouts(bad)


def test_a_budget_enumerates_every_power_of_two_tp_that_fills_it():
    assert budget_layouts(8) == [Layout(8, 1), Layout(4, 2), Layout(2, 4), Layout(1, 8)]
    assert budget_layouts(6) == [Layout(6, 1), Layout(3, 2)]  # TP 3 and 6 are not powers of two
    assert budget_layouts(8, beside=2) == [Layout(4, 1), Layout(2, 2), Layout(1, 4)]
    with pytest.raises(UserError, match="pipeline_parallel_size x prefill_context_parallel_size 2 does not divide it"):
        budget_layouts(3, beside=2)
    with pytest.raises(UserError, match="--budget 0"):
        budget_layouts(0)


def heads(n: int):
    return lambda tp: None if n % tp == 0 else f"num_attention_heads {n} is not divisible by tensor_parallel_size {tp}"


def test_layouts_the_model_or_the_budget_cannot_take_are_refused_or_left_out():
    assert check_layouts([Layout(2, 1), Layout(1, 2)], 1, heads(4)) == ([Layout(2, 1), Layout(1, 2)], [])
    with pytest.raises(UserError, match="--layouts 1x8: num_attention_heads 4 is not divisible by tensor_parallel_size 8: "
                                        "nothing was deployed"):  # fmt: skip
        check_layouts([Layout(8, 1), Layout(1, 8)], 1, heads(4))
    with pytest.raises(UserError, match=r"use the same devices \(2x1 uses 2, 1x1 uses 1\)"):
        check_layouts([Layout(2, 1), Layout(1, 1)], 1, heads(4))
    # --budget leaves out what the model does not split into, and says why.
    kept, skipped = check_layouts(budget_layouts(8), 1, heads(4), budget=8)
    assert kept == [Layout(8, 1), Layout(4, 2), Layout(2, 4)] and skipped == [
        "1x8: num_attention_heads 4 is not divisible by tensor_parallel_size 8"
    ]
    with pytest.raises(UserError, match="--budget 2: a comparison needs 2 or more layouts the model fits, got 2x1"):
        check_layouts(budget_layouts(2), 1, heads(3), budget=2)


def test_a_layout_deploys_the_point_with_its_tp_replaced_and_a_bundle_per_rank():
    p = point({"max_num_seqs": 8}, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    # The point's own TP: the very configuration --replicas and --routers deploy (same engine version).
    same = llm_config(layout_point(p, Layout(2, 1)), 2)
    assert same == llm_config(p, 2) and engine_version(same) == engine_version(llm_config(p, 2))
    big = layout_point(p, Layout(1, 2), cores=[4, 5, 6])
    config = llm_config(big, 1)
    assert config["engine_kwargs"] == {"max_num_seqs": 8, "tensor_parallel_size": 2}
    assert config["placement_group_config"] == {"bundles": [{"CPU": 1}, {"CPU": 1}]}
    assert config["runtime_env"]["env_vars"] == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "4|5"}
    assert needs(big, config, 1).devices == 2 and needs(big, config, 1).cpus == 4.0  # 2 ranks + actor + ingress
    # A TP=2 point laid out as TP 1 drops its binding; on GPUs no binding is set.
    down = layout_point(point({"tensor_parallel_size": 2}, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}), Layout(2, 1))
    assert down.engine_args == {"tensor_parallel_size": 1} and down.env == {} and down.devices == 2
    gpu = layout_point(point({}, device="gpu"), Layout(1, 4))
    assert gpu.env == {} and gpu.engine_args == {"tensor_parallel_size": 4}


def test_every_layout_is_offered_the_picked_level_scaled_to_the_budget():
    assert budget_level(Level("concurrency", 8), 1, 2).value == 16
    assert budget_level(Level("concurrency", 3), 2, 1).value == 2  # 1.5 clients: rounded
    assert budget_level(Level("rate", 2.5), 1, 4).value == 10.0


def run(
    layout: Layout, out_tps: float, broken: bool = False, repeats: tuple[float, ...] = (), price: float | None = 2.0
):
    measured = level(16, out_tps, 300, violations=("ttft_ms_p99 > 2000",) if broken else ())
    if repeats:
        measured.runs = [LevelRun(summary=level(16, r, 300).summary) for r in repeats]
    return layout_run(layout, 1, measured, price)


def test_the_verdict_names_the_cheapest_layout_meeting_the_slo_beyond_the_noise():
    small, big = run(Layout(2, 1), 900), run(Layout(1, 2), 400)
    assert small.cost_per_hour_usd == big.cost_per_hour_usd == 4.0  # same devices, same price per hour
    assert small.cost_per_mtok_usd == pytest.approx(4.0 / (900 * 3600) * 1e6)
    v = layout_verdict([big, small])
    assert v.ship == "2x1" and not v.within_noise and v.margin == pytest.approx(0.10)
    assert "beyond the noise margin (10%)" in v.reason and "2x1 $1.23, 1x2 $2.78 per 1M output tokens" in v.reason
    # A cheaper layout that broke the SLO is not shipped.
    v = layout_verdict([run(Layout(1, 2), 400), run(Layout(2, 1), 900, broken=True)])
    assert v.ship == "1x2" and "only layout that met the SLO; 2x1 broke the SLO" in v.reason
    assert layout_verdict([run(Layout(2, 1), 900, broken=True), run(Layout(1, 2), 400, broken=True)]).ship is None
    assert layout_verdict([small]) is None


def test_costs_within_the_noise_margin_go_to_the_simpler_layout():
    # 5% apart, inside the 10% margin of a level run once: fewer replicas is simpler, though 2x1 is cheaper.
    v = layout_verdict([run(Layout(2, 1), 1000), run(Layout(1, 2), 950)])
    assert v.ship == "1x2" and v.within_noise and "1x2 and 2x1 cost within the noise margin (10%)" in v.reason
    assert "1x2 is the simpler layout" in v.reason
    # Repeats that agree within 2% narrow the margin to its floor (5%): 8% apart is then beyond the noise.
    tight = (990.0, 1000.0, 1010.0)
    v = layout_verdict([run(Layout(2, 1), 1000, repeats=tight), run(Layout(1, 2), 920, repeats=(910.0, 920.0, 930.0))])
    assert v.ship == "2x1" and not v.within_noise and v.margin == pytest.approx(0.05)
    # Without a price the costs are compared in device-hours, the same order.
    v = layout_verdict([run(Layout(2, 1), 900, price=None), run(Layout(1, 2), 400, price=None)])
    assert v.ship == "2x1" and "device-hours per 1M output tokens" in v.reason


class LayoutCluster(FakeCluster):
    """Records each deployment's engine version and TP, the deletes and the prefix-cache resets."""

    def __init__(self) -> None:
        super().__init__()
        self.versions: list[str | None] = []
        self.tps: list[int] = []
        self.deleted = 0
        self.resets = 0

    def deploy(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
        super().deploy(name, config, timeout_s, engine_version, keep_ingress)
        self.versions.append(engine_version)
        self.tps.append(int(config["engine_kwargs"].get("tensor_parallel_size") or 1))
        return 1.0

    def delete(self, name):
        self.deleted += 1
        super().delete(name)

    def replica_counters(self, name):
        return {}

    def reset_prefix_caches(self, name):
        self.resets += 1
        return super().reset_prefix_caches(name)


def test_layouts_are_measured_at_one_load_the_routers_engines_reused_the_rest_fresh(tmp_path):
    from servetune.serve.check import Routing

    picked = read_picked(cpu_study(tmp_path / "s"), "t1")
    cluster, teardown = LayoutCluster(), Teardown(pids=set())
    offered: list[tuple[str, int]] = []

    def measure_layout(url, served, layout):
        offered.append((str(layout), cluster.tps[-1]))
        return level(16, 900 if layout.tp == 1 else 400, 300)

    routing = Routing(
        routers=["default"], replicas=2, workload="rag", measure=lambda url, served, router: level(8, 500, 300)
    )
    layouts = Layouts(
        layouts=[Layout(1, 2), Layout(2, 1)], budget=2, level={"concurrency": 16.0}, measure=measure_layout
    )
    result = run_check(picked, [], cluster, "app", lambda *a: [], teardown, routing=routing, layouts=layouts)
    # 2x1 is the routers' deployment: measured first on its engines (caches reset); 1x2 deployed fresh.
    assert offered == [("2x1", 1), ("1x2", 2)]
    assert cluster.versions[1] == cluster.versions[0] and cluster.versions[2] != cluster.versions[1]
    assert cluster.resets == 1 and cluster.deleted == 2  # once before the routers, once before 1x2
    laid = result.layouts
    assert [r.layout for r in laid.runs] == ["1x2", "2x1"]  # reported in the order asked
    assert [r.engines_reused for r in laid.runs] == [False, True]
    assert laid.level == {"concurrency": 16.0} and {r.level.summary.level["concurrency"] for r in laid.runs} == {16.0}
    assert all(r.requests_per_replica for r in laid.runs) and laid.price_per_device_hour == 2
    assert laid.verdict.ship == "2x1" and laid.budget == 2 and laid.device == "CPU"


def test_layouts_are_priced_at_the_price_the_picked_trial_was_costed_at_not_the_spaces_fallback(tmp_path):
    """A study that leaves prices to the list (no price_per_device_hour: the space's field is its 1 USD fallback)
    costed its trial at its GPU type's listed price; serve-check's layouts are costed at that same price."""
    from dataclasses import replace

    picked = read_picked(cpu_study(tmp_path / "s"), "t1")
    listed = replace(picked, space=picked.space.model_copy(update={"price_per_device_hour": 1.0}),
                     trial=picked.trial.model_copy(update={"price_per_device_hour": 4.29}))  # fmt: skip
    layouts = Layouts(layouts=[Layout(1, 2), Layout(2, 1)], budget=2, level={"concurrency": 16.0},
                      measure=lambda url, served, layout: level(16, 900, 300))  # fmt: skip
    laid = run_check(listed, [], LayoutCluster(), "app", lambda *a: [], Teardown(pids=set()), layouts=layouts).layouts
    assert laid.price_per_device_hour == 4.29
    assert all(r.cost_per_hour_usd == pytest.approx(2 * 4.29) for r in laid.runs)
    assert all(r.cost_per_mtok_usd == pytest.approx(4.29 * r.device_hours_per_mtok) for r in laid.runs)


def test_cli_refusals_come_before_ray_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("servetune.serve.check.os.sched_getaffinity", lambda pid: {0, 1})  # a two-core machine
    monkeypatch.setattr("servetune.serve.cluster.ServeCluster.__enter__", lambda self: pytest.fail("Ray started"))
    study = cpu_study(tmp_path / "s")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 256, "vocab_size": 300,
        "torch_dtype": "float32"}))  # fmt: skip
    result = study / "trials" / "t1" / "result.json"
    result.write_text(result.read_text().replace("org/tiny-chat", str(model)))

    def refused(*argv: str) -> str:
        assert main(["serve-check", str(study), "--pick", "t1", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    assert "--layouts 1x2: num_attention_heads 3 is not divisible by tensor_parallel_size 2" in refused(
        "--layouts", "2x1,1x2"
    )
    assert "--budget 4: a comparison needs 2 or more layouts the model fits, got 4x1" in refused("--budget", "4")
    assert "--layouts 1x1 uses 1 devices (replicas x TP x PP 1), not --budget 2" in refused(
        "--layouts", "2x1,1x1", "--budget", "2"
    )
    assert "--layouts '2': give layouts as REPLICASxTP" in refused("--layouts", "2")
    result.write_text(result.read_text().replace(str(model), "org/tiny-chat"))  # heads unknown: TP checked at deploy
    assert "--layouts 4x1: 4 replicas of 1 CPU core (TP x PP x PCP) need 4 CPU cores; this machine has 2" in refused(
        "--layouts", "4x1,2x2"
    )
    assert "--ramp runs after the first replica count" in refused("--layouts", "2x1,1x2", "--ramp")
    assert not (study / "serve-check.json").exists()


def laid_out_study(tmp_path, trial_id="t1", slow_big=True):
    from servetune.serve.layouts import LayoutResult
    from servetune.serve.result import ServeCheckResult

    study = cpu_study(tmp_path / "s")
    runs = [run(Layout(2, 1), 900).model_copy(update={"requests_per_replica": {"r0": 12, "r1": 12}, "engines_reused": True}),
            run(Layout(1, 2), 400 if slow_big else 880).model_copy(update={"requests_per_replica": {"r2": 24}})]  # fmt: skip
    laid = LayoutResult(budget=2, device="CPU", level={"concurrency": 16.0}, price_per_device_hour=2.0, runs=runs,
                        skipped=["1x4: too many ranks"], verdict=layout_verdict(runs))  # fmt: skip
    result = ServeCheckResult(
        servetune_version="0", created="now", study="demo", trial_id=trial_id, picked_level={"concurrency": 8}, model="m",
        app_name="app", url="http://x", address=None, llm_config={}, slo=[], layouts=laid,
    )  # fmt: skip
    (study / "serve-check.json").write_text(result.model_dump_json())
    return study, result


def test_the_report_and_the_printed_table_show_each_layout_its_cost_and_the_verdict(tmp_path):
    from rich.console import Console

    from servetune.cli.serve_check_tables import layouts_table
    from servetune.report import build_report, load_study
    from servetune.report.html import render_html
    from servetune.report.markdown import render_markdown

    study, result = laid_out_study(tmp_path)
    md = render_markdown(build_report(load_study(study)))
    assert "### Layouts: 2 CPU cores each, concurrency 16" in md
    assert "| 2x1 | 2 | 2 | 1 | 900.0 | 15.00 | 150.0 | 300.0 | 25.0 | 40.0 | 4.00 | 1.23 | 12, 12 | met |" in md
    assert "| 1x2 | 2 | 1 | 2 | 400.0 |" in md and "| 2.78 | 24 | met |" in md
    assert "- left out: 1x4: too many ranks" in md and "- 2x1: measured on the engines already running" in md
    assert "- verdict: ship 2x1: 2x1 meets the SLO at the lowest cost, beyond the noise margin (10%)" in md
    assert "<h3>Layouts: 2 CPU cores each, concurrency 16</h3>" in render_html(build_report(load_study(study)))
    console = Console(width=250, record=True)
    console.print(layouts_table(result.layouts))
    text = " ".join(console.export_text().split())
    assert "serve-check --layouts: 2 CPU cores each, concurrency 16" in text and "12, 12" in text
    assert "verdict: ship 2x1" in text and "every layout offered concurrency 16" in text


def test_export_ships_the_winning_layouts_replicas_and_tp_for_that_trial_only(tmp_path, capsys):
    from tests.unit.test_report_serve_check import exported

    study, _ = laid_out_study(tmp_path / "a", slow_big=False)  # 900 against 880: a tie, the simpler 1x2 wins
    text, deployment = exported(study, capsys)
    assert deployment["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 16}
    assert "# Layout: 1 replica(s) of TP 2, named by serve-check at concurrency 16: 1x2 and 2x1 cost within" in text
    import yaml

    (config,) = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"]
    assert config["engine_kwargs"]["tensor_parallel_size"] == 2
    assert config["placement_group_config"] == {"bundles": [{"CPU": 1}, {"CPU": 1}]}
    assert config["runtime_env"]["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    study, _ = laid_out_study(tmp_path / "b", trial_id="other")
    text, deployment = exported(study, capsys)
    assert "# Layout" not in text and "tensor_parallel_size" not in text  # measured for another trial


def test_a_layout_that_fails_to_deploy_is_recorded_and_the_others_are_still_compared(tmp_path):
    from servetune.errors import EngineStartError
    from servetune.report.serving import layout_notes, layout_row

    class TpFails(LayoutCluster):
        def deploy(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
            if config["engine_kwargs"].get("tensor_parallel_size") == 2:
                raise EngineStartError(f"the Serve deployment of {name} failed: ranks", "RuntimeError: no cores")
            return super().deploy(name, config, timeout_s, engine_version, keep_ingress)

    picked = read_picked(cpu_study(tmp_path / "s"), "t1")
    layouts = Layouts(layouts=[Layout(1, 2), Layout(2, 1), Layout(4, 1)], budget=2, level={"concurrency": 16.0},
                      measure=lambda url, served, layout: level(16, 900 / layout.replicas, 300))  # fmt: skip
    result = run_check(picked, [], TpFails(), "app", lambda *a: [], Teardown(pids=set()), layouts=layouts)
    failed, two, _ = result.layouts.runs
    assert failed.level is None and "failed: ranks" in failed.error and "no cores" in failed.error
    assert not failed.meets_slo and failed.cost_per_mtok_usd is None and two.level is not None
    v = result.layouts.verdict
    assert v.ship == "2x1" and "1x2 failed to deploy" in v.reason
    dumped = result.layouts.model_dump(mode="json")
    assert layout_row(dumped["runs"][0])[-1] == "failed" and layout_row(dumped["runs"][0])[4] == "-"
    assert "1x2: deployment failed: the Serve deployment of app failed: ranks" in layout_notes(dumped)


def test_a_layout_s_cost_is_its_device_hours_at_the_price_to_the_last_bit():
    """The verdict ranks by device-hours per 1M output tokens and says the cost: one formula, so the two never
    disagree (3.7 per device-hour at 900 tok/s: the two orders of the same product differ in their last bit)."""
    at = run(Layout(2, 2), 900, price=3.7)
    assert at.device_hours_per_mtok is not None
    assert at.cost_per_mtok_usd == 3.7 * at.device_hours_per_mtok
    assert run(Layout(2, 2), 900, price=None).cost_per_mtok_usd is None
