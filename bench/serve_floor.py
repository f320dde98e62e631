"""Ray Serve's own floor on TTFT: Serve LLM's path with no engine behind it.

``serve_overhead.py`` measures Serve in front of vLLM. What it reports is the router's cost plus
whatever the router's processes take from a CPU engine beside them. This bench takes the engine
out: a fake engine answers after a fixed delay (``--ttft-ms``) with one token every ``--itl-ms``,
served

- **bare**: by servetune's fake OpenAI server (one aiohttp process, as vLLM's API server is one);
- **Serve, two hops**: behind the path Ray Serve LLM deploys: Serve's HTTP proxy, an OpenAI
  ingress replica (FastAPI, a ``StreamingResponse`` over a streaming handle) and a model replica
  whose generator yields the same tokens on the same schedule;
- **Serve, one hop**: the ingress replica yielding the tokens itself (the proxy's share).

Each is measured with ``servetune bench --url`` (servetune's client, TTFT as the first chunk that
carries a token), in alternating rounds on one local Ray that stays up throughout, so all paths see
the same background. The difference in TTFT P50 is what Serve costs a request on this host before
any engine runs: no deployment servetune chooses can go below it.

    .venv/bin/python bench/serve_floor.py [--rounds 3] [--concurrency 1] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request  # module level: FastAPI resolves the handler's string annotations here
from fastapi.responses import JSONResponse, StreamingResponse


async def fake_stream(body: dict, ttft_ms: float, itl_ms: float):
    """The fake engine's answer as vLLM streams it: SSE chunks of one token, then usage, then [DONE]."""
    start = time.perf_counter()
    n_out = int(body.get("max_tokens") or 16)
    chat = "messages" in body
    prompt = body.get("prompt") or json.dumps(body.get("messages", ""))
    for i in range(n_out):
        await asyncio.sleep(max(0.0, start + (ttft_ms + i * itl_ms) / 1000.0 - time.perf_counter()))
        choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
        yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
    usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": n_out, "total_tokens": n_out}
    yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


def serve_app(name: str, two_hops: bool, ttft_ms: float, itl_ms: float):
    """A Serve application answering ``/v1/completions`` like Ray Serve LLM's OpenAI ingress."""
    from ray import serve

    api = FastAPI()

    @serve.deployment(name=f"{name}-model", ray_actor_options={"num_cpus": 0})
    class Model:
        async def tokens(self, body: dict):
            async for chunk in fake_stream(body, ttft_ms, itl_ms):
                yield chunk

    @serve.deployment(name=f"{name}-ingress", ray_actor_options={"num_cpus": 0})
    @serve.ingress(api)
    class Ingress:
        def __init__(self, model=None) -> None:
            self.model = model.options(stream=True) if model is not None else None

        @api.get("/v1/models")
        async def models(self) -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

        @api.post("/v1/completions")
        @api.post("/v1/chat/completions")
        async def complete(self, request: Request) -> StreamingResponse:
            body = await request.json()
            chunks = self.model.tokens.remote(body) if self.model is not None else fake_stream(body, ttft_ms, itl_ms)
            return StreamingResponse(chunks, media_type="text/event-stream")

    return Ingress.bind(Model.bind()) if two_hops else Ingress.bind()


def bench(url: str, tokenizer: Path, concurrency: int, requests: int, out: Path) -> float:
    """TTFT P50 (ms) of one ``servetune bench --url`` run."""
    done = subprocess.run(
        [sys.executable, "-m", "servetune", "bench", "--url", url, "--model", str(tokenizer), "--served-model-name", "fake",
         "--workload", "cpu-tiny", "--concurrency", str(concurrency), "--num-requests", str(requests), "--json", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        sys.exit(f"servetune bench --url {url} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return float(json.loads(out.read_text())["levels"][0]["summary"]["ttft_ms"]["p50"])


def wait_ready(url: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"{url} did not answer /v1/models within {limit_s:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of bare, Serve two hops, Serve one hop")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--ttft-ms", type=float, default=15.0, help="the fake engine's TTFT (about the tiny model's on this host)"
    )
    parser.add_argument("--itl-ms", type=float, default=5.0)
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit("--rounds: at least 1")
    import ray
    from ray import serve

    from servetune.engine.server import free_port
    from servetune.local_ray import SERVE_SYSTEM_CONFIG, start_local_ray
    from servetune.models.tiny import build_tiny_model

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="serve-floor-"))
    tokenizer = build_tiny_model(work / "tiny")
    port = free_port()
    bare = subprocess.Popen(
        [sys.executable, "-m", "servetune.testing.fake_openai", "--port", str(port), "--model", "fake",
         "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    ttft: dict[str, list[float]] = {"bare": [], "serve, two hops": [], "serve, one hop": []}
    try:
        # As serve-check starts its local Ray: 4 CPUs declared, workers at niceness 0, no token left in ~/.ray.
        start_local_ray(num_cpus=4, log_to_driver=False, _system_config=SERVE_SYSTEM_CONFIG)
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        urls = {"bare": f"http://127.0.0.1:{port}"}
        for label, name, two in (("serve, two hops", "two", True), ("serve, one hop", "one", False)):
            serve.run(serve_app(name, two, args.ttft_ms, args.itl_ms), name=name, route_prefix=f"/{name}")
            urls[label] = f"{serve.context._get_global_client().root_url.rstrip('/')}/{name}"
        for url in urls.values():
            wait_ready(url)
        for index in range(args.rounds):
            for label, url in urls.items():
                ttft[label].append(
                    bench(url, tokenizer, args.concurrency, args.num_requests, work / f"{label}-{index}.json")
                )
                print(f"round {index + 1}, {label}: TTFT P50 {ttft[label][-1]:.1f} ms", flush=True)
    finally:
        bare.terminate()
        bare.wait(timeout=10)
        serve.shutdown()
        ray.shutdown()
    print(f"fake engine TTFT {args.ttft_ms:g} ms, a token every {args.itl_ms:g} ms; concurrency {args.concurrency}, "
          f"{args.num_requests} requests per run, {args.rounds} round(s)")  # fmt: skip
    base = ttft["bare"]
    for label, values in ttft.items():
        extra = (
            ""
            if label == "bare"
            else "; over bare, per round: " + ", ".join(f"{v - b:+.1f}" for v, b in zip(values, base, strict=True))
        )
        print(f"{label:16s} TTFT P50 (ms): " + ", ".join(f"{v:.1f}" for v in values) + extra)
    for label in ("serve, two hops", "serve, one hop"):
        floor = statistics.median(v - b for v, b in zip(ttft[label], base, strict=True))
        print(f"{label}: Serve's floor {floor:+.1f} ms (median round)")
    print(f"took {time.monotonic() - started:.0f} s; files in {work}")


if __name__ == "__main__":
    main()
