"""The model hub, asked once from the driver before any trial: does it serve this model to this token?

A gated model without an accepted token otherwise fails every trial the same way, each after its engine
start (trial/failures.py calls that the cluster's, so nothing is learned). One request to the hub's
``auth-check`` settles it in a second, in one line. A hub that cannot be reached (an air-gapped driver, the
weights in a local cache or a mirror) is no verdict: the study goes on with a warning.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from servetune.errors import UserError

TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def _set(env: Mapping[str, str], names: Iterable[str]) -> str | None:
    return next((env[n] for n in names if env.get(n)), None)


def offline(env: Mapping[str, str]) -> bool:
    """Whether the space's ``env`` or this process tells Hugging Face to stay offline (the weights come from a
    cache): the first of :data:`OFFLINE_VARIABLES` set, as huggingface_hub reads them (``0``/``false``: online)."""
    return _set({**os.environ, **env}, OFFLINE_VARIABLES) not in (None, "0", "false", "False")


def check_access(model: str, env: Mapping[str, str], field: str = "model") -> str | None:
    """Raise :class:`UserError` when the hub refuses ``model`` to the token the trials will use (the space's
    ``env`` first, then this process's); a warning when the hub could not be asked; None when it serves it.
    ``field``: where the space names it (``model``, or ``params.model`` for a checkpoint the search varies)."""
    if offline(env):
        return None  # offline by the user's choice: the weights come from a cache
    merged = {**os.environ, **env}
    from huggingface_hub import auth_check
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    token = _set(merged, TOKEN_VARIABLES)
    where = "with the token in " + next(n for n in TOKEN_VARIABLES if merged.get(n)) if token else "without a token"
    try:
        auth_check(model, token=token or None)
    except GatedRepoError:
        raise UserError(f"{field} {model}: gated on the hub, and it refuses access {where}; accept its terms at "
                        f"https://huggingface.co/{model} and set HF_TOKEN (in the space's env: or the shell)") from None  # fmt: skip
    except RepositoryNotFoundError:
        raise UserError(f"{field} {model}: not on the hub, or private and refused {where}") from None
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        if status in (401, 403):
            raise UserError(f"{field} {model}: the hub refuses access {where} (HTTP {status})") from None
        return f"{field} {model}: the hub answered HTTP {status} to an access check; the trials will find out"
    except Exception as exc:  # no route to the hub, DNS, a proxy: not a verdict on access
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{field} {model}: could not ask the hub for access ({first}); the trials will find out"
    return None
