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
