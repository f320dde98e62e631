"""bench/knee_noise.py: the run-to-run noise of the knee's slope and of P99 TTFT, read from repeated levels."""

from __future__ import annotations

import json

import pytest

from servetune.results import LevelRun
from tests.builders import bench_script, level, trial

knee_noise = bench_script("knee_noise")


def runs(made, throughputs, ttfts):
    return made.model_copy(update={"runs": [
        LevelRun(summary=made.summary.model_copy(update={
            "output_throughput": t, "ttft_ms": made.summary.ttft_ms.model_copy(update={"p99": p99})}))
        for t, p99 in zip(throughputs, ttfts, strict=True)]})  # fmt: skip


def test_the_noise_of_each_levels_throughput_the_slope_between_levels_and_p99_ttft(tmp_path):
    levels = [runs(level(2, 100, 300), [90, 100, 110], [200, 300, 400]),
              runs(level(8, 200, 600), [190, 200, 210], [600, 600, 600]),
              runs(level(32, 210, 900), [150, 210, 270], [900, 900, 900])]  # fmt: skip
    surface = tmp_path / "surface.json"
    surface.write_text(json.dumps({"trials": [trial("t1", {}, levels).model_dump(mode="json")]}))
    out = knee_noise.measure([surface])
    assert out["throughput_noise"]["n"] == 3 and out["throughput_noise"]["max"] == pytest.approx(60 / 210)
    # run by run (t2_i / t1_i - 1) / (x2 / x1 - 1): 2 -> 8 all below 0.5, 8 -> 32 all flat-ish: no decision flips
    low = [(190 / 90 - 1) / 3, (200 / 100 - 1) / 3, (210 / 110 - 1) / 3]
    high = [(150 / 190 - 1) / 3, (210 / 200 - 1) / 3, (270 / 210 - 1) / 3]
    spreads = [(max(s) - min(s)) / 2 for s in (low, high)]
    assert out["pairs"] == 2 and out["pairs_whose_runs_disagree_on_the_knee"] == 0
    assert out["slope_half_spread"]["median"] == pytest.approx(sum(spreads) / 2)
    assert out["slope_half_spread"]["max"] == pytest.approx(max(spreads))
    assert out["slope_noise_predicted"]["n"] == 2
    assert out["ttft_p99_noise"]["max"] == pytest.approx(100 / 300)  # 200..400 ms around 300
