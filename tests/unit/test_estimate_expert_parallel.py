"""Expert parallelism's token exchange in the step time (servetune.estimate.expert_parallel), as vLLM 0.32 runs it."""

from __future__ import annotations

import dataclasses
import math

import pytest

from servetune.capacity import arch_from_hf_config, load_model_arch, plan_capacity, resolve_hardware
from servetune.errors import UserError
from servetune.estimate import Load, decode_s, estimate, load_factors, prefill_s, replica_from_plan
from servetune.estimate.expert_parallel import ExpertExchange

# huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (the fields the planner reads): 48 layers, all MoE,
# 128 experts, top-8, hidden 2048, bf16.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}  # fmt: skip
H, K, LAYERS = 2048, 8, 48
GPU = "H100-SXM"
LINK = 450e9  # H100 SXM's NVLink, one direction (capacity/catalog/gpus.yaml)
EFF = load_factors().for_class("H100")
LAT = EFF.allreduce_us / 1e6


def _arch():
    return arch_from_hf_config(QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B")


def _replica(**args):
    arch = _arch()
    args = {"max_model_len": 8192, **args}
    return replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware(gpu=GPU)), args)


def _added(rep, step):
    """Seconds the exchange adds to ``step(rep)`` over the same replica without it."""
    return step(rep) - step(dataclasses.replace(rep, exchange=None))


def test_dp2_ep_adds_an_allgather_and_a_reduce_scatter_of_each_ranks_tokens_to_every_moe_layer():
    """TP 1 x DP 2 with EP: the DP group (2 ranks) all-gathers [n, H] bf16 plus top-8 weights and ids, and
    reduce-scatters [2n, H] back: each rank sends n x (2 H x 2 + 8 x 8) bytes a layer, in two collectives."""
    rep = _replica(data_parallel_size=2, enable_expert_parallel=True)
    assert rep.exchange is not None and rep.exchange.group == 2 and not rep.exchange.sequence_parallel
    for n in (1, 64):
        expected = LAYERS * (n * (2 * H * 2 + 8 * K) / LINK + 2 * LAT)
        assert _added(rep, lambda r, n=n: decode_s(r, EFF, n, 2000)) == pytest.approx(expected, rel=1e-9)
    prefill = LAYERS * (4096 * (2 * H * 2 + 8 * K) / LINK + 2 * LAT)
    assert _added(rep, lambda r: prefill_s(r, EFF, 4096, 4096)) == pytest.approx(prefill, rel=1e-9)


def test_tp2_dp2_ep_runs_the_moe_sequence_parallel_in_place_of_its_all_reduce():
    """TP 2 x DP 2 with EP (the default backend): each TP rank dispatches half the tokens over all 4 EP ranks,
    all-gathers the output over TP, and the MoE layer's TP all-reduce is gone."""
    rep = _replica(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    assert rep.exchange is not None and rep.exchange.group == 4 and rep.exchange.sequence_parallel
    n = 32
    s = n / 2
    exchange = 3 * s * (2 * H * 2 + 8 * K) + 1 * s * H * 2
    allreduce = 2 * (2 - 1) / 2 * n * H * 2
    expected = LAYERS * ((exchange - allreduce) / LINK + (3 - 1) * LAT)
    assert _added(rep, lambda r, n=n: decode_s(r, EFF, n, 2000)) == pytest.approx(expected, rel=1e-9)


def test_tp_only_ep_exchanges_nothing_beyond_the_all_reduce():
    """EP over TP 2 alone: each rank runs its experts on every token and the TP all-reduce joins them, as without EP."""
    on, off = _replica(tensor_parallel_size=2, enable_expert_parallel=True), _replica(tensor_parallel_size=2)
    assert on.exchange is None
    assert decode_s(on, EFF, 64, 2000) == decode_s(off, EFF, 64, 2000)
    assert prefill_s(on, EFF, 2048, 2048) == prefill_s(off, EFF, 2048, 2048)


def test_dp_without_ep_gathers_over_dp_and_dense_models_add_no_exchange():
    """EP off, DP 2: vLLM 0.32 still all-gathers the MoE layers' tokens over DP ("Falling back to
    AllGather+ReduceScatter", fused_moe/all2all_utils.py), whatever the backend argument, never sequence parallel.
    One engine without EP, or a dense model, exchanges nothing: a dense model's DP 2 TPOT is DP 1's."""
    for extra in ({}, {"all2all_backend": "deepep_low_latency"}):
        off = _replica(tensor_parallel_size=2, data_parallel_size=2, **extra)
        assert off.exchange is not None and off.exchange.backend == "allgather_reducescatter"
        assert off.exchange.group == 2 and not off.exchange.sequence_parallel
    assert _replica().exchange is None and _replica(tensor_parallel_size=2).exchange is None
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    args = {"max_model_len": 8192, "data_parallel_size": 2, "enable_expert_parallel": True}
    assert replica_from_plan(llama, plan_capacity(llama, args, resolve_hardware(gpu=GPU)), args).exchange is None
    hw, load = resolve_hardware(gpu=GPU), Load(input_tokens=1000, output_tokens=200, concurrency=32)
    one = estimate(llama, {"max_model_len": 8192}, hw, Load(input_tokens=1000, output_tokens=200, concurrency=16))
    two = estimate(llama, {"max_model_len": 8192, "data_parallel_size": 2}, hw, load)
    assert two.tpot_ms == one.tpot_ms and two.output_throughput == pytest.approx(2 * one.output_throughput)


def test_ep_over_dp_runs_as_the_gather_without_it_until_the_moe_turns_sequence_parallel():
    """TP 1 x DP 2: with EP or without, the default backend gathers over DP and a rank reads half the experts'
    bytes (whole experts or half widths), so the estimate is the same. TP 2 x DP 2 with EP runs sequence parallel:
    its exchange differs, so does the estimate."""
    hw, load = resolve_hardware(gpu=GPU), Load(input_tokens=1000, output_tokens=200, concurrency=32)
    ep = {"enable_expert_parallel": True}
    for tp in (1, 2):
        args = {"max_model_len": 8192, "data_parallel_size": 2, "tensor_parallel_size": tp}
        off, on = estimate(_arch(), args, hw, load), estimate(_arch(), {**args, **ep}, hw, load)
        if tp == 1:
            assert on.tpot_ms == pytest.approx(off.tpot_ms, rel=1e-12)
            assert on.ttft_ms == pytest.approx(off.ttft_ms, rel=1e-12)
        else:
            assert on.tpot_ms > off.tpot_ms and on.ttft_ms > off.ttft_ms


def test_a_larger_batch_moves_more_bytes():
    rep = _replica(data_parallel_size=2, enable_expert_parallel=True)
    assert rep.exchange is not None
    assert rep.exchange.layer_bytes(256) == pytest.approx(32 * rep.exchange.layer_bytes(8))
    small, large = (_added(rep, lambda r, n=n: decode_s(r, EFF, n, 2000)) for n in (8, 256))
    assert large > small


def test_all_to_all_backends_send_a_token_only_to_the_ranks_holding_its_experts():
    """DeepEP over DP 8: 16 experts a rank; top-8 of 128 reach 7 x (1 - C(112, 8) / C(128, 8)) other ranks,
    fewer than the all-gather's 7, and the token goes there and back."""
    arch = _arch()
    gather = ExpertExchange.of(arch, tp=1, dp=8, expert_parallel=True)
    deepep = ExpertExchange.of(arch, tp=1, dp=8, expert_parallel=True, backend="deepep_high_throughput")
    assert gather is not None and deepep is not None
    remote = 7 * (1 - math.comb(112, 8) / math.comb(128, 8))
    assert deepep.remote_ranks == pytest.approx(remote)
    assert deepep.layer_bytes(100) == pytest.approx(2 * 100 * remote * H * 2)
    assert deepep.layer_bytes(100) < gather.layer_bytes(100)
    naive = ExpertExchange.of(arch, tp=1, dp=8, expert_parallel=True, backend="naive")  # removed: falls back
    assert naive == gather


def test_the_backend_is_read_from_the_engine_arguments_and_a_bad_one_is_one_clear_error():
    rep = _replica(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="deepep_low_latency")
    assert rep.exchange is not None and rep.exchange.backend == "deepep_low_latency"
    with pytest.raises(UserError, match=r"all2all_backend='alltoall'.*allgather_reducescatter"):
        _replica(data_parallel_size=2, enable_expert_parallel=True, all2all_backend="alltoall")
