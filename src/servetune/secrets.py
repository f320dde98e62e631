"""What servetune never writes down: secret environment values and secret engine arguments.

Two rules, one per kind of name, because the two kinds of names mean different things:

- An **environment variable** is a secret when a *word* of its name (the name split at ``_``,
  ``-``, ``.``) says so: ``TOKEN``, ``SECRET``, ``PASSWORD``, ``CREDENTIALS``, ``AUTH``... or a
  pair of words does: ``API_KEY``, ``ACCESS_KEY``, ``PRIVATE_KEY``. ``HF_TOKEN`` and
  ``WANDB_API_KEY`` are secrets; ``VLLM_CPU_KVCACHE_SPACE`` and ``MAX_NUM_BATCHED_TOKENS`` (the
  word is TOKENS, a count) are not.
- An **engine argument** is a secret only when vLLM's server takes a credential through it:
  ``api_key`` and ``hf_token`` (a token given as text; ``hf_token: true`` only says "use the
  stored one"). Every other engine argument is configuration and is shown as it is, since a
  masked ``--max-num-batched-tokens '***'`` makes an exported command undeployable.

A parameter named ``env.NAME`` (the search's way of varying the engine's environment) follows
the environment rule.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

MASK = "***"

_SECRET_WORDS = frozenset(
    {"TOKEN", "SECRET", "PASSWORD", "PASSWD", "PASSPHRASE", "CREDENTIAL", "CREDENTIALS", "AUTH",
     "AUTHORIZATION", "APIKEY", "COOKIE"}
)  # fmt: skip
_SECRET_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"), ("SECRET", "KEY")})
_WORD = re.compile(r"[A-Za-z0-9]+")

#: vLLM server options whose value is a credential.
SECRET_ENGINE_ARGS = frozenset({"api_key", "hf_token"})


def is_secret_env(name: str) -> bool:
    """Whether an environment variable's name says its value is a secret (see the module's rule)."""
    words = [w.upper() for w in _WORD.findall(name)]
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_PAIRS for pair in itertools.pairwise(words))


def is_secret_engine_arg(name: str, value: Any) -> bool:
    """Whether an engine argument carries a credential: ``api_key``, or ``hf_token`` given as text."""
    key = name.strip().lstrip("-").replace("-", "_")
    if key not in SECRET_ENGINE_ARGS or value is None or isinstance(value, bool):
        return False
    return not (isinstance(value, str) and value.strip().lower() in ("", "true", "false"))


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment safe to write to disk, MLflow or a report: secrets become ``***``."""
    return {k: (MASK if is_secret_env(k) else v) for k, v in env.items()}


def redact_engine_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Engine arguments with credentials (``api_key``, ``hf_token``) as ``***``; the rest as they are."""
    return {k: (MASK if is_secret_engine_arg(k, v) else v) for k, v in args.items()}


def redact_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's chosen values: ``env.NAME`` keys by the environment rule, the rest as engine arguments."""
    # Here, not at the top: every Serve replica's core claim imports this module (serve/claims.py, serve/cores.py),
    # and config.space brings the search space's models and capacity/ with it (0.1-0.5 s of a core per replica).
    from servetune.config.space import ENV_PREFIX

    out: dict[str, Any] = {}
    for key, value in params.items():
        if key.startswith(ENV_PREFIX):
            out[key] = MASK if is_secret_env(key[len(ENV_PREFIX) :]) else value
        else:
            out[key] = MASK if is_secret_engine_arg(key, value) else value
    return out
