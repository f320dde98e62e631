"""Whether a draft model shares its target's vocabulary, as speculative decoding with ``draft_model`` needs.

vLLM 0.32 loads the draft with the target's tokenizer and, unless ``use_heterogeneous_vocab`` maps one
vocabulary onto the other, refuses a draft whose ``vocab_size`` differs from the target's
(``SpeculativeConfig.verify_equal_vocab_size_if_draft_model``, in ``vllm/config/speculative.py``, run when
the config is validated and again by ``v1/spec_decode/draft_model.py``: "Target and draft model should have
the same vocabulary size ... Using models with different tokenizers can cause out-of-bounds errors"). It
does not compare the tokenizers themselves: a draft of the same vocabulary size whose tokenizer gives other
ids to other text starts, and drafts ids that mean other words to the target (acceptance near none). So both
are checked here, where the files are at hand: ``vocab_size`` from the configs, and each checkpoint's
``tokenizer.json`` (its model's vocabulary and added tokens, id by id). Nothing is downloaded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servetune.capacity.model import ModelArch

TOKENIZER_FILE = "tokenizer.json"
#: The speculative methods whose drafter reads token ids with the target's tokenizer from a checkpoint of its own.
DRAFT_MODEL = "draft_model"


def tokenizer_tokens(text: str) -> dict[int, str] | None:
    """id -> token of a ``tokenizer.json`` text: its model's vocabulary (a token->id map, or Unigram's list of
    [piece, score]) and its added tokens. None where the text is not such a file."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        tokens = {int(i): str(t) for t, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):
        tokens = {i: str(entry[0]) for i, entry in enumerate(vocab) if isinstance(entry, list) and entry}
    else:
        return None
    for added in data.get("added_tokens") or ():
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            tokens[added["id"]] = str(added.get("content"))
    return tokens


def read_tokenizer(directory: Path) -> dict[int, str] | None:
    """The tokens of ``directory``/tokenizer.json; None where there is none or it cannot be read."""
    try:
        return tokenizer_tokens((directory / TOKENIZER_FILE).read_text(encoding="utf-8"))
    except OSError:
        return None


def vocab_problem(
    target_size: int | None,
    draft_size: int | None,
    target_tokens: dict[int, str] | None = None,
    draft_tokens: dict[int, str] | None = None,
) -> str | None:
    """Why a draft cannot draft for the target (None: it can, or what is at hand cannot tell): the vocabulary
    sizes (from the configs, which vLLM compares) or, where both tokenizers are at hand, the tokens themselves."""
    if target_size is not None and draft_size is not None and target_size != draft_size:
        return (
            f"its vocab_size {draft_size} is not the target's {target_size}: vLLM refuses a draft model with "
            "another vocabulary (it drafts with the target's tokenizer)"
        )
    if target_tokens is None or draft_tokens is None or target_tokens == draft_tokens:
        return None
    differ = sorted(
        i for i in target_tokens.keys() | draft_tokens.keys() if target_tokens.get(i) != draft_tokens.get(i)
    )
    first = differ[0]
    return (
        f"its tokenizer is not the target's ({len(differ)} token ids differ; id {first} is "
        f"{target_tokens.get(first)!r} for the target and {draft_tokens.get(first)!r} for the draft): the draft would "
        "propose ids that mean other text, and almost none would be accepted"
    )


def checkpoint_tokens(model: str) -> dict[int, str] | None:
    """The tokens of a checkpoint's tokenizer where it is at hand: a local directory, or a hub id whose
    ``tokenizer.json`` is in the local Hugging Face cache. None elsewhere (nothing is downloaded)."""
    directory = Path(model).expanduser()
    if directory.is_dir():
        return read_tokenizer(directory)
    if model.count("/") != 1:
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, TOKENIZER_FILE)
    return read_tokenizer(Path(cached).parent) if isinstance(cached, str) else None


def config_vocab_size(config: Mapping[str, Any]) -> int | None:
    """A Hugging Face config's ``vocab_size`` (a vision-language model's in its ``text_config``)."""
    for where in (config, config.get("text_config") or {}):
        value = where.get("vocab_size")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def draft_vocab_problem(target: ModelArch, draft: ModelArch, speculative_config: Mapping[str, Any]) -> str | None:
    """Why ``draft`` cannot draft for ``target`` under ``speculative_config`` (None: it can, another method, or a
    mapping between the vocabularies asked for), from their configs and the tokenizers at hand."""
    if speculative_config.get("method") != DRAFT_MODEL or speculative_config.get("use_heterogeneous_vocab"):
        return None
    return vocab_problem(
        target.vocab_size, draft.vocab_size, checkpoint_tokens(target.name), checkpoint_tokens(draft.name)
    )
