"""Falcon-H1 (attention and Mamba-2 side by side in every layer) and MiniMax (lightning attention with softmax
attention every 8th layer; MiniMax-M2: plain attention MoE): weights, KV per token, state per sequence, the
catalogue and ``servetune plan``.

Each config dict is the published config.json's numbers (huggingface.co/tiiuae/Falcon-H1-7B-Instruct,
MiniMaxAI/MiniMax-Text-01, MiniMaxAI/MiniMax-M2), trimmed to what the planner or transformers' defaults touch.
The blocks and tokens of both hybrid families against vLLM's own grouping code are in test_capacity_mamba.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import servetune.cli as cli
from servetune.capacity import arch_from_hf_config, count_parameters, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.kvgroups import kv_layout
from servetune.capacity.mamba import state_bytes, state_shapes
from servetune.capacity.params import kv_bytes_per_token
from servetune.capacity.profile import PROFILES

H100 = resolve_hardware(gpu="H100-SXM")

FALCON_H1_7B = {
    "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 3072,
    "num_hidden_layers": 44, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
    "intermediate_size": 12288, "vocab_size": 130048, "tie_word_embeddings": False, "mamba_d_state": 256,
    "mamba_n_groups": 1, "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_ssm": 3072, "mamba_expand": 2,
    "mamba_d_conv": 4, "mamba_chunk_size": 128, "mamba_rms_norm": False, "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}  # fmt: skip
MINIMAX_TEXT_01 = {
    "architectures": ["MiniMaxText01ForCausalLM"], "model_type": "MiniMaxText01", "hidden_size": 6144,
    "intermediate_size": 9216, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 200064, "num_local_experts": 32, "num_experts_per_tok": 2,
    "attn_type_list": ([0] * 7 + [1]) * 10, "max_position_embeddings": 10240000, "rotary_dim": 64,
    "tie_word_embeddings": False, "shared_intermediate_size": 0, "torch_dtype": "bfloat16",
}  # fmt: skip
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 3072,
    "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
    "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256, "num_experts_per_tok": 8, "vocab_size": 200064,
    "max_position_embeddings": 196608, "use_qk_norm": True, "qk_norm_type": "per_layer",
    "tie_word_embeddings": False, "attn_type_list": [1] * 62, "scoring_func": "sigmoid", "use_routing_bias": True,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}  # fmt: skip


def _arch(config: dict[str, Any]):
    return arch_from_hf_config(config, name=config["model_type"])


@pytest.mark.parametrize(
    "model, config, published",
    [
        ("tiiuae/Falcon-H1-7B-Instruct", FALCON_H1_7B, 7.59e9),  # the model page's safetensors count
        ("MiniMaxAI/MiniMax-Text-01", MINIMAX_TEXT_01, 456e9),  # "456 billion total parameters"
        ("MiniMaxAI/MiniMax-M1-80k", MINIMAX_TEXT_01, 456e9),
        ("MiniMaxAI/MiniMax-M2", MINIMAX_M2, 229e9),  # the model page's safetensors count ("230B" in the blog)
    ],
)
def test_weights_within_one_percent_of_the_published_count(model: str, config: dict[str, Any], published) -> None:
    catalogued, parsed = load_model_arch(model), _arch(config)
    assert count_parameters(catalogued) == pytest.approx(published, rel=0.01)
    # the catalogue says what the config says
    assert count_parameters(parsed) == pytest.approx(count_parameters(catalogued), rel=1e-4)
    assert parsed.layer_kinds == catalogued.layer_kinds and parsed.mamba == catalogued.mamba
    assert parsed.parallel_mamba == catalogued.parallel_mamba


def test_layers_as_vllm_registers_them() -> None:
    falcon, minimax, m2 = _arch(FALCON_H1_7B), _arch(MINIMAX_TEXT_01), _arch(MINIMAX_M2)
    # Falcon-H1: every layer attends and keeps a Mamba-2 state; vLLM registers 44 + 44 cache layers.
    assert (falcon.num_attention_layers, falcon.num_mamba_layers, falcon.parallel_mamba) == (44, 44, True)
    assert [(g.kind, g.layers) for g in kv_layout(falcon).groups] == [("full_attention", 44), ("mamba", 44)]
    # MiniMax-Text-01: softmax attention on every 8th layer, lightning attention elsewhere.
    assert minimax.layer_kinds == (("mamba",) * 7 + ("full_attention",)) * 10
    assert minimax.mamba is not None and minimax.mamba.kind == "linear_attention"
    assert sorted({(g.kind, g.layers) for g in kv_layout(minimax).groups}) == [("full_attention", 10), ("mamba", 10)]
    assert len(kv_layout(minimax).groups) == 8  # 7 lightning groups of 10 layers, 1 softmax group
    # MiniMax-M2: all softmax attention (attn_type_list all 1s), MoE, FP8.
    assert (m2.mamba, m2.num_attention_layers, m2.num_experts, m2.quant.method) == (None, 62, 256, "fp8")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_kv_bytes_per_token_count_the_attention_layers_only(tp: int) -> None:
    falcon, minimax, m2 = _arch(FALCON_H1_7B), _arch(MINIMAX_TEXT_01), _arch(MINIMAX_M2)
    kv = max(1, 2 // tp)
    assert kv_bytes_per_token(falcon, 2, tp) == 44 * 2 * kv * 128 * 2
    assert kv_bytes_per_token(minimax, 2, tp) == 10 * 2 * (8 // tp) * 128 * 2  # not 80 layers
    assert kv_bytes_per_token(m2, 2, tp) == 62 * 2 * (8 // tp) * 128 * 2


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_per_sequence_as_vllm_shapes_it(tp: int) -> None:
    mamba_utils = pytest.importorskip("vllm.model_executor.layers.mamba.mamba_utils")
    calc = mamba_utils.MambaStateShapeCalculator
    falcon, minimax = _arch(FALCON_H1_7B).mamba, _arch(MINIMAX_TEXT_01).mamba
    assert falcon is not None and minimax is not None
    assert state_shapes(falcon, tp) == calc.mamba2_state_shape(tp, 3072, 1, 24, 128, 256, 4)
    assert state_shapes(minimax, tp) == calc.linear_attention_state_shape(64, tp, 128)
    # by hand: Falcon-H1's conv (3, (3072 + 2 x 256 x groups padded to TP) / TP) + SSM (24 / TP, 128, 256), bf16
    groups = 1 if tp == 1 else tp
    assert state_bytes(falcon, "bfloat16", tp) == (3 * (3072 + 2 * groups * 256) // tp + 24 // tp * 128 * 256) * 2
    # MiniMax: one (64 / TP, 128, 128) state in the model dtype, no convolution
    assert state_bytes(minimax, "bfloat16", tp) == 64 // tp * 128 * 128 * 2
    assert state_bytes(minimax, "float32", tp) == 64 // tp * 128 * 128 * 4


def test_plan_sizes_the_state_per_sequence() -> None:
    falcon = load_model_arch("tiiuae/Falcon-H1-7B-Instruct")
    plan = plan_capacity(falcon, {"max_model_len": 32768}, H100)
    assert plan.fits and plan.mamba_layers == 44
    assert plan.mamba_state_bytes_per_sequence == 44 * state_bytes(falcon.mamba, "bfloat16")  # type: ignore[arg-type]
    assert plan.kv_bytes_per_token == 44 * 2 * 2 * 128 * 2
    # the attention block grows until one page (44 layers x 1 KiB a token) holds a 1,594,368 B state
    assert plan.settings.block_size == 16 * -(-1594368 // (16 * 2 * 2 * 128 * 2))


def test_minimax_text_01_is_refused_where_vllm_refuses_it() -> None:
    arch = load_model_arch("MiniMaxAI/MiniMax-Text-01")
    args = {"tensor_parallel_size": 8, "max_model_len": 32768, "quantization": "fp8"}
    refused = plan_capacity(arch, args, H100)
    assert not refused.fits and "MiniMaxText01ForCausalLM was served by vLLM up to 0.23" in refused.reason
    assert not plan_capacity(arch, args, H100, profile=PROFILES["vllm-0.25"]).fits
    old = plan_capacity(arch, args, H100, profile=PROFILES["vllm-0.21"])
    assert old.fits and old.mamba_layers == 70
    assert old.mamba_state_bytes_per_sequence == 70 * 8 * 128 * 128 * 2
    assert old.kv_bytes_per_token == 10 * 2 * 1 * 128 * 2


@pytest.mark.parametrize(
    "config",
    [
        {**FALCON_H1_7B, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 64,
         "intermediate_size": 512, "vocab_size": 1000, "mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_ssm": 512,
         "mamba_d_state": 32, "mamba_n_groups": 2},
        {**FALCON_H1_7B, "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64,
         "intermediate_size": 512, "vocab_size": 1000, "mamba_n_heads": 8, "mamba_d_head": "auto",
         "mamba_d_ssm": None, "mamba_d_state": 32, "mamba_rms_norm": True, "tie_word_embeddings": True},
        {**{k: v for k, v in MINIMAX_TEXT_01.items() if k != "attn_type_list"}, "model_type": "minimax",
         "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "intermediate_size": 384, "num_local_experts": 4, "vocab_size": 1000,
         "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
    ],
    ids=["falcon_h1", "falcon_h1_expand_auto_norm", "minimax"],
)  # fmt: skip
def test_parameters_match_transformers_own_model(config: dict[str, Any]) -> None:
    """Falcon-H1's parallel mixer (with and without the gated norm's weight) and MiniMax's lightning attention,
    counted against the model transformers builds from the same config (random weights, CPU)."""
    transformers = pytest.importorskip("transformers")
    fields = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config["model_type"], **fields)
    )
    built = sum(p.numel() for p in model.parameters())
    assert count_parameters(_arch(config)) == pytest.approx(built, rel=2e-3)


def test_servetune_plan_for_the_catalogued_ids(capsys) -> None:
    argv = ["plan", "--gpu", "H100-SXM", "--max-model-len", "32768", "--json"]
    assert cli.main([*argv, "--model", "tiiuae/Falcon-H1-7B-Instruct"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["mamba_layers"] == 44 and doc["max_sequences"] > 0
    assert cli.main([*argv, "--model", "MiniMaxAI/MiniMax-M2", "--tp", "4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["mamba_layers"] == 0 and doc["kv_bytes_per_token"] == 62 * 2 * 2 * 128 * 2
    minimax = [*argv, "--model", "MiniMaxAI/MiniMax-Text-01", "--tp", "8", "--quantization", "fp8"]
    assert cli.main(minimax) == 1  # does not fit: vLLM 0.32 refuses the architecture
    doc = json.loads(capsys.readouterr().out)
    assert not doc["fits"] and "up to 0.23" in doc["reason"]
    assert any("--vllm-version" in tip for tip in doc["advice"])
    assert cli.main([*minimax, "--vllm-version", "0.23.0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["mamba_layers"] == 70


# A 4-layer random Falcon-H1 (attention of 4 x 64 / 2 KV heads beside a Mamba-2 mixer of 8 x 64 heads, state 64,
# in every layer), saved by transformers' FalconH1ForCausalLM with servetune's byte tokenizer and served by
# vLLM 0.32.0's CPU build on the development host with VLLM_CPU_KVCACHE_SPACE=1 --dtype float32
# --max-model-len 2048 --enforce-eager. Its log said: "Setting attention block size to 256 tokens ...",
# "Padding mamba page size by 88.93% ...", "CPU KV cache size: 190,650 tokens, Maximum concurrency for
# 2,048 tokens per request: 93.09x" (prefix caching on by default: 3 state blocks a sequence); with
# --no-enable-prefix-caching "CPU KV cache size: 233,016 tokens ... 113.78x".
TINY_FALCON_H1 = {
    **FALCON_H1_7B, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "intermediate_size": 512, "vocab_size": 258, "mamba_n_heads": 8, "mamba_d_head": 64,
    "mamba_d_ssm": 512, "mamba_d_state": 64, "max_position_embeddings": 4096, "torch_dtype": "float32",
}  # fmt: skip


@pytest.mark.parametrize("prefix_caching, tokens, concurrency", [(None, 190650, 93.09), (False, 233016, 113.78)])
def test_the_falcon_h1_plan_equals_vllms_cpu_log(prefix_caching: bool | None, tokens: int, concurrency: float) -> None:
    arch = _arch(TINY_FALCON_H1)
    args = {"dtype": "float32", "max_model_len": 2048, "enforce_eager": True, "enable_prefix_caching": prefix_caching}
    plan = plan_capacity(arch, args, resolve_hardware(device="cpu"), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    state = plan.mamba_state_bytes_per_sequence // 4  # one layer's: conv (3, 512 + 2 x 64) + SSM (8, 64, 64), fp32
    assert state == (3 * 640 + 8 * 64 * 64) * 4
    page = 256 * 2 * 2 * 64 * 4  # the attention page (256 tokens) the Mamba state is padded to
    assert round(100 * (page - state) / state, 2) == 88.93
    assert (plan.settings.block_size, plan.kv_cache_tokens, plan.max_concurrency) == (256, tokens, concurrency)
