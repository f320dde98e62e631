"""Model architecture: config.json parsing, the catalogue, parameter counts, KV bytes per token."""

from __future__ import annotations

import json

import pytest

from servetune.capacity import (
    ModelArch,
    WeightQuant,
    arch_from_hf_config,
    count_parameters,
    kv_bytes_per_token,
    load_catalog,
    load_model_arch,
)
from servetune.capacity.params import weight_bytes_per_rank
from servetune.errors import UserError
from servetune.models.tiny import TINY_CONFIG, parameter_count

# Published parameter counts (model cards / safetensors metadata).
PUBLISHED_B = {
    "meta-llama/Llama-3.1-8B-Instruct": 8.03,
    "meta-llama/Llama-3.1-70B-Instruct": 70.6,
    "meta-llama/Llama-3.2-1B-Instruct": 1.24,
    "meta-llama/Llama-3.2-3B-Instruct": 3.21,
    "Qwen/Qwen2.5-7B-Instruct": 7.62,
    "Qwen/Qwen2.5-72B-Instruct": 72.7,
    "Qwen/Qwen3-8B": 8.2,
    "Qwen/Qwen3-32B": 32.8,
    "mistralai/Mistral-7B-Instruct-v0.3": 7.25,
    "mistralai/Mixtral-8x7B-Instruct-v0.1": 46.7,
    "deepseek-ai/DeepSeek-V3": 671.0,
    "google/gemma-3-27b-it": 27.43,
    "openai/gpt-oss-120b": 116.83,
    "openai/gpt-oss-20b": 20.91,
}

# Mixtral's and DeepSeek-V3's config.json, trimmed to the fields that matter.
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 129280, "max_position_embeddings": 163840,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}  # fmt: skip


@pytest.mark.parametrize("hub_id, billions", PUBLISHED_B.items())
def test_parameter_count_matches_the_published_size(hub_id: str, billions: float) -> None:
    counted = count_parameters(load_model_arch(hub_id)) / 1e9
    assert counted == pytest.approx(billions, rel=0.02)


def test_tiny_model_parameters_match_the_generated_weights() -> None:
    arch = arch_from_hf_config(TINY_CONFIG, "tiny")
    assert count_parameters(arch) == parameter_count()


@pytest.mark.parametrize(
    "hub_id, per_token",
    [
        ("meta-llama/Llama-3.1-8B-Instruct", 128 * 1024),  # 2 x 32 layers x 8 KV heads x 128 x 2 B
        ("Qwen/Qwen2.5-7B-Instruct", 56 * 1024),  # 2 x 28 x 4 x 128 x 2
        ("deepseek-ai/DeepSeek-V3", (512 + 64) * 61 * 2),  # MLA latent: 70,272 B
    ],
)
def test_kv_bytes_per_token(hub_id: str, per_token: int) -> None:
    assert kv_bytes_per_token(load_model_arch(hub_id), kv_dtype_bytes=2) == per_token


def test_tiny_model_kv_bytes_per_token_is_2048() -> None:
    arch = arch_from_hf_config(TINY_CONFIG, "tiny")
    assert kv_bytes_per_token(arch, 2) == 2 * 4 * 2 * 64 * 2 == 2048
    assert kv_bytes_per_token(arch, 2, tp=2) == 1024  # KV heads split over two ranks
    assert kv_bytes_per_token(arch, 2, tp=4) == 1024  # one KV head each, replicated beyond 2


def test_kv_heads_split_by_tp_then_replicated_and_mla_kept_on_every_rank() -> None:
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    assert [kv_bytes_per_token(llama, 2, tp=t) for t in (1, 2, 4, 8, 16)] == [131072, 65536, 32768, 16384, 16384]
    deepseek = load_model_arch("deepseek-ai/DeepSeek-V3")
    assert kv_bytes_per_token(deepseek, 2, tp=8) == kv_bytes_per_token(deepseek, 2, tp=1) == 70272
    assert kv_bytes_per_token(llama, 2, pp=2) == 65536  # half the layers per stage


def test_mixtral_and_deepseek_config_json_match_the_catalogue() -> None:
    mixtral = arch_from_hf_config(MIXTRAL_CONFIG, "mixtral")
    assert count_parameters(mixtral) == count_parameters(load_model_arch("mistralai/Mixtral-8x7B-Instruct-v0.1"))
    deepseek = arch_from_hf_config(DEEPSEEK_V3_CONFIG, "deepseek")
    assert deepseek.is_mla and deepseek.is_moe and deepseek.quant.method == "fp8"
    assert count_parameters(deepseek) == count_parameters(load_model_arch("deepseek-ai/DeepSeek-V3"))
    assert kv_bytes_per_token(deepseek, 2) == 70272


def test_weights_split_by_tensor_parallel_and_quantization() -> None:
    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    bf16 = weight_bytes_per_rank(llama, llama.quant, 2) / 2**30
    assert bf16 == pytest.approx(14.99, abs=0.01)  # vLLM: "Model loading took 14.9888 GiB"
    assert weight_bytes_per_rank(llama, llama.quant, 2, tp=2) / 2**30 == pytest.approx(bf16 / 2, rel=0.01)
    awq = load_model_arch("TheBloke/Mistral-7B-Instruct-v0.2-AWQ")
    assert weight_bytes_per_rank(awq, awq.quant, 2) / 2**30 == pytest.approx(3.87, abs=0.05)  # the 4.15 GB checkpoint


def test_load_model_arch_from_a_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    arch = load_model_arch(tmp_path)
    assert isinstance(arch, ModelArch)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.max_position_embeddings) == (4, 2, 64, 4096)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"]
)
def test_missing_config_field_is_named_when_transformers_does_not_know_the_model(tmp_path, field: str) -> None:
    config = {k: v for k, v in TINY_CONFIG.items() if k != field}
    config["model_type"] = "some_new_arch"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=f"config.json: missing field '{field}'"):
        load_model_arch(tmp_path)


def test_a_field_left_to_the_library_default_gets_transformers_default(tmp_path) -> None:
    """#39: a llama config without vocab_size was refused; LlamaConfig's default is 32000."""
    from transformers import LlamaConfig

    config = {k: v for k, v in TINY_CONFIG.items() if k not in ("vocab_size", "max_position_embeddings")}
    assert config["model_type"] == "llama"
    (tmp_path / "config.json").write_text(json.dumps(config))
    arch = load_model_arch(tmp_path)
    assert arch.vocab_size == LlamaConfig().vocab_size
    assert arch.max_position_embeddings == LlamaConfig().max_position_embeddings


def test_a_config_transformers_rejects_is_one_line_naming_the_field(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**TINY_CONFIG, "vocab_size": "many"}))
    with pytest.raises(UserError, match=r"config.json: Validation error for field 'vocab_size'.*int"):
        load_model_arch(tmp_path)


def test_awq_quantization_config_is_read(tmp_path) -> None:
    config = {**TINY_CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    quant = load_model_arch(tmp_path).quant
    assert (quant.method, quant.bits, quant.group_size) == ("awq", 4, 64)


def test_catalogue_lookup_by_name_without_organisation_and_unknown_model() -> None:
    assert load_model_arch("qwen2.5-7b-instruct").name == "Qwen/Qwen2.5-7B-Instruct"
    with pytest.raises(UserError, match=r"not a hub id \(org/name\) and not in servetune's catalogue.*Llama-3\.1-8B"):
        load_model_arch("no-such-model")


def test_catalogue_entries_are_consistent() -> None:
    catalog = load_catalog()
    assert len(catalog) >= 12
    for arch in catalog.values():
        assert arch.num_attention_heads % arch.num_kv_heads == 0
        assert arch.max_position_embeddings >= 4096


def test_a_local_checkpoint_is_sized_from_its_safetensors_headers(tmp_path) -> None:
    from servetune.models.tiny import build_tiny_model

    build_tiny_model(tmp_path)
    arch = load_model_arch(tmp_path)
    assert arch.checkpoint is not None and sum(arch.checkpoint.parameters.values()) == parameter_count(TINY_CONFIG)
    rope = arch.max_position_embeddings * arch.rope_dim * 2
    # Served in bfloat16, every floating tensor of the float32 checkpoint costs 2 bytes (vLLM pads the vocabulary).
    assert weight_bytes_per_rank(arch, arch.quant, 2) - rope == pytest.approx(
        parameter_count(TINY_CONFIG) * 2, rel=0.02
    )
    (tmp_path / "model.safetensors").unlink()
    assert load_model_arch(tmp_path).checkpoint is None  # no headers: the formula sizes it


def test_checkpoint_bytes_replace_the_formula_split_as_the_formula_splits_them() -> None:
    from servetune.capacity.checkpoint import Checkpoint

    llama = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    formula = [weight_bytes_per_rank(llama, llama.quant, 2, tp=tp) for tp in (1, 2)]
    larger = llama.model_copy(update={"checkpoint": Checkpoint(parameters={"BF16": 9_000_000_000, "F32": 10**6})})
    stored = [weight_bytes_per_rank(larger, larger.quant, 2, tp=tp) for tp in (1, 2)]
    rope = llama.max_position_embeddings * llama.rope_dim * 2
    assert stored[0] - rope == pytest.approx((9_000_000_000 + 10**6) * 2, rel=1e-3)  # vocab padding aside
    assert (stored[1] - rope) / (stored[0] - rope) == pytest.approx((formula[1] - rope) / (formula[0] - rope))
    # Quantized on load (--quantization fp8 on a bf16 checkpoint): the stored bytes say nothing; the formula does.
    fp8 = WeightQuant(method="fp8", bits=8)
    assert weight_bytes_per_rank(larger, fp8, 2) == weight_bytes_per_rank(llama, fp8, 2)
    assert Checkpoint(parameters={"BF16": 10, "Q9": 1}).bytes_served(2) is None  # an unknown dtype: no size
