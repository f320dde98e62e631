"""Running ``servetune serve-check`` (its arguments and help: cli/serve_check.py): the checks that can refuse
before Ray starts, the measuring of each part through Serve's ingress, the teardown that proves no replica is left,
and serve-check.json with every request sent, kept as far as it got when a serve-check stops half-way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servetune.results import LevelResult
    from servetune.serve.layouts import Layout
    from servetune.serve.result import ServeCheckResult
    from servetune.serve.study import PickedStudy


def with_stream_batching(picked: PickedStudy, interval_ms: float) -> PickedStudy:
    """``picked`` deployed with Ray Serve LLM's stream batching at ``interval_ms``."""
    from servetune.config.space import SERVE_STREAM_BATCHING, stream_batching_ok
    from servetune.errors import UserError

    if not stream_batching_ok(interval_ms):
        raise UserError(f"--stream-batching-ms {interval_ms:g}: a finite interval of 0 ms or more")
    point = dataclasses.replace(picked.point, params={**picked.point.params, SERVE_STREAM_BATCHING: interval_ms})
    return dataclasses.replace(picked, point=point)


def run(args: argparse.Namespace) -> int:
    from servetune.cli.bench import exit_on_sigterm, run_levels
    from servetune.cli.display import console as make_console
    from servetune.cli.prefetching import PointPrefetch
    from servetune.cli.serve_check_parts import (
        layout_args,
        make_ramp,
        make_ramps,
        pin_to_measured_gpu,
        ramp_autoscaling,
        ramp_policies,
        routing_args,
    )
    from servetune.cli.serve_check_tables import (
        layouts_table,
        policies_table,
        ramp_table,
        routing_table,
        scaling_table,
    )
    from servetune.engine.args import point_structured_problem, vllm_version
    from servetune.engine.cores import cores_words
    from servetune.errors import UserError
    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.serve.actors import wait_gone
    from servetune.serve.check import (
        Teardown,
        check_before_start,
        check_cluster_fits,
        check_vllm_matches,
        refuse_running,
        run_check,
    )
    from servetune.serve.cluster import ServeCluster
    from servetune.serve.plan import APP_NAME, llm_config, parse_replicas
    from servetune.serve.ramp_rounds import round_orders
    from servetune.serve.result import SERVE_CHECK_FILE
    from servetune.serve.study import read_picked
    from servetune.trial.measure import LevelPlan

    console = make_console(stderr=True)
    # The 1x phase must outlast Serve's counter's lag, so the replica serving before the ramp is known as old.
    if args.ramp_hold < 5 or not 0 < args.delay_scale <= 1 or (args.ramp_max_replicas or 1) < 1:
        raise UserError(
            "--ramp-hold needs 5 s or more, --delay-scale a factor in (0, 1], --ramp-max-replicas 1 or more"
        )
    layouts_asked = bool(args.layouts) or args.budget is not None
    replicas = parse_replicas(args.replicas) if args.replicas is not None else ([] if layouts_asked else [1, 2])
    if args.ramp and not replicas:
        raise UserError("--ramp runs after the first replica count: give --replicas N with --layouts or --budget")
    picked = read_picked(args.study_dir, args.pick, args.headroom)
    check_vllm_matches(picked, vllm_version())
    # as a study refuses it before its trials: replicas (Ray's workers, this interpreter) answering every structured
    # request with HTTP 500
    if problem := point_structured_problem(picked.point.engine_args, picked.workload.asks_structured, sys.executable):
        raise UserError(f"{args.study_dir}: trial {picked.point.trial_id}: {problem}")
    if args.stream_batching_ms is not None:
        picked = with_stream_batching(picked, args.stream_batching_ms)
    name = args.app_name or APP_NAME
    policies = ramp_policies(args.ramp_policy)
    if policies != ["inflight"] and not args.ramp:
        raise UserError(f"--ramp-policy {args.ramp_policy}: the policies are compared on a ramp: add --ramp")
    if args.ramp_rounds is not None and not args.ramp:
        raise UserError(f"--ramp-rounds {args.ramp_rounds}: the rounds are of the ramp: add --ramp")
    orders = round_orders(policies, args.ramp_rounds)
    derived = ramp_autoscaling(args, picked) if args.ramp else None
    routing_workload, routers, routing_replicas = routing_args(args, replicas, picked.point.engine_args)
    need = check_before_start(picked, replicas, args.address) if replicas else None
    if derived is not None and derived.max_replicas > max(replicas):
        asked = f"--ramp (scaling up to {derived.max_replicas} replicas; --ramp-max-replicas sets the most)"
        need = check_before_start(picked, [derived.max_replicas], args.address, asked)
    if routers and (need is None or routing_replicas > need.replicas):
        need = check_before_start(picked, [routing_replicas], args.address, f"--routers at {routing_replicas} replicas")
    laid = layout_args(args, picked, console) if layouts_asked else None
    needed = [need] if need is not None else []
    needed += laid.needs if laid is not None else []
    need = max(needed, key=lambda n: n.cpus)
    model = picked.point.model
    if args.address is None and not Path(model).exists() and model.startswith(("/", ".")):
        raise UserError(f"the trial's model {model} is not on this machine")
    if picked.operating is not None:
        console.print(f"operating point of trial {picked.point.trial_id}: {picked.operating.describe()}",
                      soft_wrap=True, highlight=False)  # fmt: skip
    out = args.json or args.study_dir / SERVE_CHECK_FILE
    with console.status(f"loading the tokenizer of {model}"):
        prompts = PromptFactory(load_tokenizer(model))
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    records: list[dict] = []
    measure_args = types.SimpleNamespace(
        repeats=picked.space.load.repeats, request_timeout=args.request_timeout or picked.space.load.request_timeout_s,
    )  # fmt: skip

    def measure(url: str, served: str, count: int) -> list[LevelResult]:
        holder = types.SimpleNamespace(levels=[])  # what bench's level loop appends to
        console.print(f"[bold]{count} replica{'s' if count > 1 else ''}[/] through {url}")
        run_levels(console, url, served, picked.workload, prompts, list(picked.plans), picked.slo, measure_args,
                    holder, records)  # fmt: skip
        return holder.levels

    cluster: ServeCluster  # started below, before the ramp reads it
    ramp = None
    if derived is not None:  # --ramp, once per --ramp-policy per --ramp-rounds, each round's order rotated
        ramp = make_ramps(orders, derived,
                          lambda d: make_ramp(args, picked, d, prompts, name, records, console, lambda: cluster))  # fmt: skip

    routing = None
    if routing_workload is not None:  # --routers
        from servetune.serve.check import Routing

        load = picked.space.load
        level = picked.operating_level()
        plan = LevelPlan.sized(level, load.requests_per_level, load.seconds_per_level, warmup=0)

        def measure_router(url: str, served: str, router: str) -> LevelResult:
            holder = types.SimpleNamespace(levels=[])
            console.print(
                f"[bold]router {router}[/]: {routing_replicas} replicas, workload {routing_workload.name}, {level}"
            )
            sent: list[dict] = []
            run_levels(console, url, served, routing_workload, prompts, [plan], picked.slo, measure_args, holder, sent)
            records.extend({**r, "router": router} for r in sent)  # serve-check.requests.jsonl says which router
            return holder.levels[0]

        routing = Routing(
            routers=routers, replicas=routing_replicas, workload=routing_workload.name, measure=measure_router
        )

    layouts = None
    if laid is not None:
        from servetune.serve.check import Layouts

        lp_load = picked.space.load
        layout_plan = LevelPlan.sized(
            laid.level, lp_load.requests_per_level, lp_load.seconds_per_level, lp_load.warmup_requests
        )

        def measure_layout(url: str, served: str, layout: Layout) -> LevelResult:
            holder = types.SimpleNamespace(levels=[])
            console.print(f"[bold]layout {layout}[/]: {layout.replicas} replica{'s' if layout.replicas > 1 else ''} "
                          f"of TP {layout.tp}, {laid.level}")  # fmt: skip
            sent: list[dict] = []
            run_levels(
                console, url, served, picked.workload, prompts, [layout_plan], picked.slo, measure_args, holder, sent
            )
            records.extend({**r, "layout": str(layout)} for r in sent)  # serve-check.requests.jsonl says which layout
            return holder.levels[0]

        layouts = Layouts(layouts=laid.layouts, budget=laid.budget, level=laid.level.as_dict(), measure=measure_layout,
                          skipped=laid.skipped, cores=laid.cores)  # fmt: skip

    teardown = Teardown(pids=set())
    where = args.address or "the local Ray"
    with console.status(f"{'joining' if args.address else 'starting'} Ray ({where})"):
        cluster = ServeCluster(args.address, need.resources()).__enter__()  # no Serve yet: the checks below may refuse
    left: list[int] = []
    owned = False  # the application is serve-check's to delete only once it did not refuse someone else's
    so_far: list[ServeCheckResult] = []  # the result as of the last part that finished (run_check's keep)
    requests_path = out.with_suffix(".requests.jsonl")

    prefetched = PointPrefetch(console)

    def keep(partial: ServeCheckResult) -> None:
        partial.prefetch = list(prefetched.records)
        so_far[:] = [partial]

    joined = f"the Ray cluster at {args.address}" if args.address else "the local Ray"
    try:
        picked, typed = pin_to_measured_gpu(picked, cluster.nodes(), joined, console)  # refused before anything
        refuse_running(cluster, name, args.replace)
        for each in needed:
            check_cluster_fits(cluster, each, joined, typed)
        if not args.no_prefetch:  # where the replicas run (its GPU type's nodes), before the first one's start-up
            deployed = llm_config(picked.point, 1)
            prefetched(model, deployed.get("runtime_env", {}).get("env_vars", {}), picked.point.engine_args,
                       picked.point.device, through_ray=args.address is not None, gpu_type=picked.gpu_type)  # fmt: skip
        with console.status(f"starting Serve ({where})"):
            cluster.open_serve()  # nothing refused: a refusal above left no Serve behind on the cluster
        owned = True
        result = run_check(
            picked, replicas, cluster, name, measure, teardown, address=args.address,
            on_ready=lambda n, s, cores: console.print(f"{n} replica{'s' if n > 1 else ''} RUNNING after {s:.0f} s"
                                                       f"{cores_words(**cores)}", soft_wrap=True, highlight=False), ramp=ramp,
            routing=routing, layouts=layouts, keep=keep,
        )  # fmt: skip
    except BaseException as exc:
        if so_far:  # stopped or broken after some part finished: that part is kept, and says why the rest is not
            so_far[0].stopped = stopped_reason(exc)
            so_far[0].replica_pids = sorted(teardown.pids)
            # never over a complete check, as verify: serve-check.stopped.json (and .stopped.requests.jsonl) beside it
            kept_at = out.with_name(f"{out.stem}.stopped{out.suffix}") if holds_complete_check(out) else out
            write_result(kept_at, kept_at.with_suffix(".requests.jsonl"), so_far[0], records)
            console.print(f"[yellow]serve-check stopped ({so_far[0].stopped}): what finished is kept in {kept_at}[/]")
            if kept_at != out:
                console.print(f"[yellow]{out} holds an earlier serve-check that ran to the end: kept as it was[/]")
        raise
    finally:
        with console.status(f"deleting the Serve application {name}"):
            try:
                if owned:
                    cluster.delete(name)
            finally:
                cluster.__exit__(None, None, None)
                left = wait_gone(sorted(teardown.pids))
    if left:
        raise UserError(f"replica processes still running after the teardown: pids {left}")
    result.replica_pids = sorted(teardown.pids)
    result.prefetch = list(prefetched.records)
    write_result(out, requests_path, result, records)
    make_console().print(scaling_table(result))
    for ramped in result.ramps or ([result.ramp] if result.ramp is not None else []):
        make_console().print(ramp_table(ramped))
    if len(result.ramps) > 1:
        make_console().print(policies_table(result.ramps, result.ramp_verdict))
    if result.routing is not None:
        make_console().print(routing_table(result.routing))
    if result.layouts is not None:
        make_console().print(layouts_table(result.layouts))
    console.print(f"wrote {out} and {requests_path}; Serve torn down, {len(teardown.pids)} replica processes gone")
    completed = all(lv.summary.completed for run in result.runs for lv in run.levels)
    completed = completed and all(
        run.level.summary.completed for run in (result.routing.runs if result.routing else [])
    )
    completed = completed and all(run.level is not None and run.level.summary.completed
                                  for run in (result.layouts.runs if result.layouts else []))  # fmt: skip
    early = any(r.traffic_before_ready for r in result.ramps or ([result.ramp] if result.ramp is not None else []))
    return 0 if completed and not early else 1


def stopped_reason(exc: BaseException) -> str:
    """Why a serve-check ended before every part ran, in a few words."""
    from servetune.verify.run import (
        stop_name,
    )  # verify names its stops the same way: "interrupted", "SIGTERM", "exit N"

    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        name = stop_name(exc)
        if name == "interrupted":
            return "interrupted (Ctrl-C)"
        return f"exited with code {name.removeprefix('exit ')}" if name.startswith("exit ") else f"stopped by {name}"
    first = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {first[0] if first else ''}".rstrip(": ")


def holds_complete_check(path: Path) -> bool:
    """Whether ``path`` holds a serve-check that ran every part it was asked for (not one that stopped)."""
    from servetune.serve.result import ServeCheckResult

    try:
        return ServeCheckResult.model_validate_json(path.read_bytes()).stopped is None
    except (OSError, ValueError):  # none there, or not a serve-check result: nothing to keep
        return False


def write_result(out: Path, requests_path: Path, result: ServeCheckResult, records: list[dict]) -> None:
    """serve-check.json and every request sent beside it, each written whole."""
    from servetune.trial.runner import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(requests_path, "".join(json.dumps(r) + "\n" for r in records))
    write_atomic(out, result.model_dump_json(indent=2) + "\n")
