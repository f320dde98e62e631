"""LoRA adapters a workload's requests name (``adapters:``), and what they ask of the engine.

Each request draws one adapter by weight (seeded, config/workload.py's seed) and sends its name as the
request's ``model``; vLLM's OpenAI server then runs it with that adapter. The engine serves them when it
has ``enable_lora`` and ``lora_modules`` (``name=path``), which :func:`lora_engine_args` adds unless the
space sets them; ``max_loras`` and ``max_lora_rank`` are engine arguments like any other (searchable).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator

#: The built-in adapter: ``path: tiny`` is servetune's LoRA for the tiny model (models/tiny.py).
TINY_ADAPTER = "tiny"
#: The ranks vLLM 0.32's ``--max-lora-rank`` takes (``vllm/config/lora.py`` ``MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's default ``max_lora_rank``.
VLLM_DEFAULT_LORA_RANK = 16


class Adapter(BaseModel):
    """One LoRA adapter: the ``name`` requests send as their model, a PEFT directory (``adapter_config.json`` and
    its weights; relative to the workload or space file) or ``tiny``, and the share of requests it gets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[^\s=]+$")
    path: str = Field(min_length=1)
    weight: float = Field(default=1.0, gt=0)
    _directory: Path | None = PrivateAttr(default=None)  # None: the built-in tiny adapter
    _rank: int | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _read(self, info: ValidationInfo) -> Adapter:
        if self.path == TINY_ADAPTER:
            from servetune.models.tiny import TINY_LORA_RANK

            self._rank = TINY_LORA_RANK
            return self
        given = Path(self.path).expanduser()
        directory = given if given.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / given
        config = directory / "adapter_config.json"
        try:
            peft = json.loads(config.read_text())
        except OSError:
            raise ValueError(f"{directory} is not a PEFT adapter directory (no adapter_config.json)") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config}: not JSON ({exc.msg})") from None
        rank = peft.get("r") if isinstance(peft, dict) else None
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{config}: no LoRA rank 'r'")
        self._directory, self._rank = directory.resolve(), rank
        return self

    @property
    def rank(self) -> int:
        assert self._rank is not None
        return self._rank

    def directory(self, build_dir: Path) -> Path:
        """The adapter's directory; the tiny adapter is built into ``build_dir``/tiny-lora first."""
        if self._directory is not None:
            return self._directory
        from servetune.models.tiny import build_tiny_adapter

        return build_tiny_adapter(build_dir / "tiny-lora").resolve()


def check_adapters(adapters: Sequence[Adapter]) -> None:
    """Names must differ (each is a model name on the server)."""
    seen: set[str] = set()
    for adapter in adapters:
        if adapter.name in seen:
            raise ValueError(f"adapters: the name '{adapter.name}' is given twice")
        seen.add(adapter.name)


def adapter_modules(adapters: Sequence[Adapter], build_dir: Path) -> dict[str, str]:
    """Each adapter's name and directory, as ``lora_modules`` gives them to vLLM (building the tiny one)."""
    return {a.name: str(a.directory(build_dir)) for a in adapters}


def lora_rank_for(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds an adapter of ``rank``."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def lora_engine_args(
    engine_args: Mapping[str, Any], modules: Mapping[str, str], max_rank: int | None = None
) -> dict[str, Any]:
    """``engine_args`` with what serving ``modules`` (name -> directory) needs, where the space left it unset:
    ``enable_lora``, ``lora_modules`` (``name=path`` each) and, for adapters above vLLM's default rank,
    ``max_lora_rank`` (``max_rank`` is the largest adapter rank). Without adapters, ``engine_args`` as they are."""
    out = dict(engine_args)
    if not modules:
        return out
    out.setdefault("enable_lora", True)
    out.setdefault("lora_modules", [f"{name}={path}" for name, path in modules.items()])
    if max_rank is not None and max_rank > VLLM_DEFAULT_LORA_RANK:
        out.setdefault("max_lora_rank", lora_rank_for(max_rank))
    return out
