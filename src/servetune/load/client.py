"""Async streaming client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Each request fills a :class:`~servetune.metrics.RequestRecord`: send time, the arrival time of
every content chunk, end time, token counts from the server's ``usage``, and, when it fails,
the kind of error. Failures are recorded, never raised. Chunks are decoded with msgspec into
just the fields the client needs, so the client spends little CPU per streamed token.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import msgspec

from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def _has_content(chunk: _Chunk) -> bool:
    for choice in chunk.choices:
        if choice.text:
            return True
        delta = choice.delta
        if delta is not None and (delta.content or delta.reasoning_content):
            return True
    return False


class StreamingClient:
    """One HTTP session to one server; use as ``async with StreamingClient(...) as client``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api: str = "completions",
        timeout_s: float = 600.0,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api = api
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None
        self._url = f"{self.base_url}/v1/{'chat/completions' if api == 'chat' else 'completions'}"

    async def __aenter__(self) -> "StreamingClient":
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True)
        self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def payload(self, spec: RequestSpec) -> dict:
        body: dict = {
            "model": self.model,
            "max_tokens": spec.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(self, spec: RequestSpec, record: RequestRecord, t0: float) -> RequestRecord:
        """Send one request; ``t0`` is the level's clock origin (``time.perf_counter()``)."""
        assert self._session is not None, "use StreamingClient as an async context manager"
        clock = time.perf_counter
        chunk_times = record.chunk_times
        record.sent = clock() - t0
        try:
            async with self._session.post(self._url, json=self.payload(spec), timeout=self.timeout) as resp:
                if resp.status != 200:
                    body = (await resp.text())[:300]
                    record.error_kind = f"http_{resp.status // 100}xx"
                    record.error = f"HTTP {resp.status}: {body}"
                    record.end = clock() - t0
                    return record
                buffer = b""
                async for data in resp.content.iter_any():
                    now = clock() - t0
                    buffer += data
                    while (cut := buffer.find(b"\n\n")) >= 0:
                        event, buffer = buffer[:cut], buffer[cut + 2 :]
                        if not event.startswith(b"data:"):
                            continue
                        body = event[5:].strip()
                        if body == b"[DONE]":
                            continue
                        chunk = _decode_chunk(body)
                        if chunk.error is not None:
                            record.error_kind = "stream_error"
                            record.error = str(chunk.error)[:300]
                        if chunk.choices and _has_content(chunk):
                            chunk_times.append(now)
                        if chunk.usage is not None:
                            record.prompt_tokens = chunk.usage.prompt_tokens
                            record.output_tokens = chunk.usage.completion_tokens
                record.end = clock() - t0
        except asyncio.CancelledError:
            record.error_kind, record.error = "cancelled", "cancelled by the load generator"
            record.end = clock() - t0
            raise
        except asyncio.TimeoutError:
            record.error_kind, record.error = "timeout", f"no answer within {self.timeout.total:g} s"
        except aiohttp.ClientConnectionError as exc:
            record.error_kind, record.error = "connection", str(exc)[:300] or type(exc).__name__
        except aiohttp.ClientError as exc:
            record.error_kind, record.error = "client_error", str(exc)[:300] or type(exc).__name__
        except msgspec.DecodeError as exc:
            record.error_kind, record.error = "bad_stream", str(exc)[:300]
        if record.end is None:
            record.end = clock() - t0
        if record.error_kind is None:
            if not chunk_times:
                record.error_kind, record.error = "empty", "the stream carried no content"
            else:
                if record.output_tokens is None:  # the server sent no usage: fall back to chunks
                    record.output_tokens = len(chunk_times)
                record.ok = True
        return record
