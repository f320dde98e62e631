"""Words and number formats shared by the renderers (Markdown, HTML, PNG)."""

from __future__ import annotations

from collections.abc import Sequence

from servetune.metrics import (
    COST_METRIC,
    E2EL_P99,
    ENERGY_PER_REQUEST,
    ENERGY_PER_TOKEN,
    ERROR_RATE,
    GOODPUT,
    IMAGE_METRICS,
    IMAGE_PIXELS,
    IMAGES_SENT,
    OUTPUT_THROUGHPUT,
    REQUEST_THROUGHPUT,
    TPOT_P99,
    TTFT_P99,
)
from servetune.report.points import OUTPUT_THROUGHPUT_PER_DEVICE, OUTPUT_THROUGHPUT_PER_USER, ReportPoint
from servetune.report.trials import TRIAL_METRICS, KvPlanCheck, SloBreak, TrialRow, worst_kv_plan
from servetune.results import Capacity, Knee

FRONT_COLOR = "#e4572e"
OTHER_COLOR = "#4c78a8"
APART_COLOR = "#9e9e9e"
RECOMMENDED_COLOR = "#2ca02c"
SLO_COLOR = "crimson"

_NAMES = {
    COST_METRIC: ("USD per million output tokens", "$/Mtok"),
    OUTPUT_THROUGHPUT: ("output tokens/s", "out tok/s"),
    OUTPUT_THROUGHPUT_PER_DEVICE: ("output tokens/s per device", "tok/s/device"),
    OUTPUT_THROUGHPUT_PER_USER: ("output tokens/s per user (1000 / mean TPOT)", "tok/s/user"),
    REQUEST_THROUGHPUT: ("requests/s", "req/s"),
    GOODPUT: ("goodput (requests/s within every SLO)", "goodput"),
    ERROR_RATE: ("error rate", "errors"),
    ENERGY_PER_TOKEN: ("joules per output token (the devices' energy)", "J/tok"),
    ENERGY_PER_REQUEST: ("joules per request (the devices' energy)", "J/req"),
    IMAGES_SENT: ("images the level's measured requests carried", "images"),
    IMAGE_PIXELS: ("image pixels (millions)", "image Mpx"),
}
#: What a cost is priced at (LevelSummary.steady_output_throughput), and goodput counted over (goodput_window),
#: said beside the prices.
COST_RATE = ("$/Mtok is priced at a level's output tok/s with every client busy (closed loops: its final drain left "
             "out), else over the whole level, and goodput is counted over the same window")  # fmt: skip
_LATENCY = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2el_ms": "E2E latency"}
#: The unit a table heading adds to the short name (short names like ``out tok/s`` carry theirs).
_UNITS = {COST_METRIC: "USD", GOODPUT: "req/s", ERROR_RATE: "%"}

#: Columns of the Pareto tables and lines of the hover text, in order.
TABLE_METRICS = (
    COST_METRIC,
    TTFT_P99,
    TPOT_P99,
    E2EL_P99,
    OUTPUT_THROUGHPUT,
    OUTPUT_THROUGHPUT_PER_DEVICE,
    OUTPUT_THROUGHPUT_PER_USER,
    GOODPUT,
    ENERGY_PER_TOKEN,
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


def metric_unit(metric: str) -> str:
    """``ms`` for a latency, ``USD`` for $/Mtok, ``req/s`` for goodput; '' when the short name says it."""
    return "ms" if _latency(metric) else _UNITS.get(metric, "")


def metric_heading(metric: str) -> str:
    """A table heading with its unit: ``TTFT P99 (ms)``, ``$/Mtok (USD)``, ``goodput (req/s)``."""
    unit = metric_unit(metric)
    return f"{metric_short(metric)} ({unit})" if unit else metric_short(metric)


def axis_title(metric: str, direction: str) -> str:
    """An axis title that says which way is better: ``USD per million output tokens — lower is better``."""
    return f"{metric_label(metric)} — {'higher' if direction == 'max' else 'lower'} is better"


def fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric == COST_METRIC:
        return f"{value:.4g}"
    if metric == ERROR_RATE:
        return f"{value:.2%}"
    return f"{value:,.1f}" if abs(value) >= 10 else f"{value:.3g}"


#: Plots label SLO-broken points with their bounds only up to this many points (beyond, hover says it).
MAX_POINT_LABELS = 30


def broken_label(point: ReportPoint) -> str:
    """The bounds a point broke, by family: ``TTFT P95/P99, TPOT P95`` ('' when it broke none)."""
    stats: dict[str, list[str]] = {}
    for metric in point.broken_metrics:
        word, _, stat = metric_short(metric).partition(" ")
        stats.setdefault(word, [])
        if stat:
            stats[word].append(stat)
    return ", ".join(f"{word} {'/'.join(found)}".strip() for word, found in stats.items())


def fmt_with_unit(metric: str, value: float | None) -> str:
    """``600.0 ms``, ``11.7 req/s``; a value whose short name holds the unit (``$/Mtok``, ``out tok/s``) stays bare."""
    text = fmt(metric, value)
    unit = metric_unit(metric)
    return f"{text} {unit}" if value is not None and unit in ("ms", "req/s") else text


def point_metrics(point: ReportPoint) -> list[tuple[str, str]]:
    """(short name, value with its unit) for the headline metrics the point has: ``("TTFT P99", "600.0 ms")``."""
    return [(metric_short(m), fmt_with_unit(m, point.value(m))) for m in TABLE_METRICS if point.value(m) is not None]


#: Headings of a Pareto table, units included.
PARETO_HEADINGS = ("#", "trial", "config", "level", *(metric_heading(m) for m in TABLE_METRICS))


def pareto_headings(images: bool = False) -> tuple[str, ...]:
    """:data:`PARETO_HEADINGS`, and the images and their pixels where the study sent images (:func:`image_cells`)."""
    return PARETO_HEADINGS + tuple(metric_short(m) for m in IMAGE_METRICS) if images else PARETO_HEADINGS


def image_cells(point: ReportPoint) -> list[str]:
    """The images the point's level sent and their millions of pixels: ``1,024``, ``805.3`` (``-``: none)."""
    sent, pixels = point.value(IMAGES_SENT), point.value(IMAGE_PIXELS)
    return ["-" if sent is None else f"{sent:,.0f}", "-" if pixels is None else f"{pixels / 1e6:,.1f}"]


#: Headings of the table of all trials, units included.
TRIAL_HEADINGS = (
    "trial", "config (varied parameters)", "outcome", "best level", "capacity at the SLO", "knee",
    *(metric_heading(m) for m in TRIAL_METRICS),
    "SLO broken (first level)", "stopped because", "conclusion", "KV tokens planned / vLLM",
)  # fmt: skip


def kv_plan_text(check: KvPlanCheck | None) -> str:
    """``447,408 / 440,672 (+1.5%)``: the planner's KV tokens, vLLM's, and the planner's error ('-' without both)."""
    if check is None:
        return "-"
    return f"{check.planned_tokens:,} / {check.measured_tokens:,} ({check.relative_error:+.1%})"


def kv_plan_summary(rows: Sequence[TrialRow]) -> str | None:
    """The study's worst planner error in one line (None where no trial has both numbers)."""
    worst = worst_kv_plan(rows)
    if worst is None or worst.kv_plan is None:
        return None
    checked = sum(row.kv_plan is not None for row in rows)
    profile = f", profile {worst.kv_plan.profile}" if worst.kv_plan.profile else ""
    return (
        f"capacity planner: KV tokens planned against vLLM's on {checked} trial{'s' if checked > 1 else ''}; "
        f"worst {worst.kv_plan.relative_error:+.1%} (trial {worst.trial_id}{profile})"
    )


TRIALS_NOTE = (
    "Numbers are at each trial's best level: the level at its capacity at the SLO where the capacity search "
    "found a bracket, else its highest goodput meeting the SLO, or the highest load it measured when none did. "
    "The conclusion: keep a trial on the cost vs P99 TTFT front, eliminate one that never met the SLO, "
    "else next round."
)


def slo_break_text(found: SloBreak | None) -> str:
    """``concurrency 2: ttft_ms_p95 = 222.2 > 150; ttft_ms_p99 = 315.2 > 300`` ('-' when it never broke)."""
    if found is None:
        return "-"
    later = ""
    if found.later_levels:
        later = f" (and {found.later_levels} later level{'s' if found.later_levels > 1 else ''})"
    return f"{found.level}: {'; '.join(found.violations)}{later}"


def knee_text(knee: Knee | None) -> str:
    """Where throughput stopped growing with load (results.py ``find_knee``), in a few words ('-': no level):
    ``8 clients at 800 tok/s (to 16: grew < 50% as fast as the load)``, or ``>= 32 clients (still growing)`` as a lower bound."""
    if knee is None:
        return "-"
    unit = "clients" if knee.unit == "concurrency" else knee.unit
    above = knee.bracket[1]
    if knee.bound == "lower" or above is None:
        return f">= {knee.value:g} {unit} (still growing)"
    return f"{knee.value:g} {unit} at {knee.throughput:.4g} tok/s (to {above:g}: grew < {knee.fraction:.0%} as fast as the load)"


def capacity_text(capacity: Capacity | None) -> str:
    """The capacity search's answer in a few words ('-' where none ran):

    - ``concurrency 11 (meets; 12 breaks ttft_ms_p95 <= 500)``: both ends of the bracket measured;
    - ``concurrency >= 64 (none broke the SLO)``: a lower bound (the climb stopped first);
    - ``concurrency < 2 (none met the SLO)``: an upper bound;
    - ``, unsettled at 12`` is added for loads whose verdict stayed within the noise (counted as breaking).
    """
    if capacity is None:
        return "-"
    unit = "clients" if capacity.unit == "concurrency" else capacity.unit
    met, broke = capacity.bracket
    if capacity.bound == "exact" and met is not None and broke is not None:
        why = f": {capacity.breaking_slo}" if capacity.breaking_slo else ""
        text = f"{met:g} {unit} ({broke:g} broke the SLO{why})"
    elif capacity.bound == "lower" and met is not None:
        text = f">= {met:g} {unit} (none broke the SLO)"
    elif broke is not None:
        text = f"< {broke:g} {unit} (none met the SLO)"
    else:
        return "-"
    if capacity.unsettled:
        text += ", unsettled at " + ", ".join(f"{v:g}" for v in capacity.unsettled)
    return text


def trial_cells(row: TrialRow) -> list[str]:
    """One row of the trials table, as text in :data:`TRIAL_HEADINGS` order."""
    if row.best_level is not None:
        best = row.best_level
    elif row.numbers_level is not None:
        best = f"none met the SLO (numbers at {row.numbers_level})"
    else:
        best = "-"
    if row.client_bound:
        best += f" (client fell behind at {len(row.client_bound)} level{'s' * (len(row.client_bound) > 1)}: no verdict)"
    return [
        row.trial_id + (" (recommended)" if row.recommended else ""),
        row.config,
        row.outcome,
        best,
        capacity_text(row.capacity),
        knee_text(row.knee),
        *(fmt(m, row.values.get(m)) for m in TRIAL_METRICS),
        slo_break_text(row.slo_break),
        row.stopped,
        str(row.conclusion),
        kv_plan_text(row.kv_plan),
    ]
