"""An MoE layer under data parallelism works on every DP rank's batch (vLLM 0.32: the naive DP prepare/finalize
all-gathers the hidden states, unchunked, and reduce-scatters the output): the activation peak per GPU grows with
DP x max_num_batched_tokens. Earlier profiles chunked it (VLLM_MOE_DP_CHUNK_SIZE) and stay as they were."""

from __future__ import annotations

import dataclasses

import pytest

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import MoeShards, activation_bytes_per_token
from servetune.capacity.profile import PROFILES

GIB = 1 << 30
ARGS = {"max_model_len": 8192, "max_num_batched_tokens": 8192, "enable_expert_parallel": True}


@pytest.fixture(scope="module")
def mixtral():
    return load_model_arch("mistralai/Mixtral-8x7B-Instruct-v0.1")


def test_the_gathered_rows_grow_with_dp(mixtral) -> None:
    h, k, inter = mixtral.hidden_size, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size
    for dp in (2, 4):
        shards = MoeShards.of(mixtral, 1, dp, expert_parallel=True)
        assert shards.gathered == dp
        alone = activation_bytes_per_token(mixtral, 2, 1, shards=dataclasses.replace(shards, gathered=1))
        gathered = activation_bytes_per_token(mixtral, 2, 1, shards=shards)
        routed = k * (3 * inter + h)  # whole experts under EP: one expert's full width per top-k row
        assert gathered - alone == 2 * (dp * (routed + 2 * h) - routed)
    # DP 1: nothing gathered, the per-token bytes as before
    assert activation_bytes_per_token(mixtral, 2, 2) == activation_bytes_per_token(
        mixtral, 2, 2, shards=MoeShards.of(mixtral, 2)
    )


def test_the_ledger_charges_the_gather_on_0_32_only(mixtral) -> None:
    h100 = resolve_hardware(gpu="H100-SXM")
    per_token = {}
    for dp in (2, 4):
        shards = MoeShards.of(mixtral, 1, dp, expert_parallel=True)
        per_token[dp] = activation_bytes_per_token(mixtral, 2, 1, shards=shards)
    two = plan_capacity(mixtral, {**ARGS, "data_parallel_size": 2}, h100)
    four = plan_capacity(mixtral, {**ARGS, "data_parallel_size": 4}, h100)
    # the forward pass sets the peak here: the difference is the extra gathered rows over 8192 tokens
    expected = 8192 * (per_token[4] - per_token[2]) / GIB
    assert four.activation_gib - two.activation_gib == pytest.approx(expected, abs=0.002)
    older = PROFILES["vllm-0.25"]
    assert not older.moe_dp_gathers_batch
    old_two = plan_capacity(mixtral, {**ARGS, "data_parallel_size": 2}, h100, profile=older)
    old_four = plan_capacity(mixtral, {**ARGS, "data_parallel_size": 4}, h100, profile=older)
    assert old_four.activation_gib == pytest.approx(old_two.activation_gib, abs=0.002)


def test_a_dense_model_gathers_nothing() -> None:
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(gpu="H100-SXM")
    one = plan_capacity(llama, {"max_model_len": 8192}, h100)
    four = plan_capacity(llama, {"max_model_len": 8192, "data_parallel_size": 4}, h100)
    assert four.activation_gib == one.activation_gib
