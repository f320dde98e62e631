"""Reports of a finished (or running) study, read from disk: no GPU, no Ray, no vLLM needed.

Compute, then draw: :func:`load_study` reads the study directory, :func:`build_report`
computes operating points, Pareto fronts (:func:`pareto_front`) and the recommendation
(:func:`recommend`) as plain data; :func:`render_markdown`, ``html.render_html`` and
``png.write_pngs`` draw that data (the last two import plotly / matplotlib, so they are not
imported here); :mod:`servetune.report.export` turns a chosen point into a ``vllm serve``
command, a Ray Serve LLM config or JSON.

Results come from disk through ``servetune.results`` (and metric names from
``servetune.metrics``); this package never imports ``servetune.trial``, ``servetune.study``
or the engine's server. Export reuses the pure ``servetune.engine.args.engine_argv``.
"""

from servetune.report.build import Front, StudyReport, build_report
from servetune.report.markdown import render_markdown
from servetune.report.pareto import FRONTS, FrontSpec, Objective, ParetoFront, pareto_front
from servetune.report.points import ReportPoint, TrialOutline, gather_points
from servetune.report.recommend import Recommendation, margin_signals, recommend
from servetune.report.study import LoadedStudy, load_study

__all__ = [
    "FRONTS",
    "Front",
    "FrontSpec",
    "LoadedStudy",
    "Objective",
    "ParetoFront",
    "Recommendation",
    "ReportPoint",
    "StudyReport",
    "TrialOutline",
    "build_report",
    "gather_points",
    "load_study",
    "margin_signals",
    "pareto_front",
    "recommend",
    "render_markdown",
]
