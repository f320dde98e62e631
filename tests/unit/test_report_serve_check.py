"""The report's Ray Serve section: serve-check.json (as serve-check writes it) drawn in summary.md and
the HTML page, and a file that cannot be read said so."""

from __future__ import annotations

from servetune.serve.routing import verdict
from tests.builders import cpu_study, level
from tests.unit.test_serve_routing import run_of


def test_the_report_shows_serve_checks_scaling_and_routers_with_the_verdict(tmp_path):
    from servetune.report import build_report, load_study
    from servetune.report.html import render_html
    from servetune.report.markdown import render_markdown
    from servetune.report.serving import ROUTER_NOTE
    from servetune.serve.result import ReplicaRun, ServeCheckResult, scaling_rows
    from servetune.serve.routing import RoutingResult

    study = cpu_study(tmp_path / "s", price=None)
    runs = [ReplicaRun(replicas=1, levels=[level(8, 380, 320)])]
    routed = [
        run_of("default", 200, 400),
        run_of("prefix-aware", 210, 500).model_copy(update={"engines_reused": True, "ready_s": 19.6}),
    ]
    result = ServeCheckResult(
        servetune_version="0", created="now", study="demo", trial_id="t1", picked_level={"concurrency": 8}, model="m",
        app_name="app", url="http://x", address=None, llm_config={}, slo=[], runs=runs, rows=scaling_rows(runs, []),
        routing=RoutingResult(workload="rag-tiny", replicas=2, level={"concurrency": 8}, runs=routed, verdict=verdict(routed)),
    )  # fmt: skip
    (study / "serve-check.json").write_text(result.model_dump_json())
    report = build_report(load_study(study))
    md = render_markdown(report)
    assert "## Ray Serve (serve-check)" in md and "### Routers: 2 replicas, workload rag-tiny, concurrency 8" in md
    assert "| prefix-aware | 12 | 1,100 | 50% | 50% / - | 1.82 |" in md  # 1000 of 1100 tokens on one of 2 replicas
    assert "| 1 | concurrency 8 | 6.33 | 380.0 | 160.0 | 320.0 | - | 100% | met |" in md
    assert "**Verdict: ship prefix-aware: prefix-aware reuses more of the prefix cache" in md
    assert (
        "- prefix-aware: on the engines already running (Serve kept them, and started any more the count needs) in 19.6 s, prefix caches reset"
        in md
    )
    assert (
        "default: " not in md.split("### Routers")[1].split("**Verdict")[0].split(ROUTER_NOTE)[1]
    )  # deployed fresh: no note
    page = render_html(report)
    assert "<h3>Routers: 2 replicas, workload rag-tiny, concurrency 8</h3>" in page
    assert (
        "<li>prefix-aware: on the engines already running (Serve kept them, and started any more the count needs) in 19.6 s, prefix caches reset</li>"
        in page
    )
    (study / "serve-check.json").write_text("{not json")
    assert "could not be read: not valid JSON" in render_markdown(build_report(load_study(study)))


def routed_study(tmp_path, routed, trial_id="t1"):
    from servetune.serve.result import ServeCheckResult
    from servetune.serve.routing import RoutingResult

    study = cpu_study(tmp_path / "s", price=None)
    result = ServeCheckResult(
        servetune_version="0", created="now", study="demo", trial_id=trial_id, picked_level={"concurrency": 8}, model="m",
        app_name="app", url="http://x", address=None, llm_config={}, slo=[], runs=[], rows=[],
        routing=RoutingResult(workload="rag-tiny", replicas=2, level={"concurrency": 8}, runs=routed, verdict=verdict(routed)),
    )  # fmt: skip
    (study / "serve-check.json").write_text(result.model_dump_json())
    return study


def exported(study, capsys):
    import yaml

    from servetune.cli import main

    assert main(["export", str(study), "--pick", "t1", "--format", "ray-serve"]) == 0
    text = capsys.readouterr().out
    (config,) = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"]
    return text, config["deployment_config"]


PREFIX_CLASS = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"


def test_export_ships_the_router_serve_check_measured_best_for_that_trial(tmp_path, capsys):
    prefix = run_of("prefix-aware", 210, 500).model_copy(update={"router_class": PREFIX_CLASS})
    text, deployment = exported(routed_study(tmp_path, [run_of("default", 200, 400), prefix]), capsys)
    assert deployment["request_router_config"] == {"request_router_class": PREFIX_CLASS}, deployment
    assert "# Router: prefix-aware, measured by serve-check: prefix-aware reuses more of the prefix cache" in text


def test_export_keeps_serves_default_router_when_none_won_or_another_trial_was_checked(tmp_path, capsys):
    even = run_of("prefix-aware", 205, 410).model_copy(update={"router_class": PREFIX_CLASS})  # within every margin
    text, deployment = exported(routed_study(tmp_path / "a", [run_of("default", 200, 400), even]), capsys)
    assert (
        "request_router_config" not in deployment
        and "# Router: Serve's default; serve-check named none: no difference" in text
    )
    better = run_of("prefix-aware", 100, 400).model_copy(update={"router_class": PREFIX_CLASS})
    text, deployment = exported(
        routed_study(tmp_path / "b", [run_of("default", 200, 400), better], trial_id="other"), capsys
    )
    assert "request_router_config" not in deployment and "# Router" not in text  # measured for another trial


def test_export_ships_the_stream_batching_interval_serve_check_deployed_that_trial_at(tmp_path, capsys):
    import json

    import yaml

    from servetune.cli import main

    for trial_id, sub in (("t1", "a"), ("other", "b")):
        study = routed_study(tmp_path / sub, [run_of("default", 200, 400)], trial_id=trial_id)
        data = json.loads((study / "serve-check.json").read_text())
        data["llm_config"] = {"experimental_configs": {"stream_batching_interval_ms": 0.0}}  # --stream-batching-ms 0
        (study / "serve-check.json").write_text(json.dumps(data))
        assert main(["export", str(study), "--pick", "t1", "--format", "ray-serve"]) == 0
        text = capsys.readouterr().out
        (config,) = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"]
        if trial_id == "t1":
            assert config["experimental_configs"] == {"stream_batching_interval_ms": 0}, config
            assert "# Stream batching: 0 ms, as serve-check deployed and measured the replicas\n" in text
            # a trial measured at its own interval: serve-check's, measured later, is shipped, and the comment says so
            result_file = study / "trials" / "t1" / "result.json"
            result = json.loads(result_file.read_text())
            result["params"] |= {"serve.num_replicas": 1, "serve.stream_batching_interval_ms": 50}
            result_file.write_text(json.dumps(result))
            assert main(["export", str(study), "--pick", "t1", "--format", "ray-serve"]) == 0
            text = capsys.readouterr().out
            (config,) = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"]
            assert config["experimental_configs"] == {"stream_batching_interval_ms": 0}, config
            assert (
                "# Stream batching: 0 ms, as serve-check deployed and measured the replicas (the trial's own: 50 ms)"
                in text
            )
        else:  # measured for another trial: Ray's default stays (the trial set none)
            assert "experimental_configs" not in config and "Stream batching" not in text


def test_serve_checks_printed_tables_show_the_rows_and_the_verdict():
    from rich.console import Console

    from servetune.cli.serve_check_tables import routing_table, scaling_table
    from servetune.report.serving import ROUTER_NOTE
    from servetune.serve.result import ReplicaRun, ServeCheckResult, scaling_rows
    from servetune.serve.routing import RoutingResult

    routed = [
        run_of("default", 200, 400),
        run_of("prefix-aware", 210, 500).model_copy(update={"engines_reused": False, "ready_s": 80.0}),
    ]
    runs = [ReplicaRun(replicas=1, levels=[level(8, 380, 320)])]
    result = ServeCheckResult(
        servetune_version="0", created="now", study="demo", trial_id="t1", picked_level={"concurrency": 8}, model="m",
        app_name="app", url="http://x", address=None, llm_config={}, slo=[], runs=runs, rows=scaling_rows(runs, []),
    )  # fmt: skip
    console = Console(width=250, record=True)
    console.print(scaling_table(result))
    console.print(routing_table(RoutingResult(workload="rag-tiny", replicas=2, level={"concurrency": 8}, runs=routed,
                                              verdict=verdict(routed))))  # fmt: skip
    text = console.export_text()
    assert (
        "serve-check: trial t1 through Ray Serve" in text and "6.33" in text and "380.0" in text
    )  # goodput, out tok/s
    assert "prefix-aware" in text and "50%" in text and "1.82" in text and ROUTER_NOTE in " ".join(text.split())
    assert "verdict: ship prefix-aware: prefix-aware reuses more of the prefix cache" in " ".join(text.split())
    # the caption says as the report does how the second router came to its engines
    assert "prefix-aware: on engines Serve restarted (as a fresh deploy) in 80.0 s, prefix caches reset" in " ".join(
        text.split()
    )
