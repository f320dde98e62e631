"""Early stopping replayed on a made-up surface: it cuts what cannot win, never what wins higher up."""

import pytest

from servetune.config.space import SearchSpace
from servetune.study.replay import replay_trials
from servetune.study.replay_cost import early_stopping_effect
from servetune.study.surface import Surface, key
from tests.builders import level, trial

SPACE = {
    "name": "made-up-ladder", "model": "org/m", "workload": "chat", "hardware": {"devices_per_node": 8},
    "load": {"kind": "concurrency", "levels": [2, 8, 32]}, "slo": {"ttft_ms": {"p99": 2000}},
    "params": {"max_num_seqs": [2, 32], "max_num_batched_tokens": [256, 4096]},
    "search": {"algorithm": "grid", "objectives": [{"metric": "goodput", "mode": "max"}]},
}  # fmt: skip
# The grid's order: FAST_LOW, DOMINATED, BATCHER, then a point that failed.
FAST_LOW = {"max_num_seqs": 2, "max_num_batched_tokens": 256}
DOMINATED = {"max_num_seqs": 2, "max_num_batched_tokens": 4096}
BATCHER = {"max_num_seqs": 32, "max_num_batched_tokens": 256}
FAILED = {"max_num_seqs": 32, "max_num_batched_tokens": 4096}


def made_up() -> Surface:
    """FAST_LOW is cheapest and fastest at 2 in flight, then breaks the SLO at 8; BATCHER is 25% costlier
    at 2 in flight but batches 32 and is best at 32; DOMINATED is four times FAST_LOW's cost at every level
    and can run only 2 at once, so it can never catch up."""
    slow = ("ttft_ms_p99 = 3000 > 2000",)
    results = [
        trial("fast-low", FAST_LOW, [level(2, 200, 100), level(8, 210, 3000, violations=slow)]),
        trial("dominated", DOMINATED, [level(2, 50, 400), level(8, 52, 450), level(32, 53, 500)]),
        trial("batcher", BATCHER, [level(2, 150, 150), level(8, 600, 200), level(32, 2000, 400)]),
        trial("failed", FAILED, outcome="FAILED", reason="engine exited"),
    ]
    for r in results:
        r.best_level_index = max((i for i, lv in enumerate(r.levels) if lv.meets_slo), key=lambda i: r.levels[i].summary.goodput,
                                 default=None)  # fmt: skip
    space = SearchSpace.model_validate(SPACE)
    assert [key(p) for p in space.grid()[0]] == [key(p) for p in (FAST_LOW, DOMINATED, BATCHER, FAILED)]
    return Surface.from_results(space, results)


def by_id(told):
    return {t.recorded.trial_id: t for t in told}


def test_a_trial_slower_at_low_load_but_best_at_high_load_is_not_cut():
    told = by_id(replay_trials(made_up(), "grid", seed=0, early_stopping=True))
    # At 2 in flight FAST_LOW is 25% cheaper and 33% faster than BATCHER: without the bound on what
    # batching 32 could still give, it would dominate.
    assert not told["batcher"].cut and told["batcher"].result.stopped_because is None
    assert len(told["batcher"].result.levels) == 3
    effect = early_stopping_effect(made_up(), "grid", seeds=[0])
    assert effect.best_lost_share == 0.0 and effect.losses == []
    assert effect.needed == [3] and effect.mean_needed == 3  # BATCHER, third in the grid's order, reached the best


def test_a_clearly_dominated_trial_is_cut_and_its_levels_not_run_count_as_saved():
    surface = made_up()
    told = by_id(replay_trials(surface, "grid", seed=0, early_stopping=True))
    cut = told["dominated"]
    assert cut.cut and len(cut.result.levels) == 1
    assert cut.result.stopped_because.startswith("dominated at concurrency 2: trial fast-low at concurrency 2")
    assert cut.result.best_level_index == 0
    assert cut.device_seconds_saved == pytest.approx(2 * 60.0)  # two levels of 60 s on one device
    effect = early_stopping_effect(surface, "grid", seeds=[0])
    # Its own best fell (53 tok/s at 32 in flight not run), yet FAST_LOW beats even that: no loss.
    assert (
        effect.cut == [1]
        and effect.lowered == [1]
        and effect.losses == []
        and effect.device_minutes_saved == pytest.approx(2.0)
    )
    assert [len(t.result.levels) for t in replay_trials(surface, "grid", seed=0)] == [2, 3, 3, 0]  # off: nothing cut


def test_trials_still_in_flight_are_not_finished_points():
    surface = made_up()
    # Two at once: DOMINATED starts while FAST_LOW runs, so nothing has finished to dominate it.
    told = by_id(replay_trials(surface, "grid", seed=0, in_flight=2, early_stopping=True))
    assert not told["dominated"].cut
    effect = early_stopping_effect(surface, "grid", seeds=[0], in_flight=2)
    assert effect.cut == [0] and effect.device_minutes_saved == 0.0
    # One at a time, FAST_LOW has finished when DOMINATED starts.
    assert by_id(replay_trials(surface, "grid", seed=0, in_flight=1, early_stopping=True))["dominated"].cut


def test_a_cut_that_loses_the_winner_is_reported_with_its_level_and_dominator():
    """A rule that could lose the winner must show up in best_lost_share: make BATCHER look capped at 2."""
    surface = made_up()
    batcher = surface.results[key(BATCHER)]
    surface.results[key(BATCHER)] = batcher.model_copy(
        update={"engine_args": {**batcher.engine_args, "max_num_seqs": 2}}
    )
    effect = early_stopping_effect(surface, "grid", seeds=[0])
    assert effect.best_lost_share == 1.0 and effect.lowered == [2]
    assert effect.needed == [None] and effect.mean_needed is None  # the best was cut before its level: never reached
    (loss,) = effect.losses
    assert loss.cut_params == BATCHER and loss.cut_at_level == 0 and "trial fast-low" in loss.reason
    assert loss.best_off == pytest.approx(2000 / 60) and loss.best_on == pytest.approx(200 / 60)
