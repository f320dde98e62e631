"""The planner's KV capacity against vLLM's CPU build, per architecture: gemma-3, Mamba / DeltaNet hybrids, windows.

For each case, builds the tiny random-weight checkpoint of its architecture (``servetune.models.tinyarch``:
transformers' model class, ``save_pretrained``, the byte tokenizer), starts one offline vLLM engine on it in a
process of its own (``--dtype float32`` unless the case says bfloat16, ``--enforce-eager``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``--max-num-seqs 128 --max-num-batched-tokens 2048`` as ``vllm serve`` defaults
them on the CPU build), reads the KV capacity vLLM logged ("CPU KV cache size: N tokens, Maximum concurrency for
L tokens per request: X"), the attention block size it settled on, and greedy-generates 8 tokens (the model serves). Beside it, the planner's plan for the same
checkpoint directory and arguments on this host's CPU flags (what ``servetune plan --model DIR --device cpu
--cpu-kvcache-space-gib 1 --dtype float32 --enforce-eager --max-model-len L ...`` prints; ``servetune models
tiny-arch NAME --out DIR`` writes the same checkpoints). Prints one row per case and exits 1 when a case
failed to start, served no request, or its planned KV tokens differ from vLLM's. Run it under the heavy lock:

    PYTHONPATH=src flock /tmp/servetune-heavy.lock .venv/bin/python bench/arch_vllm.py [--cases gemma3,jamba] \
        [--json F] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KV_GIB = 1
#: What every engine gets: the CPU build's ``vllm serve`` batch defaults, so the offline engine sizes as a server.
BASE_ENGINE: dict[str, Any] = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 128,
                               "max_num_batched_tokens": 2048}  # fmt: skip
RESULT = "ARCH_VLLM_RESULT "
_BLOCK = re.compile(r"Setting attention block size to (\d+) tokens")


@dataclass(frozen=True)
class Case:
    name: str
    arch: str  # a key of servetune.models.tinyarch.TINY_ARCHS
    engine: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


CASES = (
    Case("gemma3", "gemma3", {"max_model_len": 8192}),
    Case("granite-4.0-h", "granite-4.0-h", {"max_model_len": 4096}),
    Case("granite-4.0-h-no-prefix", "granite-4.0-h", {"max_model_len": 4096, "enable_prefix_caching": False}),
    Case("granite-4.0-h-bf16", "granite-4.0-h", {"max_model_len": 4096, "dtype": "bfloat16"}),
    # a half SSM state asked for: kept on an AVX-512 BF16 CPU (its layer_types say linear_attention), else as asked
    Case(
        "granite-4.0-h-bf16-ssm-bf16",
        "granite-4.0-h",
        {"max_model_len": 4096, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"},
    ),
    Case("jamba", "jamba", {"max_model_len": 4096}),
    Case("qwen3-next", "qwen3-next", {"max_model_len": 4096, "dtype": "bfloat16"}),  # the CPU GDN kernel: bf16 only
    Case("gpt-oss-bf16", "gpt-oss", {"max_model_len": 8192, "dtype": "bfloat16"}),
    Case("mistral-sliding", "mistral-sliding", {"max_model_len": 8192}),
)


def child(spec: dict[str, Any]) -> None:
    """In the engine's process: start vLLM, generate, print what it resolved as one JSON line."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], **spec["engine"])
    try:
        config = llm.llm_engine.vllm_config
        cache, scheduler = config.cache_config, config.scheduler_config
        output = llm.generate(["hello there"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
        found = {
            "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
            "prefix_caching": cache.enable_prefix_caching, "mamba_cache_mode": cache.mamba_cache_mode,
            "chunked_prefill": scheduler.enable_chunked_prefill,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "async_scheduling": scheduler.async_scheduling, "generated_tokens": len(output.outputs[0].token_ids),
        }  # fmt: skip
    finally:  # stop the engine core before the interpreter exits
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
    print(RESULT + json.dumps(found), flush=True)


def run_engine(case: Case, model: Path, timeout: float) -> tuple[dict[str, Any] | None, str]:
    """(what the engine resolved, or None when it did not start; its whole log). Its own process group, killed
    on a timeout."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), **case.env}
    spec = json.dumps({"model": str(model), "engine": {**BASE_ENGINE, **case.engine}})
    proc = subprocess.Popen([sys.executable, __file__, "--child", spec], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return None, log + f"\n(timed out after {timeout:g} s)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [line for line in log.splitlines() if line.startswith(RESULT)]
    return (json.loads(lines[-1][len(RESULT) :]) if lines else None), log


def _error_line(log: str) -> str:
    """The root cause a failed engine logged: the last exception line that is not the engine core's epitaph."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\w(Error|Exception)\b:|not supported", line)]
    causes = [line for line in errors if "EngineDeadError" not in line and "EngineCore encountered" not in line]
    chosen = causes or errors or lines[-1:] or ["no output"]
    return chosen[-1][:400]


def measure(case: Case, model: Path, timeout: float, logs: Path | None = None) -> dict[str, Any]:
    from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
    from servetune.capacity.compare import measured_kv_tokens
    from servetune.engine.server import KvCapacity

    engine = {**BASE_ENGINE, **case.engine}
    row: dict[str, Any] = {"case": case.name, "arch": case.arch, "engine": engine, "env": case.env}
    try:
        plan = plan_capacity(load_model_arch(model), engine, resolve_hardware(device="cpu"),
                             env={"VLLM_CPU_KVCACHE_SPACE": str(KV_GIB), **case.env})  # fmt: skip
    except Exception as exc:  # not planned (or the planner cannot read it): vLLM's numbers still recorded
        row.update(planned_tokens=None, plan_error=str(exc))
    else:
        row.update(planned_tokens=plan.kv_cache_tokens, planned_concurrency=plan.max_concurrency,
                   planned_block_size=plan.settings.block_size, planned_blocks=plan.kv_cache_blocks,
                   plan_notes=plan.notes)  # fmt: skip
    resolved, log = run_engine(case, model, timeout)
    if logs is not None:
        (logs / f"{case.name}.log").write_text(log)
    kv = KvCapacity.from_log(log)
    if kv is None:
        return {**row, "error": _error_line(log)}
    block = _BLOCK.search(log)
    tokens = measured_kv_tokens(kv.tokens, kv.max_concurrency, kv.at_tokens_per_request)
    planned = row["planned_tokens"]
    row.update(vllm_block_size=int(block.group(1)) if block else None, vllm_tokens=tokens,
               vllm_concurrency=kv.max_concurrency,
               error_pct=None if planned is None else round(100 * (planned - tokens) / tokens, 2))  # fmt: skip
    if resolved is None:  # the KV cache was sized, then the engine failed (a kernel on its first requests)
        return {**row, "served": False, "serve_error": _error_line(log)}
    return {**row, **resolved, "served": True, "vllm_block_size": row["vllm_block_size"] or resolved["block_size"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated case names")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one engine may take (default 300)")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    parser.add_argument("--logs", type=Path, help="keep each engine's log in this directory (CASE.log)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    known = {c.name: c for c in CASES}
    wanted = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    import vllm

    from servetune.models.tinyarch import build_tiny_arch

    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="servetune-arch-") as folder:  # the checkpoints, removed at exit
        built: dict[str, Path] = {}
        for name in wanted:
            case = known[name]
            if case.arch not in built:
                try:
                    built[case.arch] = build_tiny_arch(case.arch, Path(folder) / case.arch)
                except Exception as exc:  # one architecture transformers cannot build: a row, not the end
                    rows.append({"case": name, "arch": case.arch, "planned_tokens": 0, "error": f"build: {exc}"})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
            rows.append(measure(case, built[case.arch], args.timeout, args.logs))
            print(json.dumps(rows[-1]), flush=True)
    from servetune.capacity.hardware import CPU_FLAGS, host_cpu_flags

    flags = ", ".join(sorted(host_cpu_flags())) or f"none of {', '.join(CPU_FLAGS)}"
    print(f"\nvLLM {vllm.__version__} (CPU build), VLLM_CPU_KVCACHE_SPACE={KV_GIB}, this CPU's flags: {flags}")
    print("| case | vLLM KV tokens | concurrency | block | planned tokens | concurrency | block | error | served |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        planned = "not planned" if row.get("planned_tokens") is None else f"{row['planned_tokens']:,}"
        if "error" in row:
            print(f"| {row['case']} | did not start: {row['error']} | | | {planned} | | | | |")
            continue
        error = "" if row["error_pct"] is None else f"{row['error_pct']:+.2f}%"
        served = f"{row['generated_tokens']} tokens" if row["served"] else f"no: {row['serve_error']}"
        print(f"| {row['case']} | {row['vllm_tokens']:,} | {row['vllm_concurrency']} | {row['vllm_block_size'] or '-'} | "
              f"{planned} | {row.get('planned_concurrency', '')} | {row.get('planned_block_size', '')} | {error} | "
              f"{served} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in row and row["served"] and row["error_pct"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
