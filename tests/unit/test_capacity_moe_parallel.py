"""MoE weights over TP x DP, as vLLM 0.32's FusedMoE lays them (``FusedMoEParallelConfig.make``,
``determine_expert_map``): experts' widths split over TP x DP without expert parallelism, whole experts
``ceil(experts / (TP x DP))`` per rank with it; attention and dense layers split by TP only."""

from __future__ import annotations

import json

import pytest

import servetune.cli as cli
from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import (
    MoeShards,
    activation_bytes_per_token,
    layer_params,
    rank_params,
    weight_bytes_per_rank,
)
from servetune.config.space import SearchSpace
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import capacity_check

GIB = 1 << 30
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"


@pytest.fixture(scope="module")
def mixtral():
    return load_model_arch(MIXTRAL)


@pytest.fixture(scope="module")
def deepseek():
    return load_model_arch("deepseek-ai/DeepSeek-V3")


def _one_expert(arch) -> int:
    return 3 * arch.hidden_size * arch.moe_intermediate_size  # gate, up and down projections


def test_without_expert_parallelism_and_dp_1_each_expert_is_split_by_tp(mixtral) -> None:
    for tp in (1, 2, 4):
        experts = rank_params(mixtral, tp).experts
        assert experts == mixtral.num_moe_layers * mixtral.num_experts * _one_expert(mixtral) // tp
        assert rank_params(mixtral, tp, shards=MoeShards.of(mixtral, tp)).experts == experts


def test_expert_parallelism_with_dp_gives_each_rank_whole_experts_over_tp_x_dp(mixtral) -> None:
    shards = MoeShards.of(mixtral, tp=1, dp=2, expert_parallel=True)
    on_rank = rank_params(mixtral, 1, shards=shards)
    per_rank = -(-mixtral.num_experts // 2)
    assert on_rank.experts == mixtral.num_moe_layers * per_rank * _one_expert(mixtral)
    assert on_rank.experts == rank_params(mixtral, 2).experts  # as much expert weight as TP 2 holds
    # attention, embeddings and norms are split by TP alone: the TP-1 rank's, replicated over DP
    plain = rank_params(mixtral, 1)
    assert (on_rank.linear, on_rank.other) == (plain.linear, plain.other)


def test_uneven_experts_put_one_more_on_the_first_ranks(deepseek) -> None:
    group = 8 * 3  # TP 8 x DP 3: 256 experts over 24 ranks, 11 on the first 16, 10 on the rest
    shards = MoeShards.of(deepseek, tp=8, dp=3, expert_parallel=True)
    assert shards.experts_per_rank(deepseek.num_experts) == -(-deepseek.num_experts // group)
    per_layer = layer_params(deepseek, 8, moe=True, shards=shards).experts
    assert per_layer == shards.experts_per_rank(deepseek.num_experts) * _one_expert(deepseek)


def test_without_expert_parallelism_dp_still_splits_the_experts_widths(mixtral) -> None:
    """vLLM flattens TP across DP for MoE layers: TP 1 x DP 2 shards each expert over 2 ranks."""
    shards = MoeShards.of(mixtral, tp=1, dp=2)
    assert not shards.expert_parallel
    assert rank_params(mixtral, 1, shards=shards).experts == rank_params(mixtral, 2).experts


def test_shared_experts_are_replicated_only_when_the_moe_runs_sequence_parallel(deepseek) -> None:
    h, shared = deepseek.hidden_size, deepseek.shared_expert_intermediate_size
    split = layer_params(deepseek, 2, moe=True, shards=MoeShards.of(deepseek, 2, 2, expert_parallel=False))
    sequence_parallel = MoeShards.of(deepseek, 2, 2, expert_parallel=True)
    assert sequence_parallel.replicate_shared
    whole = layer_params(deepseek, 2, moe=True, shards=sequence_parallel)
    assert whole.linear - split.linear == 3 * h * shared - 3 * h * (shared // 2)
    assert whole.other == split.other  # the router gate is replicated either way
    assert not MoeShards.of(deepseek, 1, 2, expert_parallel=True).replicate_shared  # TP 1: nothing to split


def test_a_dense_model_is_the_same_whatever_dp_and_expert_parallelism() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(gpu="H100-SXM")
    base = plan_capacity(arch, {"max_model_len": 8192}, h100)
    other = plan_capacity(arch, {"max_model_len": 8192, "data_parallel_size": 4, "enable_expert_parallel": True}, h100)
    assert (other.weights_gib, other.kv_cache_tokens) == (base.weights_gib, base.kv_cache_tokens)
    assert other.settings.enable_expert_parallel is False  # no experts: vLLM has nothing to place


def test_the_ledger_plans_mixtral_dp_2_with_expert_parallelism_on_one_h100(mixtral) -> None:
    h100 = resolve_hardware(gpu="H100-SXM")
    alone = plan_capacity(mixtral, {"max_model_len": 8192}, h100)
    ep = plan_capacity(mixtral, {"max_model_len": 8192, "data_parallel_size": 2, "enable_expert_parallel": True}, h100)
    assert not alone.fits and "weights need" in alone.reason
    assert ep.fits, ep.reason
    shards = MoeShards.of(mixtral, 1, 2, expert_parallel=True)
    assert ep.weights_gib == round(weight_bytes_per_rank(mixtral, mixtral.quant, 2, 1, 1, shards) / GIB, 3)
    assert ep.weights_gib < alone.weights_gib
    assert (ep.settings.data_parallel_size, ep.settings.enable_expert_parallel) == (2, True)


def test_expert_parallel_ranks_hold_whole_expert_widths_in_the_fused_moe_caches(mixtral) -> None:
    split = activation_bytes_per_token(mixtral, 2, tp=2)
    whole = activation_bytes_per_token(mixtral, 2, tp=2, shards=MoeShards.of(mixtral, 2, expert_parallel=True))
    k, inter = mixtral.num_experts_per_tok, mixtral.moe_intermediate_size
    assert whole - split == 2 * k * 3 * (inter - inter // 2)


def test_mtp_draft_layers_shard_their_experts_as_the_target_does(deepseek) -> None:
    h200 = resolve_hardware(gpu="H200")
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    base = {"tensor_parallel_size": 8, "max_model_len": 8192, "speculative_config": spec}
    tp_only = plan_capacity(deepseek, base, h200)
    ep = plan_capacity(deepseek, {**base, "data_parallel_size": 2, "enable_expert_parallel": True}, h200)
    assert tp_only.draft is not None and ep.draft is not None
    assert ep.draft.weights_gib < tp_only.draft.weights_gib


# --- servetune plan ------------------------------------------------------------------------------------


def test_plan_cli_fits_mixtral_with_dp_2_and_expert_parallelism(capsys) -> None:
    argv = ["plan", "--model", MIXTRAL, "--gpu", "H100", "--max-model-len", "8192", "--json"]
    assert cli.main(argv) == 1
    refused = json.loads(capsys.readouterr().out)
    assert refused["fits"] is False
    assert cli.main([*argv, "--dp", "2", "--enable-expert-parallel"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["fits"] is True and planned["weights_gib"] < refused["weights_gib"]
    assert planned["settings"]["data_parallel_size"] == 2 and planned["settings"]["enable_expert_parallel"]


def test_plan_cli_table_names_the_layout(capsys) -> None:
    argv = ["plan", "--model", MIXTRAL, "--gpu", "H100", "--max-model-len", "8192", "--dp", "2"]
    assert cli.main([*argv, "--enable-expert-parallel"]) == 0
    assert "DP 2, expert parallel" in " ".join(capsys.readouterr().out.split())


def test_plan_cli_dp_below_one_is_one_line(capsys) -> None:
    assert cli.main(["plan", "--model", MIXTRAL, "--gpu", "H100", "--dp", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dp 0: must be >= 1" in err[0]


# --- the trial pre-flight ------------------------------------------------------------------------------


def _mixtral_spec(tmp_path, engine_args: dict):
    space = SearchSpace.model_validate({
        "name": "s", "model": MIXTRAL, "device": "gpu", "workload": "chat",
        "hardware": {"devices_per_node": 8, "gpu": "H100-SXM"}, "engine_args": {"max_model_len": 8192, **engine_args},
    })  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload)).spec_for({})


def test_the_trial_capacity_check_plans_dp_2_with_expert_parallelism(tmp_path) -> None:
    alone = capacity_check(_mixtral_spec(tmp_path, {}))
    assert alone is not None and not alone.fits and "weights need" in alone.reason
    ep = capacity_check(_mixtral_spec(tmp_path, {"data_parallel_size": 2, "enable_expert_parallel": True}))
    assert ep is not None and ep.fits and ep.planned, ep.reason


def test_only_the_families_vllm_replicates_shared_experts_for_replicate_them(deepseek) -> None:
    qwen3_moe = deepseek.model_copy(update={"architecture": "Qwen3MoeForCausalLM"})
    assert not MoeShards.of(qwen3_moe, 2, 2, expert_parallel=True).replicate_shared
    qwen3_next = load_model_arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert MoeShards.of(qwen3_next, 2, 2, expert_parallel=True).replicate_shared
