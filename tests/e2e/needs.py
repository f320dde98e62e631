"""Skip an end-to-end module whose optional stack is not installed, without importing it."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

VLLM = "the e2e tests need vLLM (the CPU build: pip install servetune[cpu])"


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found on the path rather than imported: ``pytest.importorskip`` imports it,
    and vLLM with Ray Serve LLM cost the test process about 15 core-s that none of its tests uses (the engines and
    Serve run in processes of their own)."""
    try:
        return find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def need(module: str, reason: str = VLLM) -> None:
    """Skip the calling test module (at import) or test where ``module`` is not installed."""
    if not installed(module):
        pytest.skip(reason, allow_module_level=True)
