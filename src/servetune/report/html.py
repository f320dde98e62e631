"""One self-contained interactive HTML page (plotly, with plotly.js inline so it works offline).

Each front is a scatter: the front's points highlighted and connected, the other points that
meet every SLO in blue, points apart (trial failed, SLO broken) as grey crosses, the
recommendation as a star, every SLO bound of the axes' metric families as red lines (dashed
for the axis's own statistic, dotted for another, e.g. a P95 bound on a P99 axis). A point
that broke the SLO is labelled with the bounds it broke. Hovering a point shows its trial,
load level, configuration, numbers and SLO verdict. A table of all trials, a row each,
follows, and the verification (``servetune verify``'s verdict, stability numbers, scenarios
and the acceptance checklist) ends the page; its verdict is also named under the recommendation.
The sections that draw their own data as tables (quality, verification, serve-check, which GPU) are in
:mod:`servetune.report.html_sections`.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import plotly.graph_objects as go

from servetune.metrics import DISTRIBUTION_PERCENTILES, STRUCTURED_VALID
from servetune.report.build import Front, StudyReport
from servetune.report.distribution import SPREAD_NOTE, spread_cells, spread_headings
from servetune.report.html_sections import (
    asks_html,
    conversations_html,
    head_html,
    quality_html,
    rows_html,
    serve_check_html,
    verification_html,
    verification_summary_html,
    which_gpu_html,
)
from servetune.report.labels import (
    APART_COLOR,
    COST_RATE,
    FRONT_COLOR,
    MAX_POINT_LABELS,
    OTHER_COLOR,
    RECOMMENDED_COLOR,
    SLO_COLOR,
    TRIAL_HEADINGS,
    TRIALS_NOTE,
    axis_title,
    broken_label,
    kv_plan_summary,
    pareto_headings,
    point_metrics,
    trial_cells,
)
from servetune.report.markdown import (
    CLIENT_BOUND_NOTE,
    DIAGNOSIS_NOTE,
    FAILED_REQUESTS_NOTE,
    SPECULATIVE_GAIN_NOTE,
    STRUCTURED_NOTE,
    client_bound_lines,
    failed_request_lines,
    limit_lines,
    pareto_rows,
    speculation_lines,
    structured_lines,
    warm_cache_lines,
)
from servetune.report.params import BASELINE
from servetune.report.points import ReportPoint, level_label
from servetune.report.recommend import describe
from servetune.report.trials import TrialRow, speculation_text


def hover_text(point: ReportPoint) -> str:
    """What hovering a point shows (plotly's HTML subset: <b>, <br>)."""
    e = html.escape
    lines = [f"<b>trial {e(point.trial_id)}</b> · {e(level_label(point.level))}"]
    lines += [f"{e(str(k))}={e(str(v))}" for k, v in point.params.items()] or [BASELINE]
    lines.append(f"devices: {point.devices}")
    lines += [f"{e(heading)}: {e(value)}" for heading, value in point_metrics(point)]
    kv = point.server_metrics.get("kv_cache_usage_max")
    if kv is not None:
        lines.append(f"KV cache peak: {kv:.0%}")
    drafted = speculation_text(point.server_metrics)
    if drafted is not None:
        lines.append(f"speculation: {e(drafted)}")
    parsed = point.value(STRUCTURED_VALID)
    if parsed is not None:
        lines.append(f"structured output parsed: {parsed:.1%}")
    if point.eligible:
        lines.append("SLO met")
    elif point.outcome == "COMPLETE" and point.slo_violations:
        lines.append(f"<b>SLO broken</b> ({e(broken_label(point))}):")
        lines += [e(text) for text in point.slo_violations]
    else:
        lines.append(e(point.why_apart))
    return "<br>".join(lines)


def capacity_label(point: ReportPoint) -> str:
    """The text beside a trial's capacity point: its trial and the load it carries at the SLO."""
    return f"{point.trial_id[:6]}: capacity {level_label(point.level)}"


def _scatter(
    front: Front,
    points: Sequence[ReportPoint],
    name: str,
    label: Callable[[ReportPoint], str] | None = None,
    **style: object,
) -> go.Scatter:
    """A trace of the points the front can place, left to right; ``label(point)`` writes text beside each."""
    x, y = front.spec.x.metric, front.spec.y.metric
    points = sorted(front.result.drawable(points), key=lambda p: p.value(x) or 0.0)
    if label is not None:
        style.update(
            text=[label(p) for p in points], textposition="top center", textfont={"size": 9, "color": "#616161"}
        )
    return go.Scatter(
        x=[p.value(x) for p in points],
        y=[p.value(y) for p in points],
        name=f"{name} ({len(points)})",
        hovertext=[hover_text(p) for p in points],
        hovertemplate="%{hovertext}<extra></extra>",
        **style,
    )


def front_figure(report: StudyReport, front: Front) -> go.Figure:
    result, spec = front.result, front.spec
    fig = go.Figure()
    labelled = len(result.drawable(result.apart)) <= MAX_POINT_LABELS  # each broken point says which bounds
    fig.add_trace(
        _scatter(front, result.apart, "apart: failed or SLO broken", label=broken_label if labelled else None,
                 mode="markers+text" if labelled else "markers",
                 marker={"symbol": "x", "size": 8, "color": APART_COLOR})
    )  # fmt: skip
    fig.add_trace(
        _scatter(front, result.dominated, "meets SLO, dominated",
                 mode="markers", marker={"size": 8, "color": OTHER_COLOR, "opacity": 0.7})
    )  # fmt: skip
    fig.add_trace(
        _scatter(front, result.front, "Pareto front",
                 mode="lines+markers", marker={"size": 11, "color": FRONT_COLOR},
                 line={"color": FRONT_COLOR, "width": 2})
    )  # fmt: skip
    at_capacity = [p for p in report.points if p.at_capacity]
    if at_capacity:  # each trial's capacity at the SLO, wherever it stands against the front
        fig.add_trace(
            _scatter(front, at_capacity, "capacity at the SLO", label=capacity_label, mode="markers+text",
                     marker={"symbol": "diamond-open", "size": 15, "color": FRONT_COLOR, "line": {"width": 2}})
        )  # fmt: skip
    recommended = report.recommendation.point
    if recommended is not None and result.drawable([recommended]):
        fig.add_trace(
            _scatter(front, [recommended], "recommended",
                     mode="markers", marker={"symbol": "star", "size": 18, "color": RECOMMENDED_COLOR,
                                             "line": {"width": 1, "color": "black"}})
        )  # fmt: skip
    for bound in report.bounds_on(spec.x.metric):
        fig.add_vline(x=bound.line.max, line_dash="dash" if bound.same_statistic else "dot", line_color=SLO_COLOR,
                      annotation_text=bound.label, annotation_textangle=-90,
                      annotation_position="top left")  # fmt: skip
    for bound in report.bounds_on(spec.y.metric):
        fig.add_hline(y=bound.line.max, line_dash="dash" if bound.same_statistic else "dot", line_color=SLO_COLOR,
                      annotation_text=bound.label)  # fmt: skip
    fig.update_layout(
        title=spec.title,
        xaxis_title=axis_title(spec.x.metric, spec.x.direction),
        yaxis_title=axis_title(spec.y.metric, spec.y.direction),
        template="plotly_white",
        height=540,
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        margin={"t": 90},
    )
    return fig


def _table_html(front: Front, images: bool = False) -> str:
    rows = pareto_rows(front, images)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table>{head_html(pareto_headings(images))}<tbody>{body}</tbody></table>"


def _trial_row(row: TrialRow) -> str:
    e = html.escape
    stopped = TRIAL_HEADINGS.index("stopped because")  # its cell shows the whole reason on hover
    tds = "".join(
        f"<td title='{e(row.stopped_detail)}'>{e(cell)}</td>" if i == stopped and row.stopped_detail
        else f"<td>{e(cell)}</td>"
        for i, cell in enumerate(trial_cells(row))
    )  # fmt: skip
    verdict = row.conclusion.verdict.replace(" ", "-")
    classes = f"recommended {verdict}" if row.recommended else verdict
    return f"<tr data-trial='{e(row.trial_id)}' class='{classes}'>{tds}</tr>"


def trials_table_html(rows: Sequence[TrialRow]) -> str:
    body = "".join(_trial_row(row) for row in rows)
    return f"<table id='trials'>{head_html(TRIAL_HEADINGS)}<tbody>{body}</tbody></table>"


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;padding:0 16px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:8px 0 24px}td,th{border:1px solid #ddd;padding:3px 8px}
th{background:#f4f4f4}.rec{background:#eef7ee;border-left:4px solid #5a9a5a;padding:8px 12px}
.muted{color:#666;font-size:13px}tr.recommended td{background:#eef7ee;font-weight:600}
tr.eliminate td{color:#777}tr.failed td{color:#a33}.rec ul{margin:4px 0;padding:0}.rec li{display:inline-block;margin-right:18px}
tr.pass td,tr.passed td{background:#eef7ee}tr.fail td,tr.failed td{background:#fdecea}tr.not-checked td{color:#666}
.verdict.accepted{color:#2e6b2e}.verdict.rejected{color:#b3261e}.warn{color:#b3261e}
"""


def spread_figure(report: StudyReport) -> go.Figure:
    """The recommended trial's TTFT per level as empirical CDFs, with the SLO's TTFT bounds."""
    fig = go.Figure()
    for spread in report.ttft_spreads:
        together = "" if spread.sent_together is None else f" · {spread.sent_together:.0%} sent together"
        fig.add_trace(go.Scatter(
            x=list(spread.ttft_ms), y=list(DISTRIBUTION_PERCENTILES), mode="lines+markers", name=spread.level + together,
            hovertemplate="P%{y}: %{x:.0f} ms<extra>" + html.escape(spread.level) + "</extra>",
        ))  # fmt: skip
    for line in report.slo:
        if line.family == "ttft_ms":
            fig.add_vline(x=line.max, line_dash="dash", line_color=SLO_COLOR, annotation_text=str(line),
                          annotation_textangle=-90, annotation_position="top left")  # fmt: skip
    fig.update_layout(
        title="TTFT distribution of the recommended trial, per level",
        xaxis={"title": "TTFT (ms, log scale)", "type": "log"},
        yaxis={"title": "percentile of requests", "range": [0, 100]}, template="plotly_white", height=440,
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0}, margin={"t": 90},
    )  # fmt: skip
    return fig


def spread_html(report: StudyReport) -> str:
    fig = spread_figure(report)
    plot = fig.to_html(full_html=False, include_plotlyjs=not report.fronts, div_id="ttft-distribution-plot",
                       config={"displaylogo": False, "responsive": True})  # fmt: skip
    rows = [spread_cells(s) for s in report.ttft_spreads]
    return (
        "<h2 id='ttft-distribution'>TTFT distribution</h2>"
        + plot
        + rows_html(spread_headings(), rows)
        + f"<p class='muted'>{html.escape(SPREAD_NOTE)}</p>"
    )


def render_html(report: StudyReport) -> str:
    """The whole page as a string; the first figure carries plotly.js inline."""
    e = html.escape
    info, rec = report.info, report.recommendation
    counts = ", ".join(f"{n} {name}" for name, n in report.outcome_counts().items())
    if rec.point is not None:
        headline = "".join(f"<li>{e(name)}: {e(value)}</li>" for name, value in point_metrics(rec.point))
        rec_html = f"<b>Recommended:</b> {e(describe(rec.point))}<ul>{headline}</ul>{e(rec.reason)}."
        rec_html += "".join(f"<br>Next: <code>{e(c)}</code> settles the tie round by round." for c in rec.next_steps)
        if report.asks_warning:
            rec_html += (
                f"<p class='warn' id='asks-warning'><b>{e(report.asks_warning)}</b> (<a href='#asks'>below</a>).</p>"
            )
    else:
        rec_html = f"<b>No recommendation:</b> {e(rec.reason)}."
    parts = [
        f"<h1>servetune report: {e(info.name)}</h1>",
        f"<p class='muted'>model {e(report.model_label)} on {e(info.device)} · trials: {e(counts)} · "
        f"SLO: {e(', '.join(str(s) for s in report.slo) or 'none')}</p>",
        f"<p class='muted' id='prices'>Costs at the {e(report.price_line())}. {e(COST_RATE)}.</p>",
        *([f"<p class='muted'>{e(report.goodput_window.capitalize())}.</p>"] if report.goodput_window else []),
        f"<div class='rec'>{rec_html}</div>",
        which_gpu_html(report),
        verification_summary_html(report.verification, report.verifications, report.verification_conclusion),
    ]
    if report.device_time:
        parts.append("<p class='muted'>" + "<br>".join(e(line) for line in report.device_time) + "</p>")
    if report.trial_table:
        parts.append(f"<p class='muted'><a href='#all-trials'>All {len(report.trial_table)} trials</a>: "
                     "a row each, below the plots.</p>")  # fmt: skip
        planner = kv_plan_summary(report.trial_table)
        if planner:
            parts.append(f"<p class='muted' id='kv-plan'>{e(planner)}.</p>")
    for index, front in enumerate(report.fronts):
        fig = front_figure(report, front)
        parts.append(
            fig.to_html(full_html=False, include_plotlyjs=index == 0, div_id=f"front-{front.spec.name}",
                        config={"displaylogo": False, "responsive": True})
        )  # fmt: skip
        parts.append(_table_html(front, report.sent_images))
        if index == 0:
            parts.append("<p class='muted'># is the row <code>servetune export STUDY_DIR --pick N</code> takes.</p>")
    if report.trial_table:
        parts += [f"<h2 id='all-trials'>All trials ({len(report.trial_table)})</h2>",
                  trials_table_html(report.trial_table),
                  f"<p class='muted'>{e(TRIALS_NOTE)} Hover “stopped because” for the whole reason.</p>"]  # fmt: skip
        limits = limit_lines(report.trial_table)
        if limits:
            parts.append("<h3 id='limits'>What limited each trial</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in limits)
                         + f"</ul><p class='muted'>{e(DIAGNOSIS_NOTE)}</p>")  # fmt: skip
        warm = warm_cache_lines(report.trial_table)
        if warm:
            parts.append("<h3>Warm prefix cache</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in warm) + "</ul>")
        behind = client_bound_lines(report.trial_table)
        if behind:
            parts.append("<h3>Load client fell behind</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in behind)
                         + f"</ul><p class='muted'>{e(CLIENT_BOUND_NOTE)}</p>")  # fmt: skip
        failures = failed_request_lines(report.trial_table)
        if failures:
            parts.append("<h3>Failed requests</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in failures)
                         + f"</ul><p class='muted'>{e(FAILED_REQUESTS_NOTE)}</p>")  # fmt: skip
        drafted = speculation_lines(report.trial_table) + list(report.speculative_gain)
        if drafted:
            note = f"<p class='muted'>{e(SPECULATIVE_GAIN_NOTE)}</p>" if report.speculative_gain else ""
            parts.append(
                "<h3>Speculative decoding</h3><ul>"
                + "".join(f"<li>{e(line)}</li>" for line in drafted)
                + "</ul>"
                + note
            )
        parsed = structured_lines(report.trial_table)
        if parsed:
            parts.append("<h3>Structured output</h3><ul>" + "".join(f"<li>{e(line)}</li>" for line in parsed)
                         + f"</ul><p class='muted'>{e(STRUCTURED_NOTE)}</p>")  # fmt: skip
    parts.append(asks_html(report))
    if report.estimate:  # the estimate made before each trial, against what it measured
        items = "".join(f"<li>{e(line)}</li>" for line in report.estimate)
        parts.append(f"<h3 id='estimate'>The estimate against the measurements</h3><ul>{items}</ul>")
    if report.quality_table:
        parts.append(quality_html(report))
    if report.ttft_spreads:
        parts.append(spread_html(report))
    parts.append(conversations_html(report))
    parts.append(verification_html(report.verification, report.verifications, report.verification_conclusion))
    if report.serve_check is not None:
        parts.append(serve_check_html(report.serve_check))
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>servetune report: {e(info.name)}</title><style>{_STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )
