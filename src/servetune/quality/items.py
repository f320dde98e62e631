"""Quality items: one prompt (or chat) and one rule that scores the answer, no model as judge.

A suite is a JSONL file, one item a line::

    {"id": "sum-3", "prompt": "12 + 30 =", "expected": "42"}
    {"id": "caps", "messages": [{"role": "user", "content": "Say hi in capitals"}], "regex": "^[^a-z]+$"}
    {"id": "user", "prompt": "A user as JSON:", "json_schema": {"type": "object", "required": ["name"]}}

- ``expected``: the answer, stripped of surrounding white space, begins with this text;
- ``regex``: the pattern is found in the answer (``re.search``; anchor it to match the whole);
- ``json_schema``: the answer (a ```json fence or text around the first ``{...}``/``[...]``
  allowed) parses as JSON and validates against the schema (JSON Schema, draft 2020-12).

``max_tokens`` (default 64) bounds the answer. Answers are greedy (temperature 0), so a suite's
score is a deterministic function of the configuration, up to the engine's numerics.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from servetune.errors import UserError

DEFAULT_MAX_TOKENS = 64


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: str = Field(pattern=r"^(system|user|assistant|tool)$")
    content: str


class QualityItem(BaseModel):
    """One line of a suite: the request and the rule its answer must pass."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = None
    prompt: str | None = None
    messages: tuple[Message, ...] | None = None
    expected: str | None = None
    regex: str | None = None
    json_schema: dict[str, Any] | None = None
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, le=4096)

    @model_validator(mode="after")
    def _one_of_each(self) -> QualityItem:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        rules = [name for name in ("expected", "regex", "json_schema") if getattr(self, name) is not None]
        if len(rules) != 1:
            raise ValueError("give exactly one of 'expected', 'regex' or 'json_schema'")
        return self

    @field_validator("regex")
    @classmethod
    def _compiles(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from None
        return pattern

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                raise ValueError(f"json_schema is not a valid JSON Schema: {exc.message}") from None
        return schema

    def passes(self, answer: str | None) -> bool:
        """Whether an answer passes the item's rule (an answer that never came fails)."""
        if answer is None:
            return False
        if self.expected is not None:
            return answer.strip().startswith(self.expected.strip())
        if self.regex is not None:
            return re.search(self.regex, answer) is not None
        return json_answer_valid(answer, self.json_schema or {})


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


def json_answer_valid(answer: str, schema: dict[str, Any]) -> bool:
    """The answer holds one JSON value that validates against ``schema``."""
    from jsonschema import Draft202012Validator

    fenced = _FENCE.search(answer)
    text = (fenced.group(1) if fenced else answer).strip()
    value = _first_json(text)
    if value is _NOTHING:
        return False
    return Draft202012Validator(schema).is_valid(value)


_NOTHING = object()


def _first_json(text: str) -> Any:
    """The JSON value the text is, or the first object or array in it (``_NOTHING`` when none parses)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    for start, char in enumerate(text):
        if char in "{[":
            try:
                return decoder.raw_decode(text, start)[0]
            except ValueError:
                continue
    return _NOTHING


def read_suite(path: Path) -> list[QualityItem]:
    """Every item of a JSONL suite; a bad line is a :class:`UserError` naming the file and line."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    items = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except ValueError as exc:  # JSONDecodeError, or e.g. an integer over Python's 4300-digit limit
            detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise UserError(f"{path}:{number}: not valid JSON ({detail})") from None
        if not isinstance(data, dict):
            raise UserError(f"{path}:{number}: expected a JSON object")
        try:
            item = QualityItem.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            msg = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                msg = "unknown key"
            raise UserError(f"{path}:{number}: {where + ': ' if where else ''}{msg}") from None
        items.append(item if item.id else item.model_copy(update={"id": f"{path.stem}-{number}"}))
    if not items:
        raise UserError(f"{path}: no items (one JSON object a line)")
    return items
