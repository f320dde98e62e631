"""load_tokenizer reads a plain tokenizer.json with ``tokenizers`` and must agree with AutoTokenizer
(what vLLM counts with) on every call servetune makes, without importing transformers."""

import itertools
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.load.requests import PromptFactory, iter_requests
from servetune.load.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "",
    " ",
    "hello world",
    "  two  spaces\tand a tab\n",
    "Ünïcödé, 漢字 and 🙂 emoji",
    "<s> a special token in the text </s>",
    "tokens<s>glued</s>on",
    "1234567890 !@#$%^&*()",
    "a" * 300,
]


def auto_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    """A byte-level BPE with a real merge table (whole words with a leading space, as LLM vocabularies
    have) whose post-processor puts a BOS token first, as Llama 3's tokenizer.json does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(3, 9))) for _ in range(900)]
    corpus = [" ".join(rng.choice(words, size=50)) for _ in range(400)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<s>", "</s>"], initial_alphabet=alphabet)
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    path = tmp_path_factory.mktemp("word-model")
    backend.save(str(path / "tokenizer.json"))
    # add_eos_token: transformers ignores it beside a tokenizer.json (the post-processor decides); so must servetune.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_eos_token": True,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("model", ["tiny_model", "word_model"])
def test_the_fast_tokenizer_agrees_with_auto_tokenizer(model, request):
    path = request.getfixturevalue(model)
    fast, auto = load_tokenizer(str(path)), auto_tokenizer(path)
    assert isinstance(fast, FastTokenizer)
    assert len(fast) == len(auto)
    assert fast.all_special_ids == auto.all_special_ids and fast.all_special_ids
    for text in TEXTS:
        for special in (True, False):
            ids = fast.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special), (text, special)
        assert fast.decode(ids) == auto.decode(ids)
    every = [[i] for i in range(len(auto))]
    assert fast.batch_decode(every) == auto.batch_decode(every)
    pairs = [[i, j] for i, j in itertools.product(range(0, len(auto), 37), repeat=2)]
    assert fast.batch_decode(pairs) == auto.batch_decode(pairs)
    if model == "word_model":  # the post-processor's BOS, and no EOS
        assert fast.encode("abc", add_special_tokens=True)[0] == 0 and 1 not in fast.encode(
            "abc", add_special_tokens=True
        )


@pytest.mark.parametrize("model", ["tiny_model", "word_model"])
def test_prompts_are_the_same_for_a_seed_on_either_tokenizer(model, request):
    path = request.getfixturevalue(model)
    workload = Workload.model_validate(
        {
            "name": "t",
            "input_tokens": {"dist": "uniform", "min": 1, "max": 400},
            "output_tokens": {"dist": "fixed", "value": 8},
            "shared_prefix": {"tokens": 32, "fraction": 0.5},
        }
    )
    fast, auto = PromptFactory(load_tokenizer(str(path))), PromptFactory(auto_tokenizer(path))
    assert list(fast.pool) == list(auto.pool)
    if model == "word_model":
        assert len(fast.pool) >= 500  # the word pool, not single characters
    stream = lambda factory: list(itertools.islice(iter_requests(workload, factory, stream=3), 40))  # noqa: E731
    assert stream(fast) == stream(auto)


def test_a_trial_worker_imports_neither_transformers_nor_mlflow(tiny_model):
    # What a Ray Tune worker imports to run a trial: the trainable's module, the runner, the prompts.
    code = (
        "import sys, itertools\n"
        "import servetune.study.driver, servetune.study.early_stop, servetune.trial.runner\n"
        "from servetune.config.workload import load_workload\n"
        "from servetune.load.requests import PromptFactory, iter_requests\n"
        "from servetune.load.tokenizer import load_tokenizer\n"
        f"factory = PromptFactory(load_tokenizer({str(tiny_model)!r}))\n"
        "list(itertools.islice(iter_requests(load_workload('cpu-tiny'), factory), 5))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers', 'mlflow'}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "update",
    [
        {"tokenizer_class": "GPT2Tokenizer"},  # transformers 5 rebuilds a model-specific class's pipeline
        {"tokenizer_class": None},  # transformers picks a class from config.json
        {"additional_special_tokens": ["<image>"]},  # transformers adds it to the vocabulary
    ],
)
def test_a_directory_transformers_would_change_goes_through_auto_tokenizer(tiny_model, tmp_path, update):
    model = shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, **update}))
    tokenizer = load_tokenizer(str(model))
    assert not isinstance(tokenizer, FastTokenizer)
    if "additional_special_tokens" in update:
        assert len(tokenizer) == len(load_tokenizer(str(tiny_model))) + 1


def test_a_broken_tokenizer_json_is_one_line_naming_the_file(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(UserError) as raised:
        load_tokenizer(str(model))
    assert str(model / "tokenizer.json") in str(raised.value) and "\n" not in str(raised.value)


def test_a_missing_tokenizer_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot load the tokenizer of") as raised:
        load_tokenizer(str(tmp_path / "no-such-model"))
    assert "\n" not in str(raised.value)
