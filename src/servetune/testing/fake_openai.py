"""A fake OpenAI-compatible streaming server with set TTFT and inter-token gaps.

Fast client and scheduler tests use it where real vLLM would make them slow. It speaks the
parts of vLLM's API servetune uses: ``/health``, ``/v1/models``, streaming
``/v1/completions`` and ``/v1/chat/completions`` with ``usage``, and a small ``/metrics``; ``/server_info``
where ``$SERVETUNE_FAKE_VLLM_CONFIG`` gives the configuration to answer with.
It streams ``n`` choices and log-probabilities (in each API's shape) where a request asks for them, unless made
with ``honour_asks=False`` (a server that takes the fields and ignores them). It also logs vLLM's KV capacity
line, so it can stand in for the engine in lifecycle tests:

    python -m servetune.testing.fake_openai --port 8000 --ttft-ms 50 --itl-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web

from servetune.config.graphs import GRAPH_ARGS
from servetune.engine.server import free_port

if TYPE_CHECKING:  # the twin reads the estimate: imported only when a fake is paced by it
    from servetune.testing.twin import Twin

_T = TypeVar("_T")


def _prompt_and_images(body: dict[str, Any]) -> tuple[str, list[str]]:
    """A request's prompt as the fake counts it, and the URLs of the images its chat content parts carry.
    A message whose content is a list of parts counts its text parts as the prompt (its images are not text)."""
    if "prompt" in body:
        return str(body.get("prompt") or ""), []
    messages = body.get("messages", "")
    if not isinstance(messages, list) or not any(isinstance(m.get("content"), list) for m in messages):
        return json.dumps(messages), []
    texts: list[str] = []
    images: list[str] = []
    for message in messages:
        content = message.get("content")
        parts: list[dict[str, Any]] = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            if part.get("type") == "image_url":
                images.append(str(part["image_url"]["url"]))
            elif part.get("type") == "text":
                texts.append(str(part.get("text", "")))
    return json.dumps(texts), images


def _logprobs(chat: bool, position: int) -> dict[str, Any]:
    """The log-probabilities of one streamed token ``x``, in the chat or the completions API's shape."""
    if chat:
        return {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]}
    return {"tokens": ["x"], "token_logprobs": [-0.5], "top_logprobs": [{"x": -0.5}], "text_offset": [position]}


class FakeOpenAI:
    def __init__(self, ttft_ms: float = 20.0, itl_ms: float = 5.0, model: str = "fake", fail_status: int | None = None,
                 max_num_seqs: int | None = None, dev_mode: bool = True, stall_after: int | None = None,
                 stall_ms: float = 0.0, release_ms: float = 0.0, max_num_queued_reqs: int | None = None,
                 twin: Twin | None = None, honour_asks: bool = True,
                 vllm_config: dict[str, Any] | None = None, finish_lead_ms: float = 0.0) -> None:  # fmt: skip
        self.ttft_s = ttft_ms / 1000.0
        # What ``/server_info?config_format=json`` answers (dev mode), as a vLLM that resolved these (None: no route)
        self.vllm_config = vllm_config
        self.itl_s = itl_ms / 1000.0
        # A stream that falls silent: after ``stall_after`` tokens, ``stall_ms`` without a byte.
        self.stall_after = stall_after
        self.stall_s = stall_ms / 1000.0
        self.disconnected = 0  # streams the client closed before their end
        # An engine slow to notice a client gone: a dropped stream stays running this long.
        self.release_s = release_ms / 1000.0
        # An engine done with a request before its client has read the end: counted finished and no longer running this
        # long before the stream's last bytes (a client reading behind the engine, as on a loaded host).
        self.finish_lead_s = finish_lead_ms / 1000.0
        self.model = model
        self.honour_asks = honour_asks  # n and logprobs: streamed as asked, or left out
        # A GPU twin (testing/twin.py) paces every request by the estimate instead of ttft_ms / itl_ms:
        # TTFT from the requests in flight at its arrival, each gap from those in flight at that token.
        self.twin = twin
        self.in_flight = 0
        self.twin_slots = 0  # what the twin runs at once at the last request's length
        self.fail_status = fail_status
        # Like a batch: at most max_num_seqs requests generate at once, the rest wait (TTFT grows).
        self.slots = asyncio.Semaphore(max_num_seqs) if max_num_seqs else None
        self.running = 0
        self.waiting = 0  # requests queued for a slot (max_num_seqs)
        # vLLM's admission bound: past this many requests running and waiting, 503 at once (AsyncLLM.check_admission).
        self.max_num_queued_reqs = max_num_queued_reqs
        self.rejected = 0
        self.finished = 0
        self.generated = 0
        # A prefix cache of whole prompts, as vLLM counts it: prompt tokens queried, and hit when the
        # same prompt came before (since the last reset). ``dev_mode`` serves /reset_prefix_cache.
        self.dev_mode = dev_mode
        self.cached: set[str] = set()
        self.cache_queries = 0
        self.cache_hits = 0
        self.resets = 0
        # Chat content parts: the images each request carried (their count, in arrival order) and their URLs.
        self.images_per_request: list[int] = []
        self.image_urls: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_get("/metrics", self.metrics)
        if self.dev_mode:
            app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
            if self.vllm_config is not None:
                app.router.add_get("/server_info", self.server_info)
        return app

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"vllm_config": self.vllm_config})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.cached.clear()
        self.resets += 1
        return web.json_response({"success": True})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text(), content_type="text/plain")

    def metrics_text(self) -> str:
        """What ``/metrics`` serves now (vLLM's names)."""
        running, waiting = self.running, self.waiting
        if self.twin is not None:  # the twin queues in its model: past its slots, requests wait
            running = min(self.in_flight, self.twin_slots)
            waiting = self.in_flight - running
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.model}"}} {running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} {waiting}\n'
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="{self.model}"}} {self.generated}\n'
            # vLLM writes every finish reason from its start; the fake runs each request to its max_tokens, and, as
            # vLLM v1, does not count a request its client dropped (the abort's sample stays 0)
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{model_name="{self.model}",finished_reason="stop"}} 0\n'
            f'vllm:request_success_total{{model_name="{self.model}",finished_reason="length"}} {self.finished}\n'
            f'vllm:request_success_total{{model_name="{self.model}",finished_reason="abort"}} 0\n'
            "# TYPE vllm:prefix_cache_queries counter\n"
            f'vllm:prefix_cache_queries_total{{model_name="{self.model}"}} {self.cache_queries}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            f'vllm:prefix_cache_hits_total{{model_name="{self.model}"}} {self.cache_hits}\n'
            # vLLM 0.32 writes both reasons from its start; the fake bounds requests alone, so refuses none by tokens
            "# TYPE vllm:admission_rejections counter\n"
            f'vllm:admission_rejections_total{{model_name="{self.model}",reason="max_num_queued_reqs"}} {self.rejected}\n'
            f'vllm:admission_rejections_total{{model_name="{self.model}",reason="max_num_queued_tokens"}} 0\n'
        )

    async def complete(self, request: web.Request) -> web.StreamResponse:
        start = time.perf_counter()  # TTFT counts from the request's arrival
        body = await request.json()
        if self.fail_status:
            return web.json_response({"error": {"message": "injected failure"}}, status=self.fail_status)
        if self.max_num_queued_reqs is not None and self.running + self.waiting + 1 > self.max_num_queued_reqs:
            self.rejected += 1
            message = "The engine is currently busy and cannot accept new requests."  # vLLM's QueueOverflowError
            return web.json_response({"error": {"message": message, "code": 503}}, status=503)
        chat = request.path.endswith("/chat/completions")
        n_out = int(body.get("max_tokens") or 16)
        choices = int(body.get("n") or 1) if self.honour_asks else 1
        logprobs = self.honour_asks and body.get("logprobs") not in (None, False)
        prompt, images = _prompt_and_images(body)
        self.images_per_request.append(len(images))
        self.image_urls.extend(images)
        prompt_tokens = len(prompt.split())
        self.cache_queries += prompt_tokens
        if prompt in self.cached:
            self.cache_hits += prompt_tokens
        self.cached.add(prompt)
        if self.slots is not None:
            self.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.waiting -= 1
            start = time.perf_counter()  # waiting for a slot is queueing: TTFT counts it via the client
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.running += 1
        twin = self.twin
        if twin is not None:
            self.in_flight += 1
            self.twin_slots = twin.slots(prompt_tokens, n_out)
        dropped = released = False
        due = start
        try:
            for i in range(n_out):
                # Sleep to an absolute schedule, so gaps do not drift with event-loop delays.
                if twin is not None:
                    pace = twin.pace(self.in_flight, prompt_tokens, n_out)
                    due += pace.ttft_s if i == 0 else pace.itl_s
                else:
                    due = start + self.ttft_s + i * self.itl_s
                if self.stall_after is not None and i >= self.stall_after:
                    due += self.stall_s
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                for index in range(choices):
                    choice = {"index": index, "delta": {"content": "x"}} if chat else {"index": index, "text": "x"}
                    if logprobs:
                        choice["logprobs"] = _logprobs(chat, i)
                    await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                    self.generated += 1
            if self.finish_lead_s > 0:  # the engine is done: counted and released before the client has the end
                self.finished += 1
                self._release()
                released = True
                await asyncio.sleep(self.finish_lead_s)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n_out * choices,
                "total_tokens": n_out * choices,
            }
            await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            if not released:
                self.finished += 1
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected += 1  # the client went away: stop generating, as vLLM aborts the request
            dropped = True
            raise
        finally:
            if released:
                pass
            elif dropped and self.release_s > 0:
                asyncio.get_running_loop().call_later(self.release_s, self._release)
            else:
                self._release()
        return resp

    def _release(self) -> None:
        self.running -= 1
        if self.twin is not None:
            self.in_flight -= 1
        if self.slots is not None:
            self.slots.release()


#: vLLM's engine arguments that shape the compiled graph, as flags (config/graphs.py: where vLLM hashes each); the
#: rest (memory fraction, KV-cache size, prefix caching, the port) do not, so engines that differ only in those
#: share one compiled graph.
GRAPH_FLAGS = tuple("--" + name.replace("_", "-") for name in GRAPH_ARGS)


def compile_key(argv: list[str]) -> str:
    """The compile cache's key for these engine arguments (vLLM's hash, in miniature)."""
    picked = []
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        if name in GRAPH_FLAGS:
            if not value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value = argv[i + 1]
            picked.append((name, value))
    return hashlib.sha256(json.dumps(sorted(picked)).encode()).hexdigest()[:10]


def compile_graph(argv: list[str], compile_s: float, hit_s: float) -> None:
    """``torch.compile`` as vLLM does it on a GPU: ``compile_s`` the first time these arguments'
    graph is built, ``hit_s`` when ``VLLM_CACHE_ROOT`` already holds it (written atomically, as
    PyTorch 2.10+ writes its artifacts), with vLLM's log lines."""
    from servetune.engine.compile_cache import vllm_default_root

    root = Path(os.environ.get("VLLM_CACHE_ROOT") or vllm_default_root(os.environ))
    graph = root / "torch_compile_cache" / compile_key(argv) / "fake-graph"
    if graph.exists():
        time.sleep(hit_s)
        print(
            f"INFO [backends.py] Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took {hit_s:.3f} s",
            flush=True,
        )
        print(f"INFO [monitor.py] torch.compile took {hit_s:.2f} s in total", flush=True)
        return
    print("INFO [monitor.py] Starting torch.compile", flush=True)
    time.sleep(compile_s)
    graph.parent.mkdir(parents=True, exist_ok=True)
    tmp = graph.with_name(f".fake-graph.tmp{os.getpid()}")
    tmp.write_text(json.dumps(argv))
    tmp.replace(graph)
    print(f"INFO [monitor.py] torch.compile took {compile_s:.2f} s in total", flush=True)


def _env(name: str, default: _T) -> str | _T:
    """Flags default to ``SERVETUNE_FAKE_<NAME>`` so a study can vary them as ``env.`` parameters."""
    return os.environ.get(f"SERVETUNE_FAKE_{name}", default)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--ttft-ms", type=float, default=float(_env("TTFT_MS", 20.0)))
    parser.add_argument("--itl-ms", type=float, default=float(_env("ITL_MS", 5.0)))
    parser.add_argument("--max-num-seqs", type=int, help="requests generating at once (vLLM's engine argument)")
    parser.add_argument("--max-num-queued-reqs", type=int, help="past this many running and waiting requests, 503")
    parser.add_argument("--stall-after", type=int, help="after this many tokens of every stream, pause (--stall-ms)")
    parser.add_argument("--stall-ms", type=float, default=0.0, help="the pause of --stall-after, in ms")
    parser.add_argument("--startup-delay-s", type=float, default=float(_env("STARTUP_DELAY_S", 0.0)))
    parser.add_argument(
        "--fail-startup",
        action="store_true",
        default=bool(_env("FAIL_STARTUP", "")),
        help="exit with an error during startup, as a failing engine does",
    )
    crash = _env("CRASH_AFTER_S", None)
    parser.add_argument(
        "--crash-after-s",
        type=float,
        default=None if crash is None else float(crash),
        help="die this many seconds after becoming ready",
    )
    parser.add_argument("--stubborn-child", action="store_true", help="start a child process that ignores SIGTERM")
    parser.add_argument(
        "--child",
        action="store_true",
        default=bool(_env("CHILD", "")),
        help="start a child process, as vLLM starts its engine cores: it outlives a killed server",
    )
    parser.add_argument("--kv-tokens", type=int, default=524288)
    compile_s = _env("COMPILE_S", None)
    parser.add_argument(
        "--compile-s",
        type=float,
        default=None if compile_s is None else float(compile_s),
        help="compile the graph at start-up for this long, unless VLLM_CACHE_ROOT holds it",
    )
    parser.add_argument(
        "--compile-hit-s",
        type=float,
        default=float(_env("COMPILE_HIT_S", 0.0)),
        help="the start-up's load from the compile cache when it holds the graph",
    )
    parser.add_argument(
        "--release-ms",
        type=float,
        default=float(_env("RELEASE_MS", 0.0)),
        help="a stream the client closed stays running this long (an engine slow to abort)",
    )
    args, _ = parser.parse_known_args(argv)  # ignore the engine arguments vLLM would take
    print(f"fake engine starting for model {args.model}", flush=True)
    twin = None
    if raw_twin := os.environ.get("SERVETUNE_FAKE_TWIN"):
        from servetune.errors import UserError
        from servetune.testing.twin import twin_from_env

        try:
            twin = twin_from_env(raw_twin, list(sys.argv[1:] if argv is None else argv))
        except UserError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            sys.exit(2)
        print(f"fake engine paced as a twin of {twin.arch.name} on {twin.replica.rates.gpu} "
              f"(run factor {twin.factor:.3f})", flush=True)  # fmt: skip
    if args.stubborn_child:
        # Ready only once the child ignores SIGTERM: on a slow host its interpreter can take long
        # enough to start that a stop would otherwise find it still defenceless.
        code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\nwhile True: time.sleep(1)"
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None  # stdout=PIPE
        child.stdout.readline()
    if args.child:  # its command line names this server's, so tests can find it
        subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)", sys.argv[0]])
    time.sleep(args.startup_delay_s)
    if args.compile_s is not None:
        compile_graph(list(sys.argv[1:] if argv is None else argv), args.compile_s, args.compile_hit_s)
    if args.fail_startup:
        print("ValueError: injected startup failure for the test", flush=True)
        sys.exit(1)
    if ipc_dir := os.environ.get("VLLM_RPC_BASE_PATH"):  # where vLLM's ZMQ sockets go, left by a killed engine
        Path(ipc_dir, str(uuid.uuid4())).touch()
    print(
        f"INFO [kv_cache_utils.py] CPU KV cache size: {args.kv_tokens:,} tokens, Maximum concurrency for 4,096 tokens per request: {args.kv_tokens / 4096:.2f}x",
        flush=True,
    )
    if args.crash_after_s is not None:
        loop_kill = args.crash_after_s

        async def on_startup(app: web.Application) -> None:
            asyncio.get_running_loop().call_later(loop_kill, os.kill, os.getpid(), signal.SIGKILL)

    app = FakeOpenAI(
        args.ttft_ms,
        args.itl_ms,
        args.model,
        max_num_seqs=None if twin else args.max_num_seqs,  # the twin queues past its own slots
        max_num_queued_reqs=args.max_num_queued_reqs,
        stall_after=args.stall_after,
        stall_ms=args.stall_ms,
        release_ms=args.release_ms,
        twin=twin,
        # the configuration a vLLM resolved, as JSON (engine/resolved.py reads it), e.g. for recheck's moved defaults
        vllm_config=json.loads(raw_config) if (raw_config := os.environ.get("SERVETUNE_FAKE_VLLM_CONFIG")) else None,
    ).app()
    if args.crash_after_s is not None:
        app.on_startup.append(on_startup)
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()


def write_fake_python(directory: Path) -> Path:
    """An executable that stands in for vLLM's interpreter: ``vllm serve MODEL ...`` (``-c PROGRAM serve``, engine/
    server.py ``VLLM_SERVE``) or ``-m <vLLM server> --model MODEL ...`` runs the fake server instead; anything else
    (``-c`` look-ups) goes to the real interpreter."""
    path = Path(directory) / "fake-vllm-python"
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "if sys.argv[1:2] == ['-c'] and sys.argv[3:4] == ['serve']:\n"
        "    argv = ['--model', *sys.argv[4:]]  # vllm serve MODEL ...\n"
        "elif sys.argv[1:2] == ['-m']:\n"
        "    argv = sys.argv[3:]  # -m vllm.entrypoints.openai.api_server --model MODEL ...\n"
        "else:\n"
        f"    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
        "from servetune.testing.fake_openai import main\n"
        "main(argv)\n"
    )
    path.chmod(0o755)
    return path


@contextmanager
def serve_in_thread(fake: FakeOpenAI) -> Iterator[str]:
    """Run ``fake`` on 127.0.0.1, on a free port, in an event loop of a background thread of this process (the
    tests' fake, and a bench's beside its load client); yields its URL and stops it on exit."""
    loop = asyncio.new_event_loop()
    port = free_port()
    runner = web.AppRunner(fake.app())
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
