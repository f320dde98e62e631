"""``servetune doctor [SPACE.yaml] [--address ADDR] [--engine]``: the Ray cluster a study will use, checked node by
node before it spends GPU-hours (servetune/doctor.py); ``--engine`` also starts vLLM on each kind of node. Exit 1 when
a check fails."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from servetune.doctor import ENGINE_TIMEOUT_S
from servetune.errors import UserError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="check the Ray cluster a study will use, node by node, before it spends GPU-hours",
        description=(
            "One Ray task per live node checks it: GPUs as Ray advertises them against NVML (names, memory, MIG, "
            "memory another process holds), the vLLM, Ray, servetune and torch versions against this driver's, "
            "/dev/shm, the niceness Ray's workers run at, the metrics interval (for Serve), vLLM's cache, and the "
            "space's model on each node (a local folder) or on the hub (the token's access). Each check is PASS, "
            "WARN or FAIL with one line of evidence; the exit status is 1 when one fails. Nothing is started but "
            "the tasks (and a local Ray when no cluster is given), unless --engine asks for an engine start."
        ),
    )
    p.add_argument("space", nargs="?", type=Path, metavar="SPACE.yaml",
                   help="the study's search space: its device, GPU type, model and Serve use decide what is checked")  # fmt: skip
    p.add_argument("--address", metavar="ADDR",
                   help="the Ray cluster to check (default: $RAY_ADDRESS, else a local Ray started for the check)")  # fmt: skip
    p.add_argument("--engine", action="store_true",
                   help="also start vLLM on servetune's tiny model once per node kind (one GPU of each GPU type, or "
                        "one node of the CPU build), as a task pinned to that node, and stop it: a minute or more")  # fmt: skip
    p.add_argument("--engine-timeout", type=float, default=ENGINE_TIMEOUT_S, metavar="S",
                   help=f"with --engine: seconds an engine may take to start (default: {ENGINE_TIMEOUT_S:g})")  # fmt: skip
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the checks there as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from servetune.cli.display import console as make_console
    from servetune.doctor import Check, engine_check, engine_targets, failed, gather, space_checks, start_engines
    from servetune.hub import check_access
    from servetune.models.names import is_hub_id
    from servetune.space_file import load_space

    console = make_console()
    if args.engine_timeout <= 0:
        raise UserError(f"--engine-timeout must be a positive number of seconds, got {args.engine_timeout:g}")
    space = load_space(args.space) if args.space is not None else None
    model, checks = None, []
    if space is not None:
        if is_hub_id(space.model, args.space.parent):
            try:
                warning = check_access(space.model, {k: str(v) for k, v in space.env.items()})
            except UserError as exc:
                checks.append(Check("driver", "model access", "FAIL", str(exc)))
            else:
                checks.append(Check("driver", "model access", "WARN" if warning else "PASS",
                                    warning or f"the hub serves {space.model} to the trials' token"))  # fmt: skip
        elif space.model != "tiny":
            local = Path(space.model).expanduser()
            model = str((local if local.is_absolute() else args.space.parent / local).resolve())
    import ray

    from servetune.study.ray_cluster import init_ray

    started = init_ray(args.address)
    engines = []
    try:
        with console.status("checking every node"):
            nodes = gather(model)
        if args.engine:
            targets = engine_targets(nodes, space.device if space is not None else "gpu")
            with console.status(f"starting vLLM on {len(targets)} node(s), one of each kind (a minute or more)"):
                reports = start_engines(targets, args.engine_timeout)
            engines = [engine_check(target, reports[target.node_id]) for target in targets]
            if not targets:
                engines = [
                    Check("cluster", "engine start", "FAIL", "no node can run an engine: none gives a task a CPU")
                ]
    finally:
        if started:
            ray.shutdown()
    checks += space_checks(nodes, space) + engines
    table = Table(title=f"servetune doctor: {len(nodes)} node(s)" + (f", for {args.space}" if args.space else ""))
    for column in ("node", "check", "status", "evidence"):
        table.add_column(column, overflow="fold")
    colour = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}
    for check in checks:
        table.add_row(check.node, check.name, f"[{colour[check.status]}]{check.status}[/]", check.evidence)
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(c) for c in checks], indent=2) + "\n")
    bad = failed(checks)
    console.print(f"{len(bad)} check(s) failed" if bad else "no check failed", style="bold red" if bad else "green")
    return 1 if bad else 0
