"""``servetune serve-check``: a study's chosen configuration deployed on Ray Serve and measured."""

from __future__ import annotations

import argparse
import json
import signal
import types
from pathlib import Path

from rich.table import Table

DESCRIPTION = """\
Deploy one operating point of a study as the Ray Serve LLM application `servetune export
--format ray-serve` prints (ray.serve.llm LLMConfig + build_openai_app), at each replica count
of --replicas in turn (each count a new version of the application, rolled out by Serve), and
measure it through
Serve's OpenAI ingress with the study's workload and load ladder. Each replica is one placement
group holding the engine's TP x PP devices.

Per replica count and level: goodput, throughput, TTFT/TPOT P50/P99; against the bare engine the
study measured for that trial at the same level (the router's TTFT overhead), and the scaling
efficiency (throughput at N replicas / (N x throughput at 1)); the requests each replica handled
(Serve's own per-replica counter). Writes serve-check.json in the study directory.

Without --address a local Ray is started, declaring the CPUs the replicas and the ingress need,
with Serve's HTTP proxy on 127.0.0.1 at a free port; it is shut down at the end. With --address
only the application serve-check deployed is deleted at the end. Either way serve-check proves,
by process id, that no replica process is left.
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
    p.add_argument("--pick", default="best", metavar="best|N|TRIAL_ID", help="which operating point, as `servetune export --pick` (default: best)")
    p.add_argument("--replicas", default="1,2", metavar="N,M", help="replica counts to measure, e.g. 1,2,4 (default: 1,2)")
    p.add_argument("--address", metavar="ADDR", help="a running Ray cluster (e.g. auto, or ray://head:10001); default: start a local Ray")
    p.add_argument("--app-name", default=None, metavar="NAME", help="the Serve application's name (default: servetune-serve-check)")
    p.add_argument("--replace", action="store_true", help="replace a Serve application of the same name that is already running")
    p.add_argument("--json", type=Path, metavar="OUT", help="where to write the result (default: STUDY_DIR/serve-check.json)")
    p.add_argument("--request-timeout", type=float, default=None, help="seconds before one request counts as timed out (default: the study's)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.cli.bench import _exit_on_sigterm, _run_levels, _write_atomic
    from servetune.cli.display import console as make_console
    from servetune.errors import UserError
    from servetune.load.requests import PromptFactory, load_tokenizer
    from servetune.serve.check import Teardown, check_before_start, check_cluster_fits, refuse_running, run_check
    from servetune.serve.cluster import ServeCluster, wait_gone
    from servetune.serve.plan import APP_NAME, parse_replicas
    from servetune.serve.result import SERVE_CHECK_FILE
    from servetune.serve.study import read_picked

    console = make_console(stderr=True)
    replicas = parse_replicas(args.replicas)
    picked = read_picked(args.study_dir, args.pick)
    name = args.app_name or APP_NAME
    need = check_before_start(picked, replicas, args.address)
    model = picked.point.model
    if args.address is None and not Path(model).exists() and model.startswith(("/", ".")):
        raise UserError(f"the trial's model {model} is not on this machine")
    out = args.json or args.study_dir / SERVE_CHECK_FILE
    with console.status(f"loading the tokenizer of {model}"):
        prompts = PromptFactory(load_tokenizer(model))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    records: list[dict] = []
    measure_args = types.SimpleNamespace(
        repeats=picked.space.load.repeats, request_timeout=args.request_timeout or picked.space.load.request_timeout_s,
    )  # fmt: skip

    def measure(url: str, served: str, count: int):
        holder = types.SimpleNamespace(levels=[])  # what bench's level loop appends to
        console.print(f"[bold]{count} replica{'s' if count > 1 else ''}[/] through {url}")
        _run_levels(console, url, served, picked.workload, prompts, list(picked.plans), picked.slo, measure_args,
                    holder, records)  # fmt: skip
        return holder.levels

    teardown = Teardown(pids=set())
    where = args.address or "the local Ray"
    with console.status(f"starting Ray and Serve ({where})"):
        cluster = ServeCluster(args.address, need.resources()).__enter__()
    left: list[int] = []
    owned = False  # the application is serve-check's to delete only once it did not refuse someone else's
    try:
        refuse_running(cluster, name, args.replace)
        check_cluster_fits(cluster, need, f"the Ray cluster at {args.address}" if args.address else "the local Ray")
        owned = True
        result = run_check(
            picked, replicas, cluster, name, measure, teardown, address=args.address,
            on_ready=lambda n, s: console.print(f"{n} replica{'s' if n > 1 else ''} RUNNING after {s:.0f} s"),
        )  # fmt: skip
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
    requests_path = out.with_suffix(".requests.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(requests_path, "".join(json.dumps(r) + "\n" for r in records))
    _write_atomic(out, result.model_dump_json(indent=2) + "\n")
    make_console().print(scaling_table(result))
    console.print(f"wrote {out} and {requests_path}; Serve torn down, {len(teardown.pids)} replica processes gone")
    return 0 if all(lv.summary.completed for run in result.runs for lv in run.levels) else 1


def _fmt(value: float | None, digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+,.{digits}f}" if signed else f"{value:,.{digits}f}"


def scaling_table(result) -> Table:
    table = Table(title=f"serve-check: trial {result.trial_id} through Ray Serve", title_justify="left")
    for col in ("replicas", "level", "goodput", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "bare tok/s", "bare TTFT p50", "router TTFT p50", "scaling eff.", "SLO"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in result.rows:
        level = ", ".join(f"{k} {v:g}" for k, v in row.level.items())
        table.add_row(
            str(row.replicas), level, _fmt(row.goodput, 2), _fmt(row.request_throughput, 2), _fmt(row.output_throughput),
            _fmt(row.ttft_ms_p50), _fmt(row.ttft_ms_p99), _fmt(row.tpot_ms_p50), _fmt(row.tpot_ms_p99),
            _fmt(row.bare_output_throughput), _fmt(row.bare_ttft_ms_p50), _fmt(row.ttft_p50_overhead_ms, signed=True),
            "-" if row.scaling_efficiency is None else f"{row.scaling_efficiency:.0%}",
            "[green]met[/]" if row.meets_slo else "[red]broken[/]",
        )  # fmt: skip
    served = [f"{run.replicas}: " + ", ".join(f"{n}" for n in sorted(run.requests_per_replica.values(), reverse=True))
              for run in result.runs if run.requests_per_replica]  # fmt: skip
    table.caption = ("latencies in ms; bare: the study's own engine at the same level; router TTFT p50: through "
                     "Serve minus bare; scaling eff.: tok/s at N / (N x tok/s at 1)")  # fmt: skip
    if served:
        table.caption += "\nrequests per replica (replicas: counts): " + "; ".join(served)
    return table
