"""Words and number formats shared by the renderers (Markdown, HTML, PNG)."""

from __future__ import annotations

from servetune.metrics import COST_METRIC
from servetune.report.points import OUTPUT_THROUGHPUT_PER_DEVICE, OUTPUT_THROUGHPUT_PER_USER, ReportPoint

FRONT_COLOR = "#e4572e"
OTHER_COLOR = "#4c78a8"
APART_COLOR = "#9e9e9e"
RECOMMENDED_COLOR = "#2ca02c"
SLO_COLOR = "crimson"

_NAMES = {
    COST_METRIC: ("USD per million output tokens", "$/Mtok"),
    "output_throughput": ("output tokens/s", "out tok/s"),
    OUTPUT_THROUGHPUT_PER_DEVICE: ("output tokens/s per device", "tok/s/device"),
    OUTPUT_THROUGHPUT_PER_USER: ("output tokens/s per user (1000 / mean TPOT)", "tok/s/user"),
    "request_throughput": ("requests/s", "req/s"),
    "goodput": ("goodput (requests/s within every SLO)", "goodput"),
    "error_rate": ("error rate", "errors"),
}
_LATENCY = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E latency"}

#: Columns of the Pareto tables and lines of the hover text, in order.
TABLE_METRICS = (
    COST_METRIC,
    "ttft_ms_p99",
    "tpot_ms_p99",
    "e2el_ms_p99",
    "output_throughput",
    OUTPUT_THROUGHPUT_PER_DEVICE,
    OUTPUT_THROUGHPUT_PER_USER,
)


def _latency(metric: str) -> tuple[str, str] | None:
    for prefix, word in _LATENCY.items():
        if metric.startswith(prefix + "_"):
            stat = metric.removeprefix(prefix + "_")
            stat = stat.upper() if stat.startswith("p") else stat
            return f"{stat} {word} (ms)", f"{word.split()[0]} {stat}"
    return None


def metric_label(metric: str) -> str:
    """An axis title: ``P99 TTFT (ms)``, ``USD per million output tokens``."""
    found = _NAMES.get(metric) or _latency(metric)
    return found[0] if found else metric


def metric_short(metric: str) -> str:
    """A table heading: ``TTFT P99``, ``$/Mtok``."""
    found = _NAMES.get(metric) or _latency(metric)
    return found[1] if found else metric


def fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == COST_METRIC:
        return f"{value:.4g}"
    if metric == "error_rate":
        return f"{value:.2%}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"


def point_metrics(point: ReportPoint) -> list[tuple[str, str]]:
    """(short heading, formatted value) for the table metrics the point has."""
    return [(metric_short(m), fmt(m, point.value(m))) for m in TABLE_METRICS if point.value(m) is not None]
