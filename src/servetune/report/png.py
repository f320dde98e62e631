"""PNG figures with matplotlib (Agg canvas, no pyplot state): one file per front."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from servetune.report.build import Front, StudyReport
from servetune.report.labels import (
    APART_COLOR,
    FRONT_COLOR,
    MAX_POINT_LABELS,
    OTHER_COLOR,
    RECOMMENDED_COLOR,
    SLO_COLOR,
    axis_title,
    broken_label,
)
from servetune.report.points import ReportPoint


def _drawn(front: Front, points: Sequence[ReportPoint]) -> list[ReportPoint]:
    return sorted(front.result.drawable(points), key=lambda p: p.value(front.spec.x.metric) or 0.0)


def _xy(front: Front, points: Sequence[ReportPoint]) -> tuple[list[float], list[float]]:
    x, y = front.spec.x.metric, front.spec.y.metric
    drawn = _drawn(front, points)
    return [p.value(x) or 0.0 for p in drawn], [p.value(y) or 0.0 for p in drawn]


def front_png(report: StudyReport, front: Front) -> Figure:
    """The figure of one front (not yet saved)."""
    result, spec = front.result, front.spec
    fig = Figure(figsize=(8, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    xs, ys = _xy(front, result.apart)
    if xs:
        ax.scatter(xs, ys, marker="x", color=APART_COLOR, label=f"apart: failed or SLO broken ({len(xs)})")
        if len(xs) <= MAX_POINT_LABELS:  # each broken point says which bounds it broke
            for x, y, point in zip(xs, ys, _drawn(front, result.apart), strict=True):
                ax.annotate(broken_label(point), (x, y), xytext=(0, 5), textcoords="offset points", ha="center",
                            fontsize=6, color="#616161")  # fmt: skip
    xs, ys = _xy(front, result.dominated)
    if xs:
        ax.scatter(xs, ys, color=OTHER_COLOR, alpha=0.7, label=f"meets SLO, dominated ({len(xs)})")
    xs, ys = _xy(front, result.front)
    if xs:
        ax.plot(xs, ys, "-o", color=FRONT_COLOR, markersize=7, label=f"Pareto front ({len(xs)})")
    rec = report.recommendation.point
    if rec is not None and result.drawable([rec]):
        xs, ys = _xy(front, [rec])
        ax.scatter(
            xs, ys, marker="*", s=260, color=RECOMMENDED_COLOR, edgecolors="black", zorder=5, label="recommended"
        )
    for bound in report.bounds_on(spec.x.metric):
        ax.axvline(bound.line.max, color=SLO_COLOR, linestyle="--" if bound.same_statistic else ":", linewidth=1,
                   label=bound.label)  # fmt: skip
    for bound in report.bounds_on(spec.y.metric):
        ax.axhline(bound.line.max, color=SLO_COLOR, linestyle="--" if bound.same_statistic else ":", linewidth=1,
                   label=bound.label)  # fmt: skip
    ax.set_xlabel(axis_title(spec.x.metric, spec.x.direction))
    ax.set_ylabel(axis_title(spec.y.metric, spec.y.direction))
    ax.set_title(f"{report.info.name}: {spec.title}", fontsize=11)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no measured operating points", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    return fig


def write_pngs(report: StudyReport, out_dir: Path) -> list[Path]:
    """``pareto-<front>.png`` for every front; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for front in report.fronts:
        path = out_dir / f"pareto-{front.spec.name}.png"
        front_png(report, front).savefig(path)
        paths.append(path)
    return paths
