"""config.json files of the architectures beyond dense / Mixtral / DeepSeek, read through transformers.

Each dict is the model's published config.json, trimmed to what the planner or transformers'
defaults touch; the parameter counts are the model cards' (safetensors metadata).
"""

from __future__ import annotations

import pytest

from servetune.capacity import arch_from_hf_config, count_parameters, load_model_arch
from servetune.capacity.kvgroups import kv_layout
from servetune.capacity.params import weight_bytes_per_rank

# google/gemma-3-27b-it: the decoder under text_config, a SigLIP vision tower beside it.
GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
        "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16, "head_dim": 128,
        "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
    },
}  # fmt: skip
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_local_experts": 128, "num_experts_per_tok": 4,
    "experts_per_token": 4, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "attention_bias": True,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096},
    "vocab_size": 201088, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}  # fmt: skip
# Qwen/Qwen2.5-VL-7B-Instruct: decoder fields at the top level, the vision tower in vision_config.
QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 128000, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
        "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
    },
}  # fmt: skip
# meta-llama/Llama-4-Scout-17B-16E-Instruct: chunked local attention on RoPE layers, every 4th global.
LLAMA4_SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 40,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
        "num_local_experts": 16, "num_experts_per_tok": 1, "vocab_size": 202048, "interleave_moe_layer_step": 1,
        "attention_chunk_size": 8192, "max_position_embeddings": 10485760, "use_qk_norm": True,
        "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "vision_config": {
        "hidden_size": 1408, "num_hidden_layers": 34, "intermediate_size": 5632, "image_size": 336,
        "patch_size": 14, "num_attention_heads": 16, "projector_input_dim": 4096, "projector_output_dim": 4096,
        "vision_output_dim": 4096, "pixel_shuffle_ratio": 0.5,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "config, hub_id", [(GEMMA3_27B, "google/gemma-3-27b-it"), (GPT_OSS_120B, "openai/gpt-oss-120b")]
)
def test_config_json_matches_the_catalogue_entry(config: dict, hub_id: str) -> None:
    parsed = arch_from_hf_config(config, hub_id)
    assert parsed == load_model_arch(hub_id)


def test_gemma3_reads_the_decoder_from_text_config_with_transformers_defaults() -> None:
    arch = arch_from_hf_config(GEMMA3_27B, "gemma")
    # vocab_size, max_position_embeddings, tie_word_embeddings and the 5:1 layer pattern are left
    # to Gemma3TextConfig's defaults in the published file.
    assert (arch.vocab_size, arch.max_position_embeddings, arch.tie_word_embeddings) == (262208, 131072, True)
    assert arch.layer_kinds.count("full_attention") == 10 and arch.layer_kinds[5] == "full_attention"
    assert arch.sliding_window == 1024 and arch.vision_parameters > 0


@pytest.mark.parametrize(
    "config, billions", [(GEMMA3_27B, 27.43), (QWEN25_VL_7B, 8.29), (LLAMA4_SCOUT, 108.6), (GPT_OSS_120B, 116.83)]
)
def test_multimodal_and_moe_parameters_match_the_model_card(config: dict, billions: float) -> None:
    assert count_parameters(arch_from_hf_config(config, "m")) / 1e9 == pytest.approx(billions, rel=0.005)


def test_vision_tower_weights_are_loaded_and_split_by_tensor_parallel() -> None:
    with_vision = arch_from_hf_config(QWEN25_VL_7B, "vl")
    text_only = with_vision.model_copy(update={"vision_parameters": 0})
    for tp in (1, 2):
        added = weight_bytes_per_rank(with_vision, with_vision.quant, 2, tp) - weight_bytes_per_rank(
            text_only, text_only.quant, 2, tp
        )
        assert added == pytest.approx(2 * with_vision.vision_parameters / tp, rel=1e-6)


def test_mxfp4_packs_only_the_experts_as_vllm_does() -> None:
    arch = arch_from_hf_config(GPT_OSS_120B, "gpt-oss")
    assert arch.quant.method == "mxfp4" and arch.attention_sinks
    dense_attention = weight_bytes_per_rank(
        arch.model_copy(update={"num_experts": 0, "intermediate_size": 1}), arch.quant, 2
    )
    unquantized_attention = weight_bytes_per_rank(
        arch.model_copy(update={"num_experts": 0, "intermediate_size": 1}),
        arch.quant.model_copy(update={"method": "none"}),
        2,
    )
    assert dense_attention == unquantized_attention  # attention stays bf16 under MXFP4
    experts = 36 * 128 * 3 * 2880 * 3072  # the hidden dimension padded to 256 on the GPU
    assert weight_bytes_per_rank(arch, arch.quant, 2) - dense_attention == pytest.approx(
        experts * (0.5 + 1 / 32), rel=0.01
    )


def test_llama4_chunked_layers_and_interleaved_moe() -> None:
    scout = arch_from_hf_config(LLAMA4_SCOUT, "scout")
    assert scout.attention_chunk_size == 8192
    assert list(scout.layer_kinds[:4]) == ["chunked_attention"] * 3 + ["full_attention"]
    assert scout.max_position_embeddings == 10485760  # llama3 rope: the file states the stretched length
    assert len(kv_layout(scout).groups) == 1  # vLLM keeps the hybrid manager off for chunked attention
    maverick_text = {**LLAMA4_SCOUT["text_config"], "num_local_experts": 128, "interleave_moe_layer_step": 2}
    maverick = arch_from_hf_config({**LLAMA4_SCOUT, "text_config": maverick_text}, "maverick")
    assert maverick.num_moe_layers == 24 and maverick.intermediate_size == 16384
    assert count_parameters(maverick) / 1e9 == pytest.approx(400, rel=0.01)


def test_linear_rope_factor_stretches_the_context_except_where_vllm_does_not() -> None:
    llama = {
        "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
        "num_attention_heads": 8, "vocab_size": 1000, "max_position_embeddings": 4096,
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }  # fmt: skip
    assert arch_from_hf_config(llama, "x").max_position_embeddings == 16384
    yarn = {**llama, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}
    assert arch_from_hf_config(yarn, "x").max_position_embeddings == 4096


@pytest.mark.parametrize(
    "quantization_config, method, bytes_per_weight",
    [
        # nvidia/Llama-3.1-8B-Instruct-FP4 style (ModelOpt): fp4 + one fp8 scale per 16 weights
        ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}, "nvfp4", 0.5625),
        ({"quant_method": "modelopt", "quant_algo": "FP8"}, "fp8", 1.0),
        ({"quant_method": "modelopt_mxfp8"}, "mxfp8", 1 + 1 / 32),
        # RedHatAI/*-NVFP4 style (compressed-tensors): float weights of 4 bits in groups of 16
        (
            {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
                "num_bits": 4, "type": "float", "group_size": 16, "strategy": "tensor_group"}}}},
            "nvfp4",
            0.5625,
        ),
        ({"quant_method": "mxfp4"}, "mxfp4", 0.53125),
    ],
)  # fmt: skip
def test_fp4_and_fp8_weight_formats_cost_their_scales(
    quantization_config: dict, method: str, bytes_per_weight: float
) -> None:
    config = {**QWEN25_VL_7B, "quantization_config": quantization_config}
    quant = arch_from_hf_config(config, "q").quant
    assert quant.method == method and quant.bytes_per_weight(2) == pytest.approx(bytes_per_weight)


def test_modelopt_quantization_flag_takes_the_checkpoints_format() -> None:
    from servetune.capacity import plan_capacity, resolve_hardware

    base = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(gpu="H100-SXM")
    fp8 = plan_capacity(base, {"quantization": "modelopt", "max_model_len": 8192}, h100)
    fp4 = plan_capacity(base, {"quantization": "modelopt_fp4", "max_model_len": 8192}, h100)
    bf16 = plan_capacity(base, {"max_model_len": 8192}, h100)
    assert fp4.weights_gib < fp8.weights_gib < bf16.weights_gib
    nvfp4_checkpoint = base.model_copy(update={"quant": arch_from_hf_config(
        {**QWEN25_VL_7B, "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "q").quant})  # fmt: skip
    same = plan_capacity(nvfp4_checkpoint, {"quantization": "modelopt", "max_model_len": 8192}, h100)
    assert same.weights_gib == fp4.weights_gib


def test_a_context_beyond_the_models_positions_needs_vllms_long_context_switch() -> None:
    from servetune.capacity import plan_capacity, resolve_hardware

    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    args = {"max_model_len": 2 * arch.max_position_embeddings}
    refused = plan_capacity(arch, args, resolve_hardware(gpu="B200"))
    assert not refused.fits and "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in refused.reason
    env = {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    allowed = plan_capacity(arch, args, resolve_hardware(gpu="B200"), env=env)
    assert "vLLM refuses" not in allowed.reason
    assert any("outputs may be wrong" in note for note in allowed.notes)
