"""Read a request log: one request a line, JSON (JSONL).

Each line is an object with a send time, and the request's input and output sizes, as token
counts or as texts (then counted with the served model's tokenizer), and optionally the
conversation it belongs to. The usual spellings are accepted:

- time: ``timestamp``, ``time``, ``ts``, ``arrival_time``, ``created``, ``start_time`` — Unix
  seconds (milliseconds when above 1e11; ``created`` as OpenAI writes it), or an ISO 8601 string;
- input tokens: ``input_tokens``, ``prompt_tokens``, ``input_length``, ``prompt_len``, or
  ``usage.prompt_tokens`` (an OpenAI response body);
- output tokens: ``output_tokens``, ``completion_tokens``, ``output_length``, ``output_len``, or
  ``usage.completion_tokens``;
- input text: ``prompt``, ``input``, or ``messages`` (OpenAI chat: the contents, in order);
- output text: ``output``, ``completion``, ``response``;
- conversation: ``session_id``, ``session``, ``conversation_id``, ``conversation``;
- how long the request took (optional, seconds): ``duration_s``, ``latency_s``, ``e2e_s``,
  or ``latency_ms`` / ``e2el_ms``.

Unknown keys are ignored. A line that cannot be read is a :class:`~servetune.errors.UserError`
naming the file and the line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from servetune.errors import UserError

TIME_KEYS = ("timestamp", "time", "ts", "arrival_time", "created", "start_time")
INPUT_TOKEN_KEYS = ("input_tokens", "prompt_tokens", "input_length", "prompt_len")
OUTPUT_TOKEN_KEYS = ("output_tokens", "completion_tokens", "output_length", "output_len")
INPUT_TEXT_KEYS = ("prompt", "input")
OUTPUT_TEXT_KEYS = ("output", "completion", "response")
SESSION_KEYS = ("session_id", "session", "conversation_id", "conversation")
SECONDS_KEYS = ("duration_s", "latency_s", "e2e_s")
MILLISECONDS_KEYS = ("latency_ms", "e2el_ms")

#: A numeric timestamp above this is in milliseconds (1e11 s is the year 5138).
_MILLISECONDS_ABOVE = 1e11


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One line of a request log, in the log's own terms."""

    line: int
    time_s: float  # seconds, on the log's clock
    input_tokens: int | None = None
    output_tokens: int | None = None
    prompt: str | None = None
    output: str | None = None
    session: str | None = None
    duration_s: float | None = None


class LogError(UserError):
    """A request log that cannot be read; the message names the file and line."""


def _first(record: dict, keys: tuple[str, ...]) -> tuple[str, object] | None:
    for key in keys:
        if record.get(key) is not None:
            return key, record[key]
    return None


def _time(key: str, value: object) -> float:
    if isinstance(value, bool):
        raise ValueError(f"'{key}' is not a time")
    if isinstance(value, (int, float)):
        seconds = float(value)
        if not math.isfinite(seconds):
            raise ValueError(f"'{key}' is not a finite number")
        return seconds / 1000.0 if seconds > _MILLISECONDS_ABOVE else seconds
    if isinstance(value, str):
        try:
            stamp = datetime.fromisoformat(value.strip())
        except ValueError:
            try:
                return _time(key, float(value))
            except ValueError:
                raise ValueError(f"'{key}' is neither Unix seconds nor an ISO 8601 time: {value[:40]!r}") from None
        return stamp.timestamp()
    raise ValueError(f"'{key}' is not a time")


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 0:
        raise ValueError(f"'{key}' must be a whole number of tokens, got {value!r}")
    return int(value)


def _text(key: str, value: object) -> str:
    if isinstance(value, str):
        return value
    if key == "messages" and isinstance(value, list):
        parts = []
        for message in value:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):  # OpenAI content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str):
                raise ValueError("'messages' must be a list of {role, content}")
            parts.append(content)
        return "\n".join(parts)
    raise ValueError(f"'{key}' must be text")


def _usage(usage: dict, key: str) -> tuple[str, object] | None:
    """``usage.prompt_tokens`` of an OpenAI response body, as ``_first`` finds a key."""
    return (f"usage.{key}", usage[key]) if usage.get(key) is not None else None


def _seconds(value: object) -> float | None:
    """A duration; one that is not a number is left out (it is optional)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def parse_record(record: object, line: int) -> LoggedRequest:
    """One decoded line; a ValueError says what is wrong with it."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    found = _first(record, TIME_KEYS)
    if found is None:
        raise ValueError(f"no time (one of {', '.join(TIME_KEYS)})")
    time_s = _time(*found)
    raw_usage = record.get("usage")
    usage = raw_usage if isinstance(raw_usage, dict) else {}
    found = _first(record, INPUT_TOKEN_KEYS) or _usage(usage, "prompt_tokens")
    input_tokens = _count(*found) if found else None
    found = _first(record, OUTPUT_TOKEN_KEYS) or _usage(usage, "completion_tokens")
    output_tokens = _count(*found) if found else None
    found = _first(record, (*INPUT_TEXT_KEYS, "messages"))
    prompt = _text(*found) if found else None
    found = _first(record, OUTPUT_TEXT_KEYS)
    output = _text(*found) if found else None
    if input_tokens is None and prompt is None:
        raise ValueError("no input size (input_tokens, prompt_tokens, usage.prompt_tokens, prompt or messages)")
    if output_tokens is None and output is None:
        raise ValueError("no output size (output_tokens, completion_tokens, usage.completion_tokens or output)")
    found = _first(record, SESSION_KEYS)
    session = None if found is None else str(found[1])
    duration_s = None
    if (found := _first(record, SECONDS_KEYS)) is not None:
        duration_s = _seconds(found[1])
    elif (found := _first(record, MILLISECONDS_KEYS)) is not None:
        duration_s = None if (ms := _seconds(found[1])) is None else ms / 1000.0
    return LoggedRequest(line, time_s, input_tokens, output_tokens, prompt, output, session, duration_s)


def read_log(path: str | Path) -> list[LoggedRequest]:
    """Every request of the log at ``path``, in order of time (lines with equal times keep theirs)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise LogError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise LogError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    requests = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, or an integer past Python's 4300-digit limit
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise LogError(f"{path} line {number}: not valid JSON ({reason})") from None
        try:
            requests.append(parse_record(record, number))
        except ValueError as exc:
            raise LogError(f"{path} line {number}: {exc}") from None
    if len(requests) < 2:
        raise LogError(f"{path}: needs at least two requests, has {len(requests)}")
    requests.sort(key=lambda r: r.time_s)
    return requests
