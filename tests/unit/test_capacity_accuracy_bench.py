"""bench/capacity_accuracy.py: the capacity search and the fixed ladders replayed on a dense surface."""

from __future__ import annotations

import json
import random

import pytest

from servetune.config.slo import Slo
from servetune.results import LevelRun
from tests.builders import bench_script, level

capacity_accuracy = bench_script("capacity_accuracy")
SLO = Slo.parse("ttft_ms.p99=1000")
LOADS = capacity_accuracy.DENSE


def engine(capacity: float, jitter: float = 0.0):
    """P99 TTFT reaching the 1 s bound at ``capacity`` clients; throughput growing with load, flat past it.
    Three runs a load, ``jitter`` apart (relative)."""
    runs = {}
    for load in LOADS:
        made = []
        for k in (-1, 0, 1):
            ttft = 1000 * load / capacity * (1 + k * jitter) * (0.999 if load == capacity else 1)
            out = 50 * min(load, capacity * 1.2)
            made.append(level(load, out, ttft))
        runs[float(load)] = [r.model_copy(update={"slo_violations": SLO.violations(r.summary)}) for r in made]
    return runs


def surface(**capacities):
    return capacity_accuracy.Surface(SLO, {name: engine(c) for name, c in capacities.items()})


def test_the_truth_is_the_highest_load_below_the_first_sustained_break():
    made = surface(a=13, b=24)
    assert capacity_accuracy.truth(made, "a") == 13 and capacity_accuracy.truth(made, "b") == 24
    # a lone pass above a majority break is not the truth: 27 meets it again after 24 broke
    made.runs["b"][24.0] = [made.runs["b"][30.0][0]] * 3
    assert capacity_accuracy.truth(made, "b") == 22
    # a lone break between passes is a blip, not the capacity: 6 breaks, 7 meets it again
    made.runs["a"][6.0] = [made.runs["a"][30.0][0]] * 3
    assert capacity_accuracy.truth(made, "a") == 13
    made.runs["a"][7.0] = made.runs["a"][6.0]  # two in a row are a break: 5 is the last load before it
    assert capacity_accuracy.truth(made, "a") == 5


def test_the_search_lands_within_its_tolerance_where_the_4x_ladder_is_a_step_off():
    made = surface(a=13, b=24)
    rng = random.Random(0)
    for name, true in (("a", 13), ("b", 24)):
        ladder = capacity_accuracy.replay(made, name, capacity_accuracy.LADDER_4X, 0, 3, rng)
        search = capacity_accuracy.replay(made, name, capacity_accuracy.LADDER_4X, 4, 3, rng)
        assert ladder.capacity == 8  # 2 and 8 meet the SLO, 32 breaks it
        assert search.capacity is not None and 0.9 * true <= search.capacity <= 1.1 * true, (name, search)
        # never past the truth in what it measured: a load between recorded ones draws the nearest's runs (25 is 24)
        assert made.nearest(name, search.capacity) <= true
        assert search.levels > ladder.levels and search.measured_s > ladder.measured_s
        # what was measured there: the runs of the nearest recorded load (23 clients are drawn from 24's)
        assert search.throughput == pytest.approx(50 * made.nearest(name, search.capacity))


def test_the_evaluation_picks_the_configuration_of_the_higher_capacity_as_the_truth_does(tmp_path):
    result = capacity_accuracy.evaluate(surface(a=13, b=24), seeds=3, repeats=3)
    assert result["truth"] == {"a": 13, "b": 24} and result["truth_best"] == "b"
    assert result["methods"]["search"]["right_pick"] == 1.0
    # the 4x ladder reads both as 8 clients: a tie, broken by the first configuration
    assert result["methods"]["ladder 4x"]["error"]["b"]["median"] == pytest.approx(8 / 24 - 1)
    assert abs(result["methods"]["search"]["error"]["b"]["worst"]) <= 0.1


def test_configurations_are_ranked_at_the_steady_rate_their_cost_is_priced_at():
    made = surface(a=20, b=24)  # over whole levels b reads more tok/s at its capacity: 1,200 against 1,000
    for runs in made.runs["a"].values():
        for run in runs:  # a's levels drain more: with every client busy it makes twice its whole-level rate
            run.summary.busy_output_throughput = 2 * run.summary.output_throughput
    result = capacity_accuracy.evaluate(made, seeds=2, repeats=3)
    assert result["truth_best"] == "a" and result["methods"]["search"]["right_pick"] == 1.0


def test_a_recorded_surface_is_read_back_with_each_run_judged_against_the_slo(tmp_path):
    runs = engine(10)
    levels = []
    for made in runs.values():
        reported = made[1].model_copy(update={"runs": [LevelRun(summary=r.summary) for r in made]})
        levels.append(reported.model_dump(mode="json"))
    bench = {"servetune_version": "0", "created": "now", "url": "http://127.0.0.1:1", "model": "tiny",
             "served_model_name": "tiny", "engine_args": {}, "env": {}, "command": None, "vllm_version": None,
             "workload_file": None, "workload": {}, "slo": [], "num_requests": 64, "duration_s": None,
             "repeats": 3, "kv_capacity": None, "startup_s": None, "levels": levels}  # fmt: skip
    path = tmp_path / "surface.json"
    path.write_text(json.dumps({"slo": "ttft_ms.p99=1000", "configs": [{"name": "c", "bench": bench}]}))
    read = capacity_accuracy.load_surface(path)
    assert sorted(read.runs["c"]) == [float(x) for x in LOADS] and len(read.runs["c"][10.0]) == 3
    assert capacity_accuracy.truth(read, "c") == 10
    assert capacity_accuracy.truth(capacity_accuracy.load_surface(path, "ttft_ms.p99=500"), "c") == 5


@pytest.mark.parametrize(("asked", "passed"), [(64, ["--num-requests", "64"]), (0, [])])
def test_record_leaves_the_requests_a_level_to_servetune_bench_when_asked_for_none(
    tmp_path, monkeypatch, asked, passed
):
    calls = []

    def run(argv, check):
        calls.append(argv)
        doc = argv[argv.index("--json") + 1]
        with open(doc, "w", encoding="utf-8") as out:
            json.dump({"levels": []}, out)

    monkeypatch.setattr(capacity_accuracy.subprocess, "run", run)
    capacity_accuracy.main(["record", "--out", str(tmp_path / "s.json"), "--model", "tiny", "--configs", "1",
                            "--num-requests", str(asked)])  # fmt: skip
    (argv,) = calls
    tail = argv[argv.index("--num-requests") :][:2] if "--num-requests" in argv else []
    assert tail == passed


def test_a_replay_whose_levels_draw_every_recorded_run_says_its_seeds_are_one_trial(capsys):
    made = surface(a=13, b=24)  # three recorded runs a load
    alike = capacity_accuracy.evaluate(made, seeds=2, repeats=3)
    assert alike["seeds_alike"] is True  # every level draws all three runs of its load, whatever the seed
    capacity_accuracy.show(alike)
    assert "every seed replays the same trial" in capsys.readouterr().out
    drawn = capacity_accuracy.evaluate(made, seeds=2, repeats=1)
    assert drawn["seeds_alike"] is False
    capacity_accuracy.show(drawn)
    assert "every seed replays the same trial" not in capsys.readouterr().out
    del made.runs["a"][2.0][0]  # a load recorded twice: its three draws differ between seeds
    assert capacity_accuracy.evaluate(made, seeds=2, repeats=3)["seeds_alike"] is False
