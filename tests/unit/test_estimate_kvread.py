"""A decode step reads each layer kind's KV as that kind attends (servetune.estimate.kvread): full attention the
whole context, a sliding window at most its window, a Mamba / linear-attention layer its state once."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from servetune.capacity import ModelArch, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import kv_bytes_per_layer_token
from servetune.estimate import decode_s, load_factors, prefill_s, replica_from_plan
from servetune.estimate.kvread import KVRead
from servetune.estimate.roofline import Replica

H100 = resolve_hardware("gpu", "H100")
EFF = load_factors().for_class("H100")


def _replica(arch: ModelArch, **args: Any) -> tuple[Replica, Any]:
    plan = plan_capacity(arch, {"max_model_len": 32768, **args}, H100)
    assert plan.fits, plan.reason
    return replica_from_plan(arch, plan, args), plan


def _all_full(arch: ModelArch) -> ModelArch:
    """The same model with every attention layer reading the whole context (how the estimate read it before)."""
    return arch.model_copy(update={"layer_types": (), "sliding_window": None})


@pytest.mark.parametrize(
    ("hub_id", "window", "sliding", "full"),
    [("openai/gpt-oss-20b", 128, 12, 12), ("google/gemma-3-27b-it", 1024, 52, 10)],
)
def test_sliding_window_layers_read_the_whole_context_inside_the_window_and_only_the_window_past_it(
    hub_id: str, window: int, sliding: int, full: int
) -> None:
    """gpt-oss alternates 128-token windows with global layers; gemma-3 has five 1024-token windows to one global
    layer. Within the window every layer reads the context; past it, the sliding layers read their window."""
    arch = load_model_arch(hub_id)
    assert arch.layer_kinds.count("sliding_attention") == sliding and arch.layer_kinds.count("full_attention") == full
    rep, plan = _replica(arch)
    per_layer = kv_bytes_per_layer_token(arch, 2)  # bf16 KV cache, TP 1
    assert rep.kv.layer_bytes == pytest.approx(per_layer)
    for context in (1, window // 2, window):
        assert rep.kv.per_sequence(context) == pytest.approx(context * plan.kv_bytes_per_token)
    long = 16 * window
    expected = (full * long + sliding * window) / ((full + sliding) * long)  # the share of the full read left
    assert rep.kv.per_sequence(long) == pytest.approx(expected * long * plan.kv_bytes_per_token)
    assert expected < 0.6

    before, _ = _replica(_all_full(arch))  # the full read, all else equal
    assert decode_s(rep, EFF, 64, window) == pytest.approx(decode_s(before, EFF, 64, window))
    assert decode_s(rep, EFF, 64, long) < decode_s(before, EFF, 64, long)
    kv_saved = 64 * (1 - expected) * long * plan.kv_bytes_per_token  # the memory-bound step's bytes not read
    saved = decode_s(before, EFF, 64, long) - decode_s(rep, EFF, 64, long)
    assert saved == pytest.approx(kv_saved / (rep.rates.hbm_bytes_s * EFF.decode_bandwidth), rel=1e-6)


def test_a_long_prompt_attends_to_the_window_in_sliding_layers_so_its_prefill_costs_less() -> None:
    arch = load_model_arch("openai/gpt-oss-20b")
    rep, _ = _replica(arch)
    before, _ = _replica(_all_full(arch))
    assert prefill_s(rep, EFF, 100, 100) == pytest.approx(prefill_s(before, EFF, 100, 100))  # inside the window
    assert rep.kv.attended_in_prompt(100) == 24 * 50  # every layer, half the prompt on average
    assert rep.kv.attended_in_prompt(20_000) == pytest.approx(12 * 10_000 + 12 * (128 - 128 * 128 / 40_000))
    share = rep.kv.attended_in_prompt(20_000) / before.kv.attended_in_prompt(20_000)
    assert share == pytest.approx(0.5 + 0.5 * (128 - 128 * 128 / 40_000) / 10_000)
    assert rep.attention_flops(20_000, prompt=True) == pytest.approx(
        share * before.attention_flops(20_000, prompt=True)
    )
    assert prefill_s(rep, EFF, 8192, 20_000) < prefill_s(before, EFF, 8192, 20_000)


def test_a_hybrids_mamba_layers_read_and_write_their_state_once_a_step_whatever_the_context() -> None:
    """Qwen3-Next: 36 gated-DeltaNet layers keep a state per sequence, 12 gated-attention layers a KV per token."""
    arch = load_model_arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    rep, plan = _replica(arch, tensor_parallel_size=4)
    assert plan.mamba_layers == 36 and plan.mamba_state_bytes_per_sequence > 0
    assert rep.kv.state_bytes == plan.mamba_state_bytes_per_sequence  # the ledger's sizing, not a copy of it
    for context in (1, 1000, 30_000):
        kv = context * plan.kv_bytes_per_token  # the 12 attention layers
        assert rep.kv.per_sequence(context) == pytest.approx(kv + 2 * plan.mamba_state_bytes_per_sequence)
    assert rep.kv.attended(1000) == 12 * 1000  # the attention FLOPs: only the attention layers attend
    # the state is worth thousands of tokens of KV: at short context it dominates the KV read
    assert 2 * plan.mamba_state_bytes_per_sequence > 1000 * plan.kv_bytes_per_token
    stateless = replace(rep, kv=KVRead(rep.kv.layer_bytes, rep.kv.layers))
    added = decode_s(rep, EFF, 64, 1000) - decode_s(stateless, EFF, 64, 1000)
    expected = 64 * 2 * plan.mamba_state_bytes_per_sequence / (rep.rates.hbm_bytes_s * EFF.decode_bandwidth)
    assert added == pytest.approx(expected, rel=1e-6)


def test_a_granite_4_h_state_is_its_mamba2_layers_state() -> None:
    """granite-4.0-h (servetune's tiny checkpoint's config): Mamba-2 layers among full-attention ones."""
    pytest.importorskip("transformers")
    from servetune.capacity import arch_from_hf_config
    from servetune.models.tinyarch import TINY_ARCHS

    arch = arch_from_hf_config(TINY_ARCHS["granite-4.0-h"], "tiny-granite")
    rep, plan = _replica(arch, max_model_len=4096)
    assert plan.mamba_layers == arch.num_mamba_layers > 0
    attention = sum(kind == "full_attention" for kind in arch.layer_kinds)
    assert rep.kv.layers == ((None, attention),)
    assert rep.kv.per_sequence(100) == pytest.approx(100 * plan.kv_bytes_per_token + 2 * rep.kv.state_bytes)
    assert rep.kv.state_bytes == plan.mamba_state_bytes_per_sequence


def test_a_model_of_full_attention_layers_reads_as_it_did() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    rep, plan = _replica(arch)
    assert rep.kv.layers == ((None, 32),) and rep.kv.state_bytes == 0
    assert rep.kv.per_sequence(5000) == pytest.approx(5000 * plan.kv_bytes_per_token)
    assert rep.attention_flops(5000) == 2.0 * 32 * (128 + 128) * 5000 * 32
