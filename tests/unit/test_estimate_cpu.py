"""The estimate on vLLM's CPU build (the stand-in): given or measured rates, calibrated on recorded surfaces."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.errors import UserError
from servetune.estimate import (
    Efficiency,
    Load,
    cpu_rates,
    decode_s,
    estimate,
    load_factors,
    measure_cpu_rates,
    replica_from_plan,
)
from servetune.estimate import calibrate as cal
from servetune.estimate import calibrate_cpu as cc
from servetune.estimate.factors import Factors
from servetune.estimate.queueing import closed_loop, wave_ttft_s
from servetune.models.tiny import TINY_CONFIG

SURFACES = Path(__file__).resolve().parents[2] / "bench" / "data"
ARGS = {"max_model_len": 1024, "dtype": "float32", "enforce_eager": True, "max_num_seqs": 8}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _est(concurrency: int, rates=cc.RECORDED_HOST, **args):
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    load = Load(input_tokens=128, output_tokens=32, concurrency=concurrency)
    return estimate(arch, {**ARGS, **args}, resolve_hardware("cpu"), load, env=ENV, rates=rates)


@pytest.fixture(scope="module")
def fits() -> dict[str, Efficiency]:
    """The CPU factors fitted on r3 with and without the closed loop's waves (r4 held out)."""
    train = cc.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=False)
    start = Efficiency(decode_bandwidth=0.1, prefill_flops=0.01, step_overhead_ms=5.0, sequence_overhead_ms=0.1)
    return {
        "waves": cc.fit_cpu(train),
        "spread": cal.fit_efficiency(train, start=start, bounds=cc.CPU_BOUNDS),
    }


def test_the_cpu_build_needs_its_rates():
    with pytest.raises(UserError, match="rates"):
        _est(2, rates=None)


def test_on_the_cpu_build_batching_behaves_as_on_a_gpu():
    assert load_factors().for_class("CPU") != load_factors().default  # the shipped fit has a CPU entry
    one, four, eight = _est(1), _est(4), _est(8)
    assert one.tpot_ms < four.tpot_ms < eight.tpot_ms
    assert one.output_throughput < four.output_throughput < eight.output_throughput
    queued = _est(32)  # max_num_seqs 8: the other 24 clients wait
    assert queued.saturated and queued.ttft_ms > 3 * eight.ttft_ms
    assert queued.output_throughput == pytest.approx(eight.output_throughput)
    assert _est(8, rates=cpu_rates(gflops=1600, memory_gbps=200)).tpot_ms < eight.tpot_ms


def test_measured_rates_are_positive_and_finite():
    rates = measure_cpu_rates(size=128, copy_mib=4, repeats=2)
    assert 0 < rates.flops < float("inf") and 0 < rates.hbm_bytes_s < float("inf")


def test_factors_fitted_on_one_surface_predict_another_of_the_same_host(fits):
    train = cc.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=False)
    held = cc.read_surface(SURFACES / "cpu-tiny-grid-r4.json", held_out=True)
    assert len(train) > 50 and len(held) > 50
    assert {p.load for p in held} == {2.0, 8.0, 32.0}

    def error(eff: Efficiency) -> float:
        cal.score(held, Factors(per_gpu_class={"CPU": eff}))
        err = cal.error_of(held, "output_throughput")
        assert err is not None
        return err.median

    assert error(fits["waves"]) < error(Efficiency())


def test_closed_loop_waves_put_the_prompts_in_ttft_not_in_every_step():
    eff = load_factors().for_class("CPU").model_copy(update={"host_cpu_ms_per_token": 0.0})  # the engine's own step
    spread, waves = eff.model_copy(update={"closed_loop_waves": 0.0}), eff.model_copy(update={"closed_loop_waves": 1.0})
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    args = {**ARGS, "max_num_seqs": 32}
    rep = replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware("cpu"), env=ENV), args, cc.RECORDED_HOST)
    rep = replace(rep, max_num_batched_tokens=32 * 128)  # the whole wave prefills in one step
    a, b = closed_loop(rep, spread, 32, 128, 32), closed_loop(rep, waves, 32, 128, 32)
    assert b.tpot_s < a.tpot_s and b.ttft_s is not None and a.ttft_s is not None and b.ttft_s > a.ttft_s
    assert b.tpot_s == pytest.approx(decode_s(rep, waves, 32, 128 + 16))  # the step decodes, nothing else
    # A wave of n prompts waits for their prefill: longer the more arrive together.
    assert wave_ttft_s(rep, waves, 2, 128) < wave_ttft_s(rep, waves, 8, 128) < wave_ttft_s(rep, waves, 32, 128)
    # A token budget the whole wave fits in prefills it in one step: every prompt waits for all of it;
    # a smaller budget (chunked) hands the first prompts their first token sooner.
    whole = replace(rep, max_num_batched_tokens=8192)
    chunked = replace(rep, max_num_batched_tokens=256)
    assert wave_ttft_s(chunked, waves, 32, 128) < wave_ttft_s(whole, waves, 32, 128)
    # Without chunked prefill a step takes whole prompts: 300 tokens hold two of 128, as 256 do.
    assert wave_ttft_s(replace(rep, max_num_batched_tokens=300, chunked_prefill=False), waves, 8, 128) == pytest.approx(
        wave_ttft_s(replace(rep, max_num_batched_tokens=256, chunked_prefill=False), waves, 8, 128)
    )


def test_a_small_step_budget_moves_the_waves_prefill_from_ttft_into_tpot_without_shortening_the_request():
    # The engine's own steps: the host's cores would cap 32 sequences' TPOT alike whatever the budget.
    eff = load_factors().for_class("CPU").model_copy(update={"closed_loop_waves": 1.0, "host_cpu_ms_per_token": 0.0})
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    args = {**ARGS, "max_num_seqs": 32}
    rep = replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware("cpu"), env=ENV), args, cc.RECORDED_HOST)
    whole = closed_loop(replace(rep, max_num_batched_tokens=32 * 128), eff, 32, 128, 32)
    small = closed_loop(replace(rep, max_num_batched_tokens=256), eff, 32, 128, 32)
    assert small.ttft_s is not None and whole.ttft_s is not None
    # The first prompts of a wave cut in small steps get their first token sooner, then decode through the
    # steps that prefill the rest of the wave, so their TPOT holds what their TTFT does not.
    assert small.ttft_s < whole.ttft_s and small.tpot_s > whole.tpot_s
    # The wave is the same work either way; each extra step adds its overhead, so the small budget serves no more.
    assert small.request_rate <= whole.request_rate
    no_overhead = eff.model_copy(update={"step_overhead_ms": 0.0, "sequence_overhead_ms": 0.0})
    whole0 = closed_loop(replace(rep, max_num_batched_tokens=32 * 128), no_overhead, 32, 128, 32)
    small0 = closed_loop(replace(rep, max_num_batched_tokens=256), no_overhead, 32, 128, 32)
    assert small0.request_rate == pytest.approx(whole0.request_rate, rel=0.02)


def test_gpu_factors_keep_prompts_spread_over_the_steps():
    factors = load_factors()
    assert factors.default.closed_loop_waves == 0.0
    assert all(eff.closed_loop_waves == 0.0 for cls, eff in factors.per_gpu_class.items() if cls != "CPU")
    assert 0.0 < factors.for_class("CPU").closed_loop_waves < 1.0


def test_waves_fitted_on_one_surface_predict_tpot_at_high_load_on_the_other(fits):
    assert 0.0 < fits["waves"].closed_loop_waves < 1.0  # the r3 fit finds both: neither all waves nor none
    held = cc.read_surface(SURFACES / "cpu-tiny-grid-r4.json", held_out=True)
    busy = [p for p in held if p.load == 32.0]

    def error(eff: Efficiency, metric: str) -> float:
        cal.score(busy, Factors(per_gpu_class={"CPU": eff}))
        err = cal.error_of(busy, metric)
        assert err is not None
        return err.median

    # Spread over every step, the prompts' prefill inflates TPOT at 32 clients and so cuts throughput.
    for metric in ("tpot_ms", "output_throughput"):
        assert error(fits["waves"], metric) < error(fits["spread"], metric)


def _replica(slots: int, rates=cc.RECORDED_HOST):
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    args = {**ARGS, "max_num_seqs": slots}
    return replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware("cpu"), env=ENV), args, rates)


def test_the_host_s_cores_cap_the_tokens_it_streams_and_bring_the_knee_before_the_slots():
    from servetune.estimate.queueing import host_bound_tpot_s, knee

    eff = load_factors().for_class("CPU").model_copy(update={"host_cpu_ms_per_token": 0.0, "closed_loop_waves": 0.0})
    rep = _replica(32)
    free = [closed_loop(rep, eff, c, 128, 32).request_rate * 32 for c in (4, 8, 16, 32)]
    bound = 0.5 * free[-1]  # tokens a second the cores stream: half what the engine alone reaches at 32 slots
    capped = eff.model_copy(update={"host_cpu_ms_per_token": 2 * 1e3 / bound})  # on 2 cores
    tokens = [closed_loop(rep, capped, c, 128, 32).request_rate * 32 for c in (4, 8, 16, 32)]
    # Flat at cores / cost (a request's first token comes with its prefill: O / (O - 1) of it at most), whatever
    # the slots; the engine alone still climbs from 16 to 32.
    assert bound <= max(tokens) <= bound * 32 / 31
    assert tokens[-1] == pytest.approx(tokens[-2], rel=0.03) and free[-1] > 1.1 * free[-2]
    assert all(t <= f + 1e-9 for t, f in zip(tokens, free, strict=True))
    assert tokens[0] == pytest.approx(free[0]) or free[0] > bound  # below the bound the engine's own pace
    assert knee(rep, capped, 128, 32) < knee(rep, eff, 128, 32)
    # Twice the cores: twice the bound. No cores counted (a GPU's host) or no cost: no bound.
    four = _replica(32, cpu_rates(gflops=160.0, memory_gbps=20.0, cores=4))
    assert max(closed_loop(four, capped, c, 128, 32).request_rate * 32 for c in (32,)) > bound
    assert host_bound_tpot_s(_replica(32, cpu_rates(gflops=160.0, memory_gbps=20.0)), capped, 32) == 0.0
    assert host_bound_tpot_s(rep, eff, 32) == 0.0


def test_measured_rates_count_the_cores_this_process_may_run_on():
    import os

    assert measure_cpu_rates(size=64, copy_mib=1, repeats=1).cores == len(os.sched_getaffinity(0))
    assert cc.RECORDED_HOST.cores == 2


def test_the_cpu_fit_keeps_the_cores_bound_only_where_it_fits_better(fits):
    train = cc.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=False)
    with_bound, without = fits["waves"], cc.fit_cpu(train, host_cores=False)
    assert without.host_cpu_ms_per_token == 0.0
    assert cc.fit_cost(train, with_bound) <= cc.fit_cost(train, without)


def test_a_batch_big_enough_is_core_bound_and_a_small_one_is_not():
    from servetune.estimate.queueing import host_bound_tpot_s, steady

    rep = _replica(32)
    free = load_factors().for_class("CPU").model_copy(update={"host_cpu_ms_per_token": 0.0})
    pace = {n: steady(rep, free, n, 128, 32, free.closed_loop_waves).tpot_s for n in (8, 16, 32)}
    # A cost a token at which the cores just keep up with 16 sequences: 8 are below the bound, 32 above it.
    cost_ms = pace[16] * 1e3 * rep.rates.cores / 16
    capped = free.model_copy(update={"host_cpu_ms_per_token": cost_ms})
    tpot = {n: steady(rep, capped, n, 128, 32, capped.closed_loop_waves).tpot_s for n in (8, 16, 32)}
    assert host_bound_tpot_s(rep, capped, 8) < pace[8] and tpot[8] == pytest.approx(pace[8])
    assert host_bound_tpot_s(rep, capped, 32) > pace[32]
    assert tpot[32] == pytest.approx(32 * cost_ms / 1e3 / rep.rates.cores)  # the cores' pace, not the engine's
    assert tpot[32] > pace[32] and tpot[16] == pytest.approx(pace[16])


def test_no_gpu_class_carries_the_cores_bound():
    from servetune.estimate.queueing import host_bound_tpot_s

    factors = load_factors()
    assert factors.default.host_cpu_ms_per_token == 0.0
    assert all(eff.host_cpu_ms_per_token == 0.0 for cls, eff in factors.per_gpu_class.items() if cls != "CPU")
    # A GPU's host counts no cores: no bound, whatever the factors.
    gpu_host = _replica(32, cpu_rates(gflops=160.0, memory_gbps=20.0))
    assert host_bound_tpot_s(gpu_host, factors.for_class("CPU"), 32) == 0.0


def test_halves_hold_every_load_of_a_surface_on_both_sides():
    points = cc.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=True)
    split = cc.halves(points)
    train, held = [p for p in split if not p.held_out], [p for p in split if p.held_out]
    assert abs(len(train) - len(held)) <= 1 and len(train) + len(held) == len(points)
    assert {p.load for p in train} == {p.load for p in held} == {p.load for p in points}
    assert [p.row for p in split] == [p.row for p in points]  # the same points, only the flag set
