"""The routed experts a rank holds and reads in a step, as vLLM 0.32 lays them over TP x DP
(servetune.estimate.expert_parallel read_layout; Replica.expert_bytes, .weights_read)."""

from __future__ import annotations

import dataclasses

import pytest

from servetune.capacity import arch_from_hf_config, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import rank_params, weight_bytes_per_rank
from servetune.capacity.settings import moe_shards
from servetune.estimate import decode_s, load_factors, prefill_s, replica_from_plan
from tests.unit.test_estimate_expert_parallel import QWEN3_30B_A3B

H, WIDTH, E, K, LAYERS = 2048, 768, 128, 8, 48  # Qwen3-30B-A3B: hidden, an expert's width, experts, top-k, MoE layers
GPU = "H100-SXM"
EFF = load_factors().for_class("H100")


def _arch():
    return arch_from_hf_config(QWEN3_30B_A3B, "Qwen/Qwen3-30B-A3B")


def _replica(arch=None, **args):
    arch = arch or _arch()
    args = {"max_model_len": 8192, **args}
    return replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware(gpu=GPU)), args)


def _touched(tokens: float) -> float:
    return 1 - (1 - K / E) ** tokens


def _expert_read(rep, tokens: float) -> float:
    """Expert bytes a step over ``tokens`` tokens a DP engine reads on one rank (all weights read less the rest)."""
    return rep.weights_read(tokens) - (rep.weight_bytes - rep.expert_bytes)


@pytest.mark.parametrize(
    ("tp", "dp", "ep", "experts", "width"),
    [
        (1, 2, True, E // 2, WIDTH),  # whole experts, E / (TP x DP) of them (determine_expert_map)
        (2, 2, True, E // 4, WIDTH),
        (1, 2, False, E, WIDTH // 2),  # every expert, its width split over TP x DP (flatten_tp_across_dp_and_pcp)
        (2, 2, False, E, WIDTH // 4),
    ],
)
def test_a_rank_reads_its_share_over_tp_x_dp_of_the_experts_for_every_dp_engines_tokens(tp, dp, ep, experts, width):
    """Qwen3-30B-A3B (bf16): a rank holds ``experts`` x 3 x H x ``width`` weights a layer, and a step of ``n`` tokens
    on each DP engine picks each of them with probability 1 - (1 - k / E) ^ (DP x n)."""
    rep = _replica(tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep)
    held = experts * 3 * H * width * LAYERS * 2
    assert rep.expert_bytes == held
    for n in (1, 16, 256):
        assert _expert_read(rep, n) == pytest.approx(held * _touched(dp * n), rel=1e-9)
    assert _expert_read(rep, 8192) == pytest.approx(held, rel=1e-9)  # a prefill step reads them all


def test_a_dp_rank_reads_less_of_the_expert_bytes_than_one_engine():
    """The overstatement this fixes: at 16 tokens an engine, a DP 2 rank reads p(32) / (2 p(16)) = 0.68 of the
    expert bytes one TP 1 engine reads, and its decode step is faster (EP on or off alone, the exchange apart)."""
    one = _replica()
    for ep in (True, False):
        two = _replica(data_parallel_size=2, enable_expert_parallel=ep)
        ratio = _expert_read(two, 16) / _expert_read(one, 16)
        assert ratio == pytest.approx(_touched(32) / (2 * _touched(16)), rel=1e-9)
        assert ratio < 0.7
        assert two.weight_bytes == pytest.approx(one.weight_bytes - one.expert_bytes / 2, rel=1e-9)
        no_exchange = dataclasses.replace(two, exchange=None)
        assert decode_s(no_exchange, EFF, 16, 2000) < decode_s(one, EFF, 16, 2000)


@pytest.mark.parametrize(
    "args", [{}, {"tensor_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True}]
)
def test_one_engine_reads_what_it_read_before(args):
    """DP 1 (EP off, or EP over TP alone: E / TP whole experts are as many bytes as E experts at 1 / TP width):
    the experts split over TP alone, read for the engine's own tokens, as before the layout was read."""
    rep = _replica(**args)
    tp = args.get("tensor_parallel_size", 1)
    assert rep.expert_bytes == rank_params(_arch(), tp).experts * 2
    assert rep.weight_bytes == weight_bytes_per_rank(_arch(), rep.quant, 2, tp)
    before = dataclasses.replace(rep, experts=None)
    for n in (1, 64):
        assert decode_s(rep, EFF, n, 2000) == decode_s(before, EFF, n, 2000)
    assert prefill_s(rep, EFF, 2048, 2048) == prefill_s(before, EFF, 2048, 2048)


def test_a_dense_model_over_dp_is_unchanged():
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    rep = _replica(llama, data_parallel_size=2, tensor_parallel_size=2)
    assert rep.experts is None and rep.expert_bytes == 0
    assert rep.weight_bytes == weight_bytes_per_rank(llama, rep.quant, 2, 2)


def test_eplb_places_its_redundant_experts_and_its_transfer_buffer_is_not_read():
    """EPLB with 2 redundant experts over TP 1 x DP 2: 65 physical experts on the heavier rank, read as the others;
    the ledger's transfer buffer (one MoE layer's experts, EplbState.add_model) is memory a step does not read."""
    args = {"data_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True}
    rep = _replica(**args, eplb_config={"num_redundant_experts": 2})
    one_expert_layer = 3 * H * WIDTH * 2
    assert rep.expert_bytes == 65 * one_expert_layer * LAYERS
    arch = _arch()
    plan = plan_capacity(arch, {"max_model_len": 8192, **args, "eplb_config": {"num_redundant_experts": 2}},
                         resolve_hardware(gpu=GPU))  # fmt: skip
    ledger = weight_bytes_per_rank(arch, rep.quant, 2, 1, shards=moe_shards(arch, plan.settings))
    assert ledger - rep.weight_bytes == 65 * one_expert_layer
