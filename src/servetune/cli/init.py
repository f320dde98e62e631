"""``servetune init``: write a search space from intent: a model, its GPUs and a scenario."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from servetune.errors import UserError

DESCRIPTION = """\
Write a search space for a model, a GPU and a scenario, from the tuning checklist's starting
points (section 12's row for the scenario, section 5's scan ranges, section 6's tensor
parallelism, section 1's SLO examples), pruned by the memory ledger: tensor-parallel sizes that
cannot hold the model or would leave GPUs idle, context lengths whose KV cache cannot hold one
request and memory fractions that leave no KV pool are left out, each with a comment saying why.

  servetune init --model meta-llama/Llama-3.1-8B-Instruct --gpu H100-SXM --gpus 8 --scenario chat > space.yaml
  servetune run space.yaml --dry-run

The model is a local directory (its config.json) or a hub id (org/name: the local caches,
servetune's catalogue, then the hub; `servetune plan --help` lists how it reads models).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from servetune.config.scenarios import SCENARIOS

    p = subparsers.add_parser("init", help="write a search space for a model, GPUs and a scenario (pruned by the planner)",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument(
        "--model", required=True, metavar="DIR|HUB_ID", help="model directory with config.json, or a hub id (org/name)"
    )
    p.add_argument("--scenario", required=True, choices=list(SCENARIOS), help="what the deployment serves")
    p.add_argument(
        "--gpu", metavar="NAME", help="GPU from the catalogue (H100-SXM, A100-80GB, L40S, L4...; default: detected)"
    )
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs per node (default: 1)")
    p.add_argument(
        "--slo",
        metavar="METRIC.STAT=BOUND,...",
        help="replace the scenario's SLO, e.g. ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001 "
        "(structured_valid.min=0.99: a floor on the share of structured answers that parsed)",
    )
    p.add_argument(
        "--price", type=float, metavar="USD",
        help="price per GPU-hour, over the price list (default: none, the shipped list's price of the GPU)",
    )  # fmt: skip
    p.add_argument("--name", help="the study's name (default: SCENARIO-MODEL)")
    p.add_argument("--out", type=Path, metavar="FILE", help="write the space here (default: standard output)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.config.scenarios import render_space
    from servetune.space_file import load_space

    if args.price is not None and args.price < 0:
        raise UserError("--price: a price cannot be negative")
    text = render_space(args.model, args.scenario, args.gpu, args.gpus, slo=args.slo, price=args.price, name=args.name)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    if args.out.is_dir():
        raise UserError(f"--out {args.out}: is a directory; give a file name")
    tmp = args.out.with_name(f".{args.out.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        load_space(tmp)  # what run will read: a space init writes must load
        tmp.replace(args.out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {args.out}: `servetune run {args.out} --dry-run` lists its trials", file=sys.stderr)
    return 0
