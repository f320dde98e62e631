"""``servetune models``: build the models servetune can make itself, and keep hub models for offline planning."""

from __future__ import annotations

import argparse
from pathlib import Path

from servetune.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models",
        help="build the tiny test models for CPU runs; keep a hub model's config for offline planning; list them",
        description="Build models servetune makes itself, or keep a hub model's config for planning offline.",
    )
    sub = p.add_subparsers(dest="model_command", metavar="MODEL", required=True)
    tiny = sub.add_parser(
        "tiny",
        help="a 2.5M-parameter Llama with a byte-level tokenizer, for vLLM's CPU build",
        description=(
            "Write a tiny Llama-architecture model (random weights from a fixed seed, a byte-level "
            "tokenizer with a chat template, safetensors) that vLLM loads offline. The files are "
            "the same every time."
        ),
    )
    tiny.add_argument("--out", type=Path, required=True, help="directory to write the model into")
    tiny.set_defaults(run=run_tiny)
    lora = sub.add_parser(
        "tiny-lora",
        help="a rank-8 LoRA adapter for the tiny model (PEFT format), for workloads with adapters",
        description=(
            "Write a LoRA adapter for the tiny model in PEFT's format (adapter_config.json and "
            "adapter_model.safetensors; rank 8 on q_proj and v_proj, random weights from a fixed seed), "
            "that vLLM serves with --enable-lora --lora-modules NAME=DIR. The files are the same every time."
        ),
    )
    lora.add_argument("--out", type=Path, required=True, help="directory to write the adapter into")
    lora.set_defaults(run=run_tiny_lora)
    from servetune.models.tinyarch import TINY_ARCHS  # configs only: no torch import

    arch = sub.add_parser(
        "tiny-arch",
        help="a tiny random-weight checkpoint of gemma-3, a Mamba hybrid, gpt-oss, ..., for vLLM's CPU build",
        description=(
            "Write a tiny random-weight checkpoint of an architecture the planner models beyond Llama "
            "(transformers' model class, hidden size 256, the byte-level tokenizer; random weights from a fixed "
            "seed), as bench/arch_vllm.py builds it, so that `servetune plan --model DIR --device cpu` and vLLM's "
            f"CPU build can be compared on it. NAME: {', '.join(TINY_ARCHS)}. Needs torch and transformers."
        ),
    )
    arch.add_argument("name", metavar="NAME", help=f"the architecture: {', '.join(TINY_ARCHS)}")
    arch.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint into")
    arch.set_defaults(run=run_tiny_arch)
    add = sub.add_parser(
        "add",
        help="fetch a hub model's config.json and safetensors sizes, so that plan and run work offline",
        description=(
            "Fetch a model's config.json and its safetensors headers (parameter counts per dtype, no weights) "
            "from the Hugging Face hub (HF_ENDPOINT; HF_TOKEN for gated models) and keep them beside the "
            "Hugging Face cache (HF_HOME/servetune/models), where `servetune plan`, `init` and `run` find "
            "them offline."
        ),
    )
    add.add_argument("model_id", metavar="ID", help="hub id, e.g. google/gemma-3-27b-it")
    add.set_defaults(run=run_add)
    listing = sub.add_parser(
        "list",
        help="the models plan, init and run know offline, and the tiny test models servetune builds",
        description=(
            "List the models servetune plans with no network: its shipped catalogue, the models kept by "
            "`servetune models add` (HF_HOME/servetune/models), and the tiny test models it can build itself "
            "(`models tiny`, `models tiny-arch NAME`)."
        ),
    )
    listing.set_defaults(run=run_list)


def run_tiny(args: argparse.Namespace) -> int:
    from servetune.models.tiny import build_tiny_model

    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")
    try:
        build_tiny_model(args.out)
    except OSError as exc:  # a parent that is a file, a read-only or missing mount, no permission
        raise UserError(f"--out {args.out}: cannot write the model there ({exc.strerror or exc})") from None
    print(f"wrote the tiny model to {args.out}")
    return 0


def run_tiny_lora(args: argparse.Namespace) -> int:
    from servetune.models.tiny import build_tiny_adapter

    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")
    try:
        build_tiny_adapter(args.out)
    except OSError as exc:
        raise UserError(f"--out {args.out}: cannot write the adapter there ({exc.strerror or exc})") from None
    print(f"wrote the tiny LoRA adapter to {args.out}")
    return 0


def run_tiny_arch(args: argparse.Namespace) -> int:
    from servetune.models.tinyarch import TINY_ARCHS, build_tiny_arch

    if args.name not in TINY_ARCHS:
        raise UserError(f"models tiny-arch {args.name}: unknown architecture; known: {', '.join(TINY_ARCHS)}")
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")
    try:
        build_tiny_arch(args.name, args.out)
    except OSError as exc:
        raise UserError(f"--out {args.out}: cannot write the checkpoint there ({exc.strerror or exc})") from None
    print(f"wrote the tiny {args.name} ({TINY_ARCHS[args.name]['architectures'][0]}) to {args.out}")
    return 0


def run_add(args: argparse.Namespace) -> int:
    from servetune.capacity.arch import arch_from_hf_config
    from servetune.capacity.source import hub_model, model_store
    from servetune.models.names import looks_like_hub_id

    if not looks_like_hub_id(args.model_id):
        raise UserError(f"models add {args.model_id}: expected a hub id, org/name")
    found = hub_model(args.model_id)
    arch = arch_from_hf_config(found.config, name=found.name, source=found.source)  # fails now, not when planning
    size = f"{sum(found.parameters.values()) / 1e9:.2f}B parameters" if found.parameters else "no safetensors"
    print(f"kept {arch.name} ({arch.architecture}, {size}) in {model_store()}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    from servetune.capacity.arch import load_catalog
    from servetune.capacity.params import count_parameters
    from servetune.capacity.source import model_store
    from servetune.models.tinyarch import TINY_ARCHS

    print("catalogue (shipped with servetune):")
    for name, arch in sorted(load_catalog().items(), key=lambda item: item[0].lower()):
        print(f"  {name}  {arch.architecture}, {count_parameters(arch) / 1e9:.1f}B parameters")
    store = model_store()
    kept = sorted(p.stem.replace("--", "/") for p in store.glob("*.json")) if store.is_dir() else []
    print(f"kept by `servetune models add` ({store}):" + ("" if kept else " none"))
    for name in kept:
        print(f"  {name}")
    print("tiny test models servetune builds (vLLM's CPU build):")
    print("  tiny  LlamaForCausalLM (servetune models tiny; model: tiny in a space)")
    for name, config in TINY_ARCHS.items():
        print(f"  {name}  {config['architectures'][0]} (servetune models tiny-arch {name})")
    return 0
