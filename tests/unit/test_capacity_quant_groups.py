"""AWQ/GPTQ layouts vLLM 0.32 refuses because a rank's share of a layer is not whole quantization groups, and
MoE layers over TP x DP x PCP (``FusedMoEParallelConfig.make``: ``flatten_tp_across_dp_and_pcp``).

Dense and shared-expert down projections split by TP (AutoAWQ's fallback linear method raises unless the
rank's input width is whole groups); routed experts split over TP x DP x PCP without expert parallelism, whole
with it; Marlin MoE takes whole groups, anything else falls back to MoE WNA16, which halves the group to 32.
"""

from __future__ import annotations

import json

import pytest

import servetune.cli as cli
from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.arch import WeightQuant
from servetune.capacity.params import MoeShards, rank_params
from servetune.capacity.settings import structural_problem

AWQ = WeightQuant(method="awq", bits=4, group_size=128)
GPTQ = WeightQuant(method="gptq", bits=4, group_size=128)
DEEPSEEK = "deepseek-ai/DeepSeek-V3"


@pytest.fixture(scope="module")
def deepseek():
    return load_model_arch(DEEPSEEK)


@pytest.fixture(scope="module")
def lite(deepseek):
    """DeepSeek-V2-Lite's expert widths on DeepSeek-V3's layout: experts 1408 wide (11 groups of 128), two shared
    experts (2816, 22 groups), dense layers of 11008 (86 groups)."""
    return deepseek.model_copy(
        update={
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 2816,
            "intermediate_size": 11008,
            "hidden_size": 2048,
            "num_attention_heads": 16,
        }
    )


def _expert_width_per_rank(arch, shards: MoeShards) -> int:
    return arch.moe_intermediate_size // shards.expert_split


def test_the_moe_group_is_tp_x_dp_x_pcp(deepseek) -> None:
    for tp, dp, pcp in ((8, 1, 2), (2, 2, 2), (4, 2, 1)):
        shards = MoeShards.of(deepseek, tp, dp, pcp=pcp)
        assert shards.group == tp * dp * pcp and shards.expert_split == tp * dp * pcp
        ep = MoeShards.of(deepseek, tp, dp, expert_parallel=True, pcp=pcp)
        assert ep.expert_split == 1
        assert ep.experts_per_rank(deepseek.num_experts) == -(-deepseek.num_experts // (tp * dp * pcp))
    # PCP alone with EP: vLLM 0.32 makes EP of a TP 1 x PCP 2 group (dp_size * pcp_size * tp_size > 1)
    assert MoeShards.of(deepseek, 1, 1, expert_parallel=True, pcp=2).expert_parallel
    # sequence-parallel MoE needs TP > 1 and DP > 1 (use_sequence_parallel_moe); PCP does not count
    assert not MoeShards.of(deepseek, 2, 1, expert_parallel=True, pcp=2).replicate_shared


def test_pcp_splits_the_experts_as_dp_does_and_leaves_the_rest(deepseek) -> None:
    by_pcp = rank_params(deepseek, 8, shards=MoeShards.of(deepseek, 8, 1, pcp=2))
    by_dp = rank_params(deepseek, 8, shards=MoeShards.of(deepseek, 8, 2))
    alone = rank_params(deepseek, 8)
    assert by_pcp == by_dp
    assert by_pcp.experts < alone.experts and (by_pcp.linear, by_pcp.other) == (alone.linear, alone.other)


def test_the_ledger_reads_prefill_context_parallel_size(deepseek) -> None:
    h200 = resolve_hardware(gpu="H200")
    base = {"tensor_parallel_size": 8, "max_model_len": 8192}
    tp_only = plan_capacity(deepseek, base, h200)
    pcp = plan_capacity(deepseek, {**base, "prefill_context_parallel_size": 2}, h200)
    dp = plan_capacity(deepseek, {**base, "data_parallel_size": 2}, h200)
    assert pcp.settings.prefill_context_parallel_size == 2
    assert pcp.weights_gib == dp.weights_gib < tp_only.weights_gib


def test_a_moe_width_the_group_does_not_divide_is_refused(deepseek) -> None:
    assert structural_problem(deepseek, 1, 1, deepseek.quant, MoeShards.of(deepseek, 1, 3)) is not None
    problem = structural_problem(deepseek, 2, 1, deepseek.quant, MoeShards.of(deepseek, 2, 1, pcp=3))
    assert problem is not None and problem.startswith(f"moe_intermediate_size {deepseek.moe_intermediate_size}")
    assert "TP 2 x PCP 3 (6 ranks)" in problem
    # whole experts under EP: nothing to divide
    assert structural_problem(deepseek, 1, 1, deepseek.quant, MoeShards.of(deepseek, 1, 3, True)) is None


@pytest.mark.parametrize("quant", [AWQ, GPTQ])
def test_expert_widths_marlin_or_the_wna16_fallback_take_are_not_refused(lite, quant) -> None:
    # 1408 / 2 = 704: not whole groups of 128 (Marlin), 11 of 64 (WNA16); / 4 = 352: 11 of 32
    for dp in (1, 2, 4):
        shards = MoeShards.of(lite, 1, dp)
        width = _expert_width_per_rank(lite, shards)
        assert width % 32 == 0
        assert structural_problem(lite, 1, 1, quant, shards) is None


@pytest.mark.parametrize("quant", [AWQ, GPTQ])
def test_expert_widths_below_whole_groups_of_32_are_refused(lite, quant) -> None:
    shards = MoeShards.of(lite, 1, 8)  # 1408 / 8 = 176: 5.5 groups of 32
    assert _expert_width_per_rank(lite, shards) % 32
    problem = structural_problem(lite, 1, 1, quant, shards)
    assert problem is not None and problem.startswith(
        "moe_intermediate_size 1408 split over TP 1 x DP 8 (8 ranks) is 176 a rank"
    )
    assert f"{quant.method.upper()} group size 128" in problem
    # the same ranks holding whole experts are fine
    assert structural_problem(lite, 1, 1, quant, MoeShards.of(lite, 1, 8, expert_parallel=True)) is None


def test_the_dense_layers_of_a_moe_model_split_by_tp_alone(lite) -> None:
    assert structural_problem(lite, 2, 1, AWQ, MoeShards.of(lite, 2, 1, expert_parallel=True)) is None
    # 11008 / 4 = 2752 = 21.5 x 128: the dense layers' down projection cannot be whole groups, whatever EP does
    problem = structural_problem(lite, 4, 1, AWQ, MoeShards.of(lite, 4, 1, expert_parallel=True))
    assert problem is not None and problem.startswith("intermediate_size 11008 / tensor_parallel_size 4 = 2752")
    assert structural_problem(lite, 4, 1, WeightQuant(), MoeShards.of(lite, 4)) is None  # unquantized
    # every layer MoE: no dense row to check (the shared experts' 2816 / 4 = 704 is, next)
    all_moe = lite.model_copy(update={"first_k_dense_layers": 0, "intermediate_size": 0})
    problem = structural_problem(all_moe, 4, 1, AWQ, MoeShards.of(all_moe, 4, 1, expert_parallel=True))
    assert problem is not None and problem.startswith("shared_expert_intermediate_size 2816")


def test_shared_experts_split_by_tp_unless_sequence_parallel_replicates_them(lite) -> None:
    shared = lite.model_copy(update={"first_k_dense_layers": 0, "intermediate_size": 0,
                                     "shared_expert_intermediate_size": 1408})  # fmt: skip
    # TP 4: 1408 / 4 = 352, not whole groups of 128; EP with DP 2 and TP 4 runs sequence parallel: whole 1408
    problem = structural_problem(shared, 4, 1, AWQ, MoeShards.of(shared, 4, 1, expert_parallel=True))
    assert problem is not None and problem.startswith("shared_expert_intermediate_size 1408 / tensor_parallel_size 4")
    replicated = MoeShards.of(shared, 4, 2, expert_parallel=True)
    assert replicated.replicate_shared and structural_problem(shared, 4, 1, AWQ, replicated) is None


def test_a_trial_with_such_a_layout_is_refused_before_vllm_starts(lite) -> None:
    quantized = lite.model_copy(update={"quant": AWQ})
    args = {"data_parallel_size": 8, "max_model_len": 4096, "quantization": "awq"}
    plan = plan_capacity(quantized, args, resolve_hardware(gpu="H200"))
    assert not plan.fits and "moe_intermediate_size 1408" in plan.reason
    assert plan.reason.startswith("vLLM refuses this configuration")
    ep = plan_capacity(quantized, {**args, "enable_expert_parallel": True}, resolve_hardware(gpu="H200"))
    assert "moe_intermediate_size" not in ep.reason


def test_plan_cli_refuses_in_one_line_naming_the_field(capsys) -> None:
    argv = ["plan", "--model", DEEPSEEK, "--gpu", "H200", "--tp", "8", "--quantization", "awq", "--json"]
    # 2048 / (8 x 8 x 2) = 16 a rank: not whole groups of 32
    assert cli.main([*argv, "--dp", "8", "--pcp", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].count("moe_intermediate_size 2048") == 1
    assert "--tp 8 --dp 8 --pcp 2" in err[0] and "TP 8 x DP 8 x PCP 2 (128 ranks) is 16 a rank" in err[0]
    # 2048 / (8 x 8) = 32 a rank: the WNA16 fallback's smallest group; planned
    cli.main([*argv, "--dp", "8"])
    planned = json.loads(capsys.readouterr().out)
    assert "moe_intermediate_size" not in planned["reason"]


def test_plan_cli_pcp_below_one_is_one_line(capsys) -> None:
    assert cli.main(["plan", "--model", DEEPSEEK, "--gpu", "H200", "--pcp", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pcp 0: must be >= 1" in err[0]


def test_a_channelwise_gptq_checkpoint_has_no_groups_to_split(tmp_path, lite) -> None:
    from servetune.models.tiny import TINY_CONFIG

    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    quant = load_model_arch(tmp_path).quant
    assert quant.method == "gptq" and quant.channelwise
    # the same layouts that split groups of 128 are taken: one scale per output channel
    assert structural_problem(lite, 4, 1, GPTQ, MoeShards.of(lite, 4)) is not None
    assert structural_problem(lite, 4, 1, quant, MoeShards.of(lite, 4)) is None
    assert structural_problem(lite, 1, 1, quant, MoeShards.of(lite, 1, 8)) is None
