"""A fake engine inside Ray Serve LLM's replicas, so that Serve's deployments, routing and rollouts are tested for
real without vLLM: Ray Serve LLM's ``LLMServer`` runs it in place of vLLM where the replica's environment names it
(``RAYLLM_VLLM_ENGINE_CLS``, Ray Serve LLM's own hook). A trial's ``env`` with :data:`ENGINE_ENV` in it carries it
there: the deployment's runtime environment is the trial's environment.

It streams completions and chat completions (``stream`` only) at a set time to the first token and between tokens,
``SERVETUNE_FAKE_TTFT_MS`` and ``SERVETUNE_FAKE_ITL_MS`` in its environment (as the fake server's,
testing/fake_openai.py), with the usage chunk servetune's client reads; at most ``max_num_seqs`` (its engine
argument) stream at once, the rest wait (their TTFT grows). It takes ``SERVETUNE_FAKE_START_S`` (default 0) to
start, as a real engine takes its load: a request that waits for a replica to start waits at least that long.
Starting, it runs the replica's Ray Serve LLM callback as vLLM's engine does (servetune's on a local Ray it started:
serve/cores.py, which claims a core and tells what the replica was started with). Started, it prints :data:`STARTED`
and its engine arguments (JSON) to its log: what each replica runs can be read from the replicas' logs, as from Serve
(``LLMServer.llm_config``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ray.llm._internal.serve.core.engine.protocol import LLMEngine

#: The environment that makes Ray Serve LLM's replicas run this engine.
ENGINE_ENV = {"RAYLLM_VLLM_ENGINE_CLS": "servetune.testing.serve_engine:FakeServeEngine"}
#: What it prints once started, followed by its engine arguments as JSON.
STARTED = "fake Serve engine started with engine arguments "
#: The environment variable of its start-up time, in seconds.
START_S_ENV = "SERVETUNE_FAKE_START_S"


class FakeServeEngine(LLMEngine):
    """Ray Serve LLM's ``LLMEngine`` protocol, answered without a model (see the module's doc)."""

    def __init__(self, llm_config: Any) -> None:
        self.llm_config = llm_config
        self.engine_kwargs: dict[str, Any] = dict(llm_config.engine_kwargs or {})
        self.ttft_s = float(os.environ.get("SERVETUNE_FAKE_TTFT_MS", "20")) / 1000.0
        self.itl_s = float(os.environ.get("SERVETUNE_FAKE_ITL_MS", "5")) / 1000.0
        self.slots: asyncio.Semaphore | None = None
        self.resets = 0

    async def start(self) -> None:
        # As vLLM's engine starts in Ray Serve LLM (VLLMEngine.start): the replica's callback first, servetune's on a
        # local Ray it started (serve/cores.py: a core claimed, and what the replica was started with told).
        get_callback = getattr(self.llm_config, "get_or_create_callback", None)
        callback = get_callback() if get_callback is not None else None
        if callback is not None:
            await callback.run_callback("on_before_node_init")
        await asyncio.sleep(float(os.environ.get(START_S_ENV, "0")))
        seqs = self.engine_kwargs.get("max_num_seqs")
        self.slots = asyncio.Semaphore(int(seqs)) if seqs else None
        print(STARTED + json.dumps(self.engine_kwargs, sort_keys=True, default=str), flush=True)

    async def completions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[str, None]:  # type: ignore[override]
        async for chunk in self._stream(request, chat=False):
            yield chunk

    async def chat(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[str, None]:  # type: ignore[override]
        async for chunk in self._stream(request, chat=True):
            yield chunk

    async def _stream(self, request: Any, chat: bool) -> AsyncIterator[str]:
        if not getattr(request, "stream", False):
            raise ValueError("the fake Serve engine answers streaming requests only")
        start = time.perf_counter()
        n_out = int(getattr(request, "max_tokens", None) or getattr(request, "max_completion_tokens", None) or 16)
        prompt = getattr(request, "prompt", None) if not chat else getattr(request, "messages", None)
        prompt_tokens = len(str(prompt).split())
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model}
        async with self.slots if self.slots is not None else contextlib.nullcontext():
            if self.slots is not None:
                start = time.perf_counter()  # the wait for a slot is queueing: the client's TTFT counts it
            for i in range(n_out):
                await asyncio.sleep(max(0.0, start + self.ttft_s + i * self.itl_s - time.perf_counter()))
                choice = {"index": 0, "delta": {"content": "x"}} if chat else {"index": 0, "text": "x"}
                yield f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out}
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def embeddings(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:  # type: ignore[override]
        raise NotImplementedError("the fake Serve engine has no embeddings")
        yield  # an async generator, as the protocol's

    async def transcriptions(self, request: Any, raw_request_info: Any = None) -> AsyncGenerator[Any, None]:  # type: ignore[override]
        raise NotImplementedError("the fake Serve engine has no transcriptions")
        yield  # an async generator, as the protocol's

    def routing_stats(self) -> dict[str, Any]:
        return {}

    async def resolve_lora(self, lora_model: Any) -> None:
        raise NotImplementedError("the fake Serve engine has no LoRA adapters")

    async def reset_prefix_cache(self) -> None:
        self.resets += 1
