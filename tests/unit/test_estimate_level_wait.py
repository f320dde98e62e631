"""An open-loop level of N requests starts on an empty queue: near capacity it waits less than the long run
(estimate/queueing.py slot_wait_s ``requests``, level_share)."""

from __future__ import annotations

import heapq
import math
import statistics

import numpy as np
import pytest
from scipy import integrate

from servetune.capacity import load_model_arch, resolve_hardware
from servetune.estimate import Load, estimate
from servetune.estimate.queueing import capacity, level_share, slot_wait_s, steady
from servetune.load.runner import Level
from servetune.summary import summarize
from servetune.testing.twin import Twin, TwinConfig
from servetune.trial.measure import LevelPlan
from tests.builders import bench_script

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _reflected_mean(u: float) -> float:
    """E[R(u)] / E[R(inf)] of a Brownian motion with drift -1 and variance 1 reflected at 0, started at 0, from the
    law of its running maximum (R(u) has the law of max over [0, u] of B(s) - s), not from Abate and Whitt's H."""

    def tail(x: float) -> float:
        root = math.sqrt(u)
        return 0.5 * math.erfc((x + u) / root / math.sqrt(2)) + math.exp(-2 * x) * 0.5 * math.erfc(
            (x - u) / root / math.sqrt(2)
        )

    return integrate.quad(tail, 0, 60 + 4 * u, limit=200)[0] / 0.5


@pytest.mark.parametrize("span", [0.05, 1.0, 7.0, 80.0])
def test_the_level_share_is_the_mean_of_a_reflected_brownian_motion_started_empty(span):
    expected = integrate.quad(_reflected_mean, 0, span, limit=200)[0] / span
    assert level_share(span) == pytest.approx(expected, rel=1e-3)


def test_a_finite_level_waits_less_near_capacity_never_more_than_the_long_run_and_as_much_far_from_it():
    slots, service = 64, 10.0
    for rho in (0.5, 0.8, 0.9, 0.99, 0.9999):
        long_run = slot_wait_s(64 * rho, slots, service)
        levels = [slot_wait_s(64 * rho, slots, service, requests=n) for n in (16, 256, 4096, 10**13)]
        assert levels == sorted(levels) and levels[-1] <= long_run
        assert levels[-1] == pytest.approx(long_run, rel=1e-3)
    # far from capacity a level of 256 is the long run but for its first residence, while the empty engine's slots
    # fill (256 requests at 32 in flight: 8 residences); near it, a level of 256 cannot build the long run's queue
    assert slot_wait_s(32.0, slots, service, requests=256) == pytest.approx(
        slot_wait_s(32.0, slots, service) * 7 / 8, rel=0.02
    )
    assert slot_wait_s(32.0, slots, service, requests=32) == 0.0  # the level ends as its slots fill
    near = 64 * 0.9999
    assert slot_wait_s(near, slots, service, requests=256) < slot_wait_s(near, slots, service) / 50
    assert slot_wait_s(64.0, slots, service, requests=256) == math.inf  # past capacity: saturated, as before


def _fifo_level_wait(slots: int, in_flight: float, service: float, requests: int, seeds: int) -> float:
    """The mean wait for a slot of a level of ``requests`` Poisson arrivals into an empty FIFO queue of ``slots``
    servers each holding a request ``service`` seconds (M/D/c), ``in_flight`` / ``service`` arrivals a second."""
    waits = []
    for seed in range(seeds):
        sends = np.cumsum(np.random.default_rng(seed).exponential(service / in_flight, size=requests))
        free = [0.0] * slots
        for sent in sends:
            start = max(float(sent), heapq.heappop(free))
            waits.append(start - sent)
            heapq.heappush(free, start + service)
    return statistics.mean(waits)


@pytest.mark.parametrize(("slots", "rho"), [(32, 0.99), (64, 0.98)])
def test_a_short_level_on_many_slots_waits_near_what_a_fifo_queue_of_them_does_its_slots_filling_first(slots, rho):
    """256 requests on 32 or 64 slots last a few residences, the first of which fills the empty engine's slots: the
    level's wait is within 40 % of an M/D/c queue's (it was 1.6-1.7x without counting the filling)."""
    service, requests = 4.0, 256
    simulated = _fifo_level_wait(slots, rho * slots, service, requests, seeds=100)
    model = slot_wait_s(rho * slots, slots, service, requests=requests)
    assert simulated < model < 1.4 * simulated


def test_a_256_request_level_near_capacity_on_the_noise_free_twin_waits_what_the_finite_level_estimate_says():
    """The GPU twin's own queue (bench/twin_grid.py simulates each request against the twin's pace, Poisson sends)
    with no run-to-run spread: a level of 256 requests at 0.98 of an 8-slot replica's capacity. The level's load
    as the trial reads it (Load.measured) carries its 256 requests, and the estimate made with it is near the mean
    measured TTFT, where the long run's wait is more than twice as long."""
    twin_grid = bench_script("twin_grid")
    args = {"max_model_len": 8192, "max_num_seqs": 8, "max_num_batched_tokens": 8192}
    twin = Twin(TwinConfig(gpu="H100-SXM", model=LLAMA_8B, engine_args=args, spread=0.0))
    isl, osl = 1000, 200
    full = steady(twin.replica, twin.efficiency, capacity(twin.replica, isl, osl), isl, osl)
    level = Level("rate", 0.98 * full.request_rate(osl), "poisson")
    plan = LevelPlan.sized(level, 256, None, 0)
    measured, loads = [], set()
    for seed in range(30):
        records = twin_grid.simulate_level(twin, level, plan, (isl, osl), np.random.default_rng(seed))
        summary = summarize(records, level.as_dict(), None)
        measured.append(summary.ttft_ms.mean)
        loads.add(Load.measured(summary))
    (load,) = loads
    assert load.requests == 256 and load.rate == level.value
    arch, hardware = load_model_arch(LLAMA_8B), resolve_hardware("gpu", "H100-SXM")
    finite = estimate(arch, args, hardware, load).ttft_ms
    long_run = estimate(arch, args, hardware, load.model_copy(update={"requests": None})).ttft_ms
    mean = statistics.mean(measured)
    assert finite == pytest.approx(mean, rel=0.2)
    assert long_run > 2 * mean


def test_a_closed_loop_ignores_the_level_length_and_the_open_loop_reads_it_per_replica():
    arch, hardware = load_model_arch(LLAMA_8B), resolve_hardware("gpu", "H100-SXM")
    one = {"max_model_len": 8192, "max_num_seqs": 8}
    closed = Load.at_level("concurrency", 6, 1000, 200, requests=256)
    assert closed.requests is None
    assert estimate(arch, one, hardware, closed) == estimate(
        arch, one, hardware, Load.at_level("concurrency", 6, 1000, 200)
    )
    # two replicas behind one front end: each gets half the rate and half the level's requests
    rate = (
        0.99
        * estimate(
            arch, one, hardware, Load(input_tokens=1000, output_tokens=200, concurrency=10**4)
        ).request_throughput
    )
    two = {**one, "data_parallel_size": 2}
    halves = estimate(arch, two, hardware, Load.at_level("rate", 2 * rate, 1000, 200, requests=512))
    single = estimate(arch, one, hardware, Load.at_level("rate", rate, 1000, 200, requests=256))
    assert halves.ttft_ms == pytest.approx(single.ttft_ms, rel=1e-9)
    assert single.ttft_ms < estimate(arch, one, hardware, Load.at_level("rate", rate, 1000, 200)).ttft_ms / 2
