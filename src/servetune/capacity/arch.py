"""What the ledger needs to know about a model: its architecture numbers.

A :class:`ModelArch` comes from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2/Qwen3,
Mixtral-style MoE, DeepSeek-V3-style MLA, the tiny test model) found by ``source.py`` (a local
directory, the local caches, the hub) or, so that planning works offline, from the catalogue shipped
with servetune (``catalog/models.yaml``, the same numbers for popular hub ids). Only architecture
numbers and safetensors headers are read; never weights.

The types live in ``model.py``, the config reader in ``hfconfig.py`` (hybrid layers: ``hfhybrid.py``);
their public names are importable from here.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import yaml

from servetune.capacity.checkpoint import Checkpoint
from servetune.capacity.gguf import arch_from_gguf
from servetune.capacity.hfconfig import MTP_KEYS, arch_from_hf_config
from servetune.capacity.model import ATTENTION_KINDS, LayerType, MambaMixer, ModelArch, WeightQuant
from servetune.capacity.source import ModelConfig, cached_model, hub_model, local_model
from servetune.errors import UserError
from servetune.models.names import looks_like_hub_id

__all__ = [
    "ATTENTION_KINDS",
    "MTP_KEYS",
    "LayerType",
    "MambaMixer",
    "ModelArch",
    "WeightQuant",
    "arch_from_hf_config",
    "load_catalog",
    "load_model_arch",
]

# --- the catalogue ----------------------------------------------------------------------------------


def load_catalog() -> dict[str, ModelArch]:
    """The shipped catalogue of popular models, keyed by hub id (parsed once: a dry run asks per trial)."""
    return dict(_parsed_catalog())


@functools.cache
def _parsed_catalog() -> dict[str, ModelArch]:
    text = resources.files("servetune.capacity").joinpath("catalog/models.yaml").read_text(encoding="utf-8")
    entries = yaml.safe_load(text) or {}
    return {hub_id: ModelArch(name=hub_id, **fields) for hub_id, fields in entries.items()}


def _catalog_lookup(name: str, catalog: dict[str, ModelArch]) -> ModelArch | None:
    wanted = name.strip().lower()
    exact = [arch for key, arch in catalog.items() if key.lower() == wanted]
    if exact:
        return exact[0]
    tail = [arch for key, arch in catalog.items() if key.lower().split("/")[-1] == wanted]
    return tail[0] if len(tail) == 1 else None


def _parsed(found: ModelConfig) -> ModelArch:
    arch = arch_from_hf_config(found.config, name=found.name, source=found.source)
    if found.parameters:
        return arch.model_copy(update={"checkpoint": Checkpoint(parameters=found.parameters)})
    return arch


def load_model_arch(model: str | Path) -> ModelArch:
    """A local model directory, a ``.gguf`` file (``gguf.py``), a hub id such as ``google/gemma-3-27b-it`` (local caches, then the catalogue,
    then the hub: see ``source.py``), or a catalogue name such as ``qwen2.5-7b-instruct``."""
    path = Path(model).expanduser()
    if path.suffix == ".json" and path.is_file():
        path = path.parent
    if path.is_dir():
        return _parsed(local_model(path))
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"--model {model}: no such GGUF file")
        return arch_from_gguf(path)
    name = str(model)
    cached = cached_model(name) if looks_like_hub_id(name) else None
    if cached is not None:
        return _parsed(cached)
    found = _catalog_lookup(name, load_catalog())
    if found is not None:
        return found
    if looks_like_hub_id(name):
        return _parsed(hub_model(name))
    raise UserError(
        f"--model {model}: not a local model directory, not a hub id (org/name) and not in servetune's "
        f"catalogue (known: {', '.join(sorted(load_catalog()))})"
    )
