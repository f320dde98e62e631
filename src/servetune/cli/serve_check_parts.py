"""serve-check's optional parts, checked before Ray starts: the layouts of one device budget (``--layouts``,
``--budget``), the routers and their workload (``--routers``), and the ramp of the derived autoscaling
(``--ramp``) with the driver that offers it. Each refuses what cannot run in one line, before anything deploys.
Once Ray is joined, the replicas are pinned to the GPU type the trial was measured on (:func:`pin_to_measured_gpu`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from servetune.config.workload import Workload
    from servetune.load.requests import PromptFactory
    from servetune.load.runner import Level
    from servetune.report.autoscale import Autoscaling
    from servetune.serve.check import Ramp
    from servetune.serve.cluster import ServeCluster
    from servetune.serve.layouts import Layout
    from servetune.serve.plan import Needs
    from servetune.serve.study import PickedStudy


def pin_to_measured_gpu(
    picked: PickedStudy, nodes: Sequence[Mapping[str, float]], where: str, console: Console
) -> tuple[PickedStudy, tuple[str, float] | None]:
    """The pick with every deployment pinned to the GPU type its trial was measured on, where the cluster's nodes
    declare types (``PickedStudy.pinned``: refused in one line where none is of that type), said in a line; and that
    type with the GPUs its nodes have, for the fit check (None: not pinned)."""
    from servetune.serve.plan import gpus_of_type

    pinned = picked.pinned(nodes, where)
    if pinned.gpu_type is None:
        return pinned, None
    console.print(f"replicas pinned to GPU type {pinned.gpu_type} (accelerator_type), as trial "
                  f"{picked.point.trial_id} was measured on {picked.measured_gpu}", soft_wrap=True, highlight=False)  # fmt: skip
    return pinned, (pinned.gpu_type, gpus_of_type(nodes, pinned.gpu_type))


@dataclasses.dataclass
class LayoutArgs:
    layouts: list[Layout]
    budget: int
    level: Level  # the load every layout is offered
    skipped: list[str]
    cores: list[int]
    needs: list[Needs]  # of each layout


def layout_args(args: argparse.Namespace, picked: PickedStudy, console: Console) -> LayoutArgs:
    """--layouts and --budget, checked before Ray starts: the layouts to deploy (refusing one the model
    does not split into, one off the budget, one this machine cannot hold) and the load they are offered."""
    import os

    from servetune.config.space import engine_devices
    from servetune.errors import UserError
    from servetune.serve.check import local_devices
    from servetune.serve.layouts import (
        beside_tp,
        beside_tp_label,
        budget_layouts,
        budget_level,
        check_layouts,
        layout_point,
        model_fits,
        parse_layouts,
    )
    from servetune.serve.plan import check_fits, llm_config, needs

    point = picked.point
    beside = beside_tp(point)  # PP x PCP: each layout's devices are replicas x TP x these
    fits, note = model_fits(point)
    if args.layouts:
        given = parse_layouts(args.layouts)
        off = [layout for layout in given if args.budget is not None and layout.devices(beside) != args.budget]
        if off:
            raise UserError(f"--layouts {off[0]} uses {off[0].devices(beside)} devices (replicas x TP x "
                            f"{beside_tp_label(point)}), not --budget {args.budget}: nothing was deployed")  # fmt: skip
        layouts, skipped = check_layouts(given, beside, fits)
    else:
        layouts, skipped = check_layouts(budget_layouts(args.budget, beside), beside, fits, args.budget)
    budget = layouts[0].devices(beside)
    cores = sorted(os.sched_getaffinity(0)) if args.address is None and point.device == "cpu" else []
    found = []
    for layout in layouts:
        lp = layout_point(point, layout, cores)
        asked = f"--layouts {layout}" if args.layouts else f"--budget {budget} (layout {layout})"
        need = dataclasses.replace(needs(lp, llm_config(lp, 1), layout.replicas), asked_by=asked)
        devices = local_devices(need) if args.address is None else None
        if devices is not None:
            check_fits(need, devices, need.cpus, "this machine")
        found.append(need)
    if note:
        console.print(f"[yellow]{note}[/]")
    # Measured on: the trial's devices (a Serve trial's replicas too), at least its engine's (TP x PP x PCP x DP; a
    # result recorded before PCP counted gave fewer).
    measured_on = max(point.devices, engine_devices(point.engine_args))
    return LayoutArgs(layouts, budget, budget_level(picked.operating_level(), measured_on, budget), skipped, cores,
                      found)  # fmt: skip


def routing_args(
    args: argparse.Namespace, replicas: list[int], engine_args: Mapping[str, Any]
) -> tuple[Workload | None, list[str], int]:
    """--routers, --routing-replicas and --workload, checked before Ray starts: (workload, routers, replicas).
    A workload none of whose requests fits the trial's max_model_len is refused (every request would fail)."""
    from servetune.config.workload import load_workload
    from servetune.errors import UserError
    from servetune.serve.routing import parse_routers

    if not args.routers:
        if args.routing_replicas is not None or args.workload is not None:
            raise UserError("--routing-replicas and --workload go with --routers")
        return None, [], 0
    routers = parse_routers(args.routers)
    count = args.routing_replicas if args.routing_replicas is not None else max(replicas, default=2)
    if count < 2:
        raise UserError(f"--routers compares how requests are spread over replicas: it needs 2 or more, got {count} "
                        "(--routing-replicas N, or a count of 2 or more in --replicas)")  # fmt: skip
    workload = load_workload(args.workload or "rag")
    if workload.shared_prefix is None and workload.sessions is None:
        raise UserError(f"--workload {args.workload or 'rag'}: no shared_prefix (nor sessions): routers that follow the "
                        "prefix cache need prompts that share prefixes")  # fmt: skip
    limit = engine_args.get("max_model_len")
    smallest = [
        getattr(d, "min", getattr(d, "value", None))
        for c in workload.classes
        for d in (c.input_tokens, c.output_tokens)
    ]
    sizes = [s for s in smallest if s is not None]
    if limit and len(sizes) == len(smallest):
        least = min(sizes[i] + sizes[i + 1] for i in range(0, len(sizes), 2))
        if least > int(limit):
            raise UserError(f"--workload {args.workload or 'rag'}: its smallest request ({least} tokens with its answer) "
                            f"passes the trial's max_model_len {limit}: give a workload scaled to the model")  # fmt: skip
    return workload, routers, count


def ramp_autoscaling(args: argparse.Namespace, picked: PickedStudy) -> Autoscaling:
    """The autoscaling the ramp deploys, as export derives it at --headroom x min(capacity, knee): for a peak of 3x
    that operating load, with at most --ramp-max-replicas replicas."""
    from servetune.errors import UserError
    from servetune.report.autoscale import derive_autoscaling
    from servetune.serve.ramp import one_replica_clients

    slo = [str(b) for b in picked.slo.bounds]
    operating = picked.operating
    rests = {"headroom": args.headroom, "capacity": operating.capacity if operating else None,
             "knee": operating.knee if operating else None}  # fmt: skip
    knee = derive_autoscaling(picked.trial_points, slo, **rests).knee_per_replica
    derived = derive_autoscaling(picked.trial_points, slo, peak=3 * knee, delay_scale=args.delay_scale, **rests)
    if args.ramp_max_replicas is not None:
        derived = derived.with_max_replicas(args.ramp_max_replicas, "--ramp-max-replicas")
    if one_replica_clients(derived.target_ongoing_requests) is None:
        raise UserError(f"--ramp: trial {picked.point.trial_id}'s derived target_ongoing_requests is "
                        f"{derived.target_ongoing_requests} in flight a replica, so no whole number of clients stays "
                        "below Serve's scale-up threshold for the ramp's one-replica 1x; it needs a target of 2 or "
                        "more (a higher --headroom, or a trial whose operating load is 2 or more in flight)")  # fmt: skip
    return derived


def ramp_policies(text: str) -> list[str]:
    """--ramp-policy's autoscaling policies, in order, each once (the first round's order); refused in one line if
    unknown."""
    from servetune.errors import UserError
    from servetune.report.autoscale_policy import POLICIES

    asked = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in asked if name not in POLICIES]
    if unknown or not asked:
        raise UserError(f"--ramp-policy {text!r}: choose from {', '.join(POLICIES)} (e.g. inflight,predictive)")
    return list(dict.fromkeys(asked))


def make_ramp(
    args: argparse.Namespace, picked: PickedStudy, derived: Autoscaling, prompts: PromptFactory, name: str,
    records: list[dict[str, Any]], console: Console, cluster: Callable[[], ServeCluster],
) -> Ramp:  # fmt: skip
    """The ramp: its deployment config and its driver; ``cluster()`` is the ServeCluster once started."""
    import asyncio

    from servetune.report.autoscale import SERVE_METRICS_PUSH_S
    from servetune.serve.check import Ramp
    from servetune.serve.ramp import RampResult, one_replica_clients, ramp_phases, run_ramp, settle_s

    knee = max(1, round(derived.in_flight_per_replica))
    target = derived.target_ongoing_requests
    base = one_replica_clients(target) or 1  # ramp_autoscaling refused a target of 1
    phases = ramp_phases(base, derived.max_replicas, args.ramp_hold, target)
    settle = settle_s(derived.look_back_period_s, SERVE_METRICS_PUSH_S)
    load = picked.space.load
    scale_up_timeout_s = picked.startup_timeout_s + derived.upscale_delay_s + derived.look_back_period_s + 30.0

    def run_it(url: str, served: str) -> RampResult:
        console.print(f"[bold]ramp ({derived.policy})[/]: autoscaling {derived.min_replicas}-{derived.max_replicas} replicas, target "
                      f"{target} in flight; clients {base} (one below the target: one replica), {3 * base}, {base}, "
                      f"after {settle:g} s with none (Serve's window forgets the step before)")  # fmt: skip
        summary, samples, recs, phase_of = asyncio.run(run_ramp(
            cluster(), name, url, served, picked.workload, prompts, phases, picked.slo.request_bounds_ms(),
            args.request_timeout or load.request_timeout_s, scale_up_timeout_s,
            on_phase=lambda ph, t: console.print(f"  {t:6.1f} s  {ph}"), settle=settle,
        ))  # fmt: skip
        records.extend({**r.to_dict(), "ramp_phase": ph} for r, ph in zip(recs, phase_of, strict=True))
        return RampResult(
            policy=derived.policy, knee_concurrency=knee, base_concurrency=base,
            autoscaling_config=derived.autoscaling_config(),
            max_ongoing_requests=derived.max_ongoing_requests, max_queued_requests=derived.max_queued_requests,
            reasons=derived.reasons, samples=samples, **summary,
        )  # fmt: skip

    return Ramp(deployment_config=derived.deployment_config(), run=run_it, policy=derived.policy)


def make_ramps(
    orders: Sequence[Sequence[str]], derived: Autoscaling, make: Callable[[Autoscaling], Ramp]
) -> list[Ramp]:
    """One ramp per policy per round, in each round's order (``serve.ramp_rounds.round_orders``), from ``make``
    (:func:`make_ramp` with the rest of its arguments) given ``derived`` under that policy. Where more than one
    runs, each is deployed fresh: no policy starts on the engine, caches and host state another ramp left."""
    made = {policy: make(derived.with_policy(policy)) for order in orders for policy in order}
    fresh = sum(len(order) for order in orders) > 1
    return [dataclasses.replace(made[policy], round=k, fresh=fresh)
            for k, order in enumerate(orders, 1) for policy in order]  # fmt: skip
