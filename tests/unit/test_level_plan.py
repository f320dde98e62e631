"""How many requests a level measures: "auto" sizes it by its load, for `servetune run` and `bench` alike."""

import pytest

from servetune.config.settings import LoadProtocol
from servetune.load.runner import Level
from servetune.trial.measure import LevelPlan


@pytest.mark.parametrize(
    ("level", "requests"),
    [
        (Level("concurrency", 1), 32),  # at least 32
        (Level("concurrency", 8), 64),  # eight per client in flight
        (Level("concurrency", 32), 256),
        (Level("concurrency", 100), 500),  # at most 500
        (Level("rate", 0.5, "poisson"), 32),
        (Level("rate", 4, "poisson"), 120),  # 30 s of the rate
        (Level("rate", 40, "poisson"), 500),
    ],
)
def test_auto_sizes_a_level_by_its_load(level, requests):
    plan = LevelPlan.sized(level)
    assert (plan.num_requests, plan.duration_s) == (requests, None)


def test_auto_with_seconds_lets_the_time_end_the_level():
    plan = LevelPlan.sized(Level("concurrency", 8), "auto", seconds=20.0)
    assert (plan.num_requests, plan.duration_s) == (None, 20.0)


def test_a_set_count_is_kept_whatever_the_load():
    assert LevelPlan.sized(Level("concurrency", 32), 48).num_requests == 48
    assert LevelPlan.sized(Level("concurrency", 32), 48, seconds=5.0).num_requests == 48


@pytest.mark.parametrize(("clients", "warmup"), [(1, 1), (8, 8), (64, 32)])
def test_warmup_defaults_to_one_request_per_client_at_most_32(clients, warmup):
    assert LevelPlan.sized(Level("concurrency", clients)).warmup_requests == warmup
    assert LevelPlan.sized(Level("concurrency", clients), warmup=3).warmup_requests == 3


def test_a_study_sizes_its_levels_unless_told():
    assert LoadProtocol().requests_per_level == "auto"
    assert LoadProtocol(requests_per_level=48).requests_per_level == 48


class DyingEngine:
    """An engine whose process still reads as alive for ``alive_reads`` reads after its socket closed."""

    def __init__(self, alive_reads: int) -> None:
        self.alive_reads = alive_reads

    def alive(self) -> bool:
        self.alive_reads -= 1
        return self.alive_reads >= 0

    def failure_reason(self) -> str:
        return "killed by SIGKILL"

    def log_tail(self) -> str:
        return "the end of the log"


def test_a_level_whose_requests_failed_waits_for_a_dying_engine_to_be_seen_gone():
    from servetune.errors import EngineDiedError
    from servetune.trial.measure import check_alive

    with pytest.raises(EngineDiedError, match=r"the engine died during concurrency 1 \(killed by SIGKILL\)"):
        check_alive(DyingEngine(alive_reads=3), Level("concurrency", 1), failed_requests=8)
    check_alive(DyingEngine(alive_reads=3), Level("concurrency", 1), failed_requests=0)  # nothing failed: no wait
    with pytest.raises(EngineDiedError):
        check_alive(DyingEngine(alive_reads=0), Level("concurrency", 1))  # seen gone at once


def test_an_engine_alive_after_the_settle_time_is_alive():
    from servetune.trial.measure import check_alive

    check_alive(DyingEngine(alive_reads=10**9), Level("concurrency", 1), failed_requests=8, settle_s=0.2)
