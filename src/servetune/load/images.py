"""Deterministic images for vision-language requests, as ``data:`` URLs (config/images.py says how many and how big).

Each image is made from its own seed: a small grid of random colours stretched to the drawn size (smooth, so it
encodes small), encoded by Pillow as JPEG or PNG. Every image differs, so vLLM's multimodal caches (processor and
encoder) see what distinct user images give them, not one image reused.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

#: Colours across the grid an image is stretched from.
GRID = 8


@dataclass(frozen=True, slots=True)
class ImagePart:
    """One image a request carries: its ``data:`` URL and its size."""

    url: str
    width: int
    height: int
    detail: str | None = None

    @property
    def pixels(self) -> int:
        return self.width * self.height

    def content_part(self) -> dict[str, object]:
        """The OpenAI chat content part that carries it."""
        image_url: dict[str, object] = {"url": self.url}
        if self.detail is not None:
            image_url["detail"] = self.detail
        return {"type": "image_url", "image_url": image_url}


def _pixels(width: int, height: int, seed: int) -> np.ndarray:
    """``height`` x ``width`` x 3 bytes: a random ``GRID`` x ``GRID`` colour grid stretched bilinearly."""
    grid = np.random.default_rng(seed).integers(0, 256, size=(GRID, GRID, 3)).astype(np.float32)
    ys = np.linspace(0, GRID - 1, height, dtype=np.float32)
    xs = np.linspace(0, GRID - 1, width, dtype=np.float32)
    y0, x0 = np.minimum(ys.astype(int), GRID - 2), np.minimum(xs.astype(int), GRID - 2)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    top = grid[y0][:, x0] * (1 - fx) + grid[y0][:, x0 + 1] * fx
    bottom = grid[y0 + 1][:, x0] * (1 - fx) + grid[y0 + 1][:, x0 + 1] * fx
    return np.clip(top * (1 - fy) + bottom * fy, 0, 255).astype(np.uint8)


def encode(rgb: np.ndarray, fmt: str) -> tuple[bytes, str]:
    """(the encoded bytes, their MIME type): Pillow's ``fmt`` (jpeg or png)."""
    out = io.BytesIO()
    if fmt == "png":
        Image.fromarray(rgb).save(out, format="PNG", compress_level=1)
        return out.getvalue(), "image/png"
    Image.fromarray(rgb).save(out, format="JPEG", quality=85)
    return out.getvalue(), "image/jpeg"


def make_image(width: int, height: int, seed: int, fmt: str = "jpeg", detail: str | None = None) -> ImagePart:
    """The image of ``seed`` at ``width`` x ``height``, as a ``data:`` URL."""
    data, mime = encode(_pixels(width, height, seed), fmt)
    return ImagePart(f"data:{mime};base64,{base64.b64encode(data).decode()}", width, height, detail)
