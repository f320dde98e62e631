"""Speculative decoding as search parameters: ``speculative.<field>`` names -> vLLM's ``--speculative-config``.

A space varies speculation with parameters (or fixes it in ``engine_args``) named after the fields of
vLLM's ``SpeculativeConfig`` (vLLM 0.32, ``vllm/config/speculative.py``) behind a ``speculative.``
prefix: ``speculative.method`` (one of :data:`METHODS`; ``none`` passes no flag),
``speculative.num_speculative_tokens``, ``speculative.prompt_lookup_max`` ... A choice's fields become
one JSON object for ``--speculative-config``; :func:`violations` states what vLLM would refuse at
start-up (a draft model missing, ``prompt_lookup_min`` above ``prompt_lookup_max``) before any engine
starts, and :func:`mtp_layers` reads whether a checkpoint carries the heads MTP drafts with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from servetune.capacity.arch import MTP_KEYS

PREFIX = "speculative."
METHOD = PREFIX + "method"
#: ``none`` passes no ``--speculative-config``; the others are vLLM's method names.
METHODS = ("none", "ngram", "suffix", "eagle", "eagle3", "draft_model", "mtp")
#: Methods that draft with a second checkpoint, named by ``speculative.model``.
DRAFT_METHODS = ("eagle", "eagle3", "draft_model")
#: The ``SpeculativeConfig`` fields a space may set, with the kind of value each takes (vLLM 0.32,
#: ``vllm/config/speculative.py``; vLLM checks the choices of the ``text`` ones at start-up).
FIELDS: dict[str, str] = {
    "method": "method",
    "num_speculative_tokens": "count",
    "model": "text",
    "revision": "text",
    "code_revision": "text",
    "quantization": "text",
    "moe_backend": "text",
    "attention_backend": "text",
    "kv_cache_dtype": "text",
    "enforce_eager": "switch",
    "prompt_lookup_max": "count",
    "prompt_lookup_min": "count",
    "draft_tensor_parallel_size": "count",
    "max_model_len": "count",
    "index_share_for_mtp_iteration": "switch",
    "disable_padded_drafter_batch": "switch",
    "disable_eagle_block_drop": "switch",
    "use_local_argmax_reduction": "switch",
    "parallel_drafting": "switch",
    # The draft tokens by batch size, ``[[first, last, tokens], ...]``: speculation that drafts less as batches grow.
    "num_speculative_tokens_per_batch_size": "schedule",
    "suffix_decoding_max_tree_depth": "count",
    "suffix_decoding_max_cached_requests": "size",  # 0 turns the global suffix tree off
    "suffix_decoding_max_spec_factor": "fraction",
    "suffix_decoding_min_token_prob": "fraction",
    "rejection_sample_method": "text",
    "synthetic_acceptance_rates": "rates",
    "synthetic_acceptance_length": "fraction",
    "enable_adaptive_verification": "switch",
    "draft_sample_method": "text",
    "dspark_draft_topk": "count",
    "use_heterogeneous_vocab": "switch",
}
#: The ``SpeculativeConfig`` fields servetune does not pass, and why.
NOT_PASSED: dict[str, str] = {
    "tensor_parallel_size": "vLLM only warns that it is draft_tensor_parallel_size",
    "target_model_config": "vLLM sets it from the engine's own arguments",
    "target_parallel_config": "vLLM sets it from the engine's own arguments",
    "draft_model_config": "vLLM builds it from speculative.model",
    "draft_parallel_config": "vLLM builds it from speculative.draft_tensor_parallel_size",
    "draft_load_config": "an object vLLM makes; the draft loads as the target does",
}


def is_speculative(name: str) -> bool:
    return name.startswith(PREFIX)


def check_value(name: str, value: object) -> None:
    """Raise ValueError naming ``name`` when ``value`` cannot be that field's (a range's bound included)."""
    field = name[len(PREFIX) :]
    kind = FIELDS.get(field)
    if kind is None:
        raise ValueError(f"{name}: not a speculative decoding field servetune passes (known: {', '.join(FIELDS)})")
    if value is None and field != "method":
        return
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    ok = {
        "method": value in METHODS,
        "count": _whole(value, 1),
        "size": _whole(value, 0),
        "text": isinstance(value, str) and bool(value),
        "switch": isinstance(value, bool),
        "fraction": number is not None and 0 <= number < math.inf,
        "schedule": _schedule(value),
        "rates": isinstance(value, list) and bool(value) and all(_number(r) and 0 <= r <= 1 for r in value),
    }[kind]
    if not ok:
        wanted = {
            "method": "one of " + ", ".join(METHODS),
            "count": "a whole number, 1 or more",
            "size": "a whole number, 0 or more",
            "text": "a non-empty string",
            "switch": "true or false",
            "fraction": "a number, 0 or more",
            "schedule": "a list of [first batch size, last, draft tokens], the ranges from batch 1 on, none overlapping",
            "rates": "a list of numbers from 0 to 1, one per draft position",
        }[kind]
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _whole(value: object, least: int) -> bool:
    return _number(value) and float(value).is_integer() and value >= least  # type: ignore[arg-type,operator]


def _schedule(value: object) -> bool:
    """``num_speculative_tokens_per_batch_size`` as vLLM 0.32 accepts it (``v1/spec_decode/dynamic/utils.py``):
    ``[first, last, tokens]`` entries, batch sizes from 1, ``first <= last``, tokens 0 or more; sorted by ``first``,
    the first starts at 1 and none overlaps the one before."""
    if not (isinstance(value, list) and value):
        return False
    if not all(isinstance(e, list) and len(e) == 3 and all(_whole(v, 0) for v in e) for e in value):
        return False
    ranges = sorted((int(e[0]), int(e[1])) for e in value)
    ends = [0] + [last for _, last in ranges[:-1]]
    return ranges[0][0] == 1 and all(end < first <= last for (first, last), end in zip(ranges, ends, strict=True))


def config_of(values: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``--speculative-config`` object of a choice's ``speculative.*`` values; None: no speculation
    (no method, or ``none``, whatever the other fields say)."""
    method = values.get(METHOD)
    if method is None or method == "none":
        return None
    out = {"method": method}
    for name, value in values.items():
        if is_speculative(name) and name != METHOD and value is not None:
            field = name[len(PREFIX) :]
            out[field] = int(value) if FIELDS.get(field) in ("count", "size") else value
    return out


def violations(values: Mapping[str, Any]) -> list[str]:
    """What vLLM would refuse at start-up about this choice's speculation, one reason each."""
    config = config_of(values)
    if config is None:
        return []
    broken = []
    method = config["method"]
    if method in DRAFT_METHODS and not config.get("model"):
        broken.append(f"{METHOD}={method} drafts with a second checkpoint: set {PREFIX}model")
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if low is not None and high is not None and low > high:
        broken.append(f"{PREFIX}prompt_lookup_min ({low}) is above {PREFIX}prompt_lookup_max ({high})")
    return broken


def mtp_layers(hf_config: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers a Hugging Face config declares (0: none; MTP cannot draft)."""
    for config in (hf_config, hf_config.get("text_config") or {}):
        for key in MTP_KEYS:
            value = config.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 0
