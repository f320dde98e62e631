"""The vision tower's time in the estimate (estimate/encoder.py): what encoding a request's images adds to its TTFT.

The towers are the published checkpoints' (config.json as the hub serves it): Qwen2-VL-7B's (full attention, its
blocks' width named ``embed_dim``), Qwen2.5-VL-7B's (windowed attention but in four blocks) and Gemma 3's SigLIP.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from servetune import cli
from servetune.capacity import WeightQuant, arch_from_hf_config, load_model_arch, resolve_hardware
from servetune.config.workload import Workload
from servetune.estimate import Estimate, Factors, Load, device_rates, estimate, load_factors
from servetune.estimate.encoder import image_flops, mean_encoder_flops, tower_flops
from servetune.space_file import load_space
from tests.unit.test_capacity_arch_configs import QWEN25_VL_7B

REPO = Path(__file__).resolve().parents[2]
# huggingface.co/Qwen/Qwen2-VL-7B-Instruct/blob/main/config.json: the tower is 32 blocks of 1280 (``embed_dim``),
# MLPs 4x as wide; its ``hidden_size`` is the merger's output, the decoder's width.
QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "sliding_window": 32768, "use_sliding_window": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "hidden_size": 3584,
        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    },
}  # fmt: skip
QWEN2 = arch_from_hf_config(QWEN2_VL_7B, "Qwen/Qwen2-VL-7B-Instruct")
QWEN25 = arch_from_hf_config(QWEN25_VL_7B, "Qwen/Qwen2.5-VL-7B-Instruct")
GEMMA = load_model_arch("google/gemma-3-27b-it")
H100 = resolve_hardware("gpu", "H100")


def test_the_towers_are_read_from_their_configs() -> None:
    qwen2, qwen25 = QWEN2.vision, QWEN25.vision
    assert qwen2 is not None and qwen25 is not None and GEMMA.vision is not None
    # Qwen2-VL: the blocks are 1280 wide with 5120-wide MLPs, not the 3584 of the merger's output
    assert (qwen2.hidden_size, qwen2.intermediate_size, qwen2.num_layers, qwen2.window_patches) == (1280, 5120, 32, 0)
    assert qwen2.output_size == 3584
    # the Qwen2-VL paper's 675M-parameter ViT (its merger included)
    assert QWEN2.vision_parameters == pytest.approx(675e6, rel=0.01)
    # Qwen2.5-VL: 112-px windows are 4 x 4 merged tokens, 8 x 8 patches; blocks 7, 15, 23 and 31 see the whole image
    assert (qwen25.num_layers, qwen25.window_patches, qwen25.full_attention_layers) == (32, 64, 4)
    assert GEMMA.vision.num_layers == 27 and GEMMA.vision.window_patches == 0


def test_a_small_image_costs_twice_the_towers_parameters_per_patch() -> None:
    """Attention over 16 patches is negligible: what is left is 2 FLOPs per weight per patch (the merger's per
    token of 4 patches, so a little less than the ledger's parameter count)."""
    assert QWEN2.vision is not None
    ratio = image_flops(QWEN2.vision, 56, 56) / (2 * 16 * QWEN2.vision_parameters)
    assert 0.9 < ratio < 1.0


def test_the_encoder_term_scales_with_the_images_pixels() -> None:
    assert QWEN2.vision is not None and QWEN25.vision is not None and GEMMA.vision is not None
    sizes = [(448, 448), (896, 448), (896, 896), (1792, 896)]  # each twice the pixels of the one before
    for vision in (QWEN2.vision, QWEN25.vision):
        flops = [image_flops(vision, w, h) for w, h in sizes]
        for smaller, larger in itertools.pairwise(flops):
            assert 2 < larger / smaller < 4  # linear layers double; attention over the whole image quadruples
    # windows keep attention linear in all but four blocks: less to do, and it grows less with the image
    wide = QWEN25.vision.model_copy(update={"window_patches": 0})
    assert image_flops(QWEN25.vision, 1792, 896) < image_flops(wide, 1792, 896)
    assert (image_flops(QWEN25.vision, 1792, 896) / image_flops(QWEN25.vision, 896, 896)) < (
        image_flops(wide, 1792, 896) / image_flops(wide, 896, 896)
    )
    # Gemma 3 resizes every image to its tower's 896 px square, and encodes each pan-and-scan crop as one more
    one = image_flops(GEMMA.vision, 896, 896)
    assert {image_flops(GEMMA.vision, w, h) for w, h in [(448, 448), (1920, 1080), (64, 4000)]} == {one}
    assert image_flops(GEMMA.vision, 1920, 1080, {"do_pan_and_scan": True}) == pytest.approx(3 * one)
    assert one == tower_flops(GEMMA.vision, (896 // 14) ** 2)
    # a tower whose depth the checkpoint does not say is not estimated
    assert image_flops(GEMMA.vision.model_copy(update={"num_layers": 0}), 896, 896) == 0.0


def _est(arch, flops: float, factors: Factors | None = None, **load) -> Estimate:
    load = {"input_tokens": 1500, "output_tokens": 256, **load}
    return estimate(arch, {"max_model_len": 8192}, H100, Load(**load, encoder_flops=flops), factors)


def test_an_image_requests_ttft_rises_by_the_encoders_time() -> None:
    assert QWEN25.vision is not None
    flops = image_flops(QWEN25.vision, 1280, 720)
    eff = load_factors().for_class("H100")
    encoder_ms = flops / (device_rates(H100.name, WeightQuant()).flops * eff.prefill_flops) * 1e3
    text, image = _est(QWEN25, 0.0, concurrency=1), _est(QWEN25, flops, concurrency=1)
    assert text.encoder_ms is None and image.encoder_ms == pytest.approx(encoder_ms)
    assert 1 < encoder_ms < image.ttft_ms
    # one request alone: its TTFT holds its images' encoding (and its TPOT a 256th of it, half of which TTFT waits)
    assert image.ttft_ms - text.ttft_ms == pytest.approx(encoder_ms, rel=0.01)
    assert image.tpot_ms - text.tpot_ms == pytest.approx(encoder_ms / 256, rel=0.01)
    # larger images, more time; and the throughput falls under load for it
    assert _est(QWEN25, image_flops(QWEN25.vision, 1920, 1080), concurrency=1).ttft_ms > image.ttft_ms
    assert _est(QWEN25, flops, concurrency=64).output_throughput < _est(QWEN25, 0.0, concurrency=64).output_throughput
    # with two ranks each encodes half
    two = estimate(QWEN25, {"max_model_len": 8192, "tensor_parallel_size": 2}, H100,
                   Load(input_tokens=1500, output_tokens=256, concurrency=1, encoder_flops=flops))  # fmt: skip
    assert two.encoder_ms == pytest.approx(encoder_ms / 2)


def test_a_waves_prompts_wait_for_the_images_encoded_before_theirs() -> None:
    """Prompts that arrive together prefill first come, first served: each waits for its own images and for those
    of the prompts before it."""
    assert QWEN25.vision is not None
    shipped = load_factors()
    waves = shipped.model_copy(
        update={"per_gpu_class": {"H100": shipped.for_class("H100").model_copy(update={"closed_loop_waves": 1.0})}}
    )
    flops = image_flops(QWEN25.vision, 1280, 720)
    one = _est(QWEN25, flops, concurrency=1)
    assert one.encoder_ms is not None
    text, image = _est(QWEN25, 0.0, waves, concurrency=8), _est(QWEN25, flops, waves, concurrency=8)
    rise = image.ttft_ms - text.ttft_ms
    assert one.encoder_ms < rise < 8 * one.encoder_ms
    assert image.tpot_ms > text.tpot_ms  # the wave's later prompts (and their images) prefill beside its decodes


def _workload(images: dict | None) -> Workload:
    lengths = {"input_tokens": {"dist": "fixed", "value": 100}, "output_tokens": {"dist": "fixed", "value": 10}}
    return Workload.model_validate({"name": "w", "api": "chat", **lengths, "images": images})


def test_a_workloads_mean_encoder_flops_weigh_its_sizes_and_counts() -> None:
    assert QWEN25.vision is not None
    sizes = [[1024, 768], {"width": 640, "height": 480, "weight": 3}]
    mean = mean_encoder_flops(_workload({"count": 2, "sizes": sizes}), QWEN25.vision)
    expected = 2 * (image_flops(QWEN25.vision, 1024, 768) + 3 * image_flops(QWEN25.vision, 640, 480)) / 4
    assert mean == pytest.approx(expected)
    small = '{"max_pixels": 200704, "min_pixels": 50176}'  # the engine's mm_processor_kwargs, as a space gives them
    assert mean_encoder_flops(_workload({"count": 2, "sizes": sizes}), QWEN25.vision, small) < mean
    assert mean_encoder_flops(_workload(None), QWEN25.vision) == 0.0
    assert mean_encoder_flops(_workload({"count": 2, "sizes": sizes}), None) == 0.0


def _space(tmp_path: Path, workload: dict) -> Path:
    doc = yaml.safe_load((REPO / "search_spaces" / "offline-batch.yaml").read_text())
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(workload))
    doc.update(model="google/gemma-3-27b-it", workload=str(tmp_path / "w.yaml"), constraints=[])
    doc["params"] = {"tensor_parallel_size": [2], "max_num_seqs": [64]}
    doc["load"]["levels"] = [1, 8]
    path = tmp_path / f"{workload['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _rows(capsys, space: Path) -> list[dict]:
    assert cli.main(["estimate", str(space), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def test_servetune_estimate_adds_the_encoder_to_a_vision_workloads_ttft_and_nothing_to_a_text_ones(tmp_path, capsys):
    text = {"name": "text", "api": "chat", "input_tokens": {"dist": "fixed", "value": 400},
            "output_tokens": {"dist": "fixed", "value": 128}}  # fmt: skip
    images = {**text, "name": "images", "images": {"count": 2, "sizes": [[1280, 720]]}}
    text_space = _space(tmp_path, text)
    plain, seen = _rows(capsys, text_space), _rows(capsys, _space(tmp_path, images))
    assert len(plain) == len(seen) == 2
    for without, carrying in zip(plain, seen, strict=True):
        assert "image_tokens" not in without and "encoder_ms" not in without["estimate"]
        assert carrying["image_tokens"] == 2 * 256
        encoder_ms = carrying["estimate"]["encoder_ms"]
        assert encoder_ms > 0 and carrying["estimate"]["ttft_ms"] > without["estimate"]["ttft_ms"] + encoder_ms
    # a text workload's rows are the estimate of its requests as they always were: no encoder term in them
    space = load_space(text_space)
    (params,), _ = space.grid()
    engine, _env = space.engine_params(params)
    hardware = resolve_hardware("gpu", "H100-SXM")
    for row, clients in zip(plain, (1, 8), strict=True):
        load = Load(input_tokens=400, output_tokens=128, concurrency=clients)
        assert row["estimate"] == estimate(GEMMA, engine, hardware, load).model_dump(mode="json")
