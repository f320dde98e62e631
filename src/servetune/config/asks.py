"""What a request asks of the engine beyond its lengths: how it samples (:class:`Sampling`) and the structure its
answer must have (:class:`Structured`), as a workload or one of its request classes says (config/workload.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Sampling(BaseModel):
    """How a request samples, sent in its body as vLLM's OpenAI server reads it. A field left out is not sent
    (the server's default; the workload's ``temperature`` and ``ignore_eos`` where it has them). ``logprobs``
    asks that many log-probabilities per token (``logprobs: true, top_logprobs: k`` on chat). With ``n`` > 1 a
    request's output tokens are all its choices' (the server's usage)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM: -1 (or 0) considers every token
    n: int | None = Field(default=None, ge=1)
    logprobs: int | None = Field(default=None, ge=0)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    stop: tuple[str, ...] | None = None
    ignore_eos: bool | None = None  # false lets a request end early, at the model's end of sequence

    def over(self, base: Sampling) -> Sampling:
        """These fields over ``base``'s (a class's sampling over its workload's)."""
        return Sampling.model_validate({**base.model_dump(exclude_none=True), **self.model_dump(exclude_none=True)})

    def body(self, api: str) -> dict[str, object]:
        """The request body's fields for ``api`` (``completions`` or ``chat``)."""
        out: dict[str, object] = self.model_dump(exclude_none=True)
        if "stop" in out:
            out["stop"] = list(self.stop or ())
        if api == "chat" and self.logprobs is not None:
            out["logprobs"] = True
            if self.logprobs:
                out["top_logprobs"] = self.logprobs
        return out


#: The kinds of structured output, as ``structured:`` names them.
STRUCTURED_KINDS = ("json_schema", "choice", "regex", "grammar")


class Structured(BaseModel):
    """Structured output: exactly one of a JSON schema, choices, a regular expression or a grammar (vLLM's
    EBNF/Lark form). The schema is checked as a JSON schema and the regex compiled when the workload loads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    json_schema: dict[str, Any] | None = None
    choice: tuple[str, ...] | None = Field(default=None, min_length=1)
    regex: str | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)

    @field_validator("json_schema")
    @classmethod
    def _schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                jsonschema.validators.validator_for(schema).check_schema(schema)
            except jsonschema.SchemaError as exc:
                where = "/".join(str(p) for p in exc.path)
                raise ValueError(f"not a JSON schema{f' at {where}' if where else ''}: {exc.message}") from None
        return schema

    @field_validator("regex")
    @classmethod
    def _regex(cls, regex: str | None) -> str | None:
        if regex is not None:
            try:
                re.compile(regex)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return regex

    @model_validator(mode="after")
    def _one_kind(self) -> Structured:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(STRUCTURED_KINDS)}"
                + (f" (not {' and '.join(given)})" if given else "")
            )
        return self

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) is not None)

    def body(self, name: str) -> dict[str, object]:
        """The request body's fields: ``response_format`` with the schema (named ``name``), else vLLM's
        ``structured_outputs`` (read by its completions and chat servers alike)."""
        if self.json_schema is not None:
            return {
                "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": self.json_schema}}
            }
        value = list(self.choice) if self.choice is not None else self.regex or self.grammar
        return {"structured_outputs": {self.kind: value}}

    def valid(self, text: str) -> bool | None:
        """Whether an answer's text is what was asked: JSON under the schema, one of the choices, the regex
        matched in full. None for a grammar (servetune does not parse grammars)."""
        if self.json_schema is not None:
            try:
                jsonschema.validate(json.loads(text), self.json_schema)
            except (ValueError, jsonschema.ValidationError):
                return False
            return True
        if self.choice is not None:
            return text in self.choice
        if self.regex is not None:
            return re.fullmatch(self.regex, text) is not None
        return None
