"""A draft model on real vLLM (CPU build) against the planner: the drafter's weights and KV as vLLM loads them.

Builds the tiny model, starts one offline vLLM engine with the tiny model drafting for itself
(``speculative_config`` method ``draft_model``), and reads inside vLLM's worker the drafter module
(``model_runner.drafter.model``, ``v1/spec_decode/draft_model.py``): the bytes of its parameters, of the linear
weights the CPU build moved into its GEMM kernels (an empty parameter is left behind), of its rotary cos/sin cache
where that is not the target's own tensor (vLLM's ``get_rope`` keeps one per settings), and of its other buffers
(attention scales, shown, not compared); its attention layers that keep KV; and the KV tokens vLLM's cache config
reports (the figure its "CPU KV cache size" log line prints). It prints them beside the planner's
(capacity/draft.py, and plan_capacity for the KV) for the same arguments, and one greedy answer (the drafter
ran). Exits 1 on a difference. Run it under the heavy lock:

    flock /tmp/servetune-heavy.lock .venv/bin/python bench/draft_vllm.py [--num-speculative-tokens 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from worker_probe import importable_in_workers


def drafter_bytes(worker) -> dict[str, int]:  # runs in vLLM's worker: imported there as draft_vllm.drafter_bytes
    """The drafter's bytes as vLLM holds them. The CPU build hands each linear layer's weight to a oneDNN (or
    sgl) kernel after the load and leaves an empty parameter behind (``dispatch_cpu_unquantized_gemm``): those
    are counted by the layer's own partition sizes. Modules that are the target's own (an MTP drafter's embeddings
    and lm_head, vLLM's "Sharing target model ...") are left out; their parameters are shown apart. Buffers: the
    rotary cos/sin cache (``cos_sin_cache``), counted only where it is not the target's own tensor, and the rest
    (attention scales)."""
    runner = worker.model_runner
    drafter, target = runner.drafter.model, runner.model
    targets = {t.untyped_storage().data_ptr() for t in (*target.parameters(), *target.buffers()) if t.numel()}
    shared_modules = {id(m) for m in target.modules()}
    out = dict.fromkeys(("parameter_bytes", "kernel_linear_bytes", "rope_bytes", "shared_rope_bytes"), 0)
    out["other_buffer_bytes"] = out["shared_parameter_bytes"] = 0
    for module in drafter.modules():
        if id(module) in shared_modules:
            continue
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel() == 0 and hasattr(module, "cpu_linear"):
            rows = sum(module.output_partition_sizes)  # a replicated layer (a MoE router) has no input partition
            columns = getattr(module, "input_size_per_partition", None) or module.input_size
            out["kernel_linear_bytes"] += columns * rows * weight.element_size()
    own = {id(p) for m in drafter.modules() if id(m) not in shared_modules for p in m.parameters(recurse=False)}
    for parameter in drafter.parameters():
        out["parameter_bytes" if id(parameter) in own else "shared_parameter_bytes"] += parameter.nbytes
    for name, buffer in drafter.named_buffers():
        shared = buffer.untyped_storage().data_ptr() in targets
        if name.endswith("cos_sin_cache"):
            out["shared_rope_bytes" if shared else "rope_bytes"] += buffer.nbytes
        else:
            out["other_buffer_bytes"] += buffer.nbytes
    out["kv_layers"] = len(getattr(runner.drafter, "_draft_attn_layer_names", ()))
    return out


def measure(args: argparse.Namespace, tmp: Path, drafter_bytes) -> dict:
    """vLLM's drafter bytes and KV tokens beside the planner's, the tiny model built in ``tmp``."""
    from vllm import LLM, SamplingParams

    from servetune.capacity import Hardware, arch_from_hf_config, plan_capacity
    from servetune.capacity.draft import draft_cost
    from servetune.models.tiny import TINY_CONFIG, build_tiny_model

    model = str(build_tiny_model(tmp / "tiny"))
    engine = {"enforce_eager": True, "dtype": "float32", "max_num_seqs": 16}
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=model, **engine, speculative_config=spec)
    try:
        loaded = llm.collective_rpc(drafter_bytes)[0]
        cache = llm.llm_engine.vllm_config.cache_config
        kv_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0)
        answer = llm.generate(["hello there"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    finally:  # stop the engine before its model is removed (at exit the interpreter would wait on its process)
        llm.llm_engine.engine_core.shutdown()
    arch = arch_from_hf_config(TINY_CONFIG, "tiny")
    plan = plan_capacity(arch, {**engine, "speculative_config": spec}, Hardware(device="cpu", name="cpu", fp8=False),
                         env={"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]}, draft=arch)  # fmt: skip
    planned = draft_cost(arch, spec, arch, 4, lambda _: 4.0, 1)  # float32 weights and KV, one rank
    vllm_bytes = loaded["parameter_bytes"] + loaded["kernel_linear_bytes"] + loaded["rope_bytes"]
    out = {
        "num_speculative_tokens": args.num_speculative_tokens, **{f"vllm_{k}": v for k, v in loaded.items()},
        "vllm_draft_bytes": vllm_bytes, "planned_draft_bytes": int(planned.weights),
        "vllm_draft_kv_layers": loaded["kv_layers"], "planned_draft_kv_layers": planned.kv_layers,
        "vllm_kv_tokens": kv_tokens, "planned_kv_tokens": plan.kv_cache_tokens, "answer": answer,
    }  # fmt: skip
    del out["vllm_kv_layers"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    args = parser.parse_args()
    # vLLM's worker unpickles drafter_bytes by module name: it must import this file as draft_vllm
    draft_vllm = importable_in_workers("draft_vllm")

    with tempfile.TemporaryDirectory(prefix="servetune-draft-") as folder:  # the model, removed at exit
        out = measure(args, Path(folder), draft_vllm.drafter_bytes)
    print(json.dumps(out, indent=2))
    same = ("draft_bytes", "draft_kv_layers", "kv_tokens")
    return 0 if all(out[f"vllm_{k}"] == out[f"planned_{k}"] for k in same) else 1


if __name__ == "__main__":
    sys.exit(main())
