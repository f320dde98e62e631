"""The report's "Ray Serve" section as plain data: what ``servetune serve-check`` measured
(``STUDY_DIR/serve-check.json``): a row per replica count and level (scaling), with
``--routers`` a row per router (requests, tokens served, prefix-cache hit rate, load imbalance,
goodput, TTFT) with the verdict, and with ``--layouts``/``--budget`` a row per layout (devices,
replicas, TP, throughput, latency, cost) with the verdict.

The file is read as JSON, not through ``serve/`` (which builds on ``report/``): every key is
optional, and a missing one shows as "-". :func:`read_serve_check_file` is the only I/O here,
called by ``report/study.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servetune.config.space import stream_batching_ok
from servetune.report.verification import JsonFile, read_json_file

#: The file serve-check writes in the study directory (unless --json says where).
SERVE_CHECK_FILE = "serve-check.json"


ServeCheckFile = JsonFile


@dataclass(frozen=True)
class ServeSection:
    path: Path
    problem: str = ""  # the file could not be read: why
    trial_id: str = ""
    scaling: tuple[tuple[str, ...], ...] = ()  # SCALING_HEADINGS
    routing_title: str = ""  # "2 replicas, workload rag, concurrency 8"
    routers: tuple[tuple[str, ...], ...] = ()  # ROUTER_HEADINGS
    verdict: str = ""
    engines: tuple[str, ...] = ()  # per router after the first: on the same engines, or Serve restarted them
    router: RouterChoice | None = None  # what `export --format ray-serve` ships, when routers were compared
    layouts_title: str = ""  # "2 CPU cores each, concurrency 16"
    layouts: tuple[tuple[str, ...], ...] = ()  # LAYOUT_HEADINGS
    layout_notes: tuple[str, ...] = ()  # the offered load, layouts left out, the verdict
    layout: LayoutChoice | None = None  # what `export --format ray-serve` ships, when layouts were compared
    stream_batching: StreamBatchingChoice | None = None  # the interval serve-check deployed, when it set one
    stopped: str = ""  # serve-check ended before every part ran (why); the rest is what finished


@dataclass(frozen=True)
class RouterChoice:
    """The router serve-check measured for ``trial_id``: ``name`` (None: no router beat the
    others beyond the margins), its ``request_router_class`` (None: Serve's default) and why."""

    trial_id: str
    name: str | None
    router_class: str | None
    reason: str


@dataclass(frozen=True)
class LayoutChoice:
    """The layout serve-check named for ``trial_id``: ``replicas`` x ``tp`` at the offered ``level``
    (``{"concurrency": 16}``), and why."""

    trial_id: str
    replicas: int
    tp: int
    level: dict[str, float]
    reason: str


@dataclass(frozen=True)
class StreamBatchingChoice:
    """The stream batching interval (ms) of Ray Serve LLM's replicas that serve-check measured ``trial_id`` at."""

    trial_id: str
    interval_ms: float


SCALING_HEADINGS = (
    "replicas",
    "level",
    "goodput",
    "out tok/s",
    "TTFT p50",
    "TTFT p99",
    "router TTFT p50",
    "scaling eff.",
    "SLO",
)
ROUTER_HEADINGS = ("router", "requests", "tokens served", "hit rate", "replicas' hit rates", "imbalance", "goodput",
                   "TTFT p50", "TTFT p99")  # fmt: skip
LAYOUT_HEADINGS = ("layout", "devices", "replicas", "TP", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50",
                   "TPOT p99", "$/hour", "$/1M out tok", "requests per replica", "SLO")  # fmt: skip
#: What the routers table's numbers mean, under it in the Markdown summary and the HTML page.
ROUTER_NOTE = "hit rate: prefix-cache hits over queries, in tokens; imbalance: max over mean of tokens served across the replicas; latencies in ms"


def read_serve_check_file(root: Path) -> ServeCheckFile | None:
    """``serve-check.json`` in the study directory; None when serve-check has not written one."""
    path = root / SERVE_CHECK_FILE
    return read_json_file(path) if path.is_file() else None


def num_text(value: Any, digits: int = 1, signed: bool = False) -> str:
    """A number as the Ray Serve tables show it (thousands separated); "-" for anything else."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return "-"
    return f"{value:+,.{digits}f}" if signed else f"{value:,.{digits}f}"


def pct_text(value: Any) -> str:
    """A share as a whole percentage; "-" for anything that is not a number."""
    return f"{value:.0%}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _level(level: Any) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in level.items()) if isinstance(level, dict) else "-"


def serve_section(file: ServeCheckFile | None) -> ServeSection | None:
    """What the section shows, from serve-check.json as read (None: serve-check has not run)."""
    if file is None:
        return None
    if file.content is None:
        return ServeSection(file.path, problem=file.problem)
    data = file.content
    scaling = []
    for row in data.get("rows") or []:
        eff = row.get("scaling_efficiency")
        scaling.append((str(row.get("replicas", "-")), _level(row.get("level")), num_text(row.get("goodput"), 2),
                        num_text(row.get("output_throughput")), num_text(row.get("ttft_ms_p50")), num_text(row.get("ttft_ms_p99")),
                        num_text(row.get("ttft_p50_overhead_ms"), signed=True), pct_text(eff),
                        {True: "met", False: "broken"}.get(row.get("meets_slo"), "-")))  # fmt: skip
    routing = data.get("routing") or {}
    routers = [_router_row(run) for run in routing.get("runs") or []]
    title = ""
    if routing:
        title = f"{routing.get('replicas', '-')} replicas, workload {routing.get('workload', '-')}, {_level(routing.get('level'))}"
    verdict = routing.get("verdict") or {}
    said = ""
    if verdict:
        said = (
            f"ship {verdict['ship']}" if verdict.get("ship") else "no router named"
        ) + f": {verdict.get('reason', '')}"
    trial_id = str(data.get("trial_id", ""))
    layouts = data.get("layouts")
    laid = layouts if isinstance(layouts, Mapping) else {}
    laid_title = ""
    if laid:
        unit = "GPUs" if laid.get("device") == "GPU" else "CPU cores"
        laid_title = f"{laid.get('budget', '-')} {unit} each, {_level(laid.get('level'))}"
    return ServeSection(file.path, trial_id=trial_id, scaling=tuple(scaling), routing_title=title,
                        routers=tuple(routers), verdict=said, engines=_engine_notes(routing.get("runs") or []),
                        router=_router_choice(trial_id, routing), layouts_title=laid_title,
                        layouts=tuple(layout_row(run) for run in laid.get("runs") or [] if isinstance(run, Mapping)),
                        layout_notes=layout_notes(laid) if laid else (), layout=_layout_choice(trial_id, laid),
                        stream_batching=_stream_batching(trial_id, data.get("llm_config")),
                        stopped=str(data.get("stopped") or ""))  # fmt: skip


def _stream_batching(trial_id: str, config: Any) -> StreamBatchingChoice | None:
    """The ``stream_batching_interval_ms`` of the LLM config serve-check deployed (None: not set, Ray's default)."""
    experimental = config.get("experimental_configs") if isinstance(config, Mapping) else None
    value = experimental.get("stream_batching_interval_ms") if isinstance(experimental, Mapping) else None
    if not trial_id or not stream_batching_ok(value):
        return None
    return StreamBatchingChoice(trial_id, float(value))


def layout_row(run: Mapping[str, Any]) -> tuple[str, ...]:
    """One layout as the tables show it (LAYOUT_HEADINGS)."""
    level = run.get("level") or {}
    summary = level.get("summary") or {}
    ttft, tpot = summary.get("ttft_ms") or {}, summary.get("tpot_ms") or {}
    served = sorted((run.get("requests_per_replica") or {}).values(), reverse=True)
    met = (not level.get("slo_violations") and not summary.get("failed")) if level else None
    return (str(run.get("layout", "-")), str(run.get("devices", "-")), str(run.get("replicas", "-")),
            str(run.get("tensor_parallel_size", "-")), num_text(summary.get("output_throughput")),
            num_text(summary.get("goodput"), 2), num_text(ttft.get("p50")), num_text(ttft.get("p99")),
            num_text(tpot.get("p50")), num_text(tpot.get("p99")), num_text(run.get("cost_per_hour_usd"), 2),
            num_text(run.get("cost_per_mtok_usd"), 2), ", ".join(str(n) for n in served) or "-",
            ("failed" if run.get("error") else "-") if met is None else "met" if met else "broken")  # fmt: skip


def layout_notes(laid: Mapping[str, Any]) -> tuple[str, ...]:
    """Under the layouts table: the load they were offered, the ones left out, how each came to its
    engines, and the verdict."""
    notes = [f"every layout offered {_level(laid.get('level'))} (the picked level scaled to the budget); latencies in ms; "
             f"$: devices x ${num_text(laid.get('price_per_device_hour'), 2)} per device-hour"]  # fmt: skip
    notes += [f"left out: {why}" for why in laid.get("skipped") or []]
    notes += [f"{run.get('layout')}: deployment failed: {str(run.get('error')).splitlines()[0]}"
              for run in laid.get("runs") or [] if isinstance(run, Mapping) and run.get("error")]  # fmt: skip
    notes += [f"{run.get('layout')}: measured on the engines already running, prefix caches reset"
              for run in laid.get("runs") or [] if isinstance(run, Mapping) and run.get("engines_reused")]  # fmt: skip
    verdict = laid.get("verdict")
    if isinstance(verdict, Mapping):
        ship = verdict.get("ship")
        notes.append(f"verdict: {'ship ' + str(ship) if ship else 'no layout named'}: {verdict.get('reason', '')}")
    return tuple(notes)


def _layout_choice(trial_id: str, laid: Mapping[str, Any]) -> LayoutChoice | None:
    verdict = laid.get("verdict") if laid else None
    if not isinstance(verdict, Mapping) or not verdict.get("ship") or not trial_id:
        return None
    run = next(
        (r for r in laid.get("runs") or [] if isinstance(r, Mapping) and r.get("layout") == verdict["ship"]), None
    )
    if run is None:
        return None  # a verdict naming a layout that did not run: not something to ship
    try:
        replicas, tp = int(run["replicas"]), int(run["tensor_parallel_size"])
    except (KeyError, TypeError, ValueError):
        return None
    laid_level = laid.get("level")
    level = laid_level if isinstance(laid_level, dict) else {}
    return LayoutChoice(trial_id, replicas, tp, dict(level), str(verdict.get("reason") or ""))


def engine_note(router: Any, reused: Any, ready_s: Any) -> str | None:
    """How a router came to its engines (``engines_reused``: True, deployed on the ones already running;
    False, Serve restarted them); None for one deployed fresh (``reused`` None)."""
    if not isinstance(reused, bool):
        return None
    how = (
        "on the engines already running (Serve kept them, and started any more the count needs)"
        if reused
        else "on engines Serve restarted (as a fresh deploy)"
    )
    return f"{router}: {how} in {num_text(ready_s)} s, prefix caches reset"


def _engine_notes(runs: Sequence[Any]) -> tuple[str, ...]:
    notes = (engine_note(run.get("router", "-"), run.get("engines_reused"), run.get("ready_s"))
             for run in runs if isinstance(run, Mapping))  # fmt: skip
    return tuple(note for note in notes if note)


def _router_choice(trial_id: str, routing: Mapping[str, Any]) -> RouterChoice | None:
    verdict = routing.get("verdict")
    if not isinstance(verdict, Mapping) or not trial_id:
        return None
    ship, reason = verdict.get("ship"), str(verdict.get("reason") or "")
    if not ship:
        return RouterChoice(trial_id, None, None, reason)
    classes = {
        run.get("router"): run.get("router_class") for run in routing.get("runs") or [] if isinstance(run, Mapping)
    }
    if ship not in classes:
        return None  # a verdict naming a router that did not run: not something to ship
    return RouterChoice(trial_id, str(ship), classes[ship] or None, reason)


def _router_row(run: Mapping[str, Any]) -> tuple[str, ...]:
    replicas: Sequence[Mapping[str, Any]] = list((run.get("per_replica") or {}).values())
    summary = (run.get("level") or {}).get("summary") or {}
    ttft = summary.get("ttft_ms") or {}
    each = sorted(replicas, key=lambda t: -(t.get("tokens_served") or 0))
    return (str(run.get("router", "-")), str(sum(t.get("requests", 0) for t in replicas)),
            f"{sum(t.get('tokens_served', 0) for t in replicas):,}", pct_text(run.get("prefix_cache_hit_rate")),
            " / ".join(pct_text(t.get("prefix_cache_hit_rate")) for t in each) or "-", num_text(run.get("imbalance"), 2),
            num_text(summary.get("goodput"), 2), num_text(ttft.get("p50")), num_text(ttft.get("p99")))  # fmt: skip
