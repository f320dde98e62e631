"""Images for vision-language workloads: the config (config/images.py), the images made (load/images.py), the
request stream and the chat payload, and the fake server counting what arrives."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from servetune.config.workload import Workload, load_workload
from servetune.errors import UserError
from servetune.load.client import StreamingClient
from servetune.load.images import _pixels, make_image
from servetune.load.requests import PromptFactory, RequestSpec, iter_requests
from servetune.load.runner import Level, run_level
from servetune.summary import summarize
from servetune.testing.fake_openai import FakeOpenAI
from tests.conftest import serve_fake

LENGTHS = {"input_tokens": {"dist": "uniform", "min": 4, "max": 40}, "output_tokens": {"dist": "uniform", "max": 9}}
SIZES = [[64, 48], {"width": 32, "height": 96, "weight": 3}]


def workload(**extra) -> Workload:
    return Workload.model_validate({"name": "t", "seed": 3, "api": "chat", **LENGTHS, **extra})


def take(w: Workload, tokenizer, n: int, stream: int = 0) -> list[RequestSpec]:
    requests = iter_requests(w, PromptFactory(tokenizer), stream=stream)
    return [next(requests) for _ in range(n)]


def decoded(url: str) -> Image.Image:
    head, data = url.split(",", 1)
    assert head.startswith("data:image/") and head.endswith(";base64")
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_requests_carry_images_at_the_drawn_sizes_and_keep_their_text(tiny_tokenizer):
    images = {"count": {"dist": "uniform", "min": 1, "max": 3}, "sizes": SIZES, "detail": "low"}
    with_images = take(workload(images=images), tiny_tokenizer, 300)
    counts = Counter(len(r.images) for r in with_images)
    assert set(counts) == {1, 2, 3}
    sizes = Counter((i.width, i.height) for r in with_images for i in r.images)
    assert set(sizes) == {(64, 48), (32, 96)} and 2.2 < sizes[(32, 96)] / sizes[(64, 48)] < 3.9  # 1:3 by weight
    for image in with_images[0].images + with_images[1].images:
        assert decoded(image.url).size == (image.width, image.height) and image.detail == "low"
    # deterministic per stream, different between streams, every image its own
    again = take(workload(images=images), tiny_tokenizer, 300)
    assert [i.url for r in again for i in r.images] == [i.url for r in with_images for i in r.images]
    other = take(workload(images=images), tiny_tokenizer, 300, stream=1)
    assert [i.url for r in other for i in r.images] != [i.url for r in with_images for i in r.images]
    urls = [i.url for r in with_images for i in r.images]
    assert len(set(urls)) == len(urls)
    # images are drawn apart from the text: the same prompts and lengths as without them
    plain = take(workload(), tiny_tokenizer, 300)
    strip = lambda specs: [(r.prompt, r.input_tokens, r.output_tokens) for r in specs]  # noqa: E731
    assert strip(with_images) == strip(plain) and {r.images for r in plain} == {()}


def test_a_class_carries_its_own_images_and_a_conversation_keeps_its_images(tiny_tokenizer):
    mix = [
        {"name": "look", **LENGTHS, "images": {"count": 2, "sizes": [[40, 30]]}},
        {"name": "talk", **LENGTHS},
    ]
    specs = take(workload(mix=mix, **dict.fromkeys(LENGTHS)), tiny_tokenizer, 100)
    assert {len(r.images) for r in specs if r.request_class == "look"} == {2}
    assert {len(r.images) for r in specs if r.request_class == "talk"} == {0}
    sessions = {"turns": {"dist": "fixed", "value": 3}}
    turns = take(workload(images={"count": 1, "sizes": [[40, 30]]}, sessions=sessions), tiny_tokenizer, 30)
    by_session: dict[int, set] = {}
    for spec in turns:
        by_session.setdefault(spec.session, set()).add(spec.images)
    assert all(len(images) == 1 for images in by_session.values()) and len(by_session) == 10


def test_the_chat_payload_carries_content_parts_and_is_unchanged_without_images():
    client = StreamingClient("http://127.0.0.1:1", "m", api="chat")
    plain = RequestSpec(0, "hello there", 2, 5, "c", sampling=(("top_p", 0.9),))
    before = json.dumps(client.payload(plain), sort_keys=True)
    assert json.loads(before)["messages"] == [{"role": "user", "content": "hello there"}]
    image = make_image(20, 10, seed=1, detail="high")
    body = client.payload(RequestSpec(0, "hello there", 2, 5, "c", sampling=(("top_p", 0.9),), images=(image,) * 2))
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "hello there"},
        {"type": "image_url", "image_url": {"url": image.url, "detail": "high"}},
        {"type": "image_url", "image_url": {"url": image.url, "detail": "high"}},
    ]
    # a request without images is byte for byte what it was (the same spec, the same client)
    body.pop("messages")
    assert {k: v for k, v in json.loads(before).items() if k != "messages"} == body
    assert json.dumps(client.payload(plain), sort_keys=True) == before


def test_the_fake_server_counts_the_images_each_request_carries_and_the_level_sums_them(tiny_tokenizer):
    images = {"count": {"dist": "uniform", "min": 0, "max": 1}, "sizes": [[30, 20]]}
    with pytest.raises(ValueError, match="min"):  # counts are >= 1: a class without images leaves images out
        workload(images=images)
    images = {"count": {"dist": "uniform", "min": 1, "max": 3}, "sizes": [[30, 20], [16, 16]]}
    specs = take(workload(images=images), tiny_tokenizer, 12)
    fake = FakeOpenAI(ttft_ms=1.0, itl_ms=1.0)

    async def level(url: str):
        async with StreamingClient(url, "fake", api="chat") as client:
            return await run_level(client, specs, Level("concurrency", 1), num_requests=10, warmup_requests=2)

    with serve_fake(fake) as url:
        records = asyncio.run(level(url))
    assert all(r.ok for r in records)
    assert fake.images_per_request == [len(s.images) for s in specs]  # every image arrived, per request
    assert fake.image_urls == [i.url for s in specs for i in s.images]
    summary = summarize(records, {"concurrency": 1})
    assert summary.images_sent == sum(len(s.images) for s in specs[2:])  # warm-up left out
    assert summary.image_pixels == sum(i.pixels for s in specs[2:] for i in s.images)
    assert summarize(records[:0], {"concurrency": 1}).images_sent is None


def test_completions_workloads_with_images_are_one_line_naming_file_and_field(tmp_path):
    path = tmp_path / "vlm.yaml"
    mix = [{"name": "a", **LENGTHS, "images": {"count": 1, "sizes": [[8, 8]]}}]
    path.write_text(json.dumps({"name": "vlm", "mix": mix}))
    with pytest.raises(UserError) as info:
        load_workload(path)
    text = str(info.value)
    assert str(path) in text and "mix.0.images" in text and "api: chat" in text and "\n" not in text
    path.write_text(json.dumps({"name": "vlm", **LENGTHS, "images": {"count": 1, "sizes": [[8, 8, 8]]}}))
    with pytest.raises(UserError, match="width, height"):
        load_workload(path)


def test_a_png_holds_the_same_pixels_and_each_seed_its_own():
    rgb = _pixels(13, 7, seed=5)
    assert not np.array_equal(rgb, _pixels(13, 7, seed=6))
    png = make_image(13, 7, seed=5, fmt="png")
    assert png.url.startswith("data:image/png;base64,")
    assert np.array_equal(np.asarray(decoded(png.url).convert("RGB")), rgb)


SPACE = """
name: vlm
model: tiny
device: cpu
hardware: {devices_per_node: 2}
engine_args: {max_model_len: 1024}
workload:
  name: screenshots
  api: chat
  input_tokens: {dist: fixed, value: 8}
  output_tokens: {dist: fixed, value: 4}
  mix:
"""


def test_limit_mm_per_prompt_is_searched_and_must_let_the_workloads_images_through(tmp_path):
    from servetune.engine.args import engine_argv
    from servetune.space_file import load_space

    def load(params: str, count: str = "{dist: uniform, min: 1, max: 3}"):
        path = tmp_path / "space.yaml"
        workload = SPACE.replace("  mix:\n", f"  images: {{count: {count}, sizes: [[64, 64]]}}\n")
        path.write_text(workload + params)
        return load_space(path)

    space = load("params:\n  limit_mm_per_prompt: [{image: 3, video: 0}, {image: 8}]\n")
    assert engine_argv({"limit_mm_per_prompt": space.params["limit_mm_per_prompt"][0]}) == [
        "--limit-mm-per-prompt",
        '{"image": 3, "video": 0}',
    ]
    with pytest.raises(UserError) as info:  # requests carry up to 3 images
        load("params:\n  limit_mm_per_prompt: [{image: 2}, {image: 8}]\n")
    assert "params.limit_mm_per_prompt: image 2 is fewer than the 3 images" in str(info.value)
    assert load("", count="2").engine_args == {"max_model_len": 1024}  # no limit given: vLLM's 999
    with pytest.raises(UserError, match=r"engine_args\.limit_mm_per_prompt: image 1"):
        load("engine_args: {max_model_len: 1024, limit_mm_per_prompt: {image: 1}}\n", count="2")
    with pytest.raises(UserError, match=r"limit_mm_per_prompt'?\.image: 'many' is not a count"):
        load("params:\n  limit_mm_per_prompt: [{image: many}]\n")
