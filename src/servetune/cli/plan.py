"""``servetune plan``: the memory ledger of a vLLM configuration, before starting anything."""

from __future__ import annotations

import argparse
import json
import os

from rich.console import Console
from rich.table import Table

from servetune.capacity import CapacityPlan, load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.ledger import resolve_quant, structural_problem
from servetune.cli.display import console as make_console
from servetune.errors import UserError

DESCRIPTION = """\
Will this vLLM configuration fit, and how many tokens of KV cache will it get?

Reads the model's architecture (a local directory's config.json, or a hub id from servetune's
offline catalogue), then follows vLLM's own start-up accounting per GPU:

  KV pool = gpu_memory_utilization x GPU memory - weights - activation peak
            - non-torch memory - CUDA-graph memory
  KV tokens = KV pool / (KV bytes per token), in whole blocks

and reports the KV tokens, how many requests of max_model_len (or --request-tokens) fit at
once, whether max_num_seqs is reachable, a verdict, and what to change when it does not fit.
Defaults follow `vllm serve` (vLLM 0.32). On --device cpu the KV pool is exactly
VLLM_CPU_KVCACHE_SPACE GiB per rank. Exit status: 0 fits, 1 does not fit, 2 bad input.
"""

EPILOG = """\
If a running engine later runs out of memory, the tuning checklist's order (section 13) is: lower
gpu_memory_utilization, then max_num_batched_tokens, max_num_seqs, max_model_len; then quantize
weights or use fp8 KV; check CUDA graphs and buffers; last, raise tensor parallelism.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="the memory ledger of a vLLM configuration: KV tokens, concurrency, fits or not",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", required=True, metavar="DIR|HUB_ID", help="model directory with config.json, or a catalogue id"
    )
    p.add_argument("--gpu", metavar="NAME", help="GPU from the catalogue (A100-80GB, H100-SXM, H200, L40S, ...)")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="X",
        help="GPU memory as the CUDA runtime reports it (overrides --gpu's)",
    )
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="gpu (default) or vLLM's CPU build")
    p.add_argument(
        "--cpu-kvcache-space-gib",
        type=float,
        metavar="X",
        help="VLLM_CPU_KVCACHE_SPACE: KV space per rank in GiB (CPU)",
    )
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline parallel size (default 1)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "half", "float16", "bfloat16", "float", "float32"),
        help="default auto",
    )
    p.add_argument("--quantization", metavar="METHOD", help="awq, gptq, fp8, int8, ... (default: the checkpoint's)")
    p.add_argument(
        "--kv-cache-dtype", default="auto", metavar="DTYPE", help="auto (model dtype), fp8, fp8_e4m3, fp8_e5m2, ..."
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="fraction of GPU memory vLLM may use (default 0.9)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="default: the model's max_position_embeddings; -1: longest that fits",
    )
    p.add_argument(
        "--max-num-seqs", type=int, metavar="N", help="default: vLLM's for the GPU (256, or 1024 on H100/H200/B200)"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, metavar="N", help="default: vLLM's for the GPU (2048, 8192 or 16384)"
    )
    p.add_argument(
        "--block-size", type=int, metavar="N", help="KV block size in tokens (default 16 on GPU, 128 on CPU)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (their memory is not reserved)")
    p.add_argument(
        "--request-tokens",
        type=int,
        metavar="N",
        help="request length for the concurrency figure (default max_model_len)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(run=run)


def _check_flags(args: argparse.Namespace) -> None:
    for flag in ("tp", "pp", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "request_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1 and not (flag == "max_model_len" and value == -1):
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    if not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {args.gpu_memory_utilization:g}: must be in (0, 1]")
    space = args.cpu_kvcache_space_gib
    if space is not None and (space <= 0 or space != int(space)):
        raise UserError(
            f"--cpu-kvcache-space-gib {space:g}: must be a whole number of GiB > 0 "
            "(vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)"
        )
    if args.device == "cpu" and space is None:
        raise UserError("--device cpu needs --cpu-kvcache-space-gib X (VLLM_CPU_KVCACHE_SPACE, the KV space per rank)")


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    arch = load_model_arch(args.model)
    hardware = resolve_hardware(args.device, args.gpu, args.gpu_memory_gib)
    problem = structural_problem(arch, args.tp, args.pp, resolve_quant(arch, args.quantization))
    if problem is not None:
        flag = "--pp" if problem.startswith("pipeline") else "--tp"
        raise UserError(f"{flag} {args.pp if flag == '--pp' else args.tp}: {problem}")
    if args.max_model_len is not None and args.max_model_len > arch.max_position_embeddings:
        raise UserError(
            f"--max-model-len {args.max_model_len}: exceeds the model's max_position_embeddings "
            f"{arch.max_position_embeddings}"
        )
    engine_args = {
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enforce_eager": args.enforce_eager,
    }
    env = {key: os.environ[key] for key in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN",) if key in os.environ}
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.cpu_kvcache_space_gib))
    plan = plan_capacity(arch, engine_args, hardware, env=env, request_tokens=args.request_tokens)
    if args.json:
        print(json.dumps(plan.model_dump(mode="json"), indent=2))
    else:
        render(plan, make_console())
    return 0 if plan.fits else 1


def _gib(value: float) -> str:
    return f"{value * 1024:,.1f} MiB" if abs(value) < 1 else f"{value:,.2f} GiB"


def render(plan: CapacityPlan, console: Console) -> None:
    s = plan.settings
    where = f"{s.gpu} ({s.gpu_memory_gib:g} GiB)" if s.device == "gpu" else "vLLM CPU build"
    layout = f"TP {s.tensor_parallel_size} x PP {s.pipeline_parallel_size}"
    title = f"{plan.model} ({plan.parameters_b:g}B params) on {where}, {layout}"
    ledger = Table(title=title, title_justify="left", show_header=False)
    ledger.add_column("item")
    ledger.add_column("per GPU" if s.device == "gpu" else "per rank", justify="right")
    ledger.add_column("from")
    if s.device == "gpu":
        ledger.add_row(
            "budget",
            _gib(plan.requested_gib),
            f"gpu_memory_utilization {s.gpu_memory_utilization:g} x {s.gpu_memory_gib:g} GiB",
        )
        ledger.add_row("- weights", _gib(plan.weights_gib), f"dtype {s.dtype}, quantization {s.quantization}")
        ledger.add_row(
            "- activation peak",
            _gib(plan.activation_gib),
            f"{s.max_num_batched_tokens:,} batched tokens, {s.max_num_seqs} seqs sampled",
        )
        comms = "NCCL / all-reduce buffers, " if s.tensor_parallel_size * s.pipeline_parallel_size > 1 else ""
        ledger.add_row("- non-torch + buffers", _gib(plan.non_torch_gib), f"{comms}CUDA context, runtime buffers")
        ledger.add_row(
            "- CUDA graphs", _gib(plan.cudagraph_gib), "enforce_eager" if s.enforce_eager else "vLLM's capture estimate"
        )
    else:
        ledger.add_row("KV space", _gib(plan.requested_gib), f"VLLM_CPU_KVCACHE_SPACE={s.cpu_kvcache_space_gib}")
        ledger.add_row("weights (host memory)", _gib(plan.weights_gib), f"dtype {s.dtype}; not taken from the KV space")
    ledger.add_row("= KV pool", _gib(plan.kv_cache_gib), f"kv_cache_dtype {s.kv_cache_dtype}")
    ledger.add_row("KV bytes per token", f"{plan.kv_bytes_per_token:,} B", f"block size {s.block_size}")
    ledger.add_row("KV blocks / tokens", f"{plan.kv_cache_blocks:,} / {plan.kv_cache_tokens:,}", "")
    ledger.add_row("KV per full request", _gib(plan.kv_gib_per_request), f"max_model_len {s.max_model_len:,}")
    ledger.add_row("max concurrency", f"{plan.max_concurrency:.2f}x", f"requests of {s.max_model_len:,} tokens")
    if plan.request_tokens != s.max_model_len:
        ledger.add_row(
            "  at request length",
            f"{plan.max_concurrency_at_request:.2f}x",
            f"requests of {plan.request_tokens:,} tokens",
        )
    reach = "[green]yes[/]" if plan.max_num_seqs_reachable else "[yellow]no[/]"
    ledger.add_row("max_num_seqs reachable", reach, f"max_num_seqs {s.max_num_seqs}")
    console.print(ledger)
    verdict = "[bold green]fits[/]" if plan.fits else "[bold red]does not fit[/]"
    console.print(f"{verdict}: {plan.reason}")
    for line in plan.advice:
        console.print(f"  - {line}")
    for note in plan.notes:
        console.print(f"  [dim]note: {note}[/]")
