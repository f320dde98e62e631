"""Errors a user can act on.

Anything raised as a :class:`UserError` is shown by the CLI as one line (no traceback) and
turns into a non-zero exit. Name the file and field, or the flag, that is wrong.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input or an environment problem the user must fix; shown as one line."""

    exit_code = 2


class EngineError(UserError):
    """The vLLM server failed. Carries the tail of its log."""

    exit_code = 3

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail

    def __str__(self) -> str:
        base = super().__str__()
        if not self.log_tail:
            return base
        return f"{base}\n--- engine log (last lines) ---\n{self.log_tail}"


class EngineStartError(EngineError):
    """The vLLM server did not come up."""


class EngineDiedError(EngineError):
    """The vLLM server died while it was being measured."""
