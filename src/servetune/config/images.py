"""Images a request of a vision-language workload carries (a workload's ``images``, or a request class's own).

``count`` images per request (a number, or a distribution as lengths are: config/dists.py), each at a size drawn
from ``sizes`` by weight (``[w, h]`` weighs 1; ``{width, height, weight}`` says its weight). The load generator
makes each image (load/images.py) and sends it as an OpenAI chat ``image_url`` content part with a ``data:`` URL;
``detail`` goes beside the URL where given (vLLM reads none of it; OpenAI's API does).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from servetune.config.dists import Dist, Empirical, Fixed

if TYPE_CHECKING:  # the planner's types: imported where a model's tokens are asked for, not with every workload
    from servetune.capacity.model import VisionEncoder

#: Requests drawn for a mean image count (as config/workload.py draws lengths for their means).
SAMPLES = 4000

#: Pixels on a side an image may have: vLLM's processors resize anything larger, and generating it costs the client.
MAX_SIDE = 8192


class ImageSize(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    width: int = Field(ge=1, le=MAX_SIDE)
    height: int = Field(ge=1, le=MAX_SIDE)
    weight: float = Field(default=1.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _pair(cls, data: Any) -> Any:
        """``[w, h]`` is ``{width: w, height: h}``."""
        if isinstance(data, (list, tuple)):
            if len(data) != 2:
                raise ValueError(f"a size is [width, height] or {{width, height, weight}}, not {list(data)}")
            return {"width": data[0], "height": data[1]}
        return data

    @property
    def pixels(self) -> int:
        return self.width * self.height


class Images(BaseModel):
    """``count`` images per request at ``sizes`` (drawn by weight), encoded as ``format``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    count: Dist
    sizes: tuple[ImageSize, ...] = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None
    format: Literal["jpeg", "png"] = "jpeg"

    @field_validator("count", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        """A plain number is a fixed count."""
        if isinstance(value, int) and not isinstance(value, bool):
            return {"dist": "fixed", "value": value}
        return value

    @field_validator("count")
    @classmethod
    def _counts(cls, value: Any) -> Any:
        if getattr(value, "prompts", None) is not None:
            raise ValueError("an empirical image count needs numbers, not prompts")
        return value

    def draw_count(self, rng: np.random.Generator) -> int:
        """How many images the next request carries."""
        if isinstance(self.count, Fixed):  # no draw: a fixed count leaves the generator as it was
            return self.count.value
        return int(self.count.sample(rng, 1)[0])

    def draw_size(self, rng: np.random.Generator) -> ImageSize:
        """The size of the next image, drawn by weight (no draw with one size)."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        weights = np.asarray([s.weight for s in self.sizes], dtype=float)
        return self.sizes[int(rng.choice(len(self.sizes), p=weights / weights.sum()))]

    @property
    def max_count(self) -> int:
        """The most images one request carries (what ``limit_mm_per_prompt`` must allow)."""
        count = self.count
        if isinstance(count, Fixed):
            return count.value
        if isinstance(count, Empirical):
            return count.largest
        return int(count.max)

    def mean_per_request(self, per_image: Callable[[ImageSize], float], seed: int = 0) -> float:
        """``per_image`` (an image's tokens, its encoder's FLOPs...) summed over a request's images, on average: the
        mean count times the sizes' values weighted as they are drawn."""
        if isinstance(self.count, Fixed):
            count = float(self.count.value)
        else:
            count = float(np.mean(self.count.sample(np.random.default_rng(seed), SAMPLES)))
        weights = np.asarray([s.weight for s in self.sizes], dtype=float)
        values = np.asarray([per_image(s) for s in self.sizes], dtype=float)
        return count * float(np.dot(weights, values) / weights.sum())

    def mean_tokens(self, vision: VisionEncoder, mm_kwargs: Mapping[str, Any] | None = None, seed: int = 0) -> float:
        """The image tokens one request adds to its prompt on average, for a model that makes ``vision``'s tokens."""
        from servetune.capacity.encoder import image_tokens

        return self.mean_per_request(lambda s: image_tokens(vision, s.width, s.height, mm_kwargs), seed)

    @property
    def largest(self) -> ImageSize:
        return max(self.sizes, key=lambda s: s.pixels)
