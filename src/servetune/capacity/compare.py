"""Predicted against actual: the KV capacity vLLM reports in its start-up log.

vLLM 0.32 logs ``GPU KV cache size: 447,088 tokens, Maximum concurrency for 32,768 tokens per
request: 13.64x`` (``CPU KV cache size`` on the CPU build); the engine reads it
(``servetune.engine.server.KvCapacity``). A trial records both numbers so the planner's error
is measured on every engine start, in one unit: :func:`measured_kv_tokens`.
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


def measured_kv_tokens(tokens: int, max_concurrency: float | None, at_tokens_per_request: int | None) -> int:
    """The KV capacity a start-up log states, in the planner's unit: concurrency x max_model_len.

    vLLM 0.32 logs exactly that as its token count. Earlier releases logged ``num_blocks //
    len(kv_cache_groups) * block_size`` (the code vLLM PR 40384 quotes), which for a hybrid model
    (sliding-window, chunked-local or Mamba groups sharing blocks) is no capacity: Llama-4-Scout on 8 x
    H200 logged 3,919,664 tokens beside 2.96x of 5,242,880 and 1.86x of 8,388,608 (vLLM 0.12). Where the
    two lines disagree beyond the concurrency's two decimals, the concurrency line is the capacity;
    otherwise the token line, exact, is kept.
    """
    if not max_concurrency or not at_tokens_per_request:
        return tokens
    derived = max_concurrency * at_tokens_per_request
    if abs(derived - tokens) <= 0.005 * at_tokens_per_request + 1:
        return tokens
    return int(derived)
