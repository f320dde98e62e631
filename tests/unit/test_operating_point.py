"""Where verify and serve-check run a picked configuration: headroom x min(capacity, knee), as export
(report/operating.py), not the ladder's level."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from servetune.cli import main
from servetune.cli.serve_check_parts import ramp_autoscaling
from servetune.cli.verify import opening_lines
from servetune.engine.args import engine_argv
from servetune.errors import UserError
from servetune.report import build_report, load_study
from servetune.report.operating import operating_point, operating_point_of
from servetune.results import Capacity, Knee
from servetune.serve.study import read_picked
from servetune.verify.choose import select, with_admission
from servetune.verify.document import admission_record
from servetune.verify.overload import OVERLOAD_FACTOR
from servetune.verify.run import capacity_rate, measured_rate
from tests.builders import level, study_info, trial, write_study

SLOW = ("ttft_ms_p99 = 3000 > 2000",)
#: The study's trials name a made-up hub id (tests/builders.py): its size is unknown here, and no hub is asked for it.
pytestmark = pytest.mark.usefixtures("no_hub")


def searched_trial(capacity: float | None, knee: float | None, bracket_hi: float = 13.0):
    """Levels at 2, 8, 32 clients (32 broke the SLO) and the capacity search's 16 (broke) and 12 (met)."""
    levels = [level(2, 200, 300), level(8, 800, 600), level(32, 1000, 3000, violations=SLOW),
              level(16, 950, 2500, violations=SLOW), level(12, 900, 1500)]  # fmt: skip
    t = trial("t1", {"max_num_seqs": 8}, levels, device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    if capacity is not None:
        t.capacity_at_slo = Capacity(value=capacity, unit="concurrency", bracket=(capacity, bracket_hi), bound="exact",
                                     tolerance=0.1, extra_levels=2)  # fmt: skip
    if knee is not None:
        t.knee = Knee(value=knee, unit="concurrency", bracket=(knee, 16.0), bound="exact", throughput=900.0)
    return t


def study(root: Path, capacity: float | None = 12.0, knee: float | None = 16.0) -> Path:
    write_study(root, study_info(device="cpu"), [searched_trial(capacity, knee)])
    (root / "space.yaml").write_text(
        "name: demo\nmodel: tiny\ndevice: cpu\nworkload: cpu-tiny\n"
        "load: {levels: [2, 8, 32], requests_per_level: 16}\nslo: {ttft_ms: {p99: 2000}}\n"
    )  # fmt: skip
    return root


def rate(points, clients: float) -> float:
    return next(p for p in points if p.level == {"concurrency": clients}).metrics["request_throughput"]


def test_the_operating_point_is_the_headroom_below_the_capacity_in_whole_clients(tmp_path):
    report = build_report(load_study(study(tmp_path / "s")))
    points = [p for p in report.points if p.trial_id == "t1"]
    op = operating_point_of(report, points[0], 0.8)
    assert op.kind == "concurrency" and op.value == 9  # 0.8 x 12 = 9.6 clients, rounded down
    assert op.why == "9.6, rounded down to whole clients: 0.8 x the capacity at the SLO 12 (below the knee 16)"
    at8, at12 = rate(points, 8), rate(points, 12)
    assert op.request_rate == pytest.approx(at8 + (at12 - at8) * (9 - 8) / (12 - 8))  # interpolated
    assert op.capacity_rate == pytest.approx(at12)  # measured at the capacity's level
    assert op.as_dict()["capacity"] == {"value": 12.0, "unit": "concurrency", "bracket": [12.0, 13.0], "bound": "exact"}
    assert operating_point_of(report, points[0], 1.0).value == 12


def test_the_lower_of_capacity_and_knee_sets_it_and_without_a_search_the_highest_level_meeting_the_slo(tmp_path):
    points = build_report(load_study(study(tmp_path / "s", capacity=None, knee=None))).points
    capacity = Capacity(value=12.0, unit="concurrency", bracket=(12.0, 13.0), bound="exact", tolerance=0.1)
    knee = Knee(value=5.0, unit="concurrency", bracket=(5.0, 6.0), bound="exact", throughput=500.0)
    assert operating_point(points, capacity, knee, 0.8).value == 4  # 0.8 x the knee 5
    plain = operating_point(points, None, None, 0.8)
    assert plain.value == math.floor(0.8 * 12) and "the highest load meeting the SLO 12" in plain.why
    assert operating_point(points, None, None, 0.01).value == 1  # never below one client
    with pytest.raises(UserError, match="--headroom 0: the headroom must be above 0"):
        operating_point(points, capacity, knee, 0)


def test_verify_runs_at_the_operating_point_and_overloads_the_capacity(tmp_path):
    root = study(tmp_path / "s")
    selection = select(root, "t1", headroom=0.8)
    winner = selection.winner
    assert winner.level.kind == "concurrency" and winner.level.value == 9
    assert measured_rate(winner) == pytest.approx(winner.operating.request_rate)
    assert capacity_rate(winner) == pytest.approx(winner.operating.capacity_rate) and OVERLOAD_FACTOR == 1.5
    assert opening_lines(selection, runner_up=False)[0] == (
        "verifying trial t1 at concurrency 9 (9.6, rounded down to whole clients: 0.8 x the capacity at the SLO 12 "
        "(below the knee 16))"
    )
    assert select(root, "t1", headroom=0.5).winner.level.value == 6
    with pytest.raises(UserError, match=r"--headroom 1\.2"):
        select(root, "t1", headroom=1.2)


def test_serve_check_offers_the_operating_point_and_ramps_on_it(tmp_path):
    root = study(tmp_path / "s")
    picked = read_picked(root, "t1", 0.8)
    assert str(picked.operating_level()) == "concurrency 9" and picked.operating.capacity.value == 12
    args = argparse.Namespace(headroom=0.8, delay_scale=1.0, ramp_max_replicas=None)
    derived = ramp_autoscaling(args, picked)
    assert derived.knee == {"concurrency": pytest.approx(9.6)} and derived.target_ongoing_requests == 9
    assert "0.8 x the capacity at the SLO 12" in derived.reasons["knee"]
    assert str(read_picked(root, "t1", 0.5).operating_level()) == "concurrency 6"


def test_a_bad_headroom_is_one_line_before_anything_starts(tmp_path, capsys):
    root = study(tmp_path / "s")
    assert main(["serve-check", str(root), "--pick", "t1", "--headroom", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--headroom 0: the headroom must be above 0 and at most 1" in err[0]


def test_verify_starts_its_engine_with_the_admission_bounds_export_prints(tmp_path, capsys):
    root = study(tmp_path / "s")
    winner = select(root, "t1").winner
    assert main(["export", str(root), "--pick", "t1", "--format", "vllm"]) == 0
    shipped = capsys.readouterr().out
    bounds = winner.admission.engine_args()
    assert set(bounds) == {"max_num_queued_reqs", "max_num_queued_tokens"}
    for name, value in bounds.items():
        assert winner.spec.engine_args[name] == value
        assert f"--{name.replace('_', '-')} {value}" in shipped  # the same flags export ships
    argv = engine_argv(winner.spec.engine_args)  # what the engine is started with
    assert argv[argv.index("--max-num-queued-reqs") + 1] == str(bounds["max_num_queued_reqs"])
    assert opening_lines(select(root, "t1"), runner_up=False)[2].startswith(
        f"admission bounds: max_num_queued_reqs {bounds['max_num_queued_reqs']}, max_num_queued_tokens "
    )
    assert admission_record(winner)["engine_args"] == bounds


def test_without_admission_the_configuration_starts_as_its_trial_ran(tmp_path):
    root = study(tmp_path / "s")
    bounded, recorded = select(root, "t1").winner, select(root, "t1", admission=False).winner
    assert {"max_num_queued_reqs", "max_num_queued_tokens"} <= set(bounded.spec.engine_args)
    assert recorded.admission is None and recorded.spec.engine_args == {"max_num_seqs": 8}
    assert recorded.level == bounded.level  # the same operating point, only the bounds differ


def test_recheck_asks_for_the_configuration_as_its_trial_ran(tmp_path, monkeypatch, capsys):
    import servetune.verify.choose as choose

    asked = []

    def select_spy(*args, **kwargs):
        asked.append(kwargs.get("admission", True))
        raise UserError("stop here")

    monkeypatch.setattr(choose, "select", select_spy)
    assert main(["recheck", str(study(tmp_path / "s"))]) == 2
    assert asked == [False] and "stop here" in capsys.readouterr().err


def test_a_trial_through_ray_serve_keeps_serves_queue_bound_and_says_why(tmp_path):
    root = study(tmp_path / "s")
    winner = select(root, "t1").winner
    served = dataclasses.replace(winner.spec, serve_replicas=2, engine_args={"max_num_seqs": 8})
    spec, why = with_admission(served, build_report(load_study(root)), winner.point)
    assert spec.engine_args == {"max_num_seqs": 8} and why.startswith("measured through Ray Serve")
