"""``hf_overrides`` (vLLM's ``--hf-overrides``) merged into the model's config before planning, as vLLM 0.32's
``ModelConfig`` merges it: a flat value replaces the top-level field, a dict merges into a nested config
(``text_config``) and replaces any other field whole (``rope_scaling``)."""

from __future__ import annotations

import json

import pytest

import servetune.cli as cli
from servetune.capacity import NotPlanned, arch_from_hf_config, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.hfconfig import apply_hf_overrides, with_hf_overrides
from servetune.errors import UserError

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
    "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 8, "vocab_size": 32000,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}  # fmt: skip
# google/gemma-3-27b-it's shape: the decoder under text_config (its 128K context already stretched by RoPE).
GEMMA3 = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text", "num_attention_heads": 32,
        "num_hidden_layers": 62, "num_key_value_heads": 16, "head_dim": 128, "sliding_window": 1024,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    },
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "model_type": "siglip_vision_model",
        "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
    },
}  # fmt: skip
H100 = resolve_hardware(gpu="H100-SXM")


@pytest.fixture
def llama():
    return arch_from_hf_config(LLAMA, "tiny-llama")


def test_a_flat_override_replaces_the_field(llama) -> None:
    longer = with_hf_overrides(llama, {"max_position_embeddings": 4 * LLAMA["max_position_embeddings"]})
    assert longer.max_position_embeddings == 4 * llama.max_position_embeddings
    assert longer.model_dump(exclude={"max_position_embeddings"}) == llama.model_dump(
        exclude={"max_position_embeddings"}
    )


def test_a_rope_scaling_override_stretches_the_context_as_vllm_derives_it(llama) -> None:
    factor = 4.0
    dynamic = with_hf_overrides(llama, {"rope_scaling": {"rope_type": "dynamic", "factor": factor}})
    assert dynamic.max_position_embeddings == int(LLAMA["max_position_embeddings"] * factor)
    # YaRN leaves max_position_embeddings as stated (vLLM's _get_and_verify_max_len): it is overridden beside it
    yarn = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 8192}
    assert with_hf_overrides(llama, {"rope_scaling": yarn}).max_position_embeddings == 8192
    both = with_hf_overrides(llama, {"rope_scaling": yarn, "max_position_embeddings": 32768})
    assert both.max_position_embeddings == 32768


def test_the_planner_plans_a_context_the_override_allows_and_refuses_it_without(llama) -> None:
    args = {"max_model_len": 32768}
    refused = plan_capacity(llama, args, H100)
    assert not refused.fits and "max_position_embeddings 8192" in refused.reason
    planned = plan_capacity(llama, {**args, "hf_overrides": {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}},
                            H100)  # fmt: skip
    assert planned.fits, planned.reason
    assert planned.settings.max_model_len == 32768


def test_overrides_as_json_text_as_on_vllm_s_command_line(llama) -> None:
    text = json.dumps({"max_position_embeddings": 16384})
    assert plan_capacity(llama, {"hf_overrides": text}, H100).settings.max_model_len == 16384
    with pytest.raises(UserError, match="hf_overrides"):
        plan_capacity(llama, {"hf_overrides": "{not json"}, H100)


def test_a_dict_merges_into_a_nested_config_and_a_flat_value_stays_at_the_top() -> None:
    gemma = arch_from_hf_config(GEMMA3, "gemma")
    nested = with_hf_overrides(gemma, {"text_config": {"sliding_window": 512}})
    assert nested.sliding_window == 512
    assert nested.num_layers == gemma.num_layers and nested.vision_parameters == gemma.vision_parameters
    # vLLM's config.update sets the composite config's own field: the decoder's positions do not change
    flat = with_hf_overrides(gemma, {"max_position_embeddings": 1024})
    assert flat.max_position_embeddings == gemma.max_position_embeddings
    deeper = with_hf_overrides(gemma, {"text_config": {"max_position_embeddings": 2 * gemma.max_position_embeddings}})
    assert deeper.max_position_embeddings == 2 * gemma.max_position_embeddings


def test_a_dict_replaces_a_field_that_is_not_a_config_whole() -> None:
    config = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32}, "text_config": {"a": {"b": 1}}}
    apply_hf_overrides(config, {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert config["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0}
    apply_hf_overrides(config, {"text_config": {"a": {"c": 2}}})
    assert config["text_config"] == {"a": {"b": 1, "c": 2}}


def test_the_file_s_own_config_is_left_as_it_was(llama) -> None:
    before = json.dumps(LLAMA, sort_keys=True)
    with_hf_overrides(llama, {"max_position_embeddings": 65536, "rope_scaling": {"rope_type": "dynamic"}})
    assert json.dumps(LLAMA, sort_keys=True) == before
    assert with_hf_overrides(llama, {}) is llama


def test_a_catalogue_model_has_no_config_to_merge_into_so_it_is_not_planned() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    with pytest.raises(NotPlanned, match="catalogue"):
        plan_capacity(arch, {"hf_overrides": {"max_position_embeddings": 262144}}, H100)


def test_plan_cli_reads_hf_overrides(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    argv = ["plan", "--model", str(tmp_path), "--gpu", "H100", "--max-model-len", "32768", "--json"]
    assert cli.main(argv) == 1
    capsys.readouterr()
    overrides = json.dumps({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    assert cli.main([*argv, "--hf-overrides", overrides]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["max_model_len"] == 32768
    assert cli.main([*argv, "--hf-overrides", "{oops"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--hf-overrides: not JSON" in err[0]
