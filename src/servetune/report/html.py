"""One self-contained interactive HTML page (plotly, with plotly.js inline so it works offline).

Each front is a scatter: the front's points highlighted and connected, the other points that
meet every SLO in blue, points apart (trial failed, SLO broken) as grey crosses, the
recommendation as a star, SLO bounds as dashed red lines. Hovering a point shows its trial,
load level, configuration, numbers and SLO verdict.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import plotly.graph_objects as go

from servetune.report.build import Front, StudyReport
from servetune.report.labels import (
    APART_COLOR,
    FRONT_COLOR,
    OTHER_COLOR,
    RECOMMENDED_COLOR,
    SLO_COLOR,
    TABLE_METRICS,
    metric_label,
    metric_short,
    point_metrics,
)
from servetune.report.markdown import pareto_rows
from servetune.report.points import ReportPoint, level_label
from servetune.report.recommend import describe


def hover_text(point: ReportPoint) -> str:
    """What hovering a point shows (plotly's HTML subset: <b>, <br>)."""
    e = html.escape
    lines = [f"<b>trial {e(point.trial_id)}</b> · {e(level_label(point.level))}"]
    lines += [f"{e(str(k))}={e(str(v))}" for k, v in point.params.items()]
    lines.append(f"devices: {point.devices}")
    lines += [f"{e(heading)}: {e(value)}" for heading, value in point_metrics(point)]
    kv = point.server_metrics.get("kv_cache_usage_max")
    if kv is not None:
        lines.append(f"KV cache peak: {kv:.0%}")
    lines.append("SLO met" if point.eligible else e(point.why_apart))
    return "<br>".join(lines)


def _scatter(front: Front, points: Sequence[ReportPoint], name: str, **style: object) -> go.Scatter:
    x, y = front.spec.x.metric, front.spec.y.metric
    points = sorted(front.result.drawable(points), key=lambda p: p.value(x) or 0.0)
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
    fig.add_trace(
        _scatter(front, result.apart, "apart: failed or SLO broken",
                 mode="markers", marker=dict(symbol="x", size=8, color=APART_COLOR))
    )  # fmt: skip
    fig.add_trace(
        _scatter(front, result.dominated, "meets SLO, dominated",
                 mode="markers", marker=dict(size=8, color=OTHER_COLOR, opacity=0.7))
    )  # fmt: skip
    fig.add_trace(
        _scatter(front, result.front, "Pareto front",
                 mode="lines+markers", marker=dict(size=11, color=FRONT_COLOR), line=dict(color=FRONT_COLOR, width=2))
    )  # fmt: skip
    recommended = report.recommendation.point
    if recommended is not None and result.drawable([recommended]):
        fig.add_trace(
            _scatter(front, [recommended], "recommended",
                     mode="markers", marker=dict(symbol="star", size=18, color=RECOMMENDED_COLOR,
                                                 line=dict(width=1, color="black")))
        )  # fmt: skip
    for line in report.slo_for(spec.x.metric):
        fig.add_vline(x=line.max, line_dash="dash", line_color=SLO_COLOR, annotation_text=f"SLO {line}")
    for line in report.slo_for(spec.y.metric):
        fig.add_hline(y=line.max, line_dash="dash", line_color=SLO_COLOR, annotation_text=f"SLO {line}")
    fig.update_layout(
        title=spec.title,
        xaxis_title=metric_label(spec.x.metric) + (" — higher is better" if spec.x.direction == "max" else ""),
        yaxis_title=metric_label(spec.y.metric) + (" — higher is better" if spec.y.direction == "max" else ""),
        template="plotly_white",
        height=540,
        legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
        margin=dict(t=90),
    )
    return fig


def _table_html(front: Front) -> str:
    headings = ["#", "trial", "config", "level", *(metric_short(m) for m in TABLE_METRICS)]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headings)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>" for row in pareto_rows(front)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1200px;padding:0 16px;color:#222}
table{border-collapse:collapse;font-size:13px;margin:8px 0 24px}td,th{border:1px solid #ddd;padding:3px 8px}
th{background:#f4f4f4}.rec{background:#eef7ee;border-left:4px solid #5a9a5a;padding:8px 12px}
.muted{color:#666;font-size:13px}
"""


def render_html(report: StudyReport) -> str:
    """The whole page as a string; the first figure carries plotly.js inline."""
    e = html.escape
    info, rec = report.info, report.recommendation
    counts = ", ".join(f"{n} {name}" for name, n in report.outcome_counts().items())
    if rec.point is not None:
        rec_html = f"<b>Recommended:</b> {e(describe(rec.point))}<br>{e(rec.reason)}."
    else:
        rec_html = f"<b>No recommendation:</b> {e(rec.reason)}."
    parts = [
        f"<h1>servetune report: {e(info.name)}</h1>",
        f"<p class='muted'>model {e(info.model)} on {e(info.device)} · trials: {e(counts)} · "
        f"SLO: {e(', '.join(str(s) for s in report.slo) or 'none')}</p>",
        f"<p class='rec'>{rec_html}</p>",
    ]
    if report.device_time:
        parts.append("<p class='muted'>" + "<br>".join(e(line) for line in report.device_time) + "</p>")
    for index, front in enumerate(report.fronts):
        fig = front_figure(report, front)
        parts.append(
            fig.to_html(full_html=False, include_plotlyjs=index == 0, div_id=f"front-{front.spec.name}",
                        config={"displaylogo": False, "responsive": True})
        )  # fmt: skip
        parts.append(_table_html(front))
        if index == 0:
            parts.append("<p class='muted'># is the row <code>servetune export STUDY_DIR --pick N</code> takes.</p>")
    body = "\n".join(parts)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>servetune report: {e(info.name)}</title><style>{_STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )
