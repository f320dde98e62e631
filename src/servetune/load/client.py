"""Async streaming client for OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions``.

Each request fills a :class:`~servetune.metrics.RequestRecord`: send time, the arrival time of
every content chunk, end time, token counts from the server's ``usage``, and, when it fails,
the kind of error. Failures are recorded, never raised. Chunks are decoded with msgspec into
just the fields the client needs, so the client spends little CPU per streamed token.

Timeouts (tuning checklist, section 10), each its own error kind: ``timeout_first_token`` (no
token within ``first_token_timeout_s`` of sending: the request queued or prefilled too long),
``timeout_idle`` (a stream fell silent for ``idle_timeout_s`` between two reads), and ``timeout``
(the whole request took longer than ``timeout_s``). A request sent with ``drop_after`` closes
its connection after that many content chunks, as a user who leaves does (``dropped``).

A request that asked for structured output keeps its answer's text (each choice's), and its record says
whether every choice parsed as asked (``RequestRecord.structured_valid``; the level's ``structured_valid`` is
the share of such answers). A request that asked for ``n`` > 1 choices or for ``logprobs`` is checked for them
too: an answer with fewer choices carrying content than asked (``n``), or a content chunk without log-probabilities
(``logprobs``), names what it lacked in ``RequestRecord.not_honoured`` (the level counts them per ask).
"""

from __future__ import annotations

import asyncio
import copy
import time

import aiohttp
import msgspec

from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    logprobs: msgspec.Raw = msgspec.Raw()  # kept undecoded: only whether it is there is read (b"" or b"null": not)


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _PromptDetails | None = None  # vLLM with --enable-prompt-tokens-details


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict | str | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


def stream_error(error: dict | str) -> tuple[str, str]:
    """The error kind and text of an error event inside a stream. vLLM sends an HTTP status it meant in the event's
    ``code`` when the response had already begun: vLLM 0.32 checks its admission bounds (``--max-num-queued-reqs``
    and ``--max-num-queued-tokens``) once before the stream and again when the request reaches the engine, inside the
    stream generator (``AsyncLLM.check_admission``: ``QueueOverflowError``, ``MaxQueuedTokensError``, each a 503), so
    such a refusal is an ``http_5xx`` as the same refusal before the stream began is, not a ``stream_error``."""
    if isinstance(error, dict) and isinstance(code := error.get("code"), int) and 400 <= code < 600:
        return f"http_{code // 100}xx", f"HTTP {code} (in the stream): {error.get('message', '')}"[:300]
    return "stream_error", str(error)[:300]


#: Error kinds of the timeouts (``RequestRecord.error_kind``); ``timeout`` is the total one.
TIMEOUT_FIRST_TOKEN = "timeout_first_token"
TIMEOUT_IDLE = "timeout_idle"
TIMEOUT_TOTAL = "timeout"
#: A stream the client closed on purpose after its first tokens (``drop_after``).
DROPPED = "dropped"
#: Seconds an idle connection stays in the pool (under the server's keep-alive timeout).
KEEPALIVE_S = 2.0


def _has_content(chunk: _Chunk) -> bool:
    for choice in chunk.choices:
        if choice.text:
            return True
        delta = choice.delta
        if delta is not None and (delta.content or delta.reasoning_content):
            return True
    return False


def _keep_text(chunk: _Chunk, texts: dict[int, list[str]]) -> None:
    """Add a chunk's content (each choice's, reasoning left out) to the answer's text so far."""
    for choice in chunk.choices:
        piece = choice.text if choice.delta is None else choice.delta.content
        if piece:
            texts.setdefault(choice.index, []).append(piece)


#: What a request can ask that its answer shows (``RequestRecord.not_honoured``): its choices, its log-probabilities.
ASK_N = "n"
ASK_LOGPROBS = "logprobs"


class AskCheck:
    """Whether an answer carries what its request asked beyond text: ``n`` choices (each index that streamed
    content is counted) and log-probabilities on every content chunk of every choice. Made only for a request
    that asks either (:meth:`of`), so other requests' streams are read as before."""

    __slots__ = ("choices", "lacking_logprobs", "logprobs", "n")

    def __init__(self, n: int, logprobs: bool) -> None:
        self.n, self.logprobs = n, logprobs
        self.choices: set[int] = set()
        self.lacking_logprobs = 0

    @classmethod
    def of(cls, spec: RequestSpec) -> AskCheck | None:
        asked = dict(spec.sampling)
        n = asked.get("n")
        choices = n if isinstance(n, int) else 1
        logprobs = asked.get("logprobs") not in (None, False)  # chat sends logprobs: true (and top_logprobs)
        return cls(choices, logprobs) if choices > 1 or logprobs else None

    def see(self, chunk: _Chunk) -> None:
        """Read one chunk that carried content."""
        for choice in chunk.choices:
            piece = choice.text if choice.delta is None else choice.delta.content or choice.delta.reasoning_content
            if not piece:
                continue  # a role-only or finishing chunk carries no token, and no log-probabilities for one
            self.choices.add(choice.index)
            if self.logprobs and (len(choice.logprobs) == 0 or bytes(choice.logprobs) == b"null"):
                self.lacking_logprobs += 1

    def not_honoured(self) -> list[str] | None:
        """The asks the answer lacked (``n``, ``logprobs``); None when it carried all of them."""
        lacked = [ASK_N] if len(self.choices) < self.n else []
        if self.logprobs and (self.lacking_logprobs or not self.choices):
            lacked.append(ASK_LOGPROBS)
        return lacked or None


def structured_valid(spec: RequestSpec, texts: dict[int, list[str]]) -> bool | None:
    """Whether every choice of a finished answer is what ``spec`` asked for (None: it asked for no structure,
    or for a grammar, which servetune does not parse)."""
    if spec.structured is None:
        return None
    answers = ["".join(pieces) for _, pieces in sorted(texts.items())] or [""]
    verdicts = [spec.structured.valid(text) for text in answers]
    return None if None in verdicts else all(verdicts)


class StreamingClient:
    """One HTTP session to one server; use as ``async with StreamingClient(...) as client``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api: str = "completions",
        timeout_s: float = 600.0,
        first_token_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        ignore_eos: bool = True,
        temperature: float = 0.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api = api
        self.timeout_s = timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        self.idle_timeout_s = idle_timeout_s
        # aiohttp's own limit is a backstop only: the deadlines in send() name which one ran out.
        self.timeout = aiohttp.ClientTimeout(total=timeout_s + 5.0)
        self.ignore_eos = ignore_eos
        self.temperature = temperature
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None
        self._url = f"{self.base_url}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
        self.fresh_connections = False

    def with_fresh_connections(self) -> StreamingClient:
        """The same client (its own session: use it as a context manager) whose every request opens a connection of
        its own, closed after it: no request rides a pooled keep-alive connection the server may be closing."""
        twin = copy.copy(self)  # every setting, whatever the constructor grows to take; not the session
        twin._session, twin.fresh_connections = None, True
        return twin

    async def __aenter__(self) -> StreamingClient:
        # Idle connections are let go before the server's keep-alive (uvicorn: 5 s) closes them:
        # a request written on a connection the server just closed fails ("Can not write request body").
        if self.fresh_connections:
            connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=True, force_close=True)
        else:
            connector = aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=300, enable_cleanup_closed=True, keepalive_timeout=KEEPALIVE_S
            )
        self._session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def payload(self, spec: RequestSpec) -> dict:
        body: dict = {
            "model": spec.model or self.model,  # a request naming a LoRA adapter sends its name
            "max_tokens": spec.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": self.temperature,
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(spec.sampling)  # the request class's own sampling, over the workload's defaults
        if self.api == "chat" and spec.images:  # the text, then each image as a content part
            parts = [{"type": "text", "text": spec.prompt}, *(image.content_part() for image in spec.images)]
            body["messages"] = [{"role": "user", "content": parts}]
        elif self.api == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        return body

    async def send(
        self,
        spec: RequestSpec,
        record: RequestRecord,
        t0: float,
        drop_after: int | None = None,
        latency_timeouts: bool = True,
    ) -> RequestRecord:
        """Send one request; ``t0`` is the level's clock origin (``time.perf_counter()``).

        ``drop_after``: close the connection once that many content chunks arrived (error kind
        ``dropped``; the server should cancel the request and free its KV cache).
        ``latency_timeouts=False``: only the total timeout binds, not the first-token and idle ones
        (a probe whose closing is the caller's to decide, not a user who gives up on latency).
        """
        assert self._session is not None, "use StreamingClient as an async context manager"
        clock = time.perf_counter
        chunk_times = record.chunk_times
        texts: dict[int, list[str]] | None = {} if spec.structured is not None else None
        asks = AskCheck.of(spec)
        record.sent = clock() - t0
        loop = asyncio.get_running_loop()
        total_at = loop.time() + self.timeout_s
        first_s, idle_s = (self.first_token_timeout_s, self.idle_timeout_s) if latency_timeouts else (None, None)
        # The deadline that binds now, and which kind it is: before the first token the
        # first-token one, after it the idle one (moved on at every read), the total one always.
        first_at = loop.time() + first_s if first_s is not None else None
        if first_at is not None and first_at < total_at:
            binding, deadline = TIMEOUT_FIRST_TOKEN, first_at
        else:
            binding, deadline = TIMEOUT_TOTAL, total_at
        try:
            async with asyncio.timeout_at(deadline) as scope:
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
                            message = event[5:].strip()
                            if message == b"[DONE]":
                                continue
                            chunk = _decode_chunk(message)
                            if chunk.error is not None:
                                record.error_kind, record.error = stream_error(chunk.error)
                            if chunk.choices and _has_content(chunk):
                                chunk_times.append(now)
                                if texts is not None:
                                    _keep_text(chunk, texts)
                                if asks is not None:
                                    asks.see(chunk)
                            if chunk.usage is not None:
                                record.prompt_tokens = chunk.usage.prompt_tokens
                                record.output_tokens = chunk.usage.completion_tokens
                                if chunk.usage.prompt_tokens_details is not None:
                                    record.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
                        if drop_after is not None and len(chunk_times) >= drop_after:
                            resp.close()  # the user leaves: the connection goes, the server should cancel
                            record.error_kind, record.error = (
                                DROPPED,
                                f"closed by the client after {len(chunk_times)} chunks",
                            )
                            break
                        if chunk_times and binding != TIMEOUT_TOTAL:
                            idle_at = loop.time() + idle_s if idle_s is not None else None
                            if idle_at is not None and idle_at < total_at:
                                binding = TIMEOUT_IDLE
                                scope.reschedule(idle_at)
                            else:
                                binding = TIMEOUT_TOTAL
                                scope.reschedule(total_at)
                    record.end = clock() - t0
        except asyncio.CancelledError:
            record.error_kind, record.error = "cancelled", "cancelled by the load generator"
            record.end = clock() - t0
            raise
        except TimeoutError:
            limit = {TIMEOUT_FIRST_TOKEN: first_s, TIMEOUT_IDLE: idle_s}.get(binding, self.timeout_s)
            what = {TIMEOUT_FIRST_TOKEN: "no token", TIMEOUT_IDLE: "no data between two reads"}.get(
                binding, "no complete answer"
            )
            record.error_kind, record.error = binding, f"{what} within {limit:g} s"
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
                if texts is not None:
                    record.structured_valid = structured_valid(spec, texts)
                if asks is not None:
                    record.not_honoured = asks.not_honoured()
        return record
