"""LoRA on real vLLM (CPU build) against the planner: what vLLM allocates for ``enable_lora`` on the tiny model.

Builds the tiny model and its adapter, starts one offline vLLM engine with ``enable_lora`` (``--max-loras``,
``--max-lora-rank``), sums the stacked A and B tensors of every layer vLLM wrapped for LoRA, and prints them
beside the planner's slots (capacity/lora.py), the KV tokens vLLM reported beside the plan's, and one greedy
answer without and with the adapter (they differ: the adapter is served). Run it under the heavy lock:

    flock /tmp/servetune-heavy.lock .venv/bin/python bench/lora_vllm.py [--max-loras 2] [--max-lora-rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from worker_probe import importable_in_workers


def lora_bytes(model) -> dict[str, int]:  # runs in vLLM's worker: imported there as lora_vllm.lora_bytes
    total = layers = 0
    for _, module in model.named_modules():
        found = False
        for attr in ("lora_a_stacked", "lora_b_stacked"):
            value = getattr(module, attr, None)
            if value is None:
                continue
            tensors = value if isinstance(value, (tuple, list)) else (value,)
            total += sum(t.numel() * t.element_size() for t in tensors)
            found = True
        layers += found
    return {"bytes": total, "wrapped_layers": layers}


def measure(args: argparse.Namespace, tmp: Path, lora_bytes) -> dict:
    """vLLM's LoRA allocation and KV tokens beside the planner's, the tiny model and adapter built in ``tmp``."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from servetune.capacity import Hardware, arch_from_hf_config, plan_capacity
    from servetune.capacity.lora import lora_cost
    from servetune.models.tiny import TINY_CONFIG, build_tiny_adapter, build_tiny_model

    model, adapter = build_tiny_model(tmp / "tiny"), build_tiny_adapter(tmp / "tiny-lora")
    engine = {"max_model_len": 1024, "enforce_eager": True, "dtype": "float32"}
    lora = {"enable_lora": True, "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}
    llm = LLM(model=str(model), **engine, **lora)
    try:
        allocated = llm.apply_model(lora_bytes)[0]
        cache = llm.llm_engine.vllm_config.cache_config
        kv_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0)
        greedy = SamplingParams(max_tokens=12, temperature=0)
        base = llm.generate(["hello there"], greedy)[0].outputs[0].text
        adapted = llm.generate(["hello there"], greedy, lora_request=LoRARequest("tiny", 1, str(adapter)))[0]
    finally:  # stop the engine before its model is removed (at exit the interpreter would wait on its process)
        llm.llm_engine.engine_core.shutdown()
    arch = arch_from_hf_config(TINY_CONFIG, "tiny")
    planned = lora_cost(arch, 4, args.max_loras, args.max_lora_rank)
    plan = plan_capacity(arch, {**engine, **lora}, Hardware(device="cpu", name="cpu", fp8=False),
                         env={"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]})  # fmt: skip
    out = {
        "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
        "vllm_lora_bytes": allocated["bytes"], "vllm_wrapped_layers": allocated["wrapped_layers"],
        "planned_lora_bytes": planned.max_loras * planned.slot_bytes,
        "vllm_kv_tokens": kv_tokens, "planned_kv_tokens": plan.kv_cache_tokens,
        "base_answer": base, "adapter_answer": adapted.outputs[0].text,
    }  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    args = parser.parse_args()
    # vLLM's worker unpickles lora_bytes by module name: it must import this file as lora_vllm
    lora_vllm = importable_in_workers("lora_vllm")

    with tempfile.TemporaryDirectory(prefix="servetune-lora-") as folder:  # the model and adapter, removed at exit
        out = measure(args, Path(folder), lora_vllm.lora_bytes)
    print(json.dumps(out, indent=2))
    return 0 if out["vllm_lora_bytes"] == out["planned_lora_bytes"] else 1


if __name__ == "__main__":
    sys.exit(main())
