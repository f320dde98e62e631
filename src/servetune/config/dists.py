"""Distributions of token lengths and other counts a workload draws (config/workload.py, config/images.py):
fixed, uniform, normal, lognormal (each bounded), or empirical from a field of a JSONL file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, model_validator


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class Fixed(_Dist):
    dist: Literal["fixed"]
    value: int = Field(ge=1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=np.int64)


class _Bounded(_Dist):
    min: int = Field(default=1, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> _Bounded:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self

    def _clip(self, values: np.ndarray) -> np.ndarray:
        return np.clip(np.rint(values), self.min, self.max).astype(np.int64)


class Uniform(_Bounded):
    dist: Literal["uniform"]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(self.min, self.max + 1, size=n, dtype=np.int64)


class Normal(_Bounded):
    dist: Literal["normal"]
    mean: float = Field(gt=0)
    std: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.normal(self.mean, self.std, size=n))


class LogNormal(_Bounded):
    """Lengths whose logarithm is normal: ``median`` and ``sigma`` (the spread in log space)."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(gt=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.lognormal(np.log(self.median), self.sigma, size=n))


class Empirical(_Dist):
    """Lengths (integers) or prompts (strings) from one field of a JSONL file.

    The path is relative to the workload file. With prompts, their token counts are the input
    lengths and the prompts themselves are sent.
    """

    dist: Literal["empirical"]
    file: Path
    field: str = "prompt"
    _values: list = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _read(self, info: ValidationInfo) -> Empirical:
        base = Path((info.context or {}).get("base_dir", "."))
        path = self.file if self.file.is_absolute() else base / self.file
        try:
            lines = path.read_text().splitlines()
        except OSError:
            raise ValueError(f"cannot read {path}") from None
        values = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)[self.field]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"{path} line {number} has no field '{self.field}'") from None
            if isinstance(value, bool) or not isinstance(value, (int, str)) or (isinstance(value, int) and value < 1):
                raise ValueError(f"{path} line {number}: '{self.field}' must be a prompt or a length >= 1")
            values.append(value)
        if not values:
            raise ValueError(f"{path} has no records")
        self._values = values
        return self

    @property
    def prompts(self) -> list[str] | None:
        return self._values if isinstance(self._values[0], str) else None

    @property
    def largest(self) -> int:
        """The largest of the file's numbers (lengths or counts; not for prompts)."""
        return max(int(v) for v in self._values)

    def sample_indices(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.integers(0, len(self._values), size=n)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.prompts is not None:
            raise TypeError("prompt datasets are sampled by index; token counts need the tokenizer")
        return np.asarray(self._values, dtype=np.int64)[self.sample_indices(rng, n)]


Dist = Annotated[Fixed | Uniform | Normal | LogNormal | Empirical, Field(discriminator="dist")]
