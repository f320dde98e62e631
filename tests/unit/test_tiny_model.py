import hashlib
import json

from servetune.cli import main
from servetune.models.tiny import TINY_CONFIG, parameter_count


def digest(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_files_every_time(tmp_path, tiny_model):
    assert main(["models", "tiny", "--out", str(tmp_path / "again")]) == 0
    assert digest(tmp_path / "again") == digest(tiny_model)


def test_architecture_and_size(tiny_model):
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config == TINY_CONFIG
    assert 2_000_000 < parameter_count() < 3_000_000


def test_byte_level_tokenizer_round_trips_any_text(tiny_model):
    from transformers import AutoTokenizer  # as vLLM loads it, chat template included

    tiny_tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    text = 'héllo, 世界! {"json": [1, 2]}'
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())
    assert tiny_tokenizer.decode(ids) == text
    chat = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("assistant: ") and "user: hi" in chat


def test_an_out_that_cannot_be_created_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for out in (tmp_path / "a-file" / "model", "/proc/servetune-none/model"):
        assert main(["models", "tiny", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith(f"servetune models: error: --out {out}: cannot write the model there (")
            and err.count("\n") == 1
        ), err


def test_tiny_adapter_is_the_same_every_time_and_fits_the_model(tmp_path):
    from safetensors.numpy import load_file

    assert main(["models", "tiny-lora", "--out", str(tmp_path / "a")]) == 0
    assert main(["models", "tiny-lora", "--out", str(tmp_path / "b")]) == 0
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    rank, hidden, head_dim = config["r"], TINY_CONFIG["hidden_size"], TINY_CONFIG["head_dim"]
    out = {
        "q_proj": TINY_CONFIG["num_attention_heads"] * head_dim,
        "v_proj": TINY_CONFIG["num_key_value_heads"] * head_dim,
    }
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(config["target_modules"]) * TINY_CONFIG["num_hidden_layers"]
    for layer in range(TINY_CONFIG["num_hidden_layers"]):
        for module in config["target_modules"]:
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            assert tensors[f"{name}.lora_A.weight"].shape == (rank, hidden)
            assert tensors[f"{name}.lora_B.weight"].shape == (out[module], rank)
            assert abs(tensors[f"{name}.lora_B.weight"]).max() > 0  # the adapter changes what the model says


def test_vllm_reads_the_tiny_adapter(tmp_path):
    import pytest

    peft_helper = pytest.importorskip("vllm.lora.peft_helper")
    from servetune.models.tiny import build_tiny_adapter

    helper = peft_helper.PEFTHelper.from_local_dir(
        str(build_tiny_adapter(tmp_path / "lora")), max_position_embeddings=4096
    )
    assert (
        helper.r == 8
        and sorted(helper.target_modules) == ["q_proj", "v_proj"]
        and helper.vllm_lora_scaling_factor == 2.0
    )  # alpha / r
