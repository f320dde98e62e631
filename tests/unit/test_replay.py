"""The replay harness: a made-up surface with a known optimum, searched by every algorithm."""

import json

import pytest
import yaml

from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.results import LevelRun, best_level
from servetune.study.replay import ALGORITHMS, in_flight_order, replay
from servetune.study.replay_cost import efficiencies, efficiency, reaching, score_noise, trials_to_reach
from servetune.study.surface import Surface, key, score
from tests.builders import level, trial

SPACE = {
    "name": "made-up", "model": "org/m", "workload": "chat", "hardware": {"devices_per_node": 8},
    "slo": {"ttft_ms": {"p99": 2000}},
    "params": {"max_num_seqs": [1, 2, 3, 4, 5, 6, 7, 8], "max_num_batched_tokens": [1, 2, 3, 4, 5, 6],
               "enable_prefix_caching": [True, False]},
    "constraints": ["max_num_seqs + max_num_batched_tokens <= 13"],  # two points excluded: 8 + 6
    "search": {"algorithm": "tpe", "objectives": [{"metric": "goodput", "mode": "max"}]},
}  # fmt: skip
OPTIMUM = {"max_num_seqs": 6, "max_num_batched_tokens": 2, "enable_prefix_caching": True}


def made_up(params) -> "trial":
    """Goodput peaks at OPTIMUM; the largest batches break the TTFT bound; one point ran out of memory."""
    s, b, cached = params["max_num_seqs"], params["max_num_batched_tokens"], params["enable_prefix_caching"]
    out_tps = 6000 - 150 * (s - 6) ** 2 - 200 * (b - 2) ** 2 - (0 if cached else 300)
    if (s, b) == (5, 2) and not cached:
        return trial(key(params), params, outcome="FAILED", reason="engine exited: CUDA out of memory")
    ttft = 3000 if s + b >= 12 else 500
    violations = ("ttft_ms_p99 = 3000 > 2000",) if ttft > 2000 else ()
    result = trial(
        key(params), params, [level(4, out_tps / 2, ttft / 2), level(16, out_tps, ttft, violations=violations)]
    )
    result.best_level_index = best_level(result)
    return result


@pytest.fixture(scope="module")
def surface() -> Surface:
    space = SearchSpace.model_validate(SPACE)
    kept, _ = space.grid()
    return Surface.from_results(space, [made_up(p) for p in kept], {"how": "made up"})


def test_the_surface_knows_its_optimum_and_scores_failures_and_slo_breaks_zero(surface):
    assert len(surface.results) == 94
    assert surface.best_score == pytest.approx(6000 / 60)
    assert surface.score_of(OPTIMUM) == surface.best_score
    assert surface.score_of({**OPTIMUM, "max_num_seqs": 5, "enable_prefix_caching": False}) == 0.0  # failed
    assert surface.score_of({"max_num_seqs": 7, "max_num_batched_tokens": 5, "enable_prefix_caching": True}) == pytest.approx(
        (6000 - 150 - 1800) / 2 / 60)  # its top level broke the SLO: the level below counts  # fmt: skip


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_finds_the_known_optimum(surface, algorithm):
    scores = replay(surface, algorithm, seed=3, until=surface.best_score)
    assert scores[-1] == surface.best_score and max(scores[:-1], default=0) < surface.best_score
    assert len(scores) <= len(surface.results)


def test_the_grid_replays_in_the_grid_s_order_and_random_depends_on_its_seed(surface):
    kept, _ = surface.space.grid()
    assert replay(surface, "grid", seed=0) == [surface.score_of(p) for p in kept]
    assert replay(surface, "grid", seed=0, budget=5) == [surface.score_of(p) for p in kept[:5]]
    first, again, other = (replay(surface, "random", seed=s, budget=20) for s in (1, 1, 2))
    assert first == again and first != other


def test_tpe_needs_far_fewer_trials_than_the_grid_on_a_smooth_surface(surface):
    grid = efficiency(surface, "grid", seeds=[0])
    tpe = efficiency(surface, "tpe", seeds=range(4))
    assert tpe.reached == 4
    assert tpe.mean < grid.mean / 2, (tpe.needed, grid.needed)


def test_trials_in_flight_still_find_the_optimum(surface):
    scores = replay(surface, "tpe", seed=0, in_flight=4, until=surface.best_score)
    assert scores[-1] == surface.best_score


class CountingSearcher:
    """Proposes ``x`` from a list, then ``FINISHED``; records how many trials were outstanding at each tell."""

    FINISHED = "FINISHED"

    def __init__(self, xs):
        self.xs, self.outstanding, self.outstanding_at_tell, self.told = list(xs), set(), [], []

    def suggest(self, trial_id):
        if not self.xs:
            return self.FINISHED
        self.outstanding.add(trial_id)
        return {"params": {"x": self.xs.pop(0)}}

    def on_trial_complete(self, trial_id, result=None, error=False):
        self.outstanding_at_tell.append(len(self.outstanding))
        self.outstanding.remove(trial_id)
        self.told.append(result)


@pytest.mark.parametrize(
    "points, budget, in_flight, outstanding",
    [(10, 10, 4, [4] * 7 + [3, 2, 1]), (10, 6, 4, [4, 4, 4, 3, 2, 1]), (3, 10, 4, [3, 2, 1]), (5, 5, 1, [1] * 5)],
)  # fmt: skip
def test_in_flight_keeps_n_trials_outstanding_and_tells_the_oldest(points, budget, in_flight, outstanding):
    searcher = CountingSearcher(range(points))
    order = [p["x"] for p in in_flight_order(searcher, lambda _id, p: {"x": p["x"]}, budget, in_flight)]
    assert order == list(range(min(points, budget)))
    assert searcher.outstanding_at_tell == outstanding
    assert searcher.told == [{"x": x} for x in order]  # each trial is told its own report


def test_the_replay_asks_the_study_s_searcher_with_n_trials_in_flight(surface, monkeypatch):
    import servetune.study.searcher as searcher_module

    live_at_tell = []

    class Recording(searcher_module.ConstrainedOptunaSearch):
        def on_trial_complete(self, trial_id, result=None, error=False):
            live_at_tell.append(len(self.live))
            super().on_trial_complete(trial_id, result, error)

    monkeypatch.setattr(searcher_module, "ConstrainedOptunaSearch", Recording)
    scores = replay(surface, "tpe", seed=0, budget=12, in_flight=4)
    assert len(scores) == 12 and live_at_tell == [4] * 9 + [3, 2, 1]


def test_a_budget_caps_every_search_and_a_seed_that_misses_counts_as_the_grid(surface):
    for algorithm in ALGORITHMS:
        assert len(replay(surface, algorithm, seed=1, budget=5)) == 5
    kept, _ = surface.space.grid()
    assert kept.index(OPTIMUM) >= 5  # the grid's order reaches the optimum after its first five
    grid = efficiency(surface, "grid", seeds=[0], tolerance=0.0, budget=5)
    assert grid.needed == [None] and grid.mean == grid.grid_size


def test_trials_to_reach_counts_from_one():
    assert trials_to_reach([1.0, 5.0, 9.0], 5.0) == 2
    assert trials_to_reach([1.0], 5.0) is None


def repeated(out_tps: float, spread: float):
    """A level run three times whose output throughput spreads ``spread`` either side of the median."""
    runs = [LevelRun(summary=level(16, out_tps * f, 500).summary) for f in (1 - spread, 1, 1 + spread)]
    return level(16, out_tps, 500).model_copy(update={"runs": runs})


NOISY = {"max_num_seqs": [1, 2, 3, 4, 5]}


@pytest.fixture()
def noisy() -> Surface:
    """The best (6000 tok/s, ±8% over its repeats) and four others: 90% of it with tight repeats (±2%, so the 5%
    floor), 85% with tight repeats, 80% with wide ones (±15%), and 96% of it run once (MARGIN, 10%)."""
    space = SearchSpace.model_validate({**SPACE, "params": NOISY, "constraints": []})
    levels = {1: repeated(5100, 0.02), 2: repeated(5400, 0.02), 3: repeated(6000, 0.08), 4: repeated(4800, 0.15),
              5: level(16, 5760, 500)}  # fmt: skip
    results = [trial(str(s), {"max_num_seqs": s}, [levels[s]]) for s in NOISY["max_num_seqs"]]
    return Surface.from_results(space, results)


def test_the_noise_target_counts_the_points_a_repeat_could_rank_first(noisy):
    best = noisy.best_score
    noise = {s: score_noise(noisy.results[key({"max_num_seqs": s})]) for s in NOISY["max_num_seqs"]}
    assert noise == pytest.approx({1: 0.05, 2: 0.05, 3: 0.08, 4: 0.15, 5: 0.10})  # the floor, and MARGIN run once
    tolerance = reaching(noisy, 0.05, "tolerance")
    within_noise = reaching(noisy, 0.05, "noise")
    assert tolerance == {key({"max_num_seqs": s}) for s in (3, 5)}
    # 90%: 10% below, inside 5% + 8%; 85%: 15% below, outside 13%; 80%: 20% below, inside 15% + 8%.
    assert within_noise == {key({"max_num_seqs": s}) for s in (2, 3, 4, 5)} and tolerance <= within_noise
    for k in within_noise:
        assert score(noisy.results[k]) >= (1 - max(0.05, noise[noisy.results[k].params["max_num_seqs"]] + 0.08)) * best
    # A tolerance wider than the noise decides: within 16%, the 85% point counts too.
    assert key({"max_num_seqs": 1}) in reaching(noisy, 0.16, "noise")


def test_one_replay_counts_the_trials_to_reach_each_target(noisy):
    kept, _ = noisy.space.grid()
    first_of = {target: next(i + 1 for i, p in enumerate(kept) if key(p) in reaching(noisy, 0.05, target))
                for target in ("tolerance", "noise")}  # fmt: skip
    assert first_of["noise"] < first_of["tolerance"]  # the grid's order meets a point within the noise first
    both = efficiencies(noisy, "grid", seeds=[0])
    assert {t: e.needed for t, e in both.items()} == {t: [n] for t, n in first_of.items()}
    assert efficiency(noisy, "grid", seeds=[0], target="noise").needed == [first_of["noise"]]
    for target, e in efficiencies(noisy, "tpe", seeds=range(3)).items():
        assert e.reached == 3 and e.needed == efficiency(noisy, "tpe", seeds=range(3), target=target).needed


def test_a_surface_round_trips_through_its_file(surface, tmp_path):
    surface.dump(tmp_path / "s.json", yaml.safe_dump(SPACE))
    loaded = Surface.load(tmp_path / "s.json")
    assert loaded.made_by == {"how": "made up"}
    assert {k: score(r) for k, r in loaded.results.items()} == {k: score(r) for k, r in surface.results.items()}


def test_a_surface_missing_grid_points_or_not_a_surface_is_one_clear_error(surface, tmp_path):
    space = SearchSpace.model_validate(SPACE)
    with pytest.raises(UserError, match=r"search space 'made-up': 1 of 94 grid points have no result"):
        Surface.from_results(space, list(surface.results.values())[1:])
    ranged = SearchSpace.model_validate({**SPACE, "params": {"max_num_seqs": {"low": 1, "high": 8}}, "constraints": []})
    with pytest.raises(UserError, match="lists for every parameter"):
        Surface.from_results(ranged, [])
    (tmp_path / "bad.json").write_text(json.dumps({"space": "name: x"}))
    with pytest.raises(UserError, match=r"bad.json: not a recorded surface"):
        Surface.load(tmp_path / "bad.json")


def test_a_surface_where_nothing_met_the_slo_has_no_optimum_to_find():
    space = SearchSpace.model_validate({**SPACE, "params": {"max_num_seqs": [1, 2]}, "constraints": []})
    failed = Surface.from_results(
        space, [trial(key({"max_num_seqs": s}), {"max_num_seqs": s}, outcome="FAILED") for s in (1, 2)]
    )
    with pytest.raises(UserError, match="no recorded trial met the SLO"):
        efficiency(failed, "tpe", seeds=[0])


def test_the_bench_records_a_study_that_ran_its_grid_and_replays_it(surface, tmp_path, capsys):
    from tests.builders import bench_script, study_info, write_study

    module = bench_script("search_efficiency")

    kept = list(surface.results.values())
    study = write_study(
        tmp_path / "study",
        study_info(name="made-up"),
        [r.model_copy(update={"trial_id": f"t{i}"}) for i, r in enumerate(kept)],
    )
    (study / "space.yaml").write_text(yaml.safe_dump(SPACE))
    assert (
        module.main(
            ["record", str(study), "--out", str(tmp_path / "s.json"), "--command", "servetune run made-up.yaml"]
        )
        == 0
    )
    made_by = json.loads((tmp_path / "s.json").read_text())["made_by"]
    assert (
        made_by["command"] == "servetune run made-up.yaml"
        and made_by["trials"] == 94
        and made_by["outcomes"] == {"COMPLETE": 93, "FAILED": 1}
    )

    argv = [
        "replay",
        str(tmp_path / "s.json"),
        "--seeds",
        "2",
        "--algorithms",
        "grid",
        "tpe",
        "--json",
        str(tmp_path / "r.json"),
    ]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "94 grid points" in out and "best Bayesian option: tpe" in out
    assert "target 'tolerance': trials to come within 5% of the best" in out
    assert "target 'noise': trials to come within the noise of the best" in out
    written = json.loads((tmp_path / "r.json").read_text())
    rows = {r["algorithm"]: r for r in written["rows"]}
    assert rows["grid"]["seeds"] == 1 and rows["tpe"]["seeds"] == 2 and rows["tpe"]["reached"] == 2
    # Levels run once: each point's noise is MARGIN, so the noise target is every point within 20% of the best.
    within = {t: sum(score(r) >= (1 - m) * surface.best_score for r in surface.results.values())
              for t, m in (("tolerance", 0.05), ("noise", 0.2))}  # fmt: skip
    assert written["points_reaching_by_target"] == within and within["noise"] > within["tolerance"]
    for row in rows.values():  # every point within 5% is within the noise: never more trials to reach it
        assert row["by_target"]["noise"]["mean"] <= row["by_target"]["tolerance"]["mean"] == row["mean"]

    # Within 3% of the optimum (100): itself and its two neighbours at 97.5 (max_num_seqs 5 and 7).
    argv = [
        "replay",
        str(tmp_path / "s.json"),
        "--tolerance",
        "0.03",
        "--algorithms",
        "grid",
        "--json",
        str(tmp_path / "r2.json"),
    ]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "3 points reach it" in out, out.splitlines()[0]
    assert json.loads((tmp_path / "r2.json").read_text())["points_reaching"] == 3

    (study / "trials" / "t0" / "result.json").unlink()
    assert module.main(["record", str(study), "--out", str(tmp_path / "t.json"), "--command", "x"]) == 2
    assert "1 of 94 grid points have no result" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_recording_keeps_trials_of_a_wider_grid_only_where_they_ran_the_fixed_value(surface, tmp_path, capsys):
    from tests.builders import bench_script, study_info, write_study

    module = bench_script("search_efficiency")

    fixed = {**SPACE, "env": {"VLLM_CPU_KVCACHE_SPACE": 1}}
    wide = [r.model_copy(update={"trial_id": f"t{i}", "params": {**r.params, "env.VLLM_CPU_KVCACHE_SPACE": 1}})
            for i, r in enumerate(surface.results.values())]  # fmt: skip
    study = write_study(tmp_path / "study", study_info(name="made-up"), wide)
    (study / "space.yaml").write_text(yaml.safe_dump(fixed))
    assert module.main(["record", str(study), "--out", str(tmp_path / "s.json"), "--command", "x"]) == 0
    assert Surface.load(tmp_path / "s.json").best_score == surface.best_score

    other = wide[0].model_copy(
        update={"trial_id": "t-other", "params": {**wide[0].params, "env.VLLM_CPU_KVCACHE_SPACE": 2}}
    )
    (study / "trials" / "t-other").mkdir()
    (study / "trials" / "t-other" / "result.json").write_text(other.model_dump_json())
    assert module.main(["record", str(study), "--out", str(tmp_path / "t.json"), "--command", "x"]) == 2
    assert "t-other: ran with env.VLLM_CPU_KVCACHE_SPACE=2, but" in capsys.readouterr().err


def test_the_grid_replays_in_the_order_a_run_with_that_many_in_flight_would_use():
    from servetune.study.packing import order_for_packing

    space = SearchSpace.model_validate({**SPACE, "params": {"tensor_parallel_size": [4, 2, 1], "max_num_seqs": [1, 2]},
                                        "constraints": []})  # fmt: skip
    kept, _ = space.grid()
    results = []
    for i, p in enumerate(kept):
        r = trial(f"t{i}", p, [level(4, 600 + 60 * i, 300)], devices=p["tensor_parallel_size"])
        r.best_level_index = 0
        results.append(r)
    surface = Surface.from_results(space, results)
    assert replay(surface, "grid", 0) == [surface.score_of(p) for p in kept]  # 4, 4, 2, 2, 1, 1 GPUs
    packed = order_for_packing(kept, space.devices, 8)
    assert [space.devices(p) for p in packed] == [1, 1, 2, 2, 4, 4]
    assert replay(surface, "grid", 0, in_flight=4) == [surface.score_of(p) for p in packed]
