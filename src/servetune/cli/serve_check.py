"""``servetune serve-check``: a study's chosen configuration deployed on Ray Serve and measured.

This module is the command's face: its help (:data:`DESCRIPTION`) and its arguments; cli/serve_check_run.py runs it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from servetune.cli.prefetching import add_no_prefetch
from servetune.cli.serve_check_run import run

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
autoscaling_config and, once Serve's averaging window holds no load from the step before, offers
1x (one client below target_ongoing_requests: what one replica holds below Serve's scale-up
threshold), then 3x until Serve has scaled out and --ramp-hold seconds more, then 1x again. Per 5 s window: replicas RUNNING, requests per
replica (Serve's counter), SLO violations; the time to scale up, and whether a new replica
served a request before Serve had it RUNNING (its engine started): it must not (exit 1).
--delay-scale shrinks section 11's delays (120 s up, 600 s down, 30 s window) for a quick check.

--ramp-policy inflight,predictive compares the two autoscaling policies on that ramp, in rounds
(--ramp-rounds N, default one per policy: inflight then predictive, predictive then inflight),
each round's order rotated so each policy runs first as often as last, and each ramp on a fresh
deployment (its engine start not in the ramp), so no policy runs on what another left. Per ramp:
its round, SLO attainment, replica-seconds and mean replicas (replica-seconds over its length),
when Serve decided and when the new replica was RUNNING. serve-check.json keeps each round's order
(ramp_orders) and a verdict (ramp_verdict): a policy wins only where its lead in SLO met or mean
replicas passes the spread between rounds of the same policy (max - min), and no other leads
beyond it on the other; else "no winner within the noise", with the numbers.

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
(devices x the price per device-hour the trial was costed at, and per 1M output tokens), and a verdict naming the
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
        "--ramp",
        action="store_true",
        help="also validate the derived autoscaling with a 1x, 3x, 1x ramp (1x: one client below its target)",
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
        "--ramp-rounds",
        type=int,
        default=None,
        metavar="N",
        help="rounds of the --ramp-policy policies, the order rotating each round (AB, BA), each ramp on a fresh "
        "deployment; a multiple of the number of policies (default: that number, so AB, BA for two)",
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
