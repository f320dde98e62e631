"""What a request's images cost before its prefill: the vision tower's FLOPs, at the compute roofline.

vLLM runs a request's images through the model's vision tower (a ViT) in the step that schedules the prompt
tokens they stand for, then prefills the embeddings as prompt tokens. Per sequence of ``P`` patches (one image, or
one of its pan-and-scan crops: capacity/encoder.py ``image_patches``), for a tower of ``L`` blocks of width ``h``
and MLP width ``i``:

    linear    = 2 x P x (3 x t x p^2 x h + L x (4 h^2 + (3 if gated else 2) x h x i))   patch embedding, blocks
    attention = 4 x h x P x (attended patches, summed over the blocks)                  QK^T and AV
    projector = 2 x tokens x (h m^2 x (h m^2 + out))   Qwen2-VL's merger of m x m patches to a token
              | 2 x tokens x h x out                   Gemma 3's projection of its pooled tokens

A block attends over the whole image (Qwen2-VL, Gemma 3's SigLIP), or within windows of ``window_patches``
(Qwen2.5-VL) in all but its ``full_attention_layers``: attention grows with the square of the patches where it
is global, linearly where windowed. The time is these FLOPs over the replica's tensor-parallel ranks at the
GPU's peak times the prefill efficiency (``Efficiency.prefill_flops``), the same roofline the decoder's prefill
runs at: vLLM encodes the images of a step's prompts together, so the tower's weights are read once a step,
and an image of more than a few hundred patches is past the GPU's ridge point.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from servetune.capacity.encoder import image_patches
from servetune.capacity.model import VisionEncoder
from servetune.config.workload import Workload, mean_image_tokens, mean_over_images, processor_kwargs
from servetune.estimate.factors import Efficiency
from servetune.estimate.roofline import Replica

#: Colour channels of an image the patch embedding reads.
CHANNELS = 3


def tower_flops(vision: VisionEncoder, patches: int) -> float:
    """FLOPs of the tower and its projector over one sequence of ``patches`` patches."""
    h, layers = vision.hidden_size, vision.num_layers
    block = 4 * h * h + (3 if vision.gated else 2) * h * vision.intermediate_size
    linear = 2.0 * patches * (CHANNELS * vision.temporal_patch_size * vision.patch_size**2 * h + layers * block)
    if vision.window_patches:
        full = min(vision.full_attention_layers, layers)
        attended = full * patches + (layers - full) * min(patches, vision.window_patches)
    else:
        attended = layers * patches
    attention = 4.0 * h * patches * attended
    if vision.kind == "grid":
        wide = h * vision.merge_size**2
        projector = 2.0 * patches / vision.merge_size**2 * wide * (wide + vision.output_size)
    else:
        projector = 2.0 * vision.tokens_per_image * h * vision.output_size
    return linear + attention + projector


def image_flops(vision: VisionEncoder, width: int, height: int, mm_kwargs: Mapping[str, Any] | None = None) -> float:
    """The tower's FLOPs for one ``width`` x ``height`` image; 0 where the checkpoint does not say its depth."""
    if not vision.num_layers:
        return 0.0
    return sum(tower_flops(vision, patches) for patches in image_patches(vision, width, height, mm_kwargs))


def mean_encoder_flops(
    workload: Workload, vision: VisionEncoder | None, mm_kwargs: dict[str, Any] | str | None = None
) -> float:
    """The tower's FLOPs a request of the workload needs on average (its mix weighted, as
    ``mean_image_tokens`` counts the tokens); 0 for a text workload or a model whose tower is not known."""
    if vision is None or not vision.num_layers or not workload.sends_images:
        return 0.0
    tower, kwargs = vision, processor_kwargs(mm_kwargs)
    return mean_over_images(
        workload,
        lambda spec: spec.mean_per_request(lambda s: image_flops(tower, s.width, s.height, kwargs), workload.seed),
    )


def workload_images(
    workload: Workload | None, vision: VisionEncoder | None, engine_args: Mapping[str, Any]
) -> tuple[int, float]:
    """What a request of ``workload`` carries for its images on average, on a model whose tower is ``vision`` and
    an engine with ``engine_args``' ``mm_processor_kwargs``: the image tokens its prompt holds beside the text
    (``mean_image_tokens``) and the tower's FLOPs to encode them (:func:`mean_encoder_flops`); ``(0, 0.0)`` for a
    text workload, no workload, or a tower servetune does not model. Every estimate of a workload's requests takes
    its images from here: ``servetune estimate``, ``run --dry-run``, a study's forecast, each measured level's
    estimate, and ``plan --estimate --images-per-request`` (whose flags make a one-class workload)."""
    if workload is None:
        return 0, 0.0
    mm_kwargs = engine_args.get("mm_processor_kwargs")
    return mean_image_tokens(workload, vision, mm_kwargs), mean_encoder_flops(workload, vision, mm_kwargs)


def encode_s(rep: Replica, eff: Efficiency, flops: float) -> float:
    """Seconds the replica's ranks take to encode ``flops`` of images (0 for none)."""
    if flops <= 0:
        return 0.0
    return flops / rep.tp / (rep.rates.flops * eff.prefill_flops)
