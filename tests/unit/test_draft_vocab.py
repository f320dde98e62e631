"""A draft model must share its target's vocabulary (capacity/vocab.py): a draft of another ``vocab_size`` (which
vLLM 0.32 refuses) or of another tokenizer is refused by the space check, ``servetune plan`` and a trial's capacity
check, each in one line naming the field; a draft of the target's own family, another method, or
``use_heterogeneous_vocab`` passes. The models are two tiny checkpoints' configs and tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from servetune import cli
from servetune.capacity import arch_from_hf_config
from servetune.capacity.draft import check_draft
from servetune.capacity.vocab import read_tokenizer, tokenizer_tokens, vocab_problem
from servetune.errors import UserError
from servetune.models.tiny import TINY_CONFIG, tiny_tokenizer_json
from servetune.space_file import load_space


def checkpoint(where: Path, tiny_model: Path, vocab_size: int | None = None, swap: tuple[int, int] | None = None):
    """A copy of the tiny model's config and tokenizer, with another ``vocab_size`` or two token ids swapped."""
    where.mkdir()
    config = json.loads((tiny_model / "config.json").read_text())
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    (where / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_model / "tokenizer.json", where / "tokenizer.json")
    if swap is not None:
        data = json.loads((where / "tokenizer.json").read_text())
        vocab = data["model"]["vocab"]
        by_id = {i: t for t, i in vocab.items()}
        a, b = by_id[swap[0]], by_id[swap[1]]
        vocab[a], vocab[b] = swap[1], swap[0]
        (where / "tokenizer.json").write_text(json.dumps(data))
    return where


def space_file(tmp_path: Path, draft: str, model: str = "tiny", **engine) -> Path:
    doc = {
        "name": "s", "model": model, "device": "cpu", "workload": "cpu-tiny", "hardware": {"devices_per_node": 2},
        "engine_args": {"max_model_len": 512, "speculative.model": draft, "speculative.num_speculative_tokens": 2,
                        **engine},
        "params": {"speculative.method": ["none", "draft_model"]},
    }  # fmt: skip
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_tiny_tokenizer_reads_as_its_built_file_and_a_unigram_list_reads_too(tiny_model):
    built = read_tokenizer(tiny_model)
    assert built is not None and built == tokenizer_tokens(tiny_tokenizer_json())
    assert len(built) == TINY_CONFIG["vocab_size"]  # 256 bytes, BOS and EOS
    unigram = {"model": {"type": "Unigram", "vocab": [["<unk>", 0.0], ["a", -1.0]]}, "added_tokens": []}
    assert tokenizer_tokens(json.dumps(unigram)) == {0: "<unk>", 1: "a"}
    assert tokenizer_tokens("not json") is None and read_tokenizer(tiny_model / "nowhere") is None


def test_vocab_problem_names_the_sizes_then_the_first_token_that_differs():
    assert vocab_problem(258, 258) is None and vocab_problem(None, 300) is None
    assert "vocab_size 300 is not the target's 258" in vocab_problem(258, 300)
    target = {0: "a", 1: "b", 2: "c"}
    assert vocab_problem(3, 3, target, dict(target)) is None and vocab_problem(3, 3, target, None) is None
    problem = vocab_problem(3, 3, target, {0: "a", 1: "c", 2: "b"})
    assert "2 token ids differ; id 1 is 'b' for the target and 'c' for the draft" in problem


def test_the_space_check_refuses_a_draft_of_another_vocabulary_in_one_line(tmp_path, tiny_model):
    checkpoint(tmp_path / "same", tiny_model)
    assert load_space(space_file(tmp_path, "same")).params["speculative.method"] == ["none", "draft_model"]
    checkpoint(tmp_path / "wide", tiny_model, vocab_size=TINY_CONFIG["vocab_size"] + 64)
    with pytest.raises(UserError) as refused:
        load_space(space_file(tmp_path, "wide"))
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{tmp_path / 'space.yaml'}: engine_args.speculative.model: ")
    assert "vocab_size 322 is not the target's 258" in line
    # vLLM maps one vocabulary onto the other where asked: nothing to refuse
    assert load_space(space_file(tmp_path, "wide", **{"speculative.use_heterogeneous_vocab": True}))


def test_the_space_check_refuses_a_draft_whose_tokenizer_gives_other_ids(tmp_path, tiny_model):
    target = checkpoint(tmp_path / "target", tiny_model)
    checkpoint(tmp_path / "swapped", tiny_model, swap=(65, 66))
    for model in ("tiny", str(target)):  # the built-in name, and a local directory
        with pytest.raises(UserError, match=r"engine_args.speculative.model: .*2 token ids differ; id 65 is 'A'"):
            load_space(space_file(tmp_path, "swapped", model=model))
    # another method never loads the draft's vocabulary
    doc = yaml.safe_load(space_file(tmp_path, "swapped").read_text())
    doc["params"]["speculative.method"] = ["none", "ngram"]
    del doc["engine_args"]["speculative.model"]
    (tmp_path / "ngram.yaml").write_text(yaml.safe_dump(doc))
    assert load_space(tmp_path / "ngram.yaml")


def test_plan_and_the_capacity_check_refuse_it_too(tmp_path, tiny_model, capsys):
    target = checkpoint(tmp_path / "target", tiny_model)
    wide = checkpoint(tmp_path / "wide", tiny_model, vocab_size=TINY_CONFIG["vocab_size"] + 64)
    argv = ["plan", "--model", str(target), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--speculative-config"]
    spec = {"method": "draft_model", "model": str(wide), "num_speculative_tokens": 2}
    assert cli.main([*argv, json.dumps(spec)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"speculative_config model {wide}: its vocab_size 322" in err[0]
    assert cli.main([*argv, json.dumps({**spec, "model": str(target)})]) == 0
    capsys.readouterr()
    arch = arch_from_hf_config(json.loads((target / "config.json").read_text()), str(target))
    draft = arch_from_hf_config(json.loads((wide / "config.json").read_text()), str(wide))
    with pytest.raises(UserError, match="vocab_size 322"):
        check_draft(arch, draft, {"speculative_config": spec})
    check_draft(arch, draft, {"speculative_config": {**spec, "use_heterogeneous_vocab": True}})
    check_draft(arch, arch, {"speculative_config": {**spec, "model": str(target)}})
