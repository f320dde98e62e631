"""MTP on real vLLM (CPU build) against the planner: the target's own MTP layers and the KV as vLLM holds them.

Builds the tiny Qwen3-Next with one multi-token-prediction layer (``servetune models tiny-arch qwen3-next-mtp``),
starts one offline vLLM engine on it with ``speculative_config`` method ``mtp`` (bfloat16: the CPU build's
gated-DeltaNet kernel runs in nothing else), and reads inside vLLM's worker the drafter module
(``model_runner.drafter.model``, vLLM's ``Qwen3NextMTP``) as ``draft_vllm.drafter_bytes`` does: its own parameters,
the linear weights the CPU build moved into its kernels, its own rotary cache; the embeddings and lm_head it shares
with the target are shown apart. Beside them the planner's ``draft_cost`` and, for the KV tokens vLLM's cache config
reports (its "CPU KV cache size" log line), ``plan_capacity`` for the same directory and arguments on this host's
CPU flags. With ``--prefix-caching`` the engine runs prefix caching (Mamba ``align`` mode): vLLM 0.32's CPU build
sizes it but cannot serve a request there (its align-mode state copy is a Triton kernel), so no answer is asked for.
Exits 1 on a difference. Run it under the heavy lock:

    PYTHONPATH=src flock /tmp/servetune-heavy.lock .venv/bin/python bench/mtp_vllm.py [--num-speculative-tokens 1] \
        [--prefix-caching]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from worker_probe import importable_in_workers


def measure(args: argparse.Namespace, tmp: Path, drafter_bytes, kv_capacity) -> dict:
    """vLLM's MTP drafter bytes and KV tokens beside the planner's, the tiny model built in ``tmp``."""
    from vllm import LLM, SamplingParams

    from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
    from servetune.capacity.draft import draft_cost
    from servetune.models.tinyarch import build_tiny_arch

    model = str(build_tiny_arch("qwen3-next-mtp", tmp / "tiny"))
    engine = {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 16,
              "enable_prefix_caching": args.prefix_caching}  # fmt: skip
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=model, **engine, speculative_config=spec)
    try:
        loaded = llm.collective_rpc(drafter_bytes)[0]
        cache = llm.llm_engine.vllm_config.cache_config
        kv_tokens = llm.collective_rpc(kv_capacity)[0]
        blocks, block_size = cache.num_gpu_blocks or 0, cache.block_size or 0
        answer = None
        if not args.prefix_caching:
            params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            answer = len(llm.generate(["hello there"], params)[0].outputs[0].token_ids)
    finally:  # stop the engine before its model is removed (at exit the interpreter would wait on its process)
        llm.llm_engine.engine_core.shutdown()
    arch = load_model_arch(model)
    plan = plan_capacity(arch, {**engine, "speculative_config": spec}, resolve_hardware(device="cpu"),
                         env={"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]})  # fmt: skip
    planned = draft_cost(arch, spec, None, 2, lambda _: 2.0, 1)  # bfloat16 weights and KV, one rank
    vllm_bytes = loaded["parameter_bytes"] + loaded["kernel_linear_bytes"] + loaded["rope_bytes"]
    out = {
        "num_speculative_tokens": args.num_speculative_tokens, "prefix_caching": args.prefix_caching,
        **{f"vllm_{k}": v for k, v in loaded.items()},
        "vllm_mtp_bytes": vllm_bytes, "planned_mtp_bytes": int(planned.weights),
        "vllm_mtp_kv_layers": loaded["kv_layers"], "planned_mtp_kv_layers": planned.kv_layers,
        "vllm_blocks": blocks, "planned_blocks": plan.kv_cache_blocks,
        "vllm_block_size": block_size, "planned_block_size": plan.settings.block_size,
        "vllm_kv_tokens": kv_tokens, "planned_kv_tokens": plan.kv_cache_tokens, "generated_tokens": answer,
    }  # fmt: skip
    del out["vllm_kv_layers"]
    return out


def kv_capacity(worker) -> int:  # runs in vLLM's worker: imported there as mtp_vllm.kv_capacity
    """The KV tokens vLLM's "CPU KV cache size" line prints (``kv_cache_utils.get_kv_cache_capacity``: the blocks
    over one max_model_len request's blocks in every group, times max_model_len), from the worker's own config."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity

    return get_kv_cache_capacity(worker.vllm_config, worker.model_runner.kv_cache_config)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-speculative-tokens", type=int, default=1)
    parser.add_argument("--prefix-caching", action="store_true", help="Mamba align mode: sized, not served")
    args = parser.parse_args()
    # vLLM's worker unpickles the probes by module name: it must import draft_vllm.py and this file by theirs
    draft_vllm, mtp_vllm = importable_in_workers("draft_vllm"), importable_in_workers("mtp_vllm")

    with tempfile.TemporaryDirectory(prefix="servetune-mtp-") as folder:  # the model, removed at exit
        out = measure(args, Path(folder), draft_vllm.drafter_bytes, mtp_vllm.kv_capacity)
    print(json.dumps(out, indent=2))
    same = ("mtp_bytes", "mtp_kv_layers", "blocks", "block_size", "kv_tokens")
    served = args.prefix_caching or out["generated_tokens"] == 12
    return 0 if served and all(out[f"vllm_{k}"] == out[f"planned_{k}"] for k in same) else 1


if __name__ == "__main__":
    sys.exit(main())
