"""What to change when a plan does not fit, each lever tried on the ledger itself.

For a KV pool that is too small or negative (a start-up failure), the levers are tried in this
order, cheapest in quality and hardware first: quantize the weights, store the KV cache in fp8,
lower max_model_len, raise tensor parallelism, raise gpu_memory_utilization (up to 0.95), and
lower the activation peak (max_num_batched_tokens / max_num_seqs). The tuning checklist's OOM
order (section 13: utilization, batched tokens, seqs, context, quantization, CUDA graphs, TP) is
for running out of memory *at runtime*; vLLM's start-up budget is a different failure.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from servetune.capacity.arch import ModelArch
from servetune.capacity.hardware import Hardware
from servetune.capacity.schema import CapacityPlan

Evaluate = Callable[[dict[str, Any]], CapacityPlan]

REFUSED = "vLLM refuses"


def _outcome(plan: CapacityPlan) -> str:
    if plan.fits:
        return f"fits, {plan.kv_cache_tokens:,} KV tokens, {plan.max_concurrency:.1f} x max_model_len"
    if plan.kv_cache_tokens > 0:
        return f"not enough alone: {plan.kv_cache_tokens:,} KV tokens"
    return "not enough alone"


def _structural(arch: ModelArch, plan: CapacityPlan, evaluate: Evaluate) -> list[str]:
    s = plan.settings
    if "max_model_len" in plan.reason:
        return [
            f"lower --max-model-len to {arch.max_position_embeddings:,} or less (the model's max_position_embeddings)"
        ]
    if "served by vLLM up to" in plan.reason:  # an architecture this release no longer serves (profile.py)
        return ["serve it with the vLLM release that last served it; --vllm-version plans for that release"]
    if "kv_cache_dtype" in plan.reason:  # the CPU build's refusal of a quantized KV cache (capacity/cpubuild.py)
        cpu = "a CPU with AVX-512 or AMX" if "AVX-512" in plan.reason else "a model whose head size it takes"
        return [f"--kv-cache-dtype auto keeps an unquantized KV cache, which the CPU build takes; fp8 needs {cpu}"]
    if "pipeline_parallel_size" in plan.reason:
        return [f"lower --pp to at most {arch.num_layers}"]
    valid = [t for t in (1, 2, 4, 8, 16) if not evaluate({"tensor_parallel_size": t}).reason.startswith(REFUSED)]
    sizes = ", ".join(map(str, valid)) or "none of 1-16"
    return [f"--tp {s.tensor_parallel_size} is not a valid split of this model; valid sizes: {sizes}"]


def _fits_advice(plan: CapacityPlan) -> list[str]:
    s, tips = plan.settings, []
    can = int(plan.max_concurrency_at_request)
    if not plan.max_num_seqs_reachable and plan.request_tokens == s.max_model_len:
        tips.append(
            f"only {can} requests of the full max_model_len fit at once (max_num_seqs {s.max_num_seqs}); shorter "
            "requests share the pool, so check your typical length with --request-tokens"
        )
    elif not plan.max_num_seqs_reachable:
        tips.append(
            f"at {plan.request_tokens:,} tokens per request the KV pool holds {can} requests, fewer than "
            f"max_num_seqs {s.max_num_seqs}: vLLM will queue or preempt the rest; lower --max-num-seqs to "
            f"{max(can, 1)} or hold more per GPU (fp8 KV cache, shorter max_model_len)"
        )
    if s.device == "gpu" and s.gpu_memory_utilization > 0.95:
        tips.append(
            f"gpu_memory_utilization {s.gpu_memory_utilization:g} leaves little headroom for fragmentation and "
            "runtime buffers; the checklist (section 4) starts at 0.90-0.95 for a dedicated GPU"
        )
    return tips


def _max_len_that_fits(plan: CapacityPlan, evaluate: Evaluate, limit: int) -> CapacityPlan | None:
    """The longest max_model_len (a multiple of 256 when possible, at most ``limit``) whose request fits the pool."""
    s = plan.settings
    usable = min((plan.kv_cache_blocks - 1) * s.block_size, limit)  # vLLM holds one block back
    length = usable // 256 * 256 or usable
    for _ in range(8):
        if length < s.block_size:
            return None
        trial = evaluate({"max_model_len": length})
        if trial.fits:
            return trial
        length = min(length - 256, (trial.kv_cache_blocks - 1) * s.block_size // 256 * 256)
    return None


def advise(arch: ModelArch, plan: CapacityPlan, hardware: Hardware, evaluate: Evaluate) -> list[str]:
    """Advice lines for ``plan``; ``evaluate(changes)`` re-plans with some engine args changed."""
    if plan.fits:
        return _fits_advice(plan)
    if plan.reason.startswith(REFUSED):
        return _structural(arch, plan, evaluate)
    s, tips = plan.settings, []
    weights_alone = plan.reason.startswith("weights need")
    if s.device == "gpu" and s.quantization == "none":
        awq = evaluate({"quantization": "awq"})
        line = (
            f"quantize the weights: a 4-bit AWQ/GPTQ checkpoint holds {awq.weights_gib:.1f} GiB per GPU "
            f"instead of {plan.weights_gib:.1f} ({_outcome(awq)})"
        )
        if hardware.fp8:
            fp8 = evaluate({"quantization": "fp8"})
            line += f"; fp8 holds {fp8.weights_gib:.1f} GiB ({_outcome(fp8)})"
        tips.append(line)
    if not weights_alone and not s.kv_cache_dtype.startswith("fp8"):
        fp8_kv = evaluate({"kv_cache_dtype": "fp8"})
        caveat = "check long-context quality" if s.device == "gpu" else "the CPU build needs AVX-512 or AMX for it"
        if not fp8_kv.reason.startswith(REFUSED):  # the CPU build without AVX-512 or AMX refuses it
            tips.append(f"--kv-cache-dtype fp8 halves the KV bytes per token ({_outcome(fp8_kv)}); {caveat}")
    if not weights_alone and plan.kv_cache_blocks > 0:
        shorter = _max_len_that_fits(plan, evaluate, arch.max_position_embeddings)
        if shorter is not None:
            tips.append(
                f"lower --max-model-len to {shorter.settings.max_model_len:,}: one full-length request must fit "
                f"({_outcome(shorter)}); set it from the real P99 request length"
            )
    if s.device == "gpu":
        for tp in (2, 4, 8):
            if tp <= s.tensor_parallel_size:
                continue
            wider = evaluate({"tensor_parallel_size": tp})
            if wider.reason.startswith(REFUSED):
                continue
            tips.append(f"raise --tp to {tp}: weights and KV heads split over {tp} GPUs ({_outcome(wider)})")
            if wider.fits:
                break
        if s.gpu_memory_utilization < 0.95:
            higher = evaluate({"gpu_memory_utilization": 0.95})
            tips.append(
                f"raise --gpu-memory-utilization from {s.gpu_memory_utilization:g} to 0.95 ({_outcome(higher)})"
            )
        if not weights_alone and plan.activation_gib > 1.0:
            smaller = evaluate({"max_num_batched_tokens": 2048, "max_num_seqs": min(s.max_num_seqs, 256)})
            tips.append(
                f"lower --max-num-batched-tokens to 2048 and --max-num-seqs to {min(s.max_num_seqs, 256)}: the "
                f"profiled activation peak drops from {plan.activation_gib:.2f} to {smaller.activation_gib:.2f} GiB "
                f"({_outcome(smaller)})"
            )
    else:
        need = math.ceil(plan.kv_gib_per_request)
        tips.append(
            f"raise VLLM_CPU_KVCACHE_SPACE (--cpu-kvcache-space-gib) to at least {need} GiB: on the CPU build it is "
            f"the whole KV pool per rank, and one max_model_len request needs {plan.kv_gib_per_request:.2f} GiB"
        )
    return tips
