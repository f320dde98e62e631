"""bench/twin_grid.py: a GPU space's grid answered at the GPU twin's pace, as a surface the search replay reads."""

from __future__ import annotations

from servetune.study.surface import Surface, score
from servetune.testing.twin import Twin, TwinConfig
from tests.builders import bench_script

SPACE = """\
name: twin-test
model: meta-llama/Llama-3.1-8B-Instruct
device: gpu
workload: chat
load: {kind: concurrency, levels: [16, 32], requests_per_level: 64, capacity_levels: 2}
slo: {ttft_ms: {p99: 2000}}
hardware: {gpu: H100-SXM}
engine_args: {max_model_len: 4096}
params: {max_num_seqs: [4, 64], gpu_memory_utilization: [0.9, 0.05]}
search: {algorithm: grid, baseline: false}
"""


def test_the_twin_grid_answers_each_point_by_its_configuration_through_the_trials_own_ladder(tmp_path):
    twin_grid = bench_script("twin_grid")
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    surface, _ = twin_grid.build(path, seed=3)
    out = tmp_path / "surface.json"
    surface.dump(out, SPACE)
    loaded = Surface.load(out)  # what search_efficiency.py replay reads
    by_point = {(r.params["max_num_seqs"], r.params["gpu_memory_utilization"]): r for r in loaded.results.values()}
    assert {k: r.outcome for k, r in by_point.items() if k[1] == 0.05} == {
        (4, 0.05): "INFEASIBLE",
        (64, 0.05): "INFEASIBLE",
    }
    few, many = by_point[(4, 0.9)], by_point[(64, 0.9)]
    assert few.outcome == many.outcome == "COMPLETE"
    # the ladder's first level, then where the trial's own capacity search went: 4 slots queue 16 clients
    assert [lv.summary.level for lv in few.levels][:1] == [{"concurrency": 16.0}]
    assert few.levels[0].slo_violations and not many.levels[0].slo_violations
    assert any(lv.summary.level["concurrency"] < 16 for lv in few.levels)  # it halved the load to meet the SLO
    assert score(many) > score(few) > 0
    # each level's TTFT is the twin's pace at the requests in flight, times the point's run factor
    index = [r.trial_id for r in loaded.results.values()].index(many.trial_id)  # the point's place in the grid
    twin = Twin(TwinConfig(gpu="H100-SXM", model=many.model, engine_args=many.engine_args, seed=3 * 10_000 + index))
    isl, osl = many.levels[0].summary.total_input_tokens, many.levels[0].summary.total_output_tokens
    n = many.levels[0].summary.completed
    pace = twin.pace(16, isl // n, osl // n)
    assert abs(many.levels[0].summary.ttft_ms.p50 / (pace.ttft_s * 1000) - 1) < 0.2
    assert many.duration_s > sum(lv.summary.duration_s for lv in many.levels) > 0  # the start-up is counted
