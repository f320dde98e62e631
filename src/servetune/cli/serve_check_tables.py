"""What ``servetune serve-check`` prints at the end: a table per part it measured (replica counts, the ramp,
the routers, the layouts), drawn from the result it wrote (serve/result.py); the wording of the notes is
report/serving.py's, shared with the report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.table import Table

if TYPE_CHECKING:
    from servetune.serve.layouts import LayoutResult
    from servetune.serve.ramp import RampResult
    from servetune.serve.ramp_rounds import RampComparison
    from servetune.serve.result import ServeCheckResult
    from servetune.serve.routing import RoutingResult


def scaling_table(result: ServeCheckResult) -> Table:
    from servetune.report.serving import num_text

    table = Table(title=f"serve-check: trial {result.trial_id} through Ray Serve", title_justify="left")
    for col in ("replicas", "level", "goodput", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "bare tok/s", "bare TTFT p50", "router TTFT p50", "scaling eff.", "SLO"):  # fmt: skip
        table.add_column(col, justify="right")
    for row in result.rows:
        level = ", ".join(f"{k} {v:g}" for k, v in row.level.items())
        table.add_row(
            str(row.replicas), level, num_text(row.goodput, 2), num_text(row.request_throughput, 2), num_text(row.output_throughput),
            num_text(row.ttft_ms_p50), num_text(row.ttft_ms_p99), num_text(row.tpot_ms_p50), num_text(row.tpot_ms_p99),
            num_text(row.bare_output_throughput), num_text(row.bare_ttft_ms_p50), num_text(row.ttft_p50_overhead_ms, signed=True),
            "-" if row.scaling_efficiency is None else f"{row.scaling_efficiency:.0%}",
            "[green]met[/]" if row.meets_slo else "[red]broken[/]",
        )  # fmt: skip
    served = [f"{run.replicas}: " + ", ".join(f"{n}" for n in sorted(run.requests_per_replica.values(), reverse=True))
              for run in result.runs if run.requests_per_replica]  # fmt: skip
    table.caption = ("latencies in ms; bare: the study's own engine at the same level; router TTFT p50: through "
                     "Serve minus bare; scaling eff.: tok/s at N / (N x tok/s at 1)")  # fmt: skip
    if served:
        table.caption += "\nrequests per replica (replicas: counts): " + "; ".join(served)
    kept = [str(run.replicas) for run in result.runs if run.engines_reused]
    if kept:
        table.caption += (f"\n{', '.join(kept)} replicas: on the engines the step before left running (Serve kept them, "
                          "prefix caches reset), and any replicas it added")  # fmt: skip
    restarted = [str(run.replicas) for run in result.runs if run.engines_reused is False]
    if restarted:
        table.caption += f"\n[red]{', '.join(restarted)} replicas: Serve restarted the engines (as a fresh deploy)[/]"
    return table


def ramp_table(ramp: RampResult) -> Table:
    from servetune.report.serving import num_text

    table = Table(
        title=f"serve-check --ramp: the derived autoscaling ({ramp.policy} policy) under 1x, 3x and 1x the knee",
        title_justify="left",
    )
    for col in ("t (s)", "phase", "clients", "replicas", "done", "SLO broken", "TTFT p95", "requests per replica"):
        table.add_column(col, justify="right")
    for w in ramp.windows:
        served = ", ".join(f"{rid}: {n}" for rid, n in sorted(w.served.items()))
        table.add_row(f"{w.start_s:.0f}", w.phase, str(w.offered), str(w.running), str(w.completed),
                      str(w.slo_violations), num_text(w.ttft_ms_p95, 0), served or "-")  # fmt: skip
    up = "never" if ramp.time_to_scale_up_s is None else f"{ramp.time_to_scale_up_s:.1f} s"
    if ramp.time_to_decide_s is not None:
        up += f" (Serve started the replica after {ramp.time_to_decide_s:.1f} s)"
    table.caption = (
        f"autoscaled deployment RUNNING after {num_text(ramp.ready_s, 0)} s"
        + (" on the engine already running (prefix cache reset)" if ramp.engines_reused
           else " [red]on an engine Serve restarted (as a fresh deploy)[/]" if ramp.engines_reused is False
           else " (deployed fresh: a new engine)" if ramp.ready_s is not None else "")
        + f"; replicas {ramp.replicas_before} -> "
        f"{ramp.replicas_peak}; time to scale up {up}; "
        f"SLO broken by {ramp.slo_violations} of {ramp.requests} requests; "
        + ("[red]a new replica served before it was RUNNING[/]" if ramp.traffic_before_ready
           else "no new replica served before it was RUNNING")
        + "\n" + "; ".join(f"{p.name}: {p.slo_violations}/{p.requests} broken" for p in ramp.phases)
    )  # fmt: skip
    return table


def policies_table(ramps: Sequence[RampResult], verdict: RampComparison | None = None) -> Table:
    """The autoscaling policies side by side on the same ramp, in the order they ran (their round, whose order
    rotates): SLO attainment and the replica-seconds each used, over its length (the 3x phase lasts until the extra
    replicas are RUNNING, so a ramp that scaled up later is longer), and when Serve decided to scale up (the policy's
    part) apart from when the new replica was RUNNING; the verdict over the rounds below."""
    from servetune.report.serving import num_text
    from servetune.serve.ramp_rounds import mean_replicas

    table = Table(title="serve-check --ramp-policy: the policies on the same 1x, 3x, 1x ramp", title_justify="left")
    for col in ("round", "policy", "ramp (s)", "requests", "SLO met", "replica-seconds", "mean replicas",
                "replicas peak", "decided (s)", "RUNNING (s)"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in ramps:
        length = r.phases[-1].end_s if r.phases else None
        mean = mean_replicas(r)
        table.add_row("-" if r.round is None else str(r.round), r.policy, num_text(length, 0), str(r.requests),
                      "-" if r.slo_attainment is None else f"{r.slo_attainment:.1%}", num_text(r.replica_seconds, 0),
                      num_text(mean, 2), str(r.replicas_peak), num_text(r.time_to_decide_s, 1),
                      num_text(r.time_to_scale_up_s, 1))  # fmt: skip
    table.caption = (
        "SLO met: requests that met every per-request bound; replica-seconds: replicas RUNNING or starting, over the "
        "ramp; decided: 3x offered -> Serve started an extra replica (the policy's part; negative: during the 1x "
        "phase); RUNNING: -> the extra "
        "replica RUNNING, its engine start added. The 3x phase lasts until then, so a later scale-up makes a longer "
        "ramp with more requests and replica-seconds: compare SLO met and the mean replicas"
    )
    if verdict is not None:
        orders = ", ".join(" then ".join(order) for order in verdict.orders)
        fresh = " each on a fresh deployment;" if all(r.engines_reused is None for r in ramps) else ""
        table.caption += (f"\nrounds: {orders};{fresh} a winner only beyond the spread between rounds of one policy"
                          f"\nverdict: {verdict.reason}")  # fmt: skip
    return table


def routing_table(routing: RoutingResult) -> Table:
    from servetune.report.serving import ROUTER_NOTE, engine_note, num_text, pct_text

    table = Table(title=f"serve-check --routers: {routing.replicas} replicas, workload {routing.workload}, "
                        + ", ".join(f"{k} {v:g}" for k, v in routing.level.items()), title_justify="left")  # fmt: skip
    for col in ("router", "replica", "requests", "tokens served", "prefix queries", "prefix hits", "hit rate",
                "imbalance", "goodput", "TTFT p50", "TTFT p99"):  # fmt: skip
        table.add_column(col, justify="right")
    for run in routing.runs:
        s = run.level.summary
        table.add_row(f"[bold]{run.router}[/]", "all", str(sum(t.requests for t in run.per_replica.values())),
                      f"{sum(t.tokens_served for t in run.per_replica.values()):,}",
                      f"{sum(t.prefix_cache_queries for t in run.per_replica.values()):,}",
                      f"{sum(t.prefix_cache_hits for t in run.per_replica.values()):,}", pct_text(run.prefix_cache_hit_rate),
                      num_text(run.imbalance, 2), num_text(s.goodput, 2), num_text(s.ttft_ms.p50), num_text(s.ttft_ms.p99))  # fmt: skip
        for rid, t in sorted(run.per_replica.items(), key=lambda kv: -kv[1].tokens_served):
            table.add_row("", rid, str(t.requests), f"{t.tokens_served:,}", f"{t.prefix_cache_queries:,}",
                          f"{t.prefix_cache_hits:,}", pct_text(t.prefix_cache_hit_rate), "", "", "", "")  # fmt: skip
    v = routing.verdict
    table.caption = ROUTER_NOTE
    for run in routing.runs:
        note = engine_note(run.router, run.engines_reused, run.ready_s)
        if note:
            table.caption += "\n" + (f"[red]{note}[/]" if run.engines_reused is False else note)
    if v is not None:
        table.caption += f"\nverdict: {'ship ' + v.ship if v.ship else 'no router named'}: {v.reason}"
    return table


def layouts_table(laid: LayoutResult) -> Table:
    from servetune.report.serving import LAYOUT_HEADINGS, layout_notes, layout_row

    unit = "GPUs" if laid.device == "GPU" else "CPU cores"
    table = Table(title=f"serve-check --layouts: {laid.budget} {unit} each, "
                        + ", ".join(f"{k} {v:g}" for k, v in laid.level.items()), title_justify="left")  # fmt: skip
    for col in LAYOUT_HEADINGS:
        table.add_column(col, justify="right")
    for run in laid.runs:
        row = list(layout_row(run.model_dump(mode="json")))
        row[-1] = "[green]met[/]" if row[-1] == "met" else "[red]broken[/]" if row[-1] == "broken" else row[-1]
        table.add_row(*row)
    table.caption = "\n".join(layout_notes(laid.model_dump(mode="json")))
    return table
