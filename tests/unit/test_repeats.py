"""Repeated levels (``load.repeats``): the median run decides, and a broken majority ends the repeats."""

import asyncio
import dataclasses
from pathlib import Path

import pytest

from servetune.accounting import time_accounting
from servetune.config.settings import LoadProtocol
from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.runner import Level
from servetune.trial.measure import measure_repeated, median_run
from servetune.trial.runner import TrialSpec
from tests.builders import level, trial

SLO = Slo.parse("ttft_ms.p99=2000")


def run(ttft_p99: float, out_tps: float = 600.0):
    broken = (f"ttft_ms_p99 = {ttft_p99:g} > 2000",) if ttft_p99 > 2000 else ()
    return level(8, out_tps, ttft_p99, violations=broken)


def test_the_median_run_reports_the_level_and_every_run_is_kept():
    runs = [run(500, 700), run(2500, 300), run(1000, 600)]
    chosen = median_run(runs, SLO)
    assert chosen.summary.ttft_ms.p99 == 1000 and chosen.meets_slo  # one stall broke one run, not the level
    assert [r.summary.ttft_ms.p99 for r in chosen.runs] == [500, 2500, 1000]
    assert chosen.measured_s == 3 * 60.0


def test_a_level_breaks_the_slo_when_most_runs_did():
    chosen = median_run([run(2500), run(500), run(3000)], SLO)
    assert not chosen.meets_slo and chosen.summary.ttft_ms.p99 == 2500


def test_of_two_runs_the_worse_reports_and_ties_go_to_more_goodput():
    assert median_run([run(500), run(1500)], SLO).summary.ttft_ms.p99 == 1500
    # Same slack: more goodput ranks better, so of three equal runs the middle goodput reports.
    assert median_run([run(1000, 100), run(1000, 900), run(1000, 500)], SLO).summary.output_throughput == 500


def test_without_per_request_bounds_the_median_is_by_requests_per_second():
    runs = [run(1000, out_tps) for out_tps in (900, 100, 500)]
    for r in runs:
        r.summary.goodput = None  # an SLO with no TTFT/TPOT/E2EL bound measures no goodput
    assert median_run(runs, Slo()).summary.output_throughput == 500


def test_a_single_run_is_the_level_itself():
    only = run(500)
    assert median_run([only], SLO) is only and only.runs == [] and only.measured_s == 60.0


@pytest.mark.parametrize(
    "ttfts, expected_runs, meets",
    [
        ([500, 600, 700], 3, True),
        ([2500, 2600, 700], 2, False),  # two of three broke: a third run could not change the verdict
        ([2500, 600, 2600], 3, False),
        ([500, 2500, 700], 3, True),
    ],
)
def test_repeats_stop_once_a_majority_broke_the_slo(ttfts, expected_runs, meets):
    asked: list[int] = []

    async def measure_once(index: int):
        asked.append(index)
        return run(ttfts[index]), [f"record {index}"]

    result, records = asyncio.run(measure_repeated(measure_once, 3, SLO))
    assert asked == list(range(expected_runs)) and len(records) == expected_runs
    assert result.meets_slo is meets and len(result.runs) == expected_runs


def test_with_an_even_count_half_broken_decides_and_a_gone_server_ends_the_repeats():
    asked: list[int] = []

    async def measure_once(index: int):
        asked.append(index)
        return run([2500, 2600, 600, 700][index]), []

    result, _ = asyncio.run(measure_repeated(measure_once, 4, SLO))
    assert asked == [0, 1] and not result.meets_slo  # the worse middle of four would break: no need for more
    asked.clear()
    asyncio.run(measure_repeated(measure_once, 4, SLO, gone=lambda: len(asked) == 1))
    assert asked == [0]


def test_device_time_counts_every_run_as_measuring():
    repeated = median_run([run(500), run(600), run(700)], SLO)
    result = trial("t1", {"max_num_seqs": 8}, [repeated], device="cpu")
    result.duration_s = 300.0
    assert time_accounting([result])["measuring_device_seconds"] == pytest.approx(180.0)


def spec(repeats: int) -> TrialSpec:
    return TrialSpec(
        study="s", trials_dir=Path("/tmp"), params={}, engine_args={"max_num_seqs": 8}, env={}, model="m", device="cpu",
        devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"), levels=(Level("concurrency", 2),),
        requests_per_level=48, seconds_per_level=None, warmup_requests=None, request_timeout_s=60, startup_timeout_s=60,
        stop_on_slo_break=True, min_throughput_gain=0.0, slo=SLO, repeats=repeats,
    )  # fmt: skip


def test_repeats_name_a_different_trial():
    assert spec(1).trial_id != spec(3).trial_id != spec(5).trial_id


@pytest.mark.parametrize("repeats", [0, 10])
def test_repeats_outside_one_to_nine_are_rejected(repeats):
    with pytest.raises(ValueError, match="repeats"):
        LoadProtocol(repeats=repeats)


def test_prompts_are_counted_with_the_tokenizer_the_engine_uses():
    assert spec(1).tokenizer == "m"  # the model's own
    other = dataclasses.replace(spec(1), engine_args={"max_num_seqs": 8, "tokenizer": "/models/tok"})
    assert other.tokenizer == "/models/tok"
