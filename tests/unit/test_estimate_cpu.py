"""The estimate on vLLM's CPU build (the stand-in): given or measured rates, calibrated on recorded surfaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from servetune.capacity import arch_from_hf_config, resolve_hardware
from servetune.errors import UserError
from servetune.estimate import Efficiency, Load, cpu_rates, estimate, load_factors, measure_cpu_rates
from servetune.estimate import calibrate as cal
from servetune.estimate import calibrate_cpu as cc
from servetune.estimate.factors import Factors
from servetune.models.tiny import TINY_CONFIG

SURFACES = Path(__file__).resolve().parents[2] / "bench" / "data"
ARGS = {"max_model_len": 1024, "dtype": "float32", "enforce_eager": True, "max_num_seqs": 8}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def _est(concurrency: int, rates=cc.RECORDED_HOST, **args):
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    load = Load(input_tokens=128, output_tokens=32, concurrency=concurrency)
    return estimate(arch, {**ARGS, **args}, resolve_hardware("cpu"), load, env=ENV, rates=rates)


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


def test_factors_fitted_on_one_surface_predict_another_of_the_same_host():
    train = cc.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=False)
    held = cc.read_surface(SURFACES / "cpu-tiny-grid-r4.json", held_out=True)
    assert len(train) > 50 and len(held) > 50
    assert {p.load for p in held} == {2.0, 8.0, 32.0}

    def error(eff: Efficiency) -> float:
        cal.score(held, Factors(per_gpu_class={"CPU": eff}))
        err = cal.error_of(held, "output_throughput")
        assert err is not None
        return err.median

    assert error(cc.fit_cpu(train)) < error(Efficiency())
