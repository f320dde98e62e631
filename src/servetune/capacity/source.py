"""Where a model's ``config.json`` and checkpoint size come from, for a model named any way vLLM accepts.

Tried in this order, the first that answers wins:

1. a local directory (its ``config.json``; its safetensors headers for the size);
2. the local caches, offline-safe: servetune's model store (written by ``servetune models add`` and by
   every fetch from the hub: the config and the safetensors parameter counts), then the Hugging Face
   cache's ``config.json`` (``try_to_load_from_cache``, without the size);
3. the shipped catalogue, for the ids it knows (``arch.py``; no network for them);
4. the hub itself (``HF_ENDPOINT``, ``HF_TOKEN`` for gated repositories): ``config.json`` and the
   safetensors headers (``get_safetensors_metadata``, no weights), then kept in the store.

Offline (``HF_HUB_OFFLINE=1``) with nothing cached, a gated repository without a token, a hub that cannot
be reached: one :class:`UserError` line that says what to do. This module fetches; ``hfconfig.py`` parses.

Inside :func:`hub_closed` step 4 is not taken: ``run --dry-run`` plans from what is on this machine, and learns
which hub models it could not plan, so that it can say how to keep them here (``servetune models add``).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servetune.errors import UserError

CONFIG_FILE = "config.json"
PROBE_TIMEOUT_S = 5.0
#: Inside :func:`hub_closed`: the hub ids :func:`hub_model` was asked for and refused (None: the hub is open).
_closed: ContextVar[set[str] | None] = ContextVar("servetune_hub_closed", default=None)


@dataclass(frozen=True)
class ModelConfig:
    """A model's ``config.json`` as a dict, where it came from, and its checkpoint's parameter counts."""

    name: str
    config: dict[str, Any]
    source: str
    parameters: dict[str, int] | None = None


def model_store() -> Path:
    """servetune's store of fetched models: beside the Hugging Face cache (``HF_HOME``), never in the package."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "servetune" / "models"


def _record_path(repo_id: str) -> Path:
    return model_store() / f"{repo_id.replace('/', '--')}.json"


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _counts(metadata: Any) -> dict[str, int]:
    return {str(dtype): int(count) for dtype, count in metadata.parameter_count.items()}


def local_model(path: Path) -> ModelConfig:
    """A model directory: its ``config.json`` and, where it has safetensors files, their headers' counts."""
    from huggingface_hub import get_local_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise UserError(f"{config_path}: no config.json in the model directory")
    config = _read_json_object(config_path)
    try:
        parameters: dict[str, int] | None = _counts(get_local_safetensors_metadata(path))
    except (NotASafetensorsRepoError, SafetensorsParsingError, OSError):
        parameters = None  # .bin or .gguf weights, a broken header: the ledger's formula sizes them
    return ModelConfig(name=str(path), config=config, source=str(config_path), parameters=parameters)


def cached_model(repo_id: str) -> ModelConfig | None:
    """The model from the local caches only (no network): the store first, then the Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    record = _record_path(repo_id)
    if record.is_file():
        data = _read_json_object(record)
        config, parameters = data.get("config"), data.get("parameters")
        if not isinstance(config, dict):
            raise UserError(f"{record}: no config object; run `servetune models add {repo_id}` again")
        counts = {str(k): int(v) for k, v in parameters.items()} if isinstance(parameters, dict) else None
        return ModelConfig(name=repo_id, config=config, source=str(record), parameters=counts)
    cached = try_to_load_from_cache(repo_id, CONFIG_FILE)
    if isinstance(cached, str):
        return ModelConfig(name=repo_id, config=_read_json_object(Path(cached)), source=cached)
    return None


def _token_words() -> str:
    from huggingface_hub import get_token

    return "with the token in HF_TOKEN" if get_token() else "without a token (HF_TOKEN is not set)"


def _hub_error(repo_id: str, exc: Exception) -> UserError:
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(exc, GatedRepoError):
        return UserError(
            f"model {repo_id}: gated on the hub, which refuses it {_token_words()}; accept its terms at "
            f"its hub page and set HF_TOKEN to a token that may read it"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(f"model {repo_id}: not on the hub, or private and refused {_token_words()} (set HF_TOKEN)")
    if isinstance(exc, HfHubHTTPError):
        status = getattr(exc.response, "status_code", None)
        return UserError(f"model {repo_id}: the hub answered HTTP {status} for its config.json")
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return UserError(f"model {repo_id}: could not fetch its config.json from the hub ({first})")


def _offline_error(repo_id: str, why: str) -> UserError:
    return UserError(
        f"model {repo_id}: {why} and its config.json is not in the local cache; give a local model directory "
        f"(--model /path/to/model) or run `servetune models add {repo_id}` where the hub can be reached"
    )


@functools.cache
def _unreachable(endpoint: str) -> str | None:
    """Why the hub cannot be reached, asked once per process (a dry run checks every trial): one quick request,
    where huggingface_hub itself retries an unreachable host for ~20 s."""
    import httpx2
    from huggingface_hub import get_session

    try:
        get_session().head(endpoint, timeout=PROBE_TIMEOUT_S)
    except httpx2.TransportError as exc:
        return str(exc) or type(exc).__name__
    return None


@contextlib.contextmanager
def hub_closed() -> Iterator[set[str]]:
    """Within it :func:`hub_model` asks no hub: it raises a :class:`UserError` (the model is in no local cache) and
    adds the hub id to the set this yields, which the caller reads afterwards to say how to keep each one here."""
    refused: set[str] = set()
    token = _closed.set(refused)
    try:
        yield refused
    finally:
        _closed.reset(token)


def hub_model(repo_id: str) -> ModelConfig:
    """Fetch ``config.json`` and the safetensors parameter counts from the hub, and keep them in the store."""
    from huggingface_hub import constants, get_safetensors_metadata, hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, NotASafetensorsRepoError, SafetensorsParsingError

    refused = _closed.get()
    if refused is not None:
        refused.add(repo_id)
    if constants.HF_HUB_OFFLINE:
        raise _offline_error(repo_id, "offline (HF_HUB_OFFLINE)")
    if refused is not None:
        raise UserError(f"model {repo_id}: its config.json is in no local cache, and a dry run asks no hub")
    unreachable = _unreachable(constants.ENDPOINT)
    if unreachable is not None:
        raise _offline_error(repo_id, f"the hub at {constants.ENDPOINT} cannot be reached ({unreachable})")
    try:
        config_path = hf_hub_download(repo_id, CONFIG_FILE)
    except (HfHubHTTPError, OSError) as exc:
        raise _hub_error(repo_id, exc) from None
    config = _read_json_object(Path(config_path))
    try:
        parameters: dict[str, int] | None = _counts(get_safetensors_metadata(repo_id))
    except (NotASafetensorsRepoError, SafetensorsParsingError):
        parameters = None
    except HfHubHTTPError as exc:
        raise _hub_error(repo_id, exc) from None
    found = ModelConfig(name=repo_id, config=config, source=f"{constants.ENDPOINT}/{repo_id}", parameters=parameters)
    store(found)
    return found


def store(found: ModelConfig) -> Path:
    """Keep a fetched model in the store, so that planning it later needs no network."""
    path = _record_path(found.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"config": found.config, "parameters": found.parameters}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        raise UserError(f"{path}: cannot write the model store there ({exc.strerror or exc})") from None
    return path
