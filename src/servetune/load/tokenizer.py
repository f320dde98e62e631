"""The served model's tokenizer, loaded without importing transformers where it can be.

``import transformers`` takes 7-9 s and half a gigabyte on a small host, and every trial worker,
``bench``, ``verify`` and ``serve-check`` loads a tokenizer. Where ``tokenizer_config.json`` names
``PreTrainedTokenizerFast`` (or ``TokenizersBackend``), transformers serves the directory's
``tokenizer.json`` as it is through Hugging Face's ``tokenizers``, so reading that file with
``tokenizers`` gives the same ids, text and vocabulary size as ``AutoTokenizer`` (which vLLM counts
with). transformers ignores ``add_bos_token`` / ``add_eos_token`` beside a ``tokenizer.json`` (its
post-processor decides), and so does this.

A hub id is looked up in the Hugging Face cache (``huggingface_hub.try_to_load_from_cache``, no
network): a snapshot that holds ``tokenizer.json``, at the revision the cache's ``refs/main``
names, is read as a directory is, where the cache also knows of each other file read here whether
the repository has it (transformers would fetch one it does not know of).

Everything else goes through ``AutoTokenizer``: a hub id not in the cache, a directory without
``tokenizer.json``, a model-specific class (transformers 5 rebuilds those from the file's
vocabulary with the class's own pre-tokenizer), no class named (transformers picks one from
``config.json``), a config that asks transformers to change what the file does (cleaning up
decoded spaces, a special token the vocabulary lacks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.errors import UserError

if TYPE_CHECKING:
    # what the request stream needs of a tokenizer; this module serves it (requests.py imports nothing from here)
    from servetune.load.requests import Tokenizer

#: Classes whose ``from_pretrained`` serves ``tokenizer.json`` as it is.
_PLAIN_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}
#: The named special tokens transformers adds to the vocabulary when they are missing from it.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: The files :func:`_load_fast` reads, ``tokenizer.json`` first.
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class FastTokenizer:
    """A ``tokenizers.Tokenizer`` with the part of transformers' interface servetune calls.

    ``all_special_ids`` are the added tokens marked special in ``tokenizer.json``, in id order.
    """

    def __init__(self, backend: Any, special_ids: list[int]) -> None:
        self.backend = backend
        self.all_special_ids = special_ids

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return self.backend.decode_batch([[int(i) for i in row] for row in ids], skip_special_tokens=False)


def load_tokenizer(name: str) -> Tokenizer:
    """The served model's tokenizer (a directory or a hub id); a failure is a UserError."""
    directory = Path(name) if Path(name).is_dir() else _cached_snapshot(name)
    fast = _load_fast(directory) if directory is not None else None
    if fast is not None:
        return fast
    return _load_auto(name)


def _load_auto(name: str) -> Tokenizer:
    """The tokenizer as transformers' ``AutoTokenizer`` loads it (fetching a hub id it lacks)."""
    from transformers import AutoTokenizer

    try:
        # transformers types decode() as str | list[str] (it also takes a batch); for one list of ids it is str
        return AutoTokenizer.from_pretrained(name)  # type: ignore[return-value]
    except Exception as exc:  # transformers raises many kinds for a missing or broken tokenizer
        raise UserError(f"cannot load the tokenizer of '{name}': {str(exc).splitlines()[0][:200]}") from None


def _cached_snapshot(repo_id: str) -> Path | None:
    """The Hugging Face cache's snapshot of ``repo_id`` when it holds ``tokenizer.json`` and knows,
    of the other files :func:`_load_fast` reads, whether the repository has each; else None."""
    from huggingface_hub import try_to_load_from_cache  # a dependency of tokenizers

    try:
        found = [try_to_load_from_cache(repo_id, name) for name in _FILES]
    except ValueError:  # not a hub id (huggingface_hub's HFValidationError)
        return None
    if not isinstance(found[0], str):
        return None
    snapshot = Path(found[0]).parent
    # a file neither there nor known absent (None) may be in the repository; one that is there is in the same snapshot
    if any(path is None or (isinstance(path, str) and Path(path).parent != snapshot) for path in found):
        return None
    return snapshot


def _load_fast(directory: Path) -> FastTokenizer | None:
    """The directory's ``tokenizer.json`` read by ``tokenizers``, or None where transformers would
    not serve that file unchanged."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    config = _read_json(directory / "special_tokens_map.json") | _read_json(directory / "tokenizer_config.json")
    if config.get("tokenizer_class") not in _PLAIN_CLASSES:
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises its own Exception for unreadable or unknown JSON
        raise UserError(f"{path}: not a tokenizer: {str(exc).splitlines()[0][:200]}") from None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers rewrites decoded text for these (" ." -> "."): leave it to it
    named = [config.get(key) for key in _NAMED_SPECIALS]
    for key in ("additional_special_tokens", "extra_special_tokens"):  # a list, or (transformers 5) a dict by name
        listed = config.get(key)
        named += list(listed.values()) if isinstance(listed, dict) else listed if isinstance(listed, list) else []
    if any(backend.token_to_id(token) is None for token in map(_content, named) if token is not None):
        return None  # transformers would add it to the vocabulary
    backend.no_truncation()
    backend.no_padding()
    special = sorted(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return FastTokenizer(backend, special)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _content(token: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None
