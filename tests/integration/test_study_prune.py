"""A study that prunes by the estimate, through Ray Tune on the module's local Ray: nothing starts for a pruned trial."""

from __future__ import annotations

from servetune.config.space import SearchSpace
from servetune.study.driver import ResultMirror, finished_results
from servetune.study.tuner import run_tuner
from servetune.trial.context import StudyContext, resolve_levels


def test_a_grid_study_records_what_the_estimate_rules_out_as_pruned_without_starting_an_engine(
    module_ray, tmp_path, tiny_model
):
    space = SearchSpace.model_validate({
        "name": "prune", "model": str(tiny_model), "device": "cpu", "workload": "cpu-tiny",
        "env": {"VLLM_CPU_KVCACHE_SPACE": 1}, "hardware": {"devices_per_node": 2},
        "load": {"kind": "concurrency", "levels": [1, 4], "capacity_levels": 0},
        "slo": {"ttft_ms": {"p99": 0.01}},  # 10 us: no engine prefills a prompt that fast, whatever its error
        "params": {"max_num_seqs": [2, 8]},
        "search": {"algorithm": "grid", "baseline": False, "estimate": {"prune": True}},
    })  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    # an interpreter that does not exist: a trial that got as far as starting its engine would FAIL
    context = StudyContext(space, workload, tmp_path, str(tiny_model), resolve_levels(space, workload),
                           python=str(tmp_path / "no-python"))  # fmt: skip
    points = [{"max_num_seqs": 2}, {"max_num_seqs": 8}]
    run_tuner(context, points, None, len(points), [ResultMirror(context)], max_concurrent=1)
    results = finished_results(tmp_path)
    assert sorted(r.params["max_num_seqs"] for r in results) == [2, 8]
    for result in results:
        assert result.outcome == "PRUNED" and result.pruned is not None and result.pruned.rule == "slo"
        assert [lv.level for lv in result.pruned.levels] == [{"concurrency": 1.0}, {"concurrency": 4.0}]
        assert result.startup_s is None and not (tmp_path / "trials" / result.trial_id / "engine.log").exists()
