"""Models with Mamba / linear-attention layers: classification from config.json, the per-sequence state
against a hand calculation and vLLM 0.32's own shape code, the shared block pool against vLLM's own
grouping and capacity functions, what vLLM refuses, and ``servetune plan``'s output.

vLLM is imported (its pure sizing functions), never started.
"""

from __future__ import annotations

import json
import types
from typing import Any

import pytest

import servetune.cli as cli
from servetune.capacity import (
    arch_from_hf_config,
    count_parameters,
    load_model_arch,
    plan_capacity,
    resolve_hardware,
)
from servetune.capacity.arch import ModelArch
from servetune.capacity.kvgroups import kv_layout
from servetune.capacity.mamba import aligned_block_size, state_bytes, state_shapes
from servetune.capacity.params import kv_bytes_per_layer_token
from servetune.capacity.profile import PROFILES
from servetune.capacity.schema import NotPlanned

GIB = 1 << 30
H100 = resolve_hardware(gpu="H100-SXM")

# Small config.json files of each family, in the field names their published configs use.
QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "intermediate_size": 1024,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 1024,
    "hybrid_override_pattern": "M-M*-M-M*-",
    "num_hidden_layers": 10,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 4096,
    "mamba_num_heads": 32,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}
GRANITE_4_H = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 768,
    "num_hidden_layers": 6,
    "layer_types": ["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "intermediate_size": 2048,
    "shared_intermediate_size": 2048,
    "num_local_experts": 0,
    "mamba_n_heads": 24,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "vocab_size": 49160,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "hidden_size": 1024,
    "num_hidden_layers": 8,
    "attn_layer_period": 4,
    "attn_layer_offset": 2,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "intermediate_size": 2816,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 64,
    "vocab_size": 65536,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}


def _arch(config: dict[str, Any]) -> ModelArch:
    return arch_from_hf_config(config, name=config["model_type"])


# --- layer classification ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, kinds",
    [
        (QWEN3_NEXT, ["mamba", "mamba", "mamba", "full_attention"] * 2),
        (NEMOTRON_H, ["mamba", "mlp", "mamba", "full_attention", "mlp"] * 2),
        (GRANITE_4_H, ["mamba", "mamba", "full_attention"] * 2),
        (JAMBA, ["mamba", "mamba", "full_attention", "mamba"] * 2),
    ],
    ids=["qwen3_next", "nemotron_h", "granite_4_h", "jamba"],
)
def test_layers_are_classified_as_the_config_states(config: dict[str, Any], kinds: list[str]) -> None:
    arch = _arch(config)
    assert list(arch.layer_kinds) == kinds
    assert arch.mamba is not None and arch.not_planned is None
    assert arch.num_mamba_layers == kinds.count("mamba")


def test_each_family_reads_its_own_mixer_numbers() -> None:
    qwen, nemotron, granite, jamba = (_arch(c).mamba for c in (QWEN3_NEXT, NEMOTRON_H, GRANITE_4_H, JAMBA))
    assert qwen is not None and (qwen.kind, qwen.num_v_heads, qwen.head_k_dim) == ("gated_delta_net", 8, 64)
    # Nemotron-H: intermediate = mamba_num_heads x mamba_head_dim; SSM state float32 by vLLM's default.
    assert nemotron is not None and (nemotron.intermediate_size, nemotron.ssm_state_dtype) == (32 * 64, "float32")
    assert granite is not None and (granite.kind, granite.intermediate_size) == ("mamba2", 2 * 768)
    assert jamba is not None and (jamba.kind, jamba.intermediate_size, jamba.dt_rank) == ("mamba1", 2048, 64)
    assert _arch({**NEMOTRON_H, "mamba_ssm_cache_dtype": "bfloat16"}).mamba.ssm_state_dtype == "bfloat16"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "config, why",
    [
        (
            {**GRANITE_4_H, "model_type": "llama", "layer_types": ["linear_attention", "full_attention"] * 3},
            "not modelled",
        ),
        ({**GRANITE_4_H, "model_type": "my_hybrid", "layer_types": ["mamba", "retention"] * 3}, "retention"),
        ({**GRANITE_4_H, "model_type": "my_conv", "layer_types": ["conv", "full_attention"] * 3}, "conv"),
    ],
    ids=["unknown_mixer", "unknown_kind", "short_conv"],
)
def test_an_unknown_shape_is_not_planned_with_its_reason(config: dict[str, Any], why: str) -> None:
    arch = _arch(config)
    assert arch.not_planned is not None and why in arch.not_planned
    with pytest.raises(NotPlanned, match=why):
        plan_capacity(arch, {"max_model_len": 4096}, H100)


def test_softmax_only_attn_type_list_is_planned() -> None:
    """MiniMax marks softmax layers 1 and lightning layers 0: all 1s is plain attention."""
    config = {**QWEN3_NEXT, "model_type": "my_minimax", "attn_type_list": [1] * 8}
    del config["full_attention_interval"]
    assert _arch(config).not_planned is None


# --- the state of one sequence ---------------------------------------------------------------------------


def test_state_bytes_match_a_hand_calculation_from_vllms_formulas() -> None:
    qwen, nemotron, granite, jamba = (_arch(c).mamba for c in (QWEN3_NEXT, NEMOTRON_H, GRANITE_4_H, JAMBA))
    assert qwen and nemotron and granite and jamba
    # gated DeltaNet, TP 2: conv (3, (2*4*64 + 8*64)/2) bf16 + SSM (8/2, 64, 64) bf16
    assert state_bytes(qwen, "bfloat16", tp=2) == 3 * (2 * 4 * 64 + 8 * 64) // 2 * 2 + 4 * 64 * 64 * 2
    # mamba2 (Nemotron-H), TP 1: conv (3, 2048 + 2*8*128) bf16 + SSM (32, 64, 128) float32
    assert state_bytes(nemotron, "bfloat16") == 3 * 4096 * 2 + 32 * 64 * 128 * 4
    # mamba2 with 1 group at TP 2: the group is replicated (extra_groups_for_head_shards): 2 groups
    assert state_bytes(granite, "bfloat16", tp=2) == 3 * (1536 + 2 * 2 * 128) // 2 * 2 + 12 * 64 * 128 * 2
    # mamba1 (Jamba), float32 model: conv (3, 2048) + SSM (2048, 16), both float32
    assert state_bytes(jamba, "float32") == (3 * 2048 + 2048 * 16) * 4
    assert state_bytes(jamba, "bfloat16", mamba_ssm_cache_dtype="float32") == 3 * 2048 * 2 + 2048 * 16 * 4


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_shapes_equal_vllms_state_shape_calculator(tp: int) -> None:
    mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    calc = mamba_utils.MambaStateShapeCalculator
    qwen, nemotron, granite, jamba = (_arch(c).mamba for c in (QWEN3_NEXT, NEMOTRON_H, GRANITE_4_H, JAMBA))
    assert qwen and nemotron and granite and jamba
    assert state_shapes(qwen, tp) == calc.gated_delta_net_state_shape(tp, 4, 8, 64, 64, 4)
    for m in (nemotron, granite):
        expected = calc.mamba2_state_shape(
            tp, m.intermediate_size, m.n_groups, m.num_heads, m.head_dim, m.state_size, m.conv_kernel
        )
        assert state_shapes(m, tp) == expected
    assert state_shapes(jamba, tp) == calc.mamba1_state_shape(tp, 2048, 16, 4)


def test_the_attention_block_grows_until_its_page_holds_one_state() -> None:
    """Qwen3-Next-80B at TP 4: 274,432 B of state a layer, 1 KiB of KV a token a layer: 272-token blocks."""
    arch = load_model_arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert arch.mamba is not None
    page = state_bytes(arch.mamba, "bfloat16", tp=4)
    assert page == 3 * (2 * 16 * 128 + 32 * 128) // 4 * 2 + 8 * 128 * 128 * 2
    per_token = kv_bytes_per_layer_token(arch, 2, tp=4)
    assert per_token == 2 * 1 * 256 * 2
    assert aligned_block_size(16, 16, per_token, page) == 272  # 16 x ceil(274432 / (16 x 1024))
    assert aligned_block_size(512, 16, per_token, page) == 512  # a larger configured block is kept
    plan = plan_capacity(arch, {"tensor_parallel_size": 4, "max_model_len": 32768}, H100)
    assert plan.settings.block_size == 272
    assert plan.mamba_state_bytes_per_sequence == 36 * page


# --- the shared pool, against vLLM's own grouping and capacity code ---------------------------------------


def _vllm_capacity(arch: ModelArch, plan_block: int, pool: int, max_model_len: int, tp: int, align: bool):
    torch = pytest.importorskip("torch")
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    vllm_cache = pytest.importorskip("vllm.config.cache")
    calc = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils").MambaStateShapeCalculator
    m = arch.mamba
    assert m is not None
    dtypes = (torch.bfloat16, torch.float32 if m.ssm_state_dtype == "float32" else torch.bfloat16)
    if m.kind == "linear_attention":
        shapes, dtypes = calc.linear_attention_state_shape(m.num_heads, tp, m.head_dim), (torch.bfloat16,)
    elif m.kind == "gated_delta_net":
        shapes = calc.gated_delta_net_state_shape(
            tp, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, m.conv_kernel
        )
    else:
        shapes = calc.mamba2_state_shape(
            tp, m.intermediate_size, m.n_groups, m.num_heads, m.head_dim, m.state_size, m.conv_kernel
        )
    attention = {
        "block_size": plan_block,
        "num_kv_heads": max(1, arch.num_kv_heads // tp),
        "head_size": arch.head_dim,
        "dtype": torch.bfloat16,
    }
    attn_page = kv_interface.FullAttentionSpec(**attention).page_size_bytes
    mode = "align" if align else "none"
    specs: dict[str, object] = {}
    for i, kind in enumerate(arch.stage_kinds()):  # Falcon-H1: layers.i attention, layers.(L + i) its Mamba
        if kind == "mamba":
            specs[f"layers.{i}"] = kv_interface.MambaSpec(
                block_size=plan_block if align else max_model_len,
                shapes=shapes,
                dtypes=dtypes,
                page_size_padded=attn_page,
                mamba_cache_mode=mode,
                num_prefill_checkpoint_blocks=int(m.kind == "mamba2"),  # MambaMixer2.get_kv_cache_spec
            )
        elif kind == "full_attention":
            specs[f"layers.{i}"] = kv_interface.FullAttentionSpec(**attention)
    cache = types.SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: vllm_cache._layout_from_name("NHD"),
        prefix_cache_retention_interval=None,
        mamba_cache_mode=mode,
        num_gpu_blocks_override=None,
    )
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=types.SimpleNamespace(hisparse_config=None),
        cache_config=cache,
        model_config=types.SimpleNamespace(max_model_len=max_model_len),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1, pipeline_parallel_size=1),
        speculative_config=None,
        max_in_flight_tokens=4096,
        num_speculative_tokens=0,
    )
    groups = kv_cache_utils.get_kv_cache_groups(config, specs)
    kv_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, pool)
    tokens, _ = kv_cache_utils.get_kv_cache_capacity(config, kv_config)
    return kv_config.num_blocks, tokens, len(groups)


@pytest.mark.parametrize(
    "model, tp, max_model_len, prefix_caching",
    [
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", 4, 32768, True),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", 2, 262144, False),
        ("nvidia/Nemotron-H-8B-Base-8K", 1, 8192, True),
        ("nvidia/Nemotron-H-8B-Base-8K", 2, 8192, False),
        ("tiiuae/Falcon-H1-7B-Instruct", 1, 32768, True),
        ("tiiuae/Falcon-H1-7B-Instruct", 2, 262144, False),
        ("MiniMaxAI/MiniMax-Text-01", 8, 32768, True),
        ("MiniMaxAI/MiniMax-Text-01", 4, 131072, False),
    ],
)
def test_blocks_and_tokens_equal_vllms_own_computation(
    model: str, tp: int, max_model_len: int, prefix_caching: bool
) -> None:
    arch = load_model_arch(model)
    pool = 23 * GIB + 4321
    args = {
        "tensor_parallel_size": tp,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": pool,
        "enable_prefix_caching": prefix_caching,
    }
    plan = plan_capacity(arch, args, H100)
    blocks, tokens, groups = _vllm_capacity(arch, plan.settings.block_size, pool, max_model_len, tp, prefix_caching)
    assert (plan.kv_cache_blocks, plan.kv_cache_tokens) == (blocks, tokens)
    assert len(kv_layout(arch).groups) == groups


# --- per-sequence bounds, refusals, versions --------------------------------------------------------------


def test_state_is_per_sequence_so_the_pool_bounds_sequences_however_short() -> None:
    arch = load_model_arch("nvidia/Nemotron-H-8B-Base-8K")
    args = {"max_model_len": 8192, "max_num_seqs": 1024}
    cached = plan_capacity(arch, {**args, "enable_prefix_caching": True}, H100, request_tokens=16)
    uncached = plan_capacity(arch, {**args, "enable_prefix_caching": False}, H100, request_tokens=16)
    for plan, state_blocks in ((cached, 3), (uncached, 1)):  # align mode: 2 + Mamba-2's prefill checkpoint
        groups = sum(g.kind == "mamba" for g in kv_layout(arch).groups)
        assert plan.mamba_state_blocks_per_sequence == groups * state_blocks
        # a 16-token sequence holds one KV block and its state blocks: the pool's blocks over that
        assert plan.max_sequences == plan.kv_cache_blocks // (1 + groups * state_blocks)
        assert plan.max_sequences < 1024 and not plan.max_num_seqs_reachable
        assert any("fewer than max_num_seqs 1,024" in note for note in plan.notes)
    assert uncached.max_sequences is not None and cached.max_sequences is not None
    assert uncached.max_sequences > 2 * cached.max_sequences


def test_a_model_without_mamba_layers_reports_none() -> None:
    plan = plan_capacity(load_model_arch("meta-llama/Llama-3.1-8B-Instruct"), {"max_model_len": 8192}, H100)
    assert (plan.mamba_layers, plan.mamba_state_bytes_per_sequence, plan.max_sequences) == (0, 0, None)


def test_what_vllm_refuses_is_refused() -> None:
    arch = load_model_arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    base = {"tensor_parallel_size": 4, "max_model_len": 32768}
    # 0.32: prefix caching is on by default for hybrid models, and its align mode asserts chunked prefill.
    plan = plan_capacity(arch, {**base, "enable_chunked_prefill": False}, H100)
    assert not plan.fits and "requires chunked prefill" in plan.reason
    assert plan_capacity(arch, {**base, "enable_chunked_prefill": False, "enable_prefix_caching": False}, H100).fits
    # before 0.11.1 vLLM raised NotImplementedError for prefix caching on Mamba layers; off by default there.
    old = PROFILES["vllm-0.8"]
    assert not plan_capacity(arch, {**base, "enable_prefix_caching": True}, H100, profile=old).fits
    default_old = plan_capacity(arch, base, H100, profile=old)
    assert default_old.fits and default_old.mamba_state_blocks_per_sequence == 3
    # vLLM's divide() asserts when TP does not split the Mamba heads (the attention heads split fine here)
    granite = _arch({**GRANITE_4_H, "mamba_n_heads": 6, "mamba_d_head": 256})
    refused = plan_capacity(granite, {"tensor_parallel_size": 4, "max_model_len": 4096}, H100)
    assert not refused.fits and "mamba heads 6 is not divisible by tensor_parallel_size 4" in refused.reason
    assert plan_capacity(granite, {"tensor_parallel_size": 2, "max_model_len": 4096}, H100).fits
    with pytest.raises(NotPlanned, match="V0"):
        plan_capacity(arch, base, H100, profile=PROFILES["vllm-0.6"])


# --- servetune plan -----------------------------------------------------------------------------------------


def test_plan_json_and_table_report_the_state(capsys) -> None:
    argv = ["plan", "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--gpu", "H100-SXM", "--tp", "4"]
    assert cli.main([*argv, "--max-model-len", "32768", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mamba_layers"] == 36 and doc["settings"]["block_size"] == 272
    assert doc["mamba_state_bytes_per_sequence"] == 36 * 274432
    assert doc["max_sequences"] > 0
    off = ["--max-model-len", "32768", "--no-enable-prefix-caching", "--json"]
    assert cli.main([*argv, *off]) == 0
    assert json.loads(capsys.readouterr().out)["mamba_state_blocks_per_sequence"] == 3
    assert cli.main([*argv, "--max-model-len", "32768"]) == 0
    table = capsys.readouterr().out
    assert "Mamba state per sequence" in table and "max sequences at once" in table


def test_plan_says_not_planned_for_an_unknown_shape(tmp_path, capsys) -> None:
    config = {**GRANITE_4_H, "model_type": "my_hybrid", "layer_types": ["mamba", "retention"] * 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli.main(["plan", "--model", str(tmp_path), "--gpu", "H100-SXM", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["planned"] is False and "retention" in doc["reason"]


def test_catalogue_entries_parse_like_their_configs() -> None:
    """The catalogue's shorthands give the layer kinds and mixer a config.json would."""
    qwen = load_model_arch("Qwen/Qwen3-Next-80B-A3B-Instruct")
    assert qwen.layer_kinds == ("mamba", "mamba", "mamba", "full_attention") * 12
    nemotron = load_model_arch("nvidia/Nemotron-H-8B-Base-8K")
    assert (nemotron.num_mamba_layers, nemotron.num_attention_layers, nemotron.layer_kinds.count("mlp")) == (24, 4, 24)
    assert nemotron.mamba is not None and nemotron.mamba.intermediate_size == 128 * 64
    assert 7.5e9 < count_parameters(nemotron) < 8.5e9  # "8B"
    assert 75e9 < count_parameters(qwen) < 85e9  # "80B"


# --- against vLLM's own start-up log -------------------------------------------------------------------------

# A 4-layer random Granite-4.0-H-style checkpoint (3 Mamba-2 layers, 1 attention layer), as transformers'
# GraniteMoeHybridConfig saves it, served by vLLM 0.32.0's CPU build on the development host with
# VLLM_CPU_KVCACHE_SPACE=1 --dtype float32 --max-model-len 2048 --enforce-eager. Its log said:
#   "Setting attention block size to 256 tokens ...", "Padding mamba page size by 88.93% ...",
#   "CPU KV cache size: 493,447 tokens, Maximum concurrency for 2,048 tokens per request: 240.94x"
#   and with --no-enable-prefix-caching "CPU KV cache size: 762,600 tokens ... 372.36x".
TINY_GRANITE_H = {
    **GRANITE_4_H,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "shared_intermediate_size": 512,
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_d_state": 64,
    "mamba_n_groups": 1,
    "time_step_limit": [0.0, {"__float__": "Infinity"}],  # as transformers 5 writes it
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


# The same for a 4-layer random Qwen3-Next (3 gated-DeltaNet layers, 1 attention layer, 2 x 64 key and
# 4 x 64 value heads): "Padding mamba page size by 82.86% ...", "CPU KV cache size: 762,600 tokens,
# Maximum concurrency for 2,048 tokens per request: 372.36x" (prefix caching on: 2 state blocks).
TINY_QWEN3_NEXT = {
    **QWEN3_NEXT,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "num_experts": 4,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
}


def test_the_gated_deltanet_plan_equals_vllms_cpu_log() -> None:
    arch = _arch(TINY_QWEN3_NEXT)
    args = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True}
    plan = plan_capacity(arch, args, resolve_hardware(device="cpu"), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    state = plan.mamba_state_bytes_per_sequence // 3
    assert round(100 * (128 * 2 * 2 * 64 * 4 - state) / state, 2) == 82.86
    assert (plan.settings.block_size, plan.kv_cache_tokens, plan.max_concurrency) == (128, 762600, 372.36)


@pytest.mark.parametrize("prefix_caching, tokens, concurrency", [(None, 493447, 240.94), (False, 762600, 372.36)])
def test_the_plan_equals_vllms_cpu_log(prefix_caching: bool | None, tokens: int, concurrency: float) -> None:
    arch = _arch(TINY_GRANITE_H)
    args = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "enable_prefix_caching": prefix_caching}
    plan = plan_capacity(arch, args, resolve_hardware(device="cpu"), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert plan.settings.block_size == 256
    page = 256 * 2 * 2 * 64 * 4  # the attention page the Mamba state is padded to
    assert (
        round(100 * (page - plan.mamba_state_bytes_per_sequence / 3) / (plan.mamba_state_bytes_per_sequence / 3), 2)
        == 88.93
    )
    assert (plan.kv_cache_tokens, plan.max_concurrency) == (tokens, concurrency)


@pytest.mark.parametrize(
    "config",
    [QWEN3_NEXT, NEMOTRON_H, {**GRANITE_4_H, "num_local_experts": 4, "num_experts_per_tok": 2}, JAMBA],
    ids=["qwen3_next", "nemotron_h", "granite_4_h_moe", "jamba"],
)
def test_parameters_match_transformers_own_model(config: dict[str, Any]) -> None:
    """Mixer weights (Mamba-1, Mamba-2, gated DeltaNet) and Nemotron-H's one-block layers, counted against the
    model transformers builds from the same config (random weights, CPU, a few million parameters)."""
    transformers = pytest.importorskip("transformers")
    fields = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config["model_type"], **fields)
    )
    built = sum(p.numel() for p in model.parameters())
    assert count_parameters(_arch(config)) == pytest.approx(built, rel=2e-3)
