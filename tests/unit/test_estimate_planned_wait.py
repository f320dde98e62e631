"""The a-priori estimate of an open-loop level (the study's forecast, pruning, ``run --dry-run``, ``servetune
estimate``, ``plan --estimate --num-requests``) waits for a slot over the requests the level will measure, sent into
an empty queue, as the estimate of the measured level does (trial/estimated.py): not the long run's wait."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from servetune import cli
from servetune.capacity import load_model_arch, resolve_hardware
from servetune.config.space import SearchSpace
from servetune.estimate import Load, estimate
from servetune.load.runner import Level
from servetune.study.driver import pruned
from servetune.study.forecast import forecast
from servetune.study.prune import error_margins, judge_prune, optimistic, shipped_error
from servetune.summary import summarize
from servetune.testing.twin import Twin, TwinConfig
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.measure import LevelPlan
from tests.builders import bench_script

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
ENGINE = {"max_model_len": 8192, "max_num_seqs": 8, "max_num_batched_tokens": 8192}
LENGTHS = (1000, 200)
#: Requests of LENGTHS, Poisson: the study's forecast takes the workload's mean lengths.
WORKLOAD = {"name": "fixed", "input_tokens": {"dist": "fixed", "value": 1000},
            "output_tokens": {"dist": "fixed", "value": 200}, "arrival": {"process": "poisson"}}  # fmt: skip
PLAN = ["plan", "--model", LLAMA_8B, "--gpu", "H100-SXM", "--max-model-len", "8192", "--max-num-seqs", "8"]


def capacity_rate() -> float:
    """The 8-slot replica's capacity in requests/s at 1,000 in / 200 out (a saturated open loop's throughput)."""
    arch, hardware = load_model_arch(LLAMA_8B), resolve_hardware("gpu", "H100-SXM")
    return estimate(arch, ENGINE, hardware, Load(input_tokens=1000, output_tokens=200, rate=1e4)).request_throughput


NEAR = 0.98 * capacity_rate()


def space(load: dict, slo: dict | None = None, prune: bool = False) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "planned-wait", "model": LLAMA_8B, "workload": WORKLOAD, "device": "gpu",
        "hardware": {"gpu": "H100-SXM"}, "engine_args": {k: v for k, v in ENGINE.items() if k != "max_num_seqs"},
        "params": {"max_num_seqs": [8]},
        "slo": slo or {"ttft_ms": {"p99": 60000}}, "load": {"kind": "rate", **load},
        "search": {"estimate": {"prune": prune}},
    })  # fmt: skip


def spec_of(sp: SearchSpace, tmp_path):
    workload = sp.resolved_workload(tmp_path)
    context = StudyContext(sp, workload, tmp_path, sp.model, resolve_levels(sp, workload))
    return context, context.spec_for({"max_num_seqs": 8})


def long_run(level_requests: int | None = None) -> float:
    arch, hardware = load_model_arch(LLAMA_8B), resolve_hardware("gpu", "H100-SXM")
    load = Load.at_level("rate", NEAR, *LENGTHS, requests=level_requests)
    ttft = estimate(arch, ENGINE, hardware, load).ttft_ms
    assert ttft is not None
    return ttft


def test_an_open_loops_planned_requests_are_its_measured_ones_by_count_or_by_its_rate_over_its_seconds():
    rate = Level("rate", 4.0, "poisson")
    assert LevelPlan.sized(rate, 256, None, 8).open_loop_requests == 256
    assert LevelPlan.sized(rate, None, 30.0, 8).open_loop_requests == 4 * 30 - 8  # the warm-up is in the seconds
    assert LevelPlan.sized(rate, 50, 30.0, 8).open_loop_requests == 50  # whichever ends the level first
    assert LevelPlan.sized(rate, "auto", None, None).open_loop_requests == 120  # 30 s of the rate
    assert LevelPlan.sized(Level("concurrency", 4), 256, None, 8).open_loop_requests is None
    talks = Level("rate", 4.0, "poisson", conversations=True)  # conversations started a second, not requests
    assert LevelPlan.sized(talks, 256, None, 8).open_loop_requests is None


@pytest.mark.parametrize(
    ("load", "requests"),
    [({"levels": [NEAR], "requests_per_level": 256}, 256),
     ({"levels": [NEAR], "requests_per_level": None, "seconds_per_level": 20, "warmup_requests": 4},
      round(20 * NEAR) - 4)],
)  # fmt: skip
def test_the_forecast_and_the_dry_run_wait_for_a_slot_over_the_levels_planned_requests(tmp_path, load, requests):
    from servetune.cli.run import estimate_cell

    _, spec = spec_of(space(load), tmp_path)
    forecasts = forecast(spec, LENGTHS)
    assert not isinstance(forecasts, str)
    (fc,) = forecasts
    est = fc.estimate
    assert est.slot_wait == "level" and est.level_requests == requests
    assert est.ttft_ms == pytest.approx(long_run(requests), rel=1e-9)
    assert est.ttft_ms < long_run() / 2  # near capacity a level cannot build the long run's queue
    assert f"TTFT {est.ttft_ms:,.0f} ms" in estimate_cell(spec, fc.level, LENGTHS)


def test_the_forecast_is_the_estimate_the_measured_level_will_be_compared_with(tmp_path):
    """The level the trial runs (the twin's queue, no spread) counts its completed and failed requests after the
    warm-up (Load.measured), and its estimate is the forecast's: pruning judges the trial by the estimate its
    measured error (the margin) is taken against."""
    _, spec = spec_of(space({"levels": [NEAR], "requests_per_level": 256, "warmup_requests": 8}), tmp_path)
    (fc,) = forecast(spec, LENGTHS)
    plan = LevelPlan.sized(fc.level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
    twin = Twin(TwinConfig(gpu="H100-SXM", model=LLAMA_8B, engine_args=ENGINE, spread=0.0))
    records = bench_script("twin_grid").simulate_level(twin, fc.level, plan, LENGTHS, np.random.default_rng(0))
    measured = Load.measured(summarize(records, fc.level.as_dict(), None))
    assert measured is not None and measured.requests == 256
    arch, hardware = load_model_arch(LLAMA_8B), resolve_hardware("gpu", "H100-SXM")
    assert estimate(arch, ENGINE, hardware, measured) == fc.estimate


def test_pruning_judges_the_levels_wait_so_it_never_prunes_what_only_the_long_runs_wait_rules_out(tmp_path):
    """A TTFT bound between the level's optimistic TTFT and the long run's: the long run's wait would prune the trial,
    the level's (what it will measure) runs it; a bound under the level's optimistic TTFT still prunes it."""
    margins, _ = error_margins(shipped_error("gpu"), {})
    _, spec = spec_of(space({"levels": [NEAR], "requests_per_level": 256}), tmp_path)
    (fc,) = forecast(spec, LENGTHS)
    level_figure = optimistic(fc, margins)["ttft_ms"]
    long_fc = type(fc)(fc.level, fc.estimate.model_copy(update={"ttft_ms": long_run(), "slot_wait": "long_run"}))
    long_figure = optimistic(long_fc, margins)["ttft_ms"]
    assert level_figure < long_figure / 2
    between = round((level_figure * long_figure) ** 0.5)
    sp = space({"levels": [NEAR], "requests_per_level": 256}, {"ttft_ms": {"mean": between}}, prune=True)
    context, spec = spec_of(sp, tmp_path)
    assert judge_prune([long_fc], sp.slo_bounds, margins, [], 3.0, 1) is not None  # what the long run said
    assert pruned(spec, context, None, None) is None
    below = round(level_figure / 2)
    sp = space({"levels": [NEAR], "requests_per_level": 256}, {"ttft_ms": {"mean": below}}, prune=True)
    context, spec = spec_of(sp, tmp_path)
    result = pruned(spec, context, None, None)
    assert result is not None and result.pruned is not None and result.pruned.rule == "slo"
    assert result.pruned.levels[0].ttft_ms == pytest.approx(fc.estimate.ttft_ms)


def test_servetune_estimate_waits_over_each_rate_levels_planned_requests_and_says_so(tmp_path, capsys):
    path = tmp_path / "space.yaml"
    doc = space({"levels": [1.0, NEAR], "requests_per_level": 200}).model_dump(mode="json", exclude_unset=True)
    path.write_text(yaml.safe_dump(doc))
    assert cli.main(["estimate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "empty queue" in report["slot_wait"]
    assert [row["estimate"]["level_requests"] for row in report["rows"]] == [200, 200]
    assert {row["estimate"]["slot_wait"] for row in report["rows"]} == {"level"}
    assert cli.main(["estimate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "open loop: each rate level's TTFT holds the wait for a slot" in out and f"r={NEAR:g} n=200" in out


def test_plan_estimate_takes_the_levels_requests_or_says_it_gives_the_long_runs_wait(capsys):
    base = [*PLAN, "--estimate", "--input-tokens", "1000", "--output-tokens", "200", "--rate", f"{NEAR:.6f}"]
    assert cli.main([*base, "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)["estimate"]
    assert whole["slot_wait"] == "long_run" and "level_requests" not in whole
    assert cli.main([*base, "--num-requests", "256", "--json"]) == 0
    level = json.loads(capsys.readouterr().out)["estimate"]
    assert level["slot_wait"] == "level" and level["level_requests"] == 256
    assert level["ttft_ms"] < whole["ttft_ms"] / 2
    assert cli.main([*base, "--num-requests", "256"]) == 0
    assert "a level of 256 requests" in capsys.readouterr().out
    assert cli.main(base) == 0
    assert "the long run's" in capsys.readouterr().out
    closed = [*PLAN, "--estimate", "--input-tokens", "1000", "--output-tokens", "200", "--concurrency", "4", "--json"]
    assert cli.main(closed) == 0
    assert "slot_wait" not in json.loads(capsys.readouterr().out)["estimate"]
