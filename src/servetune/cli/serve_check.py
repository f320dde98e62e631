"""``servetune serve-check``: a study's chosen configuration deployed on Ray Serve and measured."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import types
from pathlib import Path

from servetune.cli.prefetching import add_no_prefetch

DESCRIPTION = """\
Deploy one operating point of a study as the Ray Serve LLM application `servetune export
--format ray-serve` prints (ray.serve.llm LLMConfig + build_openai_app), at each replica count
of --replicas in turn (Serve keeps the engines running and adds replicas; see "Engine starts
are shared" below), and measure it through Serve's OpenAI ingress with the study's workload and
load ladder. Each replica is one placement
group holding the engine's TP x PP x PCP devices.

Per replica count and level: goodput, throughput, TTFT/TPOT P50/P99; against the bare engine the
study measured for that trial at the same level (the router's TTFT overhead), and the scaling
efficiency (throughput at N replicas / (N x throughput at 1)); the requests each replica handled
(Serve's own per-replica counter). Writes serve-check.json in the study directory.

On GPUs every deployment is pinned to the GPU type the trial was measured on (accelerator_type in
its LLMConfig, as export --accelerator-type writes it) where the cluster's nodes declare types; a
cluster with none of that type is refused in one line, naming the types it has, before anything
is deployed. Before the first deployment, a hub model's weights are fetched where the replicas run
(this machine for a local Ray; at --address, one Ray task on each node that can host a replica, of
that GPU type), outside the replicas' start-up; serve-check.json keeps each download (prefetch).
--no-prefetch leaves the download to the replicas.

The operating point is --headroom (default 0.8, as export) times the lower of the trial's
capacity at the SLO and its knee (where throughput stopped growing with load), in whole clients
for a closed loop; serve-check prints it and serve-check.json keeps it (operating_point). The
replica counts run the study's whole ladder (to compare with the bare engine level by level);
the routers, the layouts and the ramp run at the operating point.

--ramp validates the autoscaling `export --format ray-serve` derives (peak 3x the operating
load, at most --ramp-max-replicas replicas): after the first replica count it deploys that
autoscaling_config, offers 1x the knee (clients in flight), then 3x until Serve has scaled out
and --ramp-hold seconds more, then 1x again. Per 5 s window: replicas RUNNING, requests per
replica (Serve's counter), SLO violations; the time to scale up, and whether a new replica
served a request before Serve had it RUNNING (its engine started): it must not (exit 1).
--delay-scale shrinks section 11's delays (120 s up, 600 s down, 30 s window) for a quick check.

--routers compares request routers at the end: `default` (Serve's own, power of two choices by
queue length) and `prefix-aware` (Ray Serve LLM's PrefixCacheAffinityRouter), at
--routing-replicas replicas, each on the same engines (Serve reconfigures the LLM replicas, a new
ingress routes with the new router) with every replica's prefix cache reset, and whether Serve kept
the engines is recorded. Each is offered --workload (a shared-prefix
workload, default: rag; on the CPU stand-in, a file scaled to the tiny model) at the operating
point, without warm-up. Per router and replica: requests (Serve's counter), tokens served
(vLLM's prompt + generated tokens), prefix-cache queries and hits (vLLM's counters, in tokens, as
Ray Serve LLM exports them per replica through Ray's metrics agent) and the hit rate; per router:
the overall hit rate, the load imbalance (max over mean of tokens served across the replicas),
goodput and TTFT P50/P99, and a verdict: which router to ship, named only when the TTFT P50 differs
beyond max(20 ms, 15%), goodput drops by more than 10%, or the hit rate rises by 5 points or more
at no latency cost.

--layouts 2x1,1x2 (REPLICASxTP) compares layouts of one device budget, many small replicas against
fewer with tensor parallelism (checklist section 11); --budget D compares every REPLICASxTP that
fills D devices (replicas x TP x the picked PP x PCP) with TP a power of two, leaving out (and
naming) those the model's heads do not split into. Each layout is the picked configuration with its
TP replaced, each replica a placement group of its ranks (on the CPU build one core per rank, bound with VLLM_CPU_OMP_THREADS_BIND).
Every layout is offered the same load: the operating point scaled from the devices it was
measured on to the budget (concurrency 8 on 1 device -> 16 on 2), with the study's warm-up and
requests. Per layout: devices, replicas, TP, throughput, goodput, TTFT/TPOT P50/P99, SLO, cost
(devices x the study's price per device-hour, and per 1M output tokens), and a verdict naming the
layout that meets the SLO at the lowest cost per 1M output tokens; costs within the noise margin
(10%, or the spread of the study's repeats) count as a tie, won by the simpler layout (fewer
replicas, then less TP), and the verdict says so. A layout the model or the budget cannot take, or
one that needs more devices than the cluster has, is refused before anything is deployed. Layouts
run last; one of the engines already running is measured on them, prefix caches reset; every other
layout is deployed fresh. With --layouts or --budget and no --replicas, no replica counts are measured.

Engine starts are shared. Every step deploys the LLM deployment pinned to a version of its engine
configuration, so where the engine configuration stays the same (replica counts, the ramp, the
routers, a layout of the picked TP) Serve keeps the engines already running, adds or stops replicas
as the step says, and each kept engine's prefix cache is reset before it is measured (the ramp's
autoscaling starts at its minimum: Serve stops any replica beyond it). Such a step with the router
already routing keeps the ingress replica too (its version is what it is built from and the router);
another router starts a new ingress, which is what routes with it. Everything else is deployed
fresh, the application deleted first.

Without --address a local Ray is started, declaring the CPUs the replicas and the ingress need,
with Serve's HTTP proxy on 127.0.0.1 at a free port; it is shut down at the end. With --address
only the application serve-check deployed is deleted at the end, and Serve itself only where
serve-check started it (none ran) and no application is left on it. Serve starts after every check
that can refuse, so a refusal leaves nothing on the cluster. Either way serve-check proves, by
process id, that no replica process is left.

Stopped half-way (Ctrl-C, SIGTERM) or broken by a later step (an engine that dies), serve-check
deletes its application just the same and keeps what finished (each replica count, the ramp, each
router and each layout as it ends) in serve-check.json, with `stopped` saying why the rest is missing.
An earlier serve-check there that ran to the end is not replaced: the stopped one goes beside it, in
serve-check.stopped.json.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve-check",
        help="deploy a study's chosen configuration on Ray Serve and measure replicas and the router's overhead",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: servetune serve-check servetune-results/cpu-tiny --pick best --replicas 1,2",
    )
    p.add_argument("study_dir", type=Path, metavar="STUDY_DIR", help="the study directory (servetune-results/<study>)")
    p.add_argument(
        "--pick",
        default="best",
        metavar="best|N|TRIAL_ID",
        help="which operating point, as `servetune export --pick` (default: best)",
    )
    p.add_argument(
        "--replicas",
        default=None,
        metavar="N,M",
        help="replica counts to measure, e.g. 1,2,4 (default: 1,2; none with --layouts or --budget)",
    )
    p.add_argument(
        "--address",
        metavar="ADDR",
        help="a running Ray cluster (e.g. auto, or ray://head:10001); default: start a local Ray",
    )
    p.add_argument(
        "--app-name", default=None, metavar="NAME", help="the Serve application's name (default: servetune-serve-check)"
    )
    p.add_argument(
        "--replace", action="store_true", help="replace a Serve application of the same name that is already running"
    )
    p.add_argument(
        "--json", type=Path, metavar="OUT", help="where to write the result (default: STUDY_DIR/serve-check.json)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds before one request counts as timed out (default: the study's)",
    )
    p.add_argument(
        "--ramp", action="store_true", help="also validate the derived autoscaling with a 1x, 3x, 1x ramp of the knee"
    )
    p.add_argument(
        "--ramp-hold",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds at 1x, at 3x once scaled out, and back at 1x (at least 5; default: 60)",
    )
    p.add_argument(
        "--ramp-max-replicas",
        type=int,
        metavar="N",
        help="the most replicas the ramp may scale to (default: the derived max_replicas for 3x the knee)",
    )
    p.add_argument(
        "--ramp-policy",
        default="inflight",
        metavar="A,B",
        help="the autoscaling policies to ramp, one after the other: inflight (Serve's, on requests in flight), "
        "predictive (also on requests waiting and KV usage); e.g. inflight,predictive (default: inflight)",
    )
    p.add_argument(
        "--delay-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply the derived autoscaling delays by F for the ramp (default: 1)",
    )
    p.add_argument(
        "--routers",
        metavar="A,B",
        help="compare request routers on a shared-prefix workload: default, prefix-aware "
        "(e.g. default,prefix-aware; the first is the baseline)",
    )
    p.add_argument(
        "--routing-replicas",
        type=int,
        metavar="N",
        help="replicas for --routers (at least 2; default: the largest of --replicas)",
    )
    p.add_argument(
        "--workload",
        metavar="NAME|FILE",
        help="the shared-prefix workload for --routers: a shipped workload or a workload file (default: rag)",
    )
    p.add_argument(
        "--layouts",
        metavar="RxT,...",
        help="layouts of one device budget to compare, REPLICASxTP, e.g. 2x1,1x2 (each uses the same devices)",
    )
    p.add_argument(
        "--budget",
        type=int,
        metavar="D",
        help="a device budget: compare every REPLICASxTP that uses D devices "
        "(TP a power of two the model splits into); with --layouts, each layout must use D",
    )
    p.add_argument("--headroom", type=float, default=0.8, metavar="X",
                   help="the operating point: X times the lower of the trial's capacity at the SLO and its knee, the "
                        "load --routers and --layouts offer and --ramp's knee (default 0.8, as export)")  # fmt: skip
    p.add_argument("--stream-batching-ms", type=float, default=None, metavar="MS",
                   help="Ray Serve LLM's stream batching interval for every deployment (experimental_configs."
                        "stream_batching_interval_ms; 0 sends each token as it comes). Default: the trial's, "
                        "else Ray's (50 ms), which holds the first token until the next send")  # fmt: skip
    add_no_prefetch(p)
    p.set_defaults(run=run)


def with_stream_batching(picked, interval_ms: float):
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
    from servetune.serve.result import SERVE_CHECK_FILE, ServeCheckResult
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

    def measure(url: str, served: str, count: int):
        holder = types.SimpleNamespace(levels=[])  # what bench's level loop appends to
        console.print(f"[bold]{count} replica{'s' if count > 1 else ''}[/] through {url}")
        run_levels(console, url, served, picked.workload, prompts, list(picked.plans), picked.slo, measure_args,
                    holder, records)  # fmt: skip
        return holder.levels

    cluster: ServeCluster  # started below, before the ramp reads it
    ramp = None
    if derived is not None:  # --ramp, once per --ramp-policy
        ramp = [make_ramp(args, picked, derived.with_policy(policy), prompts, name, records, console, lambda: cluster)
                for policy in policies]  # fmt: skip

    routing = None
    if routing_workload is not None:  # --routers
        from servetune.serve.check import Routing

        load = picked.space.load
        level = picked.operating_level()
        plan = LevelPlan.sized(level, load.requests_per_level, load.seconds_per_level, warmup=0)

        def measure_router(url: str, served: str, router: str):
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

        def measure_layout(url: str, served: str, layout):
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
            on_ready=lambda n, s: console.print(f"{n} replica{'s' if n > 1 else ''} RUNNING after {s:.0f} s"), ramp=ramp,
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
        make_console().print(policies_table(result.ramps))
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


def write_result(out: Path, requests_path: Path, result, records: list[dict]) -> None:
    """serve-check.json and every request sent beside it, each written whole."""
    from servetune.trial.runner import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(requests_path, "".join(json.dumps(r) + "\n" for r in records))
    write_atomic(out, result.model_dump_json(indent=2) + "\n")
