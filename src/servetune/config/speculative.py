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
#: The ``SpeculativeConfig`` fields a space may set, with the kind of value each takes (vLLM 0.32).
FIELDS: dict[str, str] = {
    "method": "method",
    "num_speculative_tokens": "count",
    "model": "text",
    "revision": "text",
    "quantization": "text",
    "prompt_lookup_max": "count",
    "prompt_lookup_min": "count",
    "draft_tensor_parallel_size": "count",
    "max_model_len": "count",
    "disable_padded_drafter_batch": "switch",
    "parallel_drafting": "switch",
    "suffix_decoding_max_tree_depth": "count",
    "suffix_decoding_max_cached_requests": "count",
    "suffix_decoding_max_spec_factor": "fraction",
    "suffix_decoding_min_token_prob": "fraction",
    "draft_sample_method": "text",
    "use_heterogeneous_vocab": "switch",
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
        "count": number is not None and float(number).is_integer() and number >= 1,
        "text": isinstance(value, str) and bool(value),
        "switch": isinstance(value, bool),
        "fraction": number is not None and 0 <= number < math.inf,
    }[kind]
    if not ok:
        wanted = {
            "method": "one of " + ", ".join(METHODS),
            "count": "a whole number, 1 or more",
            "text": "a non-empty string",
            "switch": "true or false",
            "fraction": "a number, 0 or more",
        }[kind]
        raise ValueError(f"{name}: expected {wanted}, got {value!r}")


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
            out[field] = int(value) if FIELDS.get(field) == "count" else value
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
