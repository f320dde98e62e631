"""Expert-parallel load balancing as vLLM 0.32 lays it out (``--enable-eplb``, ``--eplb-config
'{"num_redundant_experts": R}'``): the ranks place E + R physical experts, ``ceil((E + R) / EP)`` on the heaviest
(``determine_expert_counts``, ``determine_expert_map``), and ``EplbState.add_model`` allocates, inside the model
load, a transfer buffer of the first MoE layer's expert weights (``torch.empty_like``). vLLM refuses redundant
experts without EPLB, and EPLB without expert parallelism (``ParallelConfig``)."""

from __future__ import annotations

import json

import pytest

import servetune.cli as cli
from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import MoeShards, ParamSplit, formula_bytes, rank_params, weight_bytes_per_rank
from servetune.errors import UserError

DEEPSEEK = "deepseek-ai/DeepSeek-V3"
EP8 = {"data_parallel_size": 8, "enable_expert_parallel": True, "max_model_len": 8192}


@pytest.fixture(scope="module")
def deepseek():
    return load_model_arch(DEEPSEEK)


def _one_expert(arch) -> int:
    return 3 * arch.hidden_size * arch.moe_intermediate_size


def test_redundant_experts_are_placed_over_the_ep_ranks(deepseek) -> None:
    plain = MoeShards.of(deepseek, tp=1, dp=8, expert_parallel=True)
    eplb = MoeShards.of(deepseek, tp=1, dp=8, expert_parallel=True, eplb=True, redundant=32)
    assert deepseek.num_experts == 256
    assert rank_params(deepseek, 1, shards=plain).experts == deepseek.num_moe_layers * 32 * _one_expert(deepseek)
    assert rank_params(deepseek, 1, shards=eplb).experts == deepseek.num_moe_layers * 36 * _one_expert(deepseek)
    uneven = MoeShards.of(deepseek, tp=1, dp=8, expert_parallel=True, eplb=True, redundant=9)
    assert uneven.experts_per_rank(deepseek.num_experts) == 34  # 265 over 8: the first rank takes one more


def test_eplb_adds_one_moe_layers_experts_as_its_transfer_buffer(deepseek) -> None:
    plain = MoeShards.of(deepseek, tp=1, dp=8, expert_parallel=True)
    eplb = MoeShards.of(deepseek, tp=1, dp=8, expert_parallel=True, eplb=True)  # no redundant experts: the buffer only
    added = weight_bytes_per_rank(deepseek, deepseek.quant, 2, shards=eplb) - weight_bytes_per_rank(
        deepseek, deepseek.quant, 2, shards=plain
    )
    one_layer = formula_bytes(deepseek, ParamSplit(0, 0, experts=32 * _one_expert(deepseek)), deepseek.quant, 2)
    assert added == pytest.approx(one_layer, abs=2)


def test_the_ledger_reads_enable_eplb_and_eplb_config(deepseek) -> None:
    h200 = resolve_hardware(gpu="H200")
    plain = plan_capacity(deepseek, EP8, h200)
    args = {**EP8, "enable_eplb": True, "eplb_config": json.dumps({"num_redundant_experts": 32})}
    eplb = plan_capacity(deepseek, args, h200)
    expected = formula_bytes(
        deepseek, ParamSplit(0, 0, experts=deepseek.num_moe_layers * 4 * _one_expert(deepseek)), deepseek.quant, 2
    )
    expected += formula_bytes(deepseek, ParamSplit(0, 0, experts=36 * _one_expert(deepseek)), deepseek.quant, 2)
    assert (eplb.weights_gib - plain.weights_gib) * 2**30 == pytest.approx(expected, rel=0.01)
    assert eplb.kv_cache_tokens < plain.kv_cache_tokens
    assert eplb.settings.enable_eplb and eplb.settings.num_redundant_experts == 32


def test_what_vllm_refuses_of_eplb_is_one_line(deepseek) -> None:
    h200 = resolve_hardware(gpu="H200")
    with pytest.raises(UserError, match="num_redundant_experts 32 needs enable_eplb"):
        plan_capacity(deepseek, {**EP8, "eplb_config": {"num_redundant_experts": 32}}, h200)
    with pytest.raises(UserError, match="enable_eplb needs enable_expert_parallel"):
        plan_capacity(deepseek, {**EP8, "enable_expert_parallel": False, "enable_eplb": True}, h200)


def test_plan_cli_takes_enable_eplb_and_eplb_config(capsys) -> None:
    argv = ["plan", "--model", DEEPSEEK, "--gpu", "H200", "--dp", "8", "--enable-expert-parallel", "--json"]
    cli.main(argv)
    plain = json.loads(capsys.readouterr().out)
    cli.main([*argv, "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 32}'])
    eplb = json.loads(capsys.readouterr().out)
    assert eplb["settings"]["num_redundant_experts"] == 32 and eplb["weights_gib"] > plain["weights_gib"] + 1
