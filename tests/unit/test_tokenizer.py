"""load_tokenizer reads a plain tokenizer.json with ``tokenizers`` and must agree with AutoTokenizer
(what vLLM counts with) on every call servetune makes, without importing transformers."""

import hashlib
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.load import tokenizer as tokenizer_module
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


REVISION = "0123456789abcdef0123456789abcdef01234567"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def cache_repo(cache, repo_id, model, files=TOKENIZER_FILES, absent=()):
    """Lay ``files`` of the directory ``model`` out as the hub cache holds a download of ``repo_id``:
    blobs, a snapshot of links to them, ``refs/main``; ``absent``: files it knows the repository lacks."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name in files:
        blob = hashlib.sha256((model / name).read_bytes()).hexdigest()
        shutil.copy(model / name, repo / "blobs" / blob)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    for name in absent:
        (repo / ".no_exist" / REVISION).mkdir(parents=True, exist_ok=True)
        (repo / ".no_exist" / REVISION / name).touch()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache in HF_HUB_CACHE (and in huggingface_hub's constant, which it reads from there on
    import), and transformers' loader replaced by one that records what reached it."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    to_transformers: list[str] = []
    monkeypatch.setattr(tokenizer_module, "_load_auto", lambda name: to_transformers.append(name) or "auto")
    return cache, to_transformers


def test_a_hub_id_in_the_cache_is_read_with_tokenizers_not_transformers(tiny_model, tmp_path):
    cache = tmp_path / "hf-home" / "hub"
    cache_repo(cache, "servetune-test/tiny", tiny_model)
    code = (
        "import sys\n"
        "from servetune.load.tokenizer import load_tokenizer\n"
        "tokenizer = load_tokenizer('servetune-test/tiny')\n"
        "print(type(tokenizer).__name__, len(tokenizer), tokenizer.encode('hello world', add_special_tokens=True))\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'transformers'}))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    local = load_tokenizer(str(tiny_model))
    expected = f"FastTokenizer {len(local)} {local.encode('hello world', add_special_tokens=True)}"
    assert done.stdout.splitlines() == [expected, "[]"]


@pytest.mark.parametrize(
    ("files", "absent", "fast"),
    [
        (TOKENIZER_FILES, (), True),
        (TOKENIZER_FILES[:2], TOKENIZER_FILES[2:], True),  # the cache knows the repo has no special_tokens_map
        (TOKENIZER_FILES[:2], (), False),  # it does not know: the file may change what transformers does
        (TOKENIZER_FILES[:1], TOKENIZER_FILES[2:], False),  # no tokenizer_config.json to name the class
        ((), (), False),
    ],
)
def test_a_hub_id_goes_to_transformers_unless_the_cache_holds_what_decides(tiny_model, hub_cache, files, absent, fast):
    cache, to_transformers = hub_cache
    cache_repo(cache, "servetune-test/tiny", tiny_model, files, absent)
    tokenizer = load_tokenizer("servetune-test/tiny")
    if fast:
        assert isinstance(tokenizer, FastTokenizer) and len(tokenizer) == len(load_tokenizer(str(tiny_model)))
        assert to_transformers == []
    else:
        assert tokenizer == "auto" and to_transformers == ["servetune-test/tiny"]


def test_a_hub_id_not_in_the_cache_goes_to_transformers(hub_cache):
    _, to_transformers = hub_cache
    assert load_tokenizer("servetune-test/elsewhere") == "auto" and to_transformers == ["servetune-test/elsewhere"]
