"""The planner's image tokens (capacity/encoder.py) against vLLM 0.32's own Qwen2VLProcessingInfo.

No vision-language model runs here (no hub access), so this calls vLLM's processing-info methods directly on
Qwen2.5-VL-7B's published config: the largest image and video per ``max_model_len`` and the tokens of several
image sizes, for the checkpoint's pixel bounds and two ``mm_processor_kwargs``. No engine starts. Where
torchvision is missing (the CPU build here), transformers' Qwen2-VL image processor module cannot import, so
vLLM's import of its ``smart_resize`` is pointed at the PIL processor's (the same function). Exits 1 on any
difference:

    .venv/bin/python bench/vlm_tokens_vllm.py
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [(1024, 768), (640, 480), (4000, 3000), (30, 30), (1920, 1080), (500, 7000)]
KWARGS: list[dict[str, int]] = [{}, {"max_pixels": 1003520}, {"max_pixels": 200704, "min_pixels": 50176}]


def main() -> int:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

        stub = types.ModuleType("transformers.models.qwen2_vl.image_processing_qwen2_vl")
        stub.smart_resize = pil.smart_resize  # type: ignore[attr-defined]
        stub.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        sys.modules[stub.__name__] = stub
    from transformers import Qwen2_5_VLConfig
    from vllm.model_executor.models.qwen2_vl import Qwen2VLProcessingInfo

    from servetune.capacity import arch_from_hf_config
    from servetune.capacity.encoder import image_tokens, max_tokens_per_item
    from tests.unit.test_capacity_arch_configs import QWEN25_VL_7B

    config = Qwen2_5_VLConfig(**{k: v for k, v in QWEN25_VL_7B.items() if k != "model_type"})
    processor = SimpleNamespace(size={"shortest_edge": 3136, "longest_edge": 12845056})  # the checkpoint's

    class Info(Qwen2VLProcessingInfo):  # vLLM's methods, with the config and processor given here
        def __init__(self, kwargs: dict[str, int]) -> None:
            self.kwargs = kwargs

        def get_hf_config(self) -> Any:
            return config

        def get_image_processor(self, **_: object) -> Any:
            return processor

        def _merge_and_resolve_mm_processor_kwargs(self, mm_kwargs: object) -> dict[str, Any]:
            return {"images_kwargs": dict(self.kwargs), "videos_kwargs": dict(self.kwargs)}

    vision = arch_from_hf_config(QWEN25_VL_7B, "Qwen/Qwen2.5-VL-7B-Instruct").vision
    assert vision is not None
    differ = 0
    for kwargs in KWARGS:
        info = Info(kwargs)
        for seq_len in (4096, 32768, 128000):
            theirs = dict(info.get_mm_max_tokens_per_item(seq_len=seq_len, mm_counts={"image": 1, "video": 1}))
            ours = max_tokens_per_item(vision, seq_len, {}, kwargs)
            differ += theirs != ours
            print(f"{kwargs or 'checkpoint'} max_model_len {seq_len}: vLLM {theirs} servetune {ours}")
        for width, height in SIZES:
            theirs_n = info.get_num_image_tokens(image_width=width, image_height=height, image_processor=processor,
                                                 mm_kwargs={})  # fmt: skip
            ours_n = image_tokens(vision, width, height, kwargs)
            differ += theirs_n != ours_n
            print(f"  {width}x{height}: vLLM {theirs_n} servetune {ours_n}")
    print("all equal" if not differ else f"{differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
