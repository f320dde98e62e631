"""The encoder cache of a vision-language model, as vLLM 0.32 sizes and profiles it. Pure: no vLLM import.

Tokens per image (``image_tokens``): the Qwen2-VL family resizes an image (``smart_resize``: each side a multiple
of ``patch_size x merge_size``, the pixels between ``min_pixels`` and ``max_pixels``) and makes one token per
``merge_size`` x ``merge_size`` patches; Gemma 3 makes ``mm_tokens_per_image`` per image, and as many per
pan-and-scan crop when ``mm_processor_kwargs`` asks for ``do_pan_and_scan``.

The budget (vllm/v1/core/encoder_cache_manager.py ``compute_mm_encoder_budget``, vllm/multimodal/
encoder_budget.py ``MultiModalBudget``): the largest item of any modality ``limit_mm_per_prompt`` leaves on
(default 999 each; 0 turns one off) has ``max_tokens_per_item`` tokens; the encoder's compute budget and the
cache's size are both ``max(max_num_batched_tokens, max_tokens_per_item)`` tokens, and the budget is their
minimum. vLLM's profile run (gpu_model_runner ``profile_run``) encodes ``items_per_batch`` items of the largest
modality, ``min(budget // max_tokens_per_item, max_num_seqs x items per prompt)`` (at least 1), and keeps their
embeddings in the encoder cache while it runs the decoder's dummy batch: they are part of the activation peak
it subtracts from the KV pool. The tower's own peak while it encodes them is estimated here (``encoder_peak``),
not measured: no vision-language model runs on the development machine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from servetune.capacity.model import VisionEncoder

#: Items per modality vLLM allows per prompt unless ``limit_mm_per_prompt`` says (vllm/config/multimodal.py).
DEFAULT_LIMIT = 999
#: Frames a profiled video has at most (vllm/model_executor/models/qwen2_vl.py ``_MAX_FRAMES_PER_VIDEO``).
MAX_FRAMES_PER_VIDEO = 14
#: Gemma 3's pan-and-scan defaults (transformers' Gemma3ProcessorKwargs).
PAN_AND_SCAN = {"pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}  # fmt: skip


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) after the Qwen2-VL processor's resize (transformers' ``smart_resize``, which vLLM calls)."""
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def pixel_bounds(vision: VisionEncoder, mm_kwargs: Mapping[str, Any] | None) -> tuple[int, int]:
    """(min_pixels, max_pixels): ``mm_processor_kwargs``' ``min_pixels``/``max_pixels`` (or ``size``'s
    ``shortest_edge``/``longest_edge``) over the checkpoint's."""
    kwargs = dict(mm_kwargs or {})
    given = kwargs.get("size")
    size: Mapping[str, Any] = given if isinstance(given, Mapping) else {}
    low = kwargs.get("min_pixels", size.get("shortest_edge", vision.min_pixels))
    high = kwargs.get("max_pixels", size.get("longest_edge", vision.max_pixels))
    return int(low), int(high)


def _crops(vision: VisionEncoder, width: int, height: int, kwargs: Mapping[str, Any]) -> int:
    """Gemma 3's pan-and-scan crops of an image (vLLM's Gemma3ProcessingInfo.get_num_crops)."""
    if not kwargs.get("do_pan_and_scan", False):
        return 0
    opts = {**PAN_AND_SCAN, **{k: v for k, v in kwargs.items() if k in PAN_AND_SCAN}}
    min_crop, max_crops, ratio = (opts[k] for k in PAN_AND_SCAN)
    long, short = (width, height) if width >= height else (height, width)
    if long / short < ratio:
        return 0
    crops = min(max_crops, max(2, min(math.floor(long / min_crop), math.floor(long / short + 0.5))))
    crop_long = math.ceil(long / crops)
    if min(crop_long, short) < min_crop:
        return 0
    return crops


def image_tokens(vision: VisionEncoder, width: int, height: int, mm_kwargs: Mapping[str, Any] | None = None) -> int:
    """The tokens (encoder embeddings) one ``width`` x ``height`` image takes in the prompt."""
    if vision.kind == "fixed":
        return (_crops(vision, width, height, mm_kwargs or {}) + 1) * vision.tokens_per_image
    low, high = pixel_bounds(vision, mm_kwargs)
    h, w = smart_resize(height, width, vision.patch_size * vision.merge_size, low, high)
    return (h // vision.patch_size) * (w // vision.patch_size) // vision.merge_size**2


def image_patches(
    vision: VisionEncoder, width: int, height: int, mm_kwargs: Mapping[str, Any] | None = None
) -> tuple[int, ...]:
    """The patches of each sequence the tower encodes for one ``width`` x ``height`` image: the resized image's
    grid (Qwen2-VL family, ``merge_size`` x ``merge_size`` patches a token), or the tower's native square once and
    once more per pan-and-scan crop (Gemma 3)."""
    if vision.kind == "fixed":
        native = (vision.image_size // vision.patch_size) ** 2
        return (native,) * (_crops(vision, width, height, mm_kwargs or {}) + 1)
    low, high = pixel_bounds(vision, mm_kwargs)
    h, w = smart_resize(height, width, vision.patch_size * vision.merge_size, low, high)
    return ((h // vision.patch_size) * (w // vision.patch_size),)


def _grid_tokens(vision: VisionEncoder, max_pixels: int, frames: int = 1) -> int:
    """Tokens of the image (or video of ``frames``) with the most features (Qwen2VLProcessingInfo)."""
    per_frame = max_pixels // (vision.patch_size * vision.merge_size) ** 2
    for tokens in range(per_frame, 0, -1):  # the factor pair closest to square, aspect ratio at most 200
        short = next(d for d in range(math.isqrt(tokens), 0, -1) if tokens % d == 0)
        if tokens // short / short <= 200:
            break
    padded = frames + (-frames % vision.temporal_patch_size)
    return max(padded // vision.temporal_patch_size, 1) * tokens


def max_tokens_per_item(
    vision: VisionEncoder, max_model_len: int, limits: Mapping[str, int], mm_kwargs: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """The largest item's tokens, per modality the limits leave on (MultiModalBudget's ``mm_max_toks_per_item``)."""
    out: dict[str, int] = {}
    if limits.get("image", DEFAULT_LIMIT) > 0:
        if vision.kind == "fixed":  # the dummy image: native width, max_num_crops native sides high
            crops = int({**PAN_AND_SCAN, **(mm_kwargs or {})}["pan_and_scan_max_num_crops"])
            out["image"] = image_tokens(vision, vision.image_size, vision.image_size * crops, mm_kwargs)
        else:
            out["image"] = _grid_tokens(vision, pixel_bounds(vision, mm_kwargs)[1])
    if vision.video and limits.get("video", DEFAULT_LIMIT) > 0:
        high = pixel_bounds(vision, mm_kwargs)[1]
        frames = 1  # the most frames whose tokens fit max_model_len (_get_max_video_frames), at most 14
        while _grid_tokens(vision, high, frames + 1) <= max_model_len:
            frames += 1
        out["video"] = _grid_tokens(vision, high, max(min(frames, MAX_FRAMES_PER_VIDEO), 1))
    return out


@dataclass(frozen=True)
class EncoderBudget:
    """The encoder cache vLLM sets up, and what its profile run holds."""

    modality: str  # the profiled one: the most tokens per item
    max_tokens_per_item: int
    budget_tokens: int  # min(compute budget, cache size): embeddings the cache holds
    items_per_batch: int  # items of ``modality`` the profile run encodes
    cache_bytes: int  # their embeddings, held through the decoder's dummy batch
    encoder_peak_bytes: int  # estimated: the tower's activations while it encodes them

    def describe(self) -> str:
        return (
            f"encoder cache: {self.budget_tokens:,} tokens; profiled with {self.items_per_batch} {self.modality} "
            f"item(s) of {self.max_tokens_per_item:,} tokens, {self.cache_bytes / 2**30:.2f} GiB of embeddings "
            f"held through the decoder's dummy batch (tower peak about {self.encoder_peak_bytes / 2**30:.2f} GiB)"
        )


def limits_of(limit_mm_per_prompt: Mapping[str, Any] | None) -> dict[str, int]:
    """``limit_mm_per_prompt`` as counts: ``{"image": 2}`` or ``{"image": {"count": 2, ...}}``."""
    out = {}
    for modality, value in (limit_mm_per_prompt or {}).items():
        out[modality] = int(value.get("count", DEFAULT_LIMIT) if isinstance(value, Mapping) else value)
    return out


def encoder_budget(
    vision: VisionEncoder,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    chunked_prefill: bool,
    act_bytes: int,
    tp: int = 1,
    limit_mm_per_prompt: Mapping[str, Any] | None = None,
    mm_processor_kwargs: Mapping[str, Any] | None = None,
) -> EncoderBudget | None:
    """The encoder cache and its profile run; None when the limits turn every modality off."""
    limits = limits_of(limit_mm_per_prompt)
    per_item = max_tokens_per_item(vision, max_model_len, limits, mm_processor_kwargs)
    if not per_item:
        return None
    modality, most = max(per_item.items(), key=lambda kv: (kv[1], kv[0]))
    # compute budget = max(max_num_encoder_input_tokens, most), cache size = max(encoder_cache_size, most), and
    # vLLM 0.32 sets both of those to max_num_batched_tokens (SchedulerConfig.__post_init__)
    budget = max(max_num_batched_tokens, most)
    per_prompt = max(1, min(limits.get(modality, DEFAULT_LIMIT), max_model_len // most))
    seqs = max_num_seqs if chunked_prefill else min(max_num_seqs, max_num_batched_tokens // most)
    items = max(1, min(budget // most, seqs * per_prompt))
    patches = items * most * vision.merge_size**2
    # per patch: the residual stream, q/k/v and the MLP's hidden (twice where gated) on this rank
    per_patch = (
        vision.hidden_size + (3 * vision.hidden_size + (2 if vision.gated else 1) * vision.intermediate_size) / tp
    )
    return EncoderBudget(
        modality=modality,
        max_tokens_per_item=most,
        budget_tokens=budget,
        items_per_batch=items,
        cache_bytes=items * most * vision.output_size * act_bytes,
        encoder_peak_bytes=int(patches * per_patch * act_bytes),
    )
