"""Predicted against actual: the KV capacity vLLM reports in its start-up log.

vLLM 0.32 logs ``GPU KV cache size: 447,088 tokens, Maximum concurrency for 32,768 tokens per
request: 13.64x`` (``CPU KV cache size`` on the CPU build); the engine reads it
(``servetune.engine.server.KvCapacity``). A trial records both numbers so the planner's error
is measured on every engine start.
"""

from __future__ import annotations

from servetune.capacity.schema import CapacityPlan


def compare_kv(plan: CapacityPlan, reported_tokens: int) -> dict[str, float | int | str]:
    """Predicted vs reported KV tokens; ``relative_error`` is (predicted - reported) / reported."""
    predicted = plan.kv_cache_tokens
    error = (predicted - reported_tokens) / reported_tokens if reported_tokens else float("inf")
    return {
        "model": plan.model,
        "profile": plan.settings.profile,
        "predicted_tokens": predicted,
        "reported_tokens": reported_tokens,
        "abs_error_tokens": predicted - reported_tokens,
        "relative_error": round(error, 4),
    }
