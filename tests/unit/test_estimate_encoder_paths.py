"""The vision tower's time in every estimate of a workload's requests, not only ``servetune estimate``'s.

A study's forecast (pruning, seeding), ``run --dry-run``'s column, each measured level's estimate and
``plan --estimate --images-per-request`` take a request's images from one function (estimate/encoder.py
``workload_images``): an image workload's TTFT estimate grows by the encoder's time everywhere, and a text
workload's estimate is the one a plain load of its lengths gives, as before images existed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from servetune import cli
from servetune.capacity import WeightQuant, load_model_arch, resolve_hardware
from servetune.cli.run import estimate_cell
from servetune.config.workload import Workload, mean_lengths
from servetune.estimate import Estimate, Load, device_rates, estimate, load_factors
from servetune.estimate.encoder import image_flops, mean_encoder_flops, workload_images
from servetune.results import TrialResult
from servetune.space_file import load_space
from servetune.study.forecast import forecast
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.estimated import estimate_levels, planned_estimate

REPO = Path(__file__).resolve().parents[2]
SURFACES = REPO / "bench" / "data"
GEMMA = load_model_arch("google/gemma-3-27b-it")  # the catalogue's vision-language model: 256 tokens an image
H100 = resolve_hardware("gpu", "H100-SXM")
TEXT = {"name": "text", "api": "chat", "input_tokens": {"dist": "fixed", "value": 400},
        "output_tokens": {"dist": "fixed", "value": 128}}  # fmt: skip
IMAGES = {**TEXT, "name": "images", "images": {"count": 2, "sizes": [[1280, 720]]}}
PLAN = ["plan", "--model", "google/gemma-3-27b-it", "--gpu", "H100-SXM", "--tp", "2", "--max-model-len", "8192"]
LOAD = ["--estimate", "--input-tokens", "400", "--output-tokens", "128", "--concurrency", "8"]


def _space(tmp_path: Path, workload: dict) -> Path:
    """Gemma 3 27B at TP 2 on H100s, one configuration, a ladder of 1 and 8 clients (a grid: the dry run lists it)."""
    doc = yaml.safe_load((REPO / "search_spaces" / "offline-batch.yaml").read_text())
    (tmp_path / f"{workload['name']}-w.yaml").write_text(yaml.safe_dump(workload))
    doc.update(model="google/gemma-3-27b-it", workload=str(tmp_path / f"{workload['name']}-w.yaml"), constraints=[])
    doc["params"] = {"tensor_parallel_size": [2], "max_num_seqs": [64]}
    doc["load"]["levels"] = [1, 8]
    doc["search"] = {"algorithm": "grid", "baseline": False}
    path = tmp_path / f"{workload['name']}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _context(path: Path) -> StudyContext:
    space = load_space(path)
    workload = space.resolved_workload(path.parent)
    return StudyContext(space, workload, path.parent / "s", space.model, resolve_levels(space, workload))


def _estimate_rows(path: Path, capsys) -> list[dict]:
    assert cli.main(["estimate", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def _encoder_ms(flops: float, tp: int) -> float:
    """The tower's time at the H100's prefill roofline over ``tp`` ranks, as estimate/encoder.py says."""
    eff = load_factors().for_class("H100")
    return flops / tp / (device_rates(H100.name, WeightQuant()).flops * eff.prefill_flops) * 1e3


def test_the_images_of_a_workload_are_its_image_tokens_and_the_towers_flops() -> None:
    assert GEMMA.vision is not None
    images = Workload.model_validate(IMAGES)
    assert workload_images(images, GEMMA.vision, {}) == (2 * 256, mean_encoder_flops(images, GEMMA.vision))
    assert workload_images(images, GEMMA.vision, {})[1] == pytest.approx(2 * image_flops(GEMMA.vision, 1280, 720))
    pan = workload_images(images, GEMMA.vision, {"mm_processor_kwargs": '{"do_pan_and_scan": true}'})
    assert pan[0] > 2 * 256 and pan[1] > workload_images(images, GEMMA.vision, {})[1]  # the crops are encoded too
    text = Workload.model_validate(TEXT)
    assert workload_images(text, GEMMA.vision, {}) == (0, 0.0)
    assert workload_images(None, GEMMA.vision, {}) == (0, 0.0) and workload_images(images, None, {}) == (0, 0.0)


def test_the_forecast_and_the_dry_runs_estimate_are_servetune_estimates_rows(tmp_path, capsys) -> None:
    """The study's forecast at each level and the dry run's column at the top level are what ``servetune estimate``
    prints for the same configuration and level: the encoder's time in all three, for images."""
    for workload in (TEXT, IMAGES):
        path = _space(tmp_path, workload)
        rows = _estimate_rows(path, capsys)
        context = _context(path)
        (params,), _ = context.space.grid()
        spec = context.spec_for(params)
        forecasts = forecast(spec, mean_lengths(context.workload))
        assert not isinstance(forecasts, str), forecasts
        assert [fc.estimate.model_dump(mode="json") for fc in forecasts] == [row["estimate"] for row in rows]
        top = max(context.levels, key=lambda lv: lv.value)
        planned = planned_estimate(spec.model, spec.device, spec.engine_args, spec.env, spec.gpu,
                                   spec.gpu_memory_gib, top.kind, top.value, *mean_lengths(context.workload),
                                   workload=spec.workload)  # fmt: skip
        assert isinstance(planned, Estimate) and planned.model_dump(mode="json") == rows[-1]["estimate"]
        assert estimate_cell(spec, top, mean_lengths(context.workload)).startswith(
            f"{planned.output_throughput:,.0f} tok/s, TTFT {planned.ttft_ms:,.0f} ms"
        )


def test_images_raise_the_forecast_and_the_dry_runs_ttft_and_text_is_unchanged(tmp_path) -> None:
    assert GEMMA.vision is not None
    text, images = _context(_space(tmp_path, TEXT)), _context(_space(tmp_path, IMAGES))
    (params,), _ = text.space.grid()
    text_spec, image_spec = text.spec_for(params), images.spec_for(params)
    lengths = mean_lengths(text.workload)
    assert lengths == mean_lengths(images.workload) == (400, 128)
    plain, carrying = forecast(text_spec, lengths), forecast(image_spec, lengths)
    assert not isinstance(plain, str) and not isinstance(carrying, str)
    encoder_ms = _encoder_ms(2 * image_flops(GEMMA.vision, 1280, 720), tp=2)
    for without, fc in zip(plain, carrying, strict=True):
        assert without.estimate.encoder_ms is None and fc.estimate.encoder_ms == pytest.approx(encoder_ms)
        assert fc.estimate.ttft_ms > without.estimate.ttft_ms + encoder_ms  # and 512 image tokens more to prefill
        # a text workload's forecast is a plain load of its lengths, byte for byte
        load = Load(input_tokens=400, output_tokens=128, concurrency=round(without.level.value))
        plain_load = estimate(GEMMA, text_spec.engine_args, H100, load).model_dump(mode="json")
        assert without.estimate.model_dump(mode="json") == plain_load
    top = max(text.levels, key=lambda lv: lv.value)
    args = (top.kind, top.value, *lengths)
    before = planned_estimate(text_spec.model, "gpu", text_spec.engine_args, {}, "H100-SXM", None, *args)
    as_text = planned_estimate(text_spec.model, "gpu", text_spec.engine_args, {}, "H100-SXM", None, *args,
                               workload=text.workload)  # fmt: skip
    seen = planned_estimate(image_spec.model, "gpu", image_spec.engine_args, {}, "H100-SXM", None, *args,
                            workload=images.workload)  # fmt: skip
    assert isinstance(before, Estimate) and isinstance(as_text, Estimate) and isinstance(seen, Estimate)
    assert as_text.model_dump_json() == before.model_dump_json()
    assert seen.ttft_ms > before.ttft_ms + encoder_ms and seen.encoder_ms == pytest.approx(encoder_ms)


def test_the_dry_run_says_its_estimate_counts_the_images(tmp_path, capsys, no_ray) -> None:
    for workload, said in ((TEXT, False), (IMAGES, True)):
        storage = tmp_path / "results"
        assert cli.main(["run", str(_space(tmp_path, workload)), "--dry-run", "--storage", str(storage)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert "estimate: requests of 400 in / 128 out tokens (the workload's means)" in out
        assert ("vision tower's time to encode them" in out) == said
        assert not storage.exists()


def _gpu_trial(engine_args: dict) -> TrialResult:
    """A recorded trial's measured levels, as if Gemma 3 27B at TP 2 on H100s had served them."""
    trial = json.loads((SURFACES / "cpu-tiny-grid-r4.json").read_text())["trials"][0]
    update = {"model": "google/gemma-3-27b-it", "device": "gpu", "engine_args": engine_args, "env": {}}
    return TrialResult.model_validate({**trial, **update})


def test_each_measured_level_is_estimated_with_the_encoders_time() -> None:
    """The levels' prompts already hold their images' tokens (vLLM's usage counts them): the workload adds the tower's
    time to encode them; a text workload's estimates are those of no workload at all."""
    assert GEMMA.vision is not None
    args = {"tensor_parallel_size": 2, "max_model_len": 8192, "max_num_seqs": 64}
    before, as_text, seen = (_gpu_trial(args) for _ in range(3))
    estimate_levels(before, "H100-SXM", None)
    estimate_levels(as_text, "H100-SXM", None, workload=Workload.model_validate(TEXT))
    estimate_levels(seen, "H100-SXM", None, workload=Workload.model_validate(IMAGES))
    assert before.estimate_note is None and seen.estimate_note is None, (before.estimate_note, seen.estimate_note)
    assert as_text.model_dump_json() == before.model_dump_json()
    flops = 2 * image_flops(GEMMA.vision, 1280, 720)
    encoder_ms = _encoder_ms(flops, tp=2)
    for level, plain in zip(seen.levels, before.levels, strict=True):
        assert level.estimate is not None and plain.estimate is not None
        assert level.estimate.ttft_ms > plain.estimate.ttft_ms + encoder_ms
        assert level.estimate.error["ttft_ms"] > plain.estimate.error["ttft_ms"]  # the same measurement
        s = level.summary
        load = Load(input_tokens=max(1, round(s.total_input_tokens / s.completed)),
                    output_tokens=max(2, round(s.total_output_tokens / s.completed)),
                    concurrency=max(1, round(s.level["concurrency"])), encoder_flops=flops)  # fmt: skip
        assert level.estimate.ttft_ms == estimate(GEMMA, args, H100, load).ttft_ms
    # Gemma 3's pan-and-scan crops are encoded too: the engine's processor options reach the level's estimate
    panned = _gpu_trial({**args, "mm_processor_kwargs": {"do_pan_and_scan": True}})
    estimate_levels(panned, "H100-SXM", None, workload=Workload.model_validate(IMAGES))
    assert panned.levels[0].estimate is not None and seen.levels[0].estimate is not None
    assert panned.levels[0].estimate.ttft_ms > seen.levels[0].estimate.ttft_ms


def _plan(capsys, *extra: str) -> dict:
    assert cli.main([*PLAN, *LOAD, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_estimate_sends_images_when_asked(capsys) -> None:
    assert GEMMA.vision is not None
    text = _plan(capsys)
    assert "image_tokens" not in text and "encoder_ms" not in text["estimate"]
    # --image-size alone says what an image costs; it sends none, and the estimate is the text one
    noted = _plan(capsys, "--image-size", "1280x720")
    assert noted["estimate"] == text["estimate"] and "image_tokens" not in noted
    seen = _plan(capsys, "--images-per-request", "2", "--image-size", "1280x720")
    encoder_ms = _encoder_ms(2 * image_flops(GEMMA.vision, 1280, 720), tp=2)
    assert seen["image_tokens"] == 2 * 256
    assert seen["estimate"]["encoder_ms"] == pytest.approx(encoder_ms)
    assert seen["estimate"]["ttft_ms"] > text["estimate"]["ttft_ms"] + encoder_ms
    # two sizes are equally likely: their mean; pan-and-scan adds the crops
    mixed = _plan(capsys, "--images-per-request", "2", "--image-size", "1280x720", "--image-size", "448x448")
    assert mixed["estimate"]["encoder_ms"] == pytest.approx(encoder_ms)  # Gemma encodes both at 896 x 896
    panned = _plan(capsys, "--images-per-request", "2", "--image-size", "1920x1080",
                   "--mm-processor-kwargs", '{"do_pan_and_scan": true}')  # fmt: skip
    assert panned["image_tokens"] > 2 * 256 and panned["estimate"]["encoder_ms"] > encoder_ms
    # the table names the encoder's time
    assert cli.main([*PLAN, *LOAD, "--images-per-request", "2", "--image-size", "1280x720"]) == 0
    assert "vision encoder" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--images-per-request", "2", "--image-size", "1280x720"],
            "--images-per-request is read only with --estimate",
        ),
        ([*LOAD, "--images-per-request", "2"], "--images-per-request needs --image-size WxH"),
        ([*LOAD, "--images-per-request", "0", "--image-size", "1280x720"], "--images-per-request 0: must be >= 1"),
        ([*LOAD, "--images-per-request", "1", "--image-size", "9000x10"], "--image-size: at most 8192 px a side"),
        (
            [*LOAD, "--images-per-request", "1", "--image-size", "1280by720"],
            "--image-size 1280by720: give WIDTHxHEIGHT",
        ),
    ],
)
def test_plan_images_bad_input_is_one_line(capsys, extra, message) -> None:
    assert cli.main([*PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_plan_images_on_a_text_model_is_one_line(capsys) -> None:
    text_model = ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100-SXM"]
    assert cli.main([*text_model, *LOAD, "--images-per-request", "1", "--image-size", "1280x720"]) == 2
    err = capsys.readouterr().err
    assert "has no vision encoder" in err and err.count("\n") == 1


def test_the_refit_predicts_a_level_as_its_estimate_does_images_and_all() -> None:
    """The study's refit fits the factors on its trials' levels: it predicts each with the encoder's time, as the
    level's estimate has it, so the tower's time is not folded into the factors (and then counted twice)."""
    from servetune.estimate.calibrate import predict
    from servetune.study.refit import StudyRefit
    from servetune.trial.estimated import calibration_points

    args = {"tensor_parallel_size": 2, "max_model_len": 8192, "max_num_seqs": 64}
    images, shipped = Workload.model_validate(IMAGES), load_factors().for_class("H100")
    for workload in (images, Workload.model_validate(TEXT), None):
        result = _gpu_trial(args).model_copy(update={"outcome": "COMPLETE"})
        estimate_levels(result, "H100-SXM", None, workload=workload)
        points = calibration_points(result, "H100-SXM", None, workload)
        assert len(points) == len(result.levels) and points
        for point, level in zip(points, result.levels, strict=True):
            assert level.estimate is not None
            assert point.encoder_flops == workload_images(workload, GEMMA.vision, args)[1]
            assert predict(point, shipped)[0]["ttft_ms"] == pytest.approx(level.estimate.ttft_ms, rel=1e-9)
    refit = StudyRefit("H100-SXM", None, workload=images)
    refit.add(_gpu_trial(args).model_copy(update={"outcome": "COMPLETE"}))
    assert refit.record() is not None and refit.record().points > 0
