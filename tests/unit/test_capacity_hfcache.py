"""The cache of configs transformers resolves (``capacity/hfcache.py``): a second read of a model never imports
transformers, and reads the same architecture as the first; nothing the answer depends on can be changed without
the cache missing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.capacity import arch_from_hf_config, hfcache, hfconfig
from servetune.capacity.hfconfig import with_hf_overrides
from servetune.models.tiny import TINY_CONFIG
from servetune.models.tinyarch import TINY_ARCHS

# A vision-language config (the tiny gemma-3 decoder under Gemma3ForConditionalGeneration, a two-block SigLIP tower):
# transformers resolves a vision config with an int-keyed ``id2label``, which JSON would give back with str keys.
TINY_VLM = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {k: v for k, v in TINY_ARCHS["gemma3"].items() if k != "architectures"},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                      "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 224, "patch_size": 14},
}  # fmt: skip
CONFIGS = {**TINY_ARCHS, "gemma3-vlm": TINY_VLM}

# Reads each config.json named as the planner does and says which architecture it read and whether transformers (or
# torch) had come in by then, one line each.
READ = r"""
import json, sys
from servetune.capacity import arch_from_hf_config
for path in sys.argv[1:]:
    arch = arch_from_hf_config(json.loads(open(path).read()), name="tiny")
    print(json.dumps({"arch": arch.model_dump(mode="json"), "transformers": "transformers" in sys.modules,
                      "torch": "torch" in sys.modules}))
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "servetune" / "hf-configs"


def _read_in_a_process(configs: list[Path], xdg: Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    done = subprocess.run([sys.executable, "-c", READ, *map(str, configs)], capture_output=True, text=True,
                          timeout=300, env={**env, "XDG_CACHE_HOME": str(xdg)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines()[-len(configs) :]]


def test_a_second_read_in_a_new_process_imports_neither_transformers_nor_torch(tmp_path: Path) -> None:
    """Text only (gemma3) and multimodal (text_config and vision tower), both read in one process and then again in
    another: one process per read and config imported transformers twice (6-7 core-s each) for the same check."""
    names = ["gemma3", "gemma3-vlm"]
    configs = [tmp_path / f"{name}.json" for name in names]
    for name, config in zip(names, configs, strict=True):
        config.write_text(json.dumps(CONFIGS[name]))
    cached = tmp_path / "xdg" / "servetune" / "hf-configs"
    first = _read_in_a_process(configs, tmp_path / "xdg")
    assert first[0]["transformers"], "the first read resolves the config through transformers"
    assert len(list(cached.glob("*.json"))) == len(names), "each config was read and kept"
    second = _read_in_a_process(configs, tmp_path / "xdg")
    for name, cold, warm in zip(names, first, second, strict=True):
        assert not warm["transformers"] and not warm["torch"], name
        assert warm["arch"] == cold["arch"], name
    assert len(list(cached.glob("*.json"))) == len(names), "the second reads wrote nothing new"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_cached_read_is_the_resolved_one(name: str, cache: Path) -> None:
    cold = arch_from_hf_config(CONFIGS[name], f"tiny-{name}")
    assert list(cache.glob("*.json")), "the first read is kept"
    warm = arch_from_hf_config(CONFIGS[name], f"tiny-{name}")
    assert warm == cold


def test_a_changed_config_is_read_again(cache: Path) -> None:
    arch_from_hf_config(TINY_CONFIG, "tiny")
    deeper = arch_from_hf_config({**TINY_CONFIG, "num_hidden_layers": TINY_CONFIG["num_hidden_layers"] + 3}, "tiny")
    assert deeper.num_layers == TINY_CONFIG["num_hidden_layers"] + 3
    assert len(list(cache.glob("*.json"))) == 2


def test_overrides_are_part_of_the_key(cache: Path) -> None:
    plain = arch_from_hf_config(TINY_CONFIG, "tiny")
    longer = with_hf_overrides(plain, {"max_position_embeddings": 4 * plain.max_position_embeddings})
    assert longer.max_position_embeddings == 4 * plain.max_position_embeddings
    assert arch_from_hf_config(TINY_CONFIG, "tiny") == plain
    assert len(list(cache.glob("*.json"))) == 2


def test_the_key_holds_the_library_versions_and_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = Path(hfconfig.__file__)
    key = hfcache.config_key(TINY_CONFIG, {}, code)
    assert key is not None and key == hfcache.config_key(dict(reversed(TINY_CONFIG.items())), {}, code)
    changed_code = tmp_path / "hfconfig.py"
    changed_code.write_text(code.read_text() + "\n# changed\n")
    assert hfcache.config_key(TINY_CONFIG, {}, changed_code) != key
    real = importlib.metadata.version
    for library in hfcache.LIBRARIES:
        monkeypatch.setattr(
            importlib.metadata, "version", lambda name, lib=library: "0.0.1" if name == lib else real(name)
        )
        hfcache._library_versions.cache_clear()  # asked once per process
        assert hfcache.config_key(TINY_CONFIG, {}, code) != key, library
    monkeypatch.setattr(importlib.metadata, "version", real)
    hfcache._library_versions.cache_clear()
    assert hfcache.config_key(TINY_CONFIG, {"vocab_size": 1}, code) != key
    assert hfcache.config_key(TINY_CONFIG, {"bad": object()}, code) is None  # nothing to key on: not cached


def test_a_stale_file_under_another_key_is_not_read(cache: Path) -> None:
    plain = arch_from_hf_config(TINY_CONFIG, "tiny")
    (kept,) = cache.glob("*.json")
    fooled = json.loads(kept.read_text())
    fooled["num_hidden_layers"] = 99
    kept.write_text(json.dumps(fooled))  # the cache is read by key: this file now answers wrongly for its own key...
    assert arch_from_hf_config(TINY_CONFIG, "tiny").num_layers == 99
    # ...but any change to what the answer depends on reads the config afresh
    wider = arch_from_hf_config({**TINY_CONFIG, "vocab_size": TINY_CONFIG["vocab_size"] + 64}, "tiny")
    assert wider.num_layers == plain.num_layers


def test_answers_json_cannot_state_exactly_and_broken_files_are_not_used(cache: Path) -> None:
    key = hfcache.config_key(TINY_CONFIG, {}, Path(hfconfig.__file__))
    hfcache.write_config(key, {"layer_types": ("full_attention",)})  # a tuple would come back a list
    hfcache.write_config(key, {"x": float("nan")})
    assert not list(cache.glob("*.json"))
    cache.mkdir(parents=True)
    (cache / f"{key}.json").write_text("{not json")
    assert hfcache.read_config(key) is None
    assert arch_from_hf_config(TINY_CONFIG, "tiny").num_layers == TINY_CONFIG["num_hidden_layers"]
    assert hfcache.read_config(key) is not None  # written again


def test_the_cache_keeps_the_most_recently_used(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hfcache, "KEPT_CONFIGS", 3)
    keys = [f"{i:064x}" for i in range(4)]
    for i, key in enumerate(keys[:3]):
        hfcache.write_config(key, {"i": i})
        os.utime(cache / f"{key}.json", (1000 + i, 1000 + i))  # written long ago, oldest first
    assert hfcache.read_config(keys[0]) == {"i": 0}  # used now
    hfcache.write_config(keys[3], {"i": 3})
    assert sorted(p.stem for p in cache.glob("*.json")) == sorted([keys[0], keys[2], keys[3]])
