"""Serve's autoscaling derived from a stored study's measurements, and written by export."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from servetune.cli import main
from servetune.errors import UserError
from servetune.report import ReportPoint, build_report, load_study
from servetune.report.autoscale import derive_autoscaling, tolerable_wait_s
from servetune.report.export import autoscaling_for, ray_serve_yaml

STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
BASELINE = "e57a166985b8"  # met the SLO at concurrency 2 and 8 (29.31 req/s), broke it at 32


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(STUDY))


def trial_points(report, trial_id: str) -> list[ReportPoint]:
    return [p for p in report.points if p.trial_id == trial_id]


def test_the_knee_is_the_highest_level_meeting_the_slo_and_sets_every_field(report):
    points = trial_points(report, BASELINE)
    knee = next(p for p in points if p.level == {"concurrency": 8.0})
    assert knee.meets_slo and not next(p for p in points if p.level == {"concurrency": 32.0}).meets_slo
    a = derive_autoscaling(points, [str(s) for s in report.slo])
    assert a.knee == {"concurrency": 8.0}
    assert a.target_ongoing_requests == 8 and a.max_ongoing_requests == 10  # ceil(1.25 x 8)
    assert a.min_replicas == 1 and a.max_replicas == 4  # the ladder's top 32 / 8 per replica
    rate = knee.metrics["request_throughput"]
    assert a.throughput_per_replica == pytest.approx(rate)
    assert a.tolerable_wait_s == 0.3  # the study's ttft_ms.p99 <= 300
    # the queue wait the SLO leaves: the bound less the TTFT measured there, which a request takes anyway
    left = 0.3 - knee.metrics["ttft_ms_p99"] / 1000
    assert a.max_queued_requests == math.ceil(4 * rate * left) == 25  # ceil(4 x rate x 0.3) = 36 let TTFT reach W + T
    assert (
        "of queue wait (the SLO's ttft_ms_p99 bound (300 ms) less the measured TTFT" in a.reasons["max_queued_requests"]
    )
    assert (a.upscale_delay_s, a.downscale_delay_s, a.look_back_period_s) == (120.0, 600.0, 30.0)
    assert "29.31 req/s" in a.reasons["knee"] and "0.3%" in a.reasons["kv_cache"]


def test_a_stated_peak_and_a_delay_scale_change_only_what_they_size(report):
    points = trial_points(report, BASELINE)
    slo = [str(s) for s in report.slo]
    base = derive_autoscaling(points, slo)
    a = derive_autoscaling(points, slo, peak=100, delay_scale=0.05)
    assert a.max_replicas == 13 and "the stated peak (concurrency 100)" in a.reasons["max_replicas"]
    left = 0.3 - next(p for p in points if p.level == {"concurrency": 8.0}).metrics["ttft_ms_p99"] / 1000
    assert a.max_queued_requests == math.ceil(13 * base.throughput_per_replica * left)
    # the window stays above Serve's 10 s metrics push (30 s x 0.05 = 1.5 s held less than one push, Serve warned)
    assert (a.upscale_delay_s, a.downscale_delay_s, a.look_back_period_s) == pytest.approx((6.0, 30.0, 15.0))
    assert "raised to 1.5 x Serve's 10 s metrics push" in a.reasons["look_back_period_s"]
    assert derive_autoscaling(points, slo, delay_scale=0.5).look_back_period_s == 15.0
    assert base.look_back_period_s == 30.0 and base.reasons["look_back_period_s"].startswith("30: Serve's window")
    assert a.target_ongoing_requests == base.target_ongoing_requests
    capped = a.with_max_replicas(2, "the local machine has 2 cores")
    assert capped.max_replicas == 2 and capped.reasons["max_replicas"].endswith(
        "capped at 2: the local machine has 2 cores"
    )
    with pytest.raises(UserError, match="--peak 0: the peak load must be above 0"):
        derive_autoscaling(points, slo, peak=0)


def test_data_parallel_levels_are_per_replica_and_a_trial_without_a_knee_is_refused(report):
    dp2 = ReportPoint(
        trial_id="dp", level={"concurrency": 16.0}, engine_args={"data_parallel_size": 2},
        metrics={"request_throughput": 40.0},
    )  # fmt: skip
    a = derive_autoscaling([dp2], ["ttft_ms_p95 <= 200"], peak=64)
    assert a.target_ongoing_requests == 8 and a.throughput_per_replica == 20.0 and a.max_replicas == 8
    assert a.max_queued_requests == math.ceil(8 * 20.0 * 0.2)  # the tightest TTFT bound when there is no P99
    with pytest.raises(UserError, match="trial 18ae6e731937 met the SLO at no load level"):
        derive_autoscaling(trial_points(report, "18ae6e731937"), [])


def test_an_open_loop_knee_uses_littles_law():
    p = ReportPoint(trial_id="r", level={"rate": 10.0},
                    metrics={"request_throughput": 9.5, "e2el_ms_mean": 2000.0})  # fmt: skip
    a = derive_autoscaling([p], [])
    assert a.target_ongoing_requests == 19  # 9.5 req/s x 2 s
    assert a.tolerable_wait_s == 0.3 and "section 11's 300 ms" in a.reasons["max_queued_requests"]
    assert "TTFT" not in a.reasons["max_queued_requests"].split("(the SLO bounds no TTFT)")[1]  # none to take off


def test_tolerable_wait_prefers_the_ttft_p99_bound():
    assert tolerable_wait_s(["ttft_ms_p95 <= 150", "ttft_ms_p99 <= 900"])[0] == 0.9
    assert tolerable_wait_s(["tpot_ms_p95 <= 20"])[0] == 0.3


def test_export_writes_the_derived_settings_serve_accepts_with_the_reasons_as_comments(report, capsys):
    # --headroom 1: at min(capacity, knee), here the highest level meeting the SLO (8 clients) and the knee alike
    assert (
        main(["export", str(STUDY), "--pick", BASELINE, "--format", "ray-serve", "--peak", "24", "--headroom", "1"])
        == 0
    )
    text = capsys.readouterr().out
    config = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"][0]
    deployment = config["deployment_config"]
    assert deployment["autoscaling_config"]["max_replicas"] == 3 and deployment["max_queued_requests"] == 19
    assert deployment["autoscaling_config"]["target_ongoing_requests"] == 8 and deployment["max_ongoing_requests"] == 10
    assert "#   max_replicas: 3: ceil(peak 24 / knee 8 per replica)" in text
    assert "#   max_queued_requests: 19: 3 replicas x 29.31 req/s x 0.21" in text and "s of queue wait" in text
    serve_config = pytest.importorskip("ray.serve._private.config")
    checked = serve_config.DeploymentConfig(**deployment)  # the installed Ray's own validation
    assert checked.autoscaling_config.upscale_delay_s == 120.0 and checked.max_queued_requests == 19


def test_export_of_a_trial_without_a_knee_keeps_fixed_replicas_and_says_why(report):
    point = next(p for p in report.points if p.trial_id == "18ae6e731937")
    why = autoscaling_for(report, point)
    text = ray_serve_yaml(point, autoscaling=why)
    assert "# Fixed replicas, no autoscaling derived: trial 18ae6e731937 met the SLO at no load level" in text
    config = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"][0]
    assert config["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 2
    }  # fmt: skip


def test_export_operates_at_the_headroom_below_the_lower_of_capacity_and_knee(report, capsys):
    points = trial_points(report, BASELINE)
    row = next(r for r in report.trial_table if r.trial_id == BASELINE)
    assert row.knee is not None and row.knee.value == 8  # 8 -> 32 clients added little output throughput
    rate2, rate = (
        next(p for p in points if p.level == {"concurrency": c}).metrics["request_throughput"] for c in (2, 8)
    )
    a = autoscaling_for(report, next(p for p in points if p.level == {"concurrency": 8.0}), peak=24, headroom=0.8)
    assert a.knee == {"concurrency": pytest.approx(6.4)} and a.target_ongoing_requests == 6
    between = rate2 + (rate - rate2) * (6.4 - 2) / (8 - 2)  # between the levels measured at 2 and 8 clients
    assert a.throughput_per_replica == pytest.approx(between)
    left = 0.3 - next(p for p in points if p.level == {"concurrency": 8.0}).metrics["ttft_ms_p99"] / 1000
    assert a.max_replicas == math.ceil(24 / 6.4) and a.max_queued_requests == math.ceil(a.max_replicas * between * left)
    assert "0.8 x the knee 8" in a.reasons["knee"] or "0.8 x the highest load meeting the SLO 8" in a.reasons["knee"]
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "ray-serve", "--peak", "24"]) == 0  # default 0.8
    deployment = yaml.safe_load(capsys.readouterr().out)["applications"][0]["args"]["llm_configs"][0][
        "deployment_config"
    ]
    assert deployment["autoscaling_config"]["target_ongoing_requests"] == a.target_ongoing_requests


def test_the_operating_load_is_the_headroom_times_the_lower_limit():
    from servetune.report.autoscale import operating_load
    from servetune.results import Capacity, Knee

    def capacity(value):
        return Capacity(value=value, unit="req/s", bracket=(value, 2 * value), bound="exact", tolerance=0.1)

    knee = Knee(value=8.0, unit="req/s", bracket=(8.0, 16.0), bound="exact", throughput=800.0)
    assert operating_load([4.0], capacity(10.0), knee, 0.5) == (
        4.0,
        "0.5 x the knee 8 (below the capacity at the SLO 10)",
    )
    load, why = operating_load([4.0], capacity(5.0), knee, 0.5)
    assert load == 2.5 and why.startswith("0.5 x the capacity at the SLO 5")
    assert operating_load([4.0], None, None, 1.0) == (4.0, "1 x the highest load meeting the SLO 4")
    with pytest.raises(UserError, match=r"--headroom 1\.5: the headroom must be above 0 and at most 1"):
        operating_load([4.0], None, knee, 1.5)


def test_ray_serve_takes_the_ramps_quick_autoscaling_without_a_warning(report):
    """serve-check --ramp --delay-scale 0.05 deploys these settings: Ray Serve 2.60 warned that its look_back_period_s
    (1.5 s) was not above metrics_interval_s (10 s), an error in a later release."""
    import warnings

    config = pytest.importorskip("ray.serve.config", reason="Ray Serve validates the autoscaling config")
    quick = derive_autoscaling(trial_points(report, BASELINE), [str(s) for s in report.slo], delay_scale=0.05)
    for policy in ("inflight", "predictive"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config.AutoscalingConfig(**quick.with_policy(policy).autoscaling_config())
