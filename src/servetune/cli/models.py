"""``servetune models``: build the models servetune can make itself."""

from __future__ import annotations

import argparse
from pathlib import Path

from servetune.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "models", help="build the tiny test model for CPU runs", description="Build models servetune makes itself."
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
