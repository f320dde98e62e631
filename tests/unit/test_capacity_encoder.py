"""The encoder cache of vision-language models (capacity/encoder.py) against vLLM 0.32's formulas.

The expected numbers are worked from vLLM's code: Qwen2VLProcessingInfo (get_image_size_with_most_features,
_get_max_video_frames, _get_vision_info), Gemma3ProcessingInfo (get_num_crops, get_num_image_tokens),
compute_mm_encoder_budget and MultiModalBudget._get_max_items. The Qwen numbers were also checked by hand
against vLLM's own Qwen2VLProcessingInfo methods (the report of the change has the script and its output).
"""

from __future__ import annotations

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from servetune.capacity import arch_from_hf_config, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.encoder import encoder_budget, image_tokens, max_tokens_per_item, smart_resize
from servetune.errors import UserError
from tests.unit.test_capacity_arch_configs import GEMMA3_27B, QWEN25_VL_7B

QWEN = arch_from_hf_config(QWEN25_VL_7B, "Qwen/Qwen2.5-VL-7B-Instruct")
GEMMA = load_model_arch("google/gemma-3-27b-it")


@pytest.mark.parametrize("size", [(1024, 768), (640, 480), (4000, 3000), (30, 30), (1920, 1080), (500, 7000)])
@pytest.mark.parametrize("pixels", [{}, {"max_pixels": 1003520}, {"min_pixels": 50176, "max_pixels": 200704}])
def test_qwen_tokens_per_image_follow_the_processors_resize(size: tuple[int, int], pixels: dict) -> None:
    width, height = size
    low, high = pixels.get("min_pixels", 3136), pixels.get("max_pixels", 12845056)
    h, w = hf_smart_resize(height, width, factor=28, min_pixels=low, max_pixels=high)
    assert smart_resize(height, width, 28, low, high) == (h, w)
    assert image_tokens(QWEN.vision, width, height, pixels) == (h // 14) * (w // 14) // 4
    # mm_processor_kwargs may say it as size edges, as the processor's own config does
    edges = {"size": {"shortest_edge": low, "longest_edge": high}}
    assert image_tokens(QWEN.vision, width, height, edges) == image_tokens(QWEN.vision, width, height, pixels)


def test_qwen_largest_items_are_vllms_for_images_and_videos() -> None:
    # 12845056 px / 28^2 = 16384 tokens an image; a video of f frames holds ceil(f / 2) such grids, as many
    # frames as max_model_len allows, at most 14
    assert max_tokens_per_item(QWEN.vision, 4096, {}) == {"image": 16384, "video": 16384}
    assert max_tokens_per_item(QWEN.vision, 32768, {}) == {"image": 16384, "video": 32768}
    assert max_tokens_per_item(QWEN.vision, 128000, {}) == {"image": 16384, "video": 7 * 16384}
    assert max_tokens_per_item(QWEN.vision, 32768, {}, {"max_pixels": 1003520}) == {"image": 1280, "video": 8960}
    assert max_tokens_per_item(QWEN.vision, 32768, {"video": 0}) == {"image": 16384}
    assert max_tokens_per_item(QWEN.vision, 32768, {"video": 0, "image": 0}) == {}


def test_gemma3_takes_256_tokens_an_image_and_more_with_pan_and_scan() -> None:
    vision = GEMMA.vision
    assert vision is not None and arch_from_hf_config(GEMMA3_27B, "google/gemma-3-27b-it").vision == vision
    assert {image_tokens(vision, w, h) for w, h in [(896, 896), (1920, 1080), (64, 4000)]} == {256}
    pan = {"do_pan_and_scan": True}
    assert image_tokens(vision, 1920, 1080, pan) == 3 * 256  # 2 crops of 960 x 1080, and the image
    assert image_tokens(vision, 896, 896, pan) == 256  # square: below the 1.2 aspect ratio that crops
    assert image_tokens(vision, 300, 100, pan) == 256  # crops narrower than 256 px: none
    assert image_tokens(vision, 896, 3584, pan) == 5 * 256  # 4 crops, the most
    assert max_tokens_per_item(vision, 8192, {}) == {"image": 256}
    assert max_tokens_per_item(vision, 8192, {}, pan) == {"image": 1280}


def test_the_budget_and_the_profiled_items_are_vllms() -> None:
    common = {"max_num_seqs": 256, "chunked_prefill": True, "act_bytes": 2}
    gemma = encoder_budget(GEMMA.vision, max_model_len=32768, max_num_batched_tokens=8192, **common)
    assert gemma is not None and gemma.modality == "image" and gemma.max_tokens_per_item == 256
    assert gemma.budget_tokens == 8192 and gemma.items_per_batch == 8192 // 256
    assert gemma.cache_bytes == 32 * 256 * 5376 * 2  # embeddings at the decoder's width, bf16
    one = encoder_budget(GEMMA.vision, max_model_len=32768, max_num_batched_tokens=8192, max_num_seqs=2,
                         chunked_prefill=True, act_bytes=2, limit_mm_per_prompt={"image": 3})  # fmt: skip
    assert one is not None and one.items_per_batch == 2 * 3  # the decoder's bound: seqs x items per prompt
    qwen = encoder_budget(QWEN.vision, max_model_len=32768, max_num_batched_tokens=8192, **common)
    assert qwen is not None and (qwen.modality, qwen.budget_tokens, qwen.items_per_batch) == ("video", 32768, 1)
    images = encoder_budget(QWEN.vision, max_model_len=32768, max_num_batched_tokens=65536,
                            limit_mm_per_prompt={"video": 0, "image": {"count": 4}}, **common)  # fmt: skip
    assert images is not None and (images.modality, images.budget_tokens, images.items_per_batch) == ("image", 65536, 4)
    assert images.cache_bytes == 4 * 16384 * 3584 * 2
    off = {"image": 0, "video": 0}
    assert encoder_budget(QWEN.vision, max_model_len=32768, max_num_batched_tokens=8192, limit_mm_per_prompt=off,
                          **common) is None  # fmt: skip


def test_the_ledger_holds_the_profiled_embeddings_out_of_the_kv_pool() -> None:
    h100 = resolve_hardware("gpu", "H100")
    args = {"max_model_len": 32768, "limit_mm_per_prompt": '{"video": 0}'}  # a JSON string, as on vLLM's command line
    with_cache = plan_capacity(QWEN, args, h100)
    text_only = plan_capacity(QWEN.model_copy(update={"vision": None}), args, h100)
    assert with_cache.encoder_cache_tokens == 16384 and text_only.encoder_cache_tokens == 0
    assert with_cache.encoder_cache_gib == pytest.approx(16384 * 3584 * 2 / 2**30, abs=1e-4)
    assert with_cache.activation_gib > text_only.activation_gib
    assert with_cache.kv_cache_gib == pytest.approx(
        text_only.kv_cache_gib - (with_cache.activation_gib - text_only.activation_gib), abs=2e-3
    )
    assert any("encoder cache: 16,384 tokens" in note for note in with_cache.notes)
    skipped = plan_capacity(QWEN, {**args, "skip_mm_profiling": True}, h100)
    assert skipped.kv_cache_gib == text_only.kv_cache_gib and any("skip_mm_profiling" in n for n in skipped.notes)
    off = plan_capacity(QWEN, {"max_model_len": 32768, "limit_mm_per_prompt": {"image": 0, "video": 0}}, h100)
    assert off.kv_cache_gib == text_only.kv_cache_gib and any("every modality off" in n for n in off.notes)
    with pytest.raises(UserError, match="limit_mm_per_prompt"):
        plan_capacity(QWEN, {"limit_mm_per_prompt": {"image": "many"}}, h100)


def test_plan_sizes_the_encoder_cache_and_says_what_an_image_costs(capsys) -> None:
    import json

    import servetune.cli as cli

    base = ["plan", "--model", "google/gemma-3-27b-it", "--gpu", "H100", "--max-model-len", "32768", "--json"]
    pan = ["--mm-processor-kwargs", '{"do_pan_and_scan": true}', "--image-size", "1920x1080", "--image-size", "896x896"]
    assert cli.main([*base, *pan]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["encoder_cache_tokens"] == 8192
    assert "a 1920x1080 image takes 768 tokens of the prompt (and of the encoder cache)" in out["notes"]
    assert "a 896x896 image takes 256 tokens of the prompt (and of the encoder cache)" in out["notes"]
    assert cli.main([*base, "--limit-mm-per-prompt", '{"image": 0}']) == 0
    assert json.loads(capsys.readouterr().out)["encoder_cache_tokens"] == 0
    for bad, says in [
        (["--image-size", "big"], "--image-size big: give WIDTHxHEIGHT"),
        (["--limit-mm-per-prompt", "{image"], "--limit-mm-per-prompt: not JSON"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "--limit-mm-per-prompt.image: -1 is not a count"),
    ]:
        assert cli.main([*base, *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_a_workloads_images_add_their_tokens_to_the_prompt_the_estimate_sees() -> None:
    from servetune.config.workload import Workload, mean_image_tokens

    def workload(images: dict | None) -> Workload:
        lengths = {"input_tokens": {"dist": "fixed", "value": 100}, "output_tokens": {"dist": "fixed", "value": 10}}
        return Workload.model_validate({"name": "w", "api": "chat", **lengths, "images": images})

    sizes = [[1024, 768], {"width": 640, "height": 480, "weight": 3}]
    fixed = workload({"count": 2, "sizes": sizes})
    assert mean_image_tokens(fixed, QWEN.vision) == round(2 * (999 + 3 * 391) / 4)  # drawn 1:3
    assert mean_image_tokens(fixed, GEMMA.vision) == 2 * 256
    assert mean_image_tokens(fixed, QWEN.vision, '{"max_pixels": 200704, "min_pixels": 50176}') == 2 * 234
    drawn = workload({"count": {"dist": "uniform", "min": 1, "max": 3}, "sizes": [[896, 896]]})
    assert abs(mean_image_tokens(drawn, GEMMA.vision) - 2 * 256) <= 8  # a mean count of 2, drawn
    assert mean_image_tokens(workload(None), QWEN.vision) == 0 and mean_image_tokens(fixed, None) == 0


def test_the_estimate_of_a_vision_language_workload_counts_its_image_tokens(tmp_path, capsys) -> None:
    import json

    import servetune.cli as cli

    def report(images: str) -> dict:
        path = tmp_path / "space.yaml"
        path.write_text(f"""
name: vlm
model: google/gemma-3-27b-it
device: gpu
hardware: {{gpu: H100-SXM, devices_per_node: 1}}
engine_args: {{max_model_len: 8192}}
params: {{max_num_seqs: [64]}}
load: {{levels: [8]}}
workload:
  name: photos
  api: chat
  input_tokens: {{dist: fixed, value: 200}}
  output_tokens: {{dist: fixed, value: 100}}
{images}""")
        assert cli.main(["estimate", str(path), "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    text, photos = report(""), report("  images: {count: 2, sizes: [[1024, 768]]}\n")
    assert "image_tokens" not in text["rows"][0] and photos["rows"][0]["image_tokens"] == 2 * 256
    assert photos["input_tokens"] == text["input_tokens"] == 200  # the workload's text, as before
    assert photos["rows"][0]["estimate"]["ttft_ms"] > text["rows"][0]["estimate"]["ttft_ms"]
