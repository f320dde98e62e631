"""Integer arithmetic the ledger and the estimate share (a leaf module: it imports nothing of servetune)."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers, as vLLM's ``cdiv`` (``vllm.utils.math_utils``): the pages or stages ``a`` needs at ``b`` each."""
    return -(-a // b)
