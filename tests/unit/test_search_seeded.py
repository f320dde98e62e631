"""The search replay seeded by the estimate (bench/search_efficiency.py --estimate-seed): its first proposals are
the points the study's own estimate ranks best, as a study with search.estimate.seed proposes them."""

from __future__ import annotations

import json

import pytest
import yaml

from servetune.config.space import SearchSpace
from servetune.config.workload import mean_lengths
from servetune.results import best_level
from servetune.study.forecast import estimated_objective, forecast
from servetune.study.replay import estimate_seeds_for, replay_trials
from servetune.study.replay_cost import efficiency
from servetune.study.surface import Surface, key
from servetune.trial.context import StudyContext, resolve_levels
from tests.builders import bench_script, level, trial

SPACE = {
    "name": "seeded", "model": "meta-llama/Llama-3.1-8B-Instruct", "workload": "chat", "device": "gpu",
    "hardware": {"gpu": "H100-SXM"}, "engine_args": {"max_model_len": 4096},
    "load": {"kind": "concurrency", "levels": [4, 16, 64]}, "slo": {"ttft_ms": {"p99": 60000}},
    "params": {"max_num_seqs": [4, 16, 64, 256], "max_num_batched_tokens": [2048, 8192],
               "kv_cache_dtype": ["auto", "fp8"]},
    "search": {"algorithm": "tpe", "baseline": False},
}  # fmt: skip


def estimated(space: SearchSpace, tmp_path) -> dict[str, float | None]:
    """Each grid point's estimated objective (goodput), computed here from the estimate, not by the seeding code."""
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload))
    out = {}
    for params in space.grid()[0]:
        spec = context.spec_for(params)
        forecasts = forecast(spec, mean_lengths(workload))
        assert not isinstance(forecasts, str), forecasts
        out[key(params)] = estimated_objective(forecasts, space.search.objectives[0], space.slo_bounds,
                                               spec.price_per_device_hour, spec.devices)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def agreeing(tmp_path_factory) -> tuple[Surface, dict[str, float | None]]:
    """A surface whose measured goodput is the estimate's, shifted so that its best point differs from the grid's
    first: the estimate is right here, so a seeded search finds the best at once."""
    space = SearchSpace.model_validate(SPACE)
    values = estimated(space, tmp_path_factory.mktemp("seeded"))
    assert sum(v is not None for v in values.values()) >= 4, "the estimate covers this space"
    results = []
    for params in space.grid()[0]:
        goodput = values[key(params)] or 0.1
        result = trial(key(params), params, [level(16, goodput * 60, 500.0)])
        result.best_level_index = best_level(result)
        results.append(result)
    return Surface.from_results(space, results, {"how": "the estimate itself"}), values


def test_the_seeded_replay_proposes_the_estimate_s_best_points_first_best_first(agreeing):
    surface, values = agreeing
    seeds = estimate_seeds_for(surface, "tpe", surface.space.model)
    known = [(k, v) for k, v in values.items() if v is not None]  # in the grid's order
    ranked = [k for k, _ in sorted(known, key=lambda kv: -kv[1])]  # best first; ties keep the grid's order
    assert len(seeds) == 4  # seed_count: min(4, a quarter of the 16 trials)
    assert [key(p) for p in seeds] == ranked[:4]
    assert seeds[0] != surface.space.grid()[0][0]  # not simply the grid's order

    for algorithm in ("tpe", "nsga2", "gp"):
        told = replay_trials(surface, algorithm, seed=1, budget=6, seeds=seeds)
        assert told[0].params == seeds[0], algorithm
        in_flight = replay_trials(surface, algorithm, seed=1, budget=6, in_flight=4, seeds=seeds)
        assert [t.params for t in in_flight[:4]] == seeds, algorithm  # all four asked before any result came back
    # grid and random search are not seeded, in a study or here
    assert estimate_seeds_for(surface, "grid", surface.space.model) == []
    assert replay_trials(surface, "grid", seed=0, budget=1, seeds=seeds)[0].params == surface.space.grid()[0][0]


def test_a_search_seeded_by_a_right_estimate_reaches_the_best_in_one_trial_whatever_the_seed(agreeing):
    surface, _ = agreeing
    seeds = estimate_seeds_for(surface, "tpe", surface.space.model)
    seeded = efficiency(surface, "tpe", range(3), proposed_first=seeds)
    assert seeded.needed == [1, 1, 1]
    unseeded = efficiency(surface, "tpe", range(3))
    assert unseeded.mean > 1  # the sampler's own first proposals miss it


def test_the_bench_replays_with_and_without_the_estimate_s_seeds_and_names_them(agreeing, tmp_path, capsys):
    surface, _ = agreeing
    path = tmp_path / "s.json"
    surface.dump(path, yaml.safe_dump(SPACE))
    module = bench_script("search_efficiency")
    argv = ["replay", str(path), "--estimate-seed", "both", "--seeds", "2", "--algorithms", "grid", "tpe",
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    loaded = Surface.load(path)  # what the bench replays: its params in the file's order
    seeds = estimate_seeds_for(loaded, "tpe", loaded.space.model)
    assert "the estimate's likely winners, proposed first: " + module.label(seeds[0]) in out
    assert (
        "best Bayesian option seeded by the estimate: tpe+estimate, " + f"{1 / len(surface.results):.1%} of the grid"
        in out
    )
    rows = {r["algorithm"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert set(rows) == {"grid", "tpe", "tpe+estimate"}
    assert rows["tpe+estimate"]["proposed_first"] == seeds and rows["tpe+estimate"]["needed"] == [1, 1]
    assert rows["tpe"]["proposed_first"] == [] and not rows["tpe"]["estimate_seeded"]


def test_the_seeding_does_not_silently_drop_out_of_the_early_stopping_or_pruning_replays(capsys):
    module = bench_script("search_efficiency")
    with pytest.raises(SystemExit) as exit_:
        module.main(["replay", "s.json", "--estimate-seed", "on", "--pruning"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--estimate-seed" in err[-1] and "--pruning" in err[-1] and "Traceback" not in "".join(err)
