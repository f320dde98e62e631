"""A study that prunes by the estimate, through Ray Tune on the module's local Ray: nothing starts for a pruned trial,
and ``run --resume --unprune`` runs the trials it pruned."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from servetune.config.space import SearchSpace
from servetune.results import RESULT_FILE
from servetune.study.driver import finished_results, pruned_points
from servetune.study.mirror import ResultMirror
from servetune.study.surface import Surface
from servetune.study.tuner import run_tuner
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.estimated import estimate_levels

SURFACE = Path(__file__).resolve().parents[2] / "bench" / "data" / "cpu-tiny-grid-r4.json"


def test_a_resumed_cpu_study_prunes_by_its_own_measured_error_without_starting_an_engine(
    module_ray, tmp_path, tiny_model
):
    # The study measured some trials already (--resume): recorded ones, estimated as a trial estimates itself. On
    # the CPU build only their errors give the estimate a margin (no shipped error is trusted across hosts).
    measured = 0
    for recorded in Surface.load(SURFACE).results.values():
        if measured >= 6:
            break
        result = recorded.model_copy(deep=True, update={"model": str(tiny_model)})
        estimate_levels(result, None, None)
        measured += sum(lv.estimate is not None for lv in result.levels)
        (tmp_path / "trials" / result.trial_id).mkdir(parents=True)
        (tmp_path / "trials" / result.trial_id / RESULT_FILE).write_text(result.model_dump_json())
    space = SearchSpace.model_validate({
        "name": "prune", "model": str(tiny_model), "device": "cpu", "workload": "cpu-tiny",
        "env": {"VLLM_CPU_KVCACHE_SPACE": 1}, "hardware": {"devices_per_node": 2},
        "load": {"kind": "concurrency", "levels": [1, 4], "capacity_levels": 0},
        "slo": {"ttft_ms": {"p99": 0.01}},  # 10 us: no engine prefills a prompt that fast, whatever its error
        "params": {"max_num_seqs": [3, 5]},
        "search": {"algorithm": "grid", "baseline": False, "estimate": {"prune": True}},
    })  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    # an interpreter that does not exist: a trial that got as far as starting its engine would FAIL
    context = StudyContext(space, workload, tmp_path, str(tiny_model), resolve_levels(space, workload),
                           python=str(tmp_path / "no-python"))  # fmt: skip
    points = [{"max_num_seqs": 3}, {"max_num_seqs": 5}]
    run_tuner(context, points, None, len(points), [ResultMirror(context)], max_concurrent=1)
    new = [r for r in finished_results(tmp_path) if r.params in points]
    assert sorted(r.params["max_num_seqs"] for r in new) == [3, 5]
    for result in new:
        assert result.outcome == "PRUNED" and result.pruned is not None and result.pruned.rule == "slo"
        assert result.pruned.error_source.startswith("the study's own p90 error")
        assert [lv.level for lv in result.pruned.levels] == [{"concurrency": 1.0}, {"concurrency": 4.0}]
        assert result.startup_s is None and not (tmp_path / "trials" / result.trial_id / "engine.log").exists()

    # run --resume --unprune: the trials stored PRUNED run now and none is pruned again. Each gets as far as
    # starting its engine, whose interpreter does not exist, so it FAILS: a run's outcome replaces the PRUNED one.
    unpruning = dataclasses.replace(context, unprune=True)
    again = pruned_points(finished_results(tmp_path), unpruning)
    assert sorted(p["max_num_seqs"] for p in again) == [3, 5]
    run_tuner(unpruning, again, None, len(again), [ResultMirror(unpruning)], max_concurrent=1)
    ran = [r for r in finished_results(tmp_path) if r.params in points]
    assert sorted(r.params["max_num_seqs"] for r in ran) == [3, 5]
    for result in ran:
        assert result.outcome == "FAILED" and result.pruned is None, (result.outcome, result.reason)
    assert pruned_points(finished_results(tmp_path), unpruning) == []
