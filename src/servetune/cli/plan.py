"""``servetune plan``: the memory ledger of a vLLM configuration, before starting anything."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from servetune.capacity import (
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
    CapacityPlan,
    ModelArch,
    NotPlanned,
    load_model_arch,
    plan_capacity,
    resolve_hardware,
)
from servetune.capacity.draft import check_draft, load_draft
from servetune.capacity.encoder import image_tokens
from servetune.capacity.hardware import CPU_FLAGS, Hardware, parse_cpu_flags
from servetune.capacity.params import MoeShards
from servetune.capacity.profile import PROFILES, EngineProfile, profile_for_version
from servetune.capacity.settings import resolve_quant, structural_problem
from servetune.cli.display import console as make_console
from servetune.cli.plan_tables import render, render_estimate
from servetune.config.images import MAX_SIDE
from servetune.config.workload import Workload
from servetune.engine.args import mm_limits
from servetune.errors import UserError
from servetune.estimate import Load, estimate
from servetune.estimate.encoder import workload_images

DESCRIPTION = """\
Will this vLLM configuration fit, and how many tokens of KV cache will it get?

Reads the model's architecture (a local directory's config.json; a .gguf file's metadata and tensor
headers; a hub id from the local caches, servetune's catalogue or the Hugging Face hub, sized from its
safetensors headers), then follows vLLM's own start-up accounting per GPU:

  KV pool = gpu_memory_utilization x GPU memory - weights - activation peak
            - non-torch memory - CUDA-graph memory
  KV tokens = KV pool / (KV bytes per token), in whole blocks

and reports the KV tokens, how many requests of max_model_len (or --request-tokens) fit at
once, whether max_num_seqs is reachable, a verdict, and what to change when it does not fit.
Defaults follow `vllm serve` of the vLLM that will run (--vllm-version, else the installed one, else 0.32):
the memory profile differs between releases (V0's max_model_len-sized profiling run before 0.8,
CUDA-graph memory taken from the pool from 0.21, the 0.92 utilization default of 0.32). On --device cpu the KV pool is exactly
VLLM_CPU_KVCACHE_SPACE GiB per rank. A configuration the planner cannot size (a KV cache dtype or
quantization it does not model, a context above max_position_embeddings) prints "not planned:
REASON": vLLM decides when it starts. Exit status: 0 fits or not planned, 1 does not fit, 2 bad input.
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
        "--model",
        required=True,
        metavar="DIR|FILE.gguf|HUB_ID",
        help="model directory with config.json, a GGUF file, or a hub id (org/name)",
    )
    p.add_argument(
        "--gpu", metavar="NAME", help="GPU from the catalogue (A100-80GB, H100-SXM, H200, B200, GB200, B300, L40S, ...)"
    )
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
    p.add_argument(
        "--cpu-flags",
        metavar="LIST",
        help=f"the CPU's {', '.join(CPU_FLAGS)} (comma-separated, or none) that vLLM's CPU build checks (default: "
        "this host's, from /proc/cpuinfo)",
    )
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, metavar="N", help="pipeline parallel size (default 1)")
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data parallel size (default 1): an MoE model's experts shard over TP x DP ranks, the rest over TP",
    )
    p.add_argument(
        "--pcp",
        type=int,
        default=1,
        metavar="N",
        help="prefill context parallel size (default 1): joins the MoE group, TP x DP x PCP",
    )
    p.add_argument(
        "--dcp",
        type=int,
        default=1,
        metavar="N",
        help="decode context parallel size (default 1): shards each request's KV tokens over N of the TP ranks",
    )
    p.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE models: whole experts per rank, ceil(experts / (TP x DP x PCP)) each (vLLM's expert parallelism)",
    )
    p.add_argument(
        "--enable-eplb",
        action="store_true",
        help="with --enable-expert-parallel: load balancing, whose transfer buffer holds one MoE layer's experts",
    )
    p.add_argument(
        "--eplb-config",
        metavar="JSON",
        help="vLLM's EPLB config, e.g. '{\"num_redundant_experts\": 32}': redundant experts placed with the others",
    )
    p.add_argument(
        "--hf-overrides",
        metavar="JSON",
        help='merged into the model\'s config.json as vLLM merges it, e.g. \'{"rope_scaling":{"rope_type":"yarn",'
        '"factor":4.0,"original_max_position_embeddings":32768}}\' (a local directory or cached config)',
    )
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
        metavar="F",
        help=f"fraction of GPU memory vLLM may use (default vLLM's, {VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:g})",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        metavar="N",
        help="default: the model's max_position_embeddings; -1: longest that fits",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        metavar="N",
        help="default: vLLM's for the GPU (256, or 1024 on 70 GiB and up but A100s: H100, H200, H20, B200, GB200, B300)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int, metavar="N", help="default: vLLM's for the GPU (2048, 8192 or 16384)"
    )
    p.add_argument(
        "--block-size", type=int, metavar="N", help="KV block size in tokens (default 16 on GPU, 128 on CPU)"
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (their memory is not reserved)")
    p.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="serve LoRA adapters (enable_lora) with N slots in a batch: vLLM preallocates them on every GPU",
    )
    p.add_argument(
        "--max-lora-rank", type=int, metavar="R", help="with --max-loras: the largest adapter rank (vLLM's default 16)"
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding as vLLM takes it, e.g. \'{"method":"ngram","num_speculative_tokens":3}\': '
        "adds the drafter's weights, KV layers and verified tokens (draft_model/eagle/eagle3 read their model "
        "as --model is read)",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        metavar="JSON",
        help='vision-language models: items per prompt per modality, e.g. \'{"image":4,"video":0}\' (0 turns one '
        "off; vLLM's default 999): sizes the encoder cache",
    )
    p.add_argument(
        "--mm-processor-kwargs",
        metavar="JSON",
        help="vision-language models: the processor's options, e.g. '{\"max_pixels\":1003520}' (Qwen2-VL family) "
        "or '{\"do_pan_and_scan\":true}' (Gemma 3)",
    )
    p.add_argument(
        "--image-size",
        action="append",
        metavar="WxH",
        help="vision-language models: also say how many tokens a W x H image takes (repeatable)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Mamba / linear-attention models: prefix caching holds 2-3 state blocks per sequence, not 1 "
        "(default: vLLM's for --vllm-version; on in 0.32)",
    )
    p.add_argument(
        "--request-tokens",
        type=int,
        metavar="N",
        help="request length for the concurrency figure (default max_model_len)",
    )
    p.add_argument(
        "--vllm-version",
        metavar="X",
        help="plan as this vLLM release starts (0.6.4, 0.28.1, 0.32.0+cpu; default: the installed vLLM, else 0.32)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    e = p.add_argument_group("performance estimate (servetune estimate's model; GPUs only)")
    e.add_argument("--estimate", action="store_true", help="also predict TTFT, TPOT and throughput under a load")
    e.add_argument("--input-tokens", type=int, metavar="I", help="prompt tokens per request (with --estimate)")
    e.add_argument("--output-tokens", type=int, metavar="O", help="output tokens per request (with --estimate)")
    e.add_argument("--concurrency", type=int, metavar="C", help="closed loop: C clients (with --estimate)")
    e.add_argument("--rate", type=float, metavar="R", help="open loop: R requests/s (with --estimate)")
    e.add_argument("--num-requests", type=int, metavar="N",
                   help="with --rate: a level of N requests sent into an empty queue (as `servetune bench "
                   "--num-requests` measures), whose wait for a slot is less than the long run's near capacity "
                   "(default: the long run's)")  # fmt: skip
    e.add_argument("--images-per-request", type=int, metavar="N",
                   help="vision-language models: each request also sends N images of the --image-size sizes, equally "
                   "likely: their tokens add to --input-tokens, their encoding to TTFT (with --estimate)")  # fmt: skip
    e.add_argument(
        "--acceptance",
        type=float,
        metavar="A",
        help="with --speculative-config: the drafter's acceptance per draft position, 0-1, as measured "
        "(default: the method's assumed one, which the estimate names)",
    )
    p.set_defaults(run=run)


def _check_flags(args: argparse.Namespace) -> None:
    for flag in (
        "tp",
        "pp",
        "dp",
        "pcp",
        "dcp",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "request_tokens",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1 and not (flag == "max_model_len" and value == -1):
            raise UserError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise UserError(f"--gpu-memory-utilization {args.gpu_memory_utilization:g}: must be in (0, 1]")
    space = args.cpu_kvcache_space_gib
    if space is not None and (space <= 0 or space != int(space)):
        raise UserError(
            f"--cpu-kvcache-space-gib {space:g}: must be a whole number of GiB > 0 "
            "(vLLM reads VLLM_CPU_KVCACHE_SPACE as an integer)"
        )
    if args.cpu_flags is not None and args.device != "cpu":
        raise UserError("--cpu-flags is read only with --device cpu")
    if args.device == "cpu" and space is None:
        raise UserError("--device cpu needs --cpu-kvcache-space-gib X (VLLM_CPU_KVCACHE_SPACE, the KV space per rank)")
    if args.vllm_version is not None:
        profile_for_version(args.vllm_version, "--vllm-version")
    _check_vllm_choices(args)


def _check_vllm_choices(args: argparse.Namespace) -> None:
    """A value vLLM's own parser refuses is bad input; one vLLM takes and the ledger does not model is "not planned"."""
    from servetune.engine.args import load_argspecs

    given = {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    specs = load_argspecs() if any(v not in (None, "auto") for v in given.values()) else None
    for dest, value in given.items():
        spec = (specs or {}).get(dest)
        if value is not None and spec is not None and spec.choices and value not in spec.choices:
            raise UserError(f"{spec.flag} {value}: not one of vLLM's {', '.join(spec.choices)}")


#: The flags ``--estimate`` reads: bad input without it.
ESTIMATE_FLAGS = ("input_tokens", "output_tokens", "concurrency", "rate", "num_requests", "acceptance",
                  "images_per_request")  # fmt: skip


def _estimate_load(args: argparse.Namespace) -> Load | None:
    """The load of ``--estimate``, or None without it; a missing or malformed value is one clear line."""
    if args.acceptance is not None:
        if args.speculative_config is None:
            raise UserError("--acceptance is read only with --speculative-config")
        if not 0 <= args.acceptance <= 1:
            raise UserError(f"--acceptance {args.acceptance:g}: must be within [0, 1]")
    if not args.estimate:
        given = [f for f in ESTIMATE_FLAGS if getattr(args, f) is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} is read only with --estimate")
        return None
    if args.input_tokens is None or args.output_tokens is None:
        raise UserError("--estimate needs --input-tokens I and --output-tokens O")
    if (args.concurrency is None) == (args.rate is None):
        raise UserError("--estimate needs one of --concurrency C (closed loop) or --rate R (open loop)")
    if args.num_requests is not None and args.rate is None:
        raise UserError("--num-requests is read only with --rate (an open loop's level)")
    for flag in ("input_tokens", "concurrency", "num_requests", "images_per_request"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    if args.output_tokens < 2:
        raise UserError(f"--output-tokens {args.output_tokens}: must be >= 2 (TPOT needs two tokens)")
    if args.rate is not None and args.rate <= 0:
        raise UserError(f"--rate {args.rate:g}: must be > 0")
    if args.images_per_request is not None and not args.image_size:
        raise UserError("--images-per-request needs --image-size WxH (repeatable: the images' sizes, equally likely)")
    return Load(
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        concurrency=args.concurrency,
        rate=args.rate,
        requests=args.num_requests,
    )


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    load = _estimate_load(args)
    arch = load_model_arch(args.model)
    flags = None if args.cpu_flags is None else parse_cpu_flags(args.cpu_flags)
    hardware = resolve_hardware(args.device, args.gpu, args.gpu_memory_gib, cpu_flags=flags)
    try:
        plan, engine_args = _plan(args, arch, hardware)
    except NotPlanned as exc:
        if args.json:
            print(json.dumps({"model": arch.name, "planned": False, "reason": str(exc)}, indent=2))
        else:
            make_console().print(f"[bold yellow]not planned[/]: {exc}; vLLM sizes it when it starts")
        return 0
    profile = PROFILES[plan.settings.profile]
    predicted, tokens_of_images = None, 0
    if load is not None and plan.fits:
        if args.images_per_request is not None:
            load, tokens_of_images = _with_images(args, arch, engine_args, load)
        draft = load_draft(engine_args)
        predicted = estimate(
            arch, engine_args, hardware, load, profile=profile, acceptance=args.acceptance, draft=draft
        )
    if args.json:
        doc = plan.model_dump(mode="json")
        if predicted is not None:
            doc["estimate"] = predicted.model_dump(mode="json")
        if tokens_of_images:
            doc["image_tokens"] = tokens_of_images
        print(json.dumps(doc, indent=2))
    else:
        console = make_console()
        render(plan, console)
        if predicted is not None:
            render_estimate(predicted, console)
    return 0 if plan.fits else 1


def _plan(args: argparse.Namespace, arch: ModelArch, hardware: Hardware) -> tuple[CapacityPlan, dict[str, Any]]:
    shards = MoeShards.of(arch, args.tp, args.dp, args.enable_expert_parallel, args.pcp)
    problem = structural_problem(arch, args.tp, args.pp, resolve_quant(arch, args.quantization), shards)
    if problem is not None:
        flags = f"--pp {args.pp}" if problem.startswith("pipeline") else f"--tp {args.tp}"
        if problem.startswith(("moe_", "shared_expert")):  # the MoE group: TP x DP x PCP, EP or not
            flags += f" --dp {args.dp}" * (args.dp > 1) + f" --pcp {args.pcp}" * (args.pcp > 1)
            flags += " --enable-expert-parallel" * args.enable_expert_parallel
        raise UserError(f"{flags}: {problem}")
    engine_args = {
        "tensor_parallel_size": args.tp,
        "pipeline_parallel_size": args.pp,
        "data_parallel_size": args.dp,
        "enable_expert_parallel": args.enable_expert_parallel,
        "enable_eplb": args.enable_eplb,
        "prefill_context_parallel_size": args.pcp,
        "decode_context_parallel_size": args.dcp,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
    for key in ("limit_mm_per_prompt", "mm_processor_kwargs", "hf_overrides", "eplb_config"):
        text = getattr(args, key)
        if text is not None:
            try:
                engine_args[key] = json.loads(text)
            except json.JSONDecodeError:
                raise UserError(f"--{key.replace('_', '-')}: not JSON: {text!r}") from None
    if engine_args.get("limit_mm_per_prompt") is not None:
        mm_limits(engine_args["limit_mm_per_prompt"], "--limit-mm-per-prompt")
    if args.max_loras is not None or args.max_lora_rank is not None:
        engine_args.update(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    draft = None
    if args.speculative_config is not None:
        engine_args["speculative_config"] = args.speculative_config
        draft = load_draft(engine_args)
        check_draft(arch, draft, engine_args)
    env = {key: os.environ[key] for key in ("VLLM_ALLOW_LONG_MAX_MODEL_LEN",) if key in os.environ}
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(args.cpu_kvcache_space_gib))
    profile = plan_profile(args.vllm_version)
    plan = plan_capacity(
        arch, engine_args, hardware, env=env, request_tokens=args.request_tokens, profile=profile, draft=draft
    )
    if args.image_size:
        plan.notes.extend(_image_notes(arch, args.image_size, engine_args.get("mm_processor_kwargs")))
    return plan, engine_args


def _image_notes(arch: ModelArch, sizes: list[str], mm_kwargs: dict[str, Any] | None) -> list[str]:
    """``--image-size WxH``: the tokens each such image takes in a prompt of this model."""
    if arch.vision is None:
        raise UserError(f"--image-size: {arch.name} has no vision encoder servetune models (Qwen2-VL family, Gemma 3)")
    notes = []
    for width, height in map(_image_size, sizes):
        tokens = image_tokens(arch.vision, width, height, mm_kwargs)
        notes.append(f"a {width}x{height} image takes {tokens:,} tokens of the prompt (and of the encoder cache)")
    return notes


def _image_size(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or not int(width) or not int(height):
        raise UserError(f"--image-size {text}: give WIDTHxHEIGHT in pixels, e.g. 1024x768")
    return int(width), int(height)


def _with_images(args: argparse.Namespace, arch: ModelArch, engine: dict[str, Any], load: Load) -> tuple[Load, int]:
    """``load`` whose requests also send ``--images-per-request N`` images of the ``--image-size`` sizes (equally
    likely), and those images' tokens: the flags make a one-class workload, whose images are read as a space's."""
    lengths = {k: {"dist": "fixed", "value": getattr(load, k)} for k in ("input_tokens", "output_tokens")}
    sizes = [_image_size(text) for text in args.image_size]
    if max(max(size) for size in sizes) > MAX_SIDE:
        raise UserError(f"--image-size: at most {MAX_SIDE} px a side with --images-per-request (as in a workload)")
    images = {"count": args.images_per_request, "sizes": sizes}
    workload = Workload.model_validate({"name": "plan", "api": "chat", **lengths, "images": images})
    tokens, flops = workload_images(workload, arch.vision, engine)
    return Load(**{**load.model_dump(), "input_tokens": load.input_tokens + tokens, "encoder_flops": flops}), tokens


def plan_profile(flag: str | None) -> EngineProfile:
    """The memory profile of ``--vllm-version``, else of the vLLM installed here, else of the release servetune pins."""
    if flag is not None:
        return profile_for_version(flag, "--vllm-version")
    from servetune.engine.args import vllm_version

    try:
        return profile_for_version(vllm_version())
    except UserError:  # an installed build whose version names no release: the pinned one
        return profile_for_version(None)
