"""The performance estimate behaves like the physics it models (servetune.estimate)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.errors import UserError
from servetune.estimate import Load, decode_s, estimate, load_factors, replica_from_plan
from servetune.estimate.queueing import capacity, closed_loop

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"
ARGS = {"max_model_len": 8192}


def _est(model=LLAMA_8B, gpu="H100", args=None, **load):
    load.setdefault("input_tokens", 1000)
    load.setdefault("output_tokens", 200)
    return estimate(load_model_arch(model), {**ARGS, **(args or {})}, resolve_hardware("gpu", gpu), Load(**load))


def test_tpot_grows_with_batch_and_with_context():
    tpots = [_est(concurrency=c).tpot_ms for c in (1, 8, 64, 256)]
    assert tpots == sorted(tpots) and tpots[-1] > 2 * tpots[0]
    short, long = _est(concurrency=16, input_tokens=200), _est(concurrency=16, input_tokens=6000)
    assert long.tpot_ms > short.tpot_ms
    assert long.ttft_ms > short.ttft_ms


def test_throughput_grows_with_concurrency_until_the_knee_then_flattens():
    points = [_est(concurrency=c) for c in (1, 4, 16, 64, 256)]
    throughputs = [p.output_throughput for p in points]
    assert throughputs == sorted(throughputs)
    knee = points[0].knee
    at_knee = _est(concurrency=knee).output_throughput
    past = _est(concurrency=4 * knee).output_throughput
    assert past < 1.25 * at_knee  # little left to gain past the knee
    assert _est(concurrency=max(1, knee // 8)).output_throughput < 0.8 * at_knee


def test_tensor_parallelism_cuts_ttft_and_tpot_of_a_large_model():
    one = _est(LLAMA_70B, args={"tensor_parallel_size": 2}, concurrency=1, input_tokens=4000)
    four = _est(LLAMA_70B, args={"tensor_parallel_size": 4}, concurrency=1, input_tokens=4000)
    assert four.ttft_ms < one.ttft_ms
    assert four.tpot_ms < one.tpot_ms


def test_a_pcie_link_makes_tensor_parallelism_cost_more_than_nvlink():
    nvlink = _est(args={"tensor_parallel_size": 2}, gpu="H100-SXM", concurrency=64)
    pcie = _est(args={"tensor_parallel_size": 2}, gpu="H100-PCIe", concurrency=64)
    assert pcie.tpot_ms > nvlink.tpot_ms


def test_fp8_kv_cache_reads_fewer_bytes_per_decode_step():
    arch = load_model_arch(LLAMA_8B)
    hw = resolve_hardware("gpu", "H100")
    eff = load_factors().for_class("H100")
    reps = {}
    for kv in ("auto", "fp8"):
        args = {**ARGS, "kv_cache_dtype": kv}
        reps[kv] = replica_from_plan(arch, plan_capacity(arch, args, hw), args)
    assert reps["fp8"].kv.per_sequence(8000) == reps["auto"].kv.per_sequence(8000) / 2  # what decode_s reads
    assert decode_s(reps["fp8"], eff, 32, 8000) < decode_s(reps["auto"], eff, 32, 8000)
    # ... and the pool holds twice the tokens, so more long requests run at once
    assert capacity(reps["fp8"], 7000, 1000) > capacity(reps["auto"], 7000, 1000)


def test_open_loop_saturates_past_capacity():
    closed_max = _est(concurrency=10_000)
    below = _est(rate=0.5 * closed_max.request_throughput)
    past = _est(rate=2 * closed_max.request_throughput)
    assert not below.saturated and below.ttft_ms is not None
    assert below.request_throughput == pytest.approx(0.5 * closed_max.request_throughput)
    assert past.saturated and past.ttft_ms is None
    assert past.request_throughput == pytest.approx(closed_max.request_throughput, rel=1e-6)
    assert closed_max.saturated  # the clients outnumber what the KV cache and max_num_seqs admit


def test_closed_loop_obeys_littles_law():
    for c in (1, 16, 128, 2000):
        est = _est(concurrency=c)
        e2e_s = (est.ttft_ms + (200 - 1) * est.tpot_ms) / 1e3
        assert est.request_throughput * e2e_s == pytest.approx(c, rel=1e-9)


def test_queueing_past_capacity_lands_in_ttft_not_tpot():
    arch = load_model_arch(LLAMA_8B)
    args = {**ARGS, "max_num_seqs": 8}
    rep = replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware("gpu", "H100")), args)
    eff = load_factors().for_class("H100")
    at_cap, twice = closed_loop(rep, eff, 8, 500, 100), closed_loop(rep, eff, 16, 500, 100)
    assert twice.tpot_s == at_cap.tpot_s and twice.request_rate == at_cap.request_rate
    assert twice.ttft_s > at_cap.ttft_s + 0.5 * (100 - 1) * at_cap.tpot_s


def test_data_parallel_replicas_are_independent_engines():
    one = _est(concurrency=32)
    two = _est(args={"data_parallel_size": 2}, concurrency=64)
    assert two.output_throughput == pytest.approx(2 * one.output_throughput)
    assert two.tpot_ms == pytest.approx(one.tpot_ms)
    assert two.knee == 2 * one.knee


def test_moe_multiplies_only_its_active_experts():
    mixtral = load_model_arch("mistralai/Mixtral-8x7B-Instruct-v0.1")
    args = {"max_model_len": 4096, "tensor_parallel_size": 2}
    rep = replica_from_plan(mixtral, plan_capacity(mixtral, args, resolve_hardware("gpu", "H100")), args)
    assert rep.active_params < 0.4 * rep.weight_bytes / 2  # top-2 of 8 experts: about a quarter of the weights
    assert rep.weights_read(1) < rep.weights_read(64) <= rep.weight_bytes


def test_faster_memory_means_faster_decode():
    assert _est(gpu="H200", concurrency=8).tpot_ms < _est(gpu="A100-80GB", concurrency=8).tpot_ms


def test_bad_input_is_one_clear_error():
    with pytest.raises(UserError, match=r"RTX-3090.*performance"):
        _est(gpu="RTX-3090", concurrency=1)
    with pytest.raises(ValidationError, match="either concurrency"):
        Load(input_tokens=10, output_tokens=10, concurrency=1, rate=1.0)
    with pytest.raises(UserError, match="does not fit"):
        _est(LLAMA_70B, gpu="A100-40GB", concurrency=1)
