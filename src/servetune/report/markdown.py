"""The Markdown summary: the recommendation and its verification, outcomes, failure reasons, Pareto tables."""

from __future__ import annotations

from collections.abc import Sequence

from servetune.report.asks import ASKS_NOTE, ask_cells, ask_headings
from servetune.report.build import Front, StudyReport
from servetune.report.conversations import (
    CONVERSATION_HEADINGS,
    CONVERSATION_NOTE,
    SUMMARY_HEADINGS,
    TURN_HEADINGS,
    conversation_cells,
    others_shown,
    summary_cells,
    turn_cells,
)
from servetune.report.distribution import SPREAD_NOTE, spread_cells, spread_headings
from servetune.report.gpus import GPU_HEADINGS, gpu_cells, gpu_notes
from servetune.report.labels import (
    COST_RATE,
    TABLE_METRICS,
    TRIAL_HEADINGS,
    TRIALS_NOTE,
    fmt,
    image_cells,
    kv_plan_summary,
    metric_short,
    pareto_headings,
    point_metrics,
    trial_cells,
)
from servetune.report.params import config_label
from servetune.report.points import level_label
from servetune.report.quality import QUALITY_NOTE, quality_cells, quality_headings, rule_summary, suite_names
from servetune.report.recommend import describe
from servetune.report.serving import LAYOUT_HEADINGS, ROUTER_HEADINGS, ROUTER_NOTE, SCALING_HEADINGS, ServeSection
from servetune.report.trials import TrialRow
from servetune.report.verification import Verification

UNITS = (f"Latencies in ms; $/Mtok is USD per million output tokens; tok/s/user is 1000 / mean TPOT; {COST_RATE} "
         "(`priced_by` and `goodput_window` in each level's summary).")  # fmt: skip


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headings: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headings) + " |", "|" + "|".join("---" for _ in headings) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def pareto_rows(front: Front, images: bool = False) -> list[list[str]]:
    """One row per front point, in the front's order (index 0 first); ``images``: with the images each level sent."""
    rows = []
    for index, point in enumerate(front.result.front):
        rows.append(
            [str(index), point.trial_id, config_label(point.params), level_label(point.level)]
            + [fmt(m, point.value(m)) for m in TABLE_METRICS]
            + (image_cells(point) if images else [])
        )
    return rows


def _front_section(report: StudyReport, front: Front, indexed_by_export: bool) -> list[str]:
    result = front.result
    axes = " and ".join(f"{metric_short(o.metric)} ({o.direction})" for o in result.objectives)
    lines = [f"## Pareto front: {front.spec.title}", "", f"Objectives: {axes}."]
    if indexed_by_export:
        lines[-1] += " `#` is what `servetune export --pick N` takes."
    lines.append("")
    if result.front:
        lines += _table(pareto_headings(report.sent_images), pareto_rows(front, report.sent_images))
    else:
        lines.append("No operating point meets every SLO with these metrics measured.")
    lines += [
        "",
        f"{len(result.front)} on the front, {len(result.dominated)} dominated, {len(result.apart)} apart "
        "(trial failed or infeasible, SLO broken, or metric not measured). " + UNITS,
        "",
    ]
    return lines


def _recommendation(report: StudyReport) -> list[str]:
    rec = report.recommendation
    lines = ["## Recommendation", ""]
    if rec.point is None:
        return [*lines, f"None: {rec.reason}.", ""]
    point = rec.point
    lines += [
        f"**{describe(point)}**",
        "",
        *(f"- {heading}: {value}" for heading, value in point_metrics(point)),
        f"- why: {rec.reason}.",
    ]
    for passed in rec.passed_over[:5]:
        if passed.point is not point:
            lines.append(f"- passed over: {describe(passed.point)}: {'; '.join(passed.signals)}")
    lines += [f"- next: `{command}` settles the tie round by round" for command in rec.next_steps]
    lines += [
        "",
        f"Export it: `servetune export {report.root} --pick best --format vllm` (or `ray-serve`, `json`).",
        "",
    ]
    if report.verification_conclusion:
        lines += [f"Verification: {report.verification_conclusion}", ""]
    return lines


def which_gpu_section(report: StudyReport) -> list[str]:
    """Each GPU type's best configuration and cost, the estimated ones marked, and the type recommended."""
    section = report.which_gpu
    if section is None:
        return []
    target = f" for {section.target_rps:g} req/s" if section.target_rps is not None else ""
    lines = [f"## Which GPU{target}", ""]
    lines += _table(GPU_HEADINGS, [gpu_cells(row) for row in section.rows])
    return [*lines, "", *(f"- {line}" for line in gpu_notes(section)), ""]


def quality_section(report: StudyReport) -> list[str]:
    """The quality probe's table, and section 2's rule when the recommendation is at a lower precision."""
    if not report.quality_table:
        return []
    suites = suite_names(report.quality_table)
    lines = ["### Quality", ""]
    lines += _table(quality_headings(suites), [quality_cells(row, suites) for row in report.quality_table])
    lines += ["", QUALITY_NOTE, ""]
    if report.precision_rule is not None:
        lines += [rule_summary(report.precision_rule), ""]
        lines += [
            f"- {'PASS' if c.held else 'FAIL' if c.held is False else 'NOT MEASURED'}: {c.text}"
            for c in report.precision_rule
        ]
        lines.append("")
    return lines


#: How to read "What limited each trial" (report/diagnosis.py).
DIAGNOSIS_NOTE = (
    "Each trial is judged at the first level that broke the SLO, else its highest load; the first finding in the "
    "order of the tuning checklist's section 13 is shown, from the server's /metrics, the device telemetry and the "
    "client's latencies. See docs/concepts/diagnosis.md."
)


#: What ``servetune verify`` does, for a study it has not verified yet.
VERIFY_HINT = (
    "it starts the recommended configuration again, runs a soak, a peak, bursts, long/short mixes, very long "
    "outputs, disconnects, headroom and repeats at its level, and evaluates the acceptance checklist (section 15)"
)


def _verification(v: Verification | None) -> list[str]:
    if v is None:
        return []
    lines = ["## Verification", ""]
    if not v.found:
        return [*lines, f"Not verified yet. Run `{v.command}`: {VERIFY_HINT}.", ""]
    if v.problem:
        return [*lines, f"`{v.path}` could not be read: {v.problem}. Run `{v.command}` again.", ""]
    return lines + _verified(v, "###")


def _verified(v: Verification, heading: str) -> list[str]:
    """One verification's verdict, stability, scenarios and checklist, under ``heading`` sub-headings."""
    lines = [f"**{v.verdict.capitalize()}**: {v.subject}" + (f". {v.reason.rstrip('.')}" if v.reason else "") + ".", ""]
    if v.limited_by:
        lines += [f"What limited it in the verification (soak and peak): {v.limited_by}", ""]
    lines += [f"{heading} Stability", "", *_table(["number", "value"], [list(row) for row in v.stability]), ""]
    if v.scenarios:
        lines += [f"{heading} Scenarios", ""]
        lines += _table(
            ["scenario", "result", "numbers", "reason"], [[r.name, r.result, r.numbers, r.reason] for r in v.scenarios]
        )
        lines.append("")
    if v.checklist:
        lines += [f"{heading} Acceptance checklist ({v.counts_line})", ""]
        lines += _table(
            ["#", "item", "status", "evidence"], [[r.id, r.text, r.status, r.evidence] for r in v.checklist]
        )
        lines.append("")
    else:
        lines += ["verify.json holds no acceptance checklist.", ""]
    return lines


def spread_section(report: StudyReport) -> list[str]:
    if not report.ttft_spreads:
        return []
    point = report.recommendation.point
    lines = [f"### TTFT distribution of the recommended trial ({point.trial_id if point else '-'})", ""]
    lines += _table(spread_headings(), [spread_cells(s) for s in report.ttft_spreads])
    return [*lines, "", SPREAD_NOTE, ""]


def conversation_section(report: StudyReport) -> list[str]:
    """Per multi-turn level of the recommended trial: its conversations' numbers, then its turns'; then a row per
    multi-turn level of every trial, the recommended first (where another trial has some, or none is recommended)."""
    lines: list[str] = []
    if report.conversations:
        lines += [f"### Conversations of the recommended trial ({report.conversations[0].trial_id})", ""]
        for table in report.conversations:
            lines += [table.caption, "", *_table(CONVERSATION_HEADINGS, conversation_cells(table)), ""]
            lines += [*_table(TURN_HEADINGS, turn_cells(table)), ""]
    if others_shown(report.conversations, report.every_conversation):
        lines += ["### Conversations of every trial", ""]
        lines += [*_table(SUMMARY_HEADINGS, summary_cells(report.every_conversation)), ""]
    return [*lines, CONVERSATION_NOTE, ""] if lines else []


def asks_section(report: StudyReport) -> list[str]:
    """Every level whose answers lacked what their requests asked, a row per trial and level (report/asks.py)."""
    if not report.asks:
        return []
    lines = ["### Answers without what they asked", ""]
    return [*lines, *_table(ask_headings(report.asks), ask_cells(report.asks)), "", ASKS_NOTE, ""]


def verification_section(report: StudyReport) -> list[str]:
    """The Verification section: as for one verification, or a list of every verified point, what the
    verdicts mean together, then each point's details."""
    several = report.verifications
    if len(several) < 2:
        return _verification(several[0] if several else report.verification)
    lines = ["## Verification", "", f"{len(several)} points verified:", ""]
    lines += _table(["point", "verdict", "file", "why"],
                    [[v.subject, v.verdict, f"`{v.path.relative_to(report.root) if v.path.is_relative_to(report.root) else v.path}`",
                      v.problem or v.reason or "-"] for v in several])  # fmt: skip
    lines.append("")
    if report.verification_conclusion:
        lines += [f"**{report.verification_conclusion}**", ""]
    for index, v in enumerate(several, 1):
        lines += [f"### {index}. {v.subject}: {v.verdict}", ""]
        lines += [f"`{v.path}` could not be read: {v.problem}.", ""] if v.problem else _verified(v, "####")
    return lines


def warm_cache_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T, concurrency 8: prefix-cache hit rate ...`` for every level flagged by its measurement."""
    return [f"trial {row.trial_id}, {note}" for row in rows for note in row.cache_notes]


def client_bound_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T, rate 64 req/s: requests sent 38 ms late ...`` for every level where the load client fell behind."""
    return [f"trial {row.trial_id}, {note}" for row in rows for note in row.client_bound]


def failed_request_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T, concurrency 4: 12 of 24 requests failed: http_5xx 12 (...)`` for every level where requests failed."""
    return [f"trial {row.trial_id}, {note}" for row in rows for note in row.failed_requests]


#: What the failed requests' list says, under it.
FAILED_REQUESTS_NOTE = (
    "Each kind with the first error text of that kind, and the request classes the failures were sent in. "
    "Structured requests that fail with http_5xx while the others pass point at the structured-outputs backend: "
    "see the engine log's traceback."
)


#: What a client-bound level means, under the list of them.
CLIENT_BOUND_NOTE = (
    "At these levels the load client fell behind its schedule or ran its process near a full core "
    "(servetune.load.pace): what they measured may be the client's, so they take no SLO verdict, are "
    "never a trial's best level and count as unsettled in the capacity search."
)


def limit_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T: symptom → lever`` for every complete trial (report/diagnosis.py), in the table's order."""
    return [f"trial {row.trial_id}: {row.limited_by}" for row in rows if row.outcome == "COMPLETE" and row.limited_by]


SPECULATIVE_GAIN_NOTE = (
    "Gain: output throughput against the same configuration without a drafter, at each load both measured; a "
    "gain or loss counts beyond the two levels' throughput noise added."
)


def speculation_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T (concurrency 8): accepted 55% of ...`` for every trial whose engine drafted tokens."""
    return [f"trial {row.trial_id} ({row.numbers_level}): {row.speculation}" for row in rows if row.speculation]


STRUCTURED_NOTE = (
    "Structured output: the share of answers asked for JSON under a schema, one of a choice or a regex that "
    "parsed as asked, at the level the trial table shows (slo structured_valid: {min: ...} bounds it)."
)


def structured_lines(rows: Sequence[TrialRow]) -> list[str]:
    """``trial T (concurrency 8): 97.5% of structured answers parsed as asked`` for every trial that measured it."""
    return [f"trial {row.trial_id} ({row.numbers_level}): {row.structured}" for row in rows if row.structured]


def serve_check_section(section: ServeSection | None) -> list[str]:
    """What ``servetune serve-check`` measured on Ray Serve: scaling, and the routers compared."""
    if section is None:
        return []
    lines = ["## Ray Serve (serve-check)", ""]
    if section.problem:
        return [*lines, f"`{section.path}` could not be read: {section.problem}.", ""]
    lines += [f"Trial {section.trial_id} deployed as a Ray Serve LLM application (`{section.path.name}`).", ""]
    if section.stopped:
        lines += [f"**serve-check stopped before every part ran ({section.stopped}): below is what finished.**", ""]
    if section.scaling:
        lines += _table(SCALING_HEADINGS, section.scaling)
        lines += ["", "latencies in ms; router TTFT p50: through Serve minus the bare engine at the same level; "
                      "scaling eff.: tok/s at N / (N x tok/s at 1)", ""]  # fmt: skip
    if section.routers:
        lines += [f"### Routers: {section.routing_title}", ""]
        lines += _table(ROUTER_HEADINGS, section.routers)
        lines += ["", ROUTER_NOTE, ""]
        lines += [f"- {note}" for note in section.engines] + ([""] if section.engines else [])
        if section.verdict:
            lines += [f"**Verdict: {section.verdict}**", ""]
    if section.layouts:
        lines += [f"### Layouts: {section.layouts_title}", ""]
        lines += _table(LAYOUT_HEADINGS, section.layouts)
        lines += [""] + [f"- {note}" for note in section.layout_notes] + [""]
    return lines


def render_markdown(report: StudyReport) -> str:
    info = report.info
    lines = [
        f"# servetune report: {info.name}",
        "",
        f"- model: `{report.model_label}` on {info.device}, workload `{info.workload}`, search `{info.algorithm}`",
        f"- {report.price_line()}",
        *([f"- {report.energy}"] if report.energy else []),
        *([f"- {report.goodput_window}"] if report.goodput_window else []),
        f"- SLO: {', '.join(f'`{line}`' for line in report.slo) or 'none'}",
        f"- objectives: {', '.join(f'{m} ({d})' for m, d in info.objectives) or 'none'}",
        f"- study directory: `{report.root}`",
        "",
    ]
    lines += _recommendation(report)
    if report.asks_warning:
        lines += [f"**{report.asks_warning}.**", ""]
    lines += which_gpu_section(report)
    if report.estimate:  # the estimate made before each trial, against what it measured
        lines += ["### The estimate against the measurements", "", *(f"- {line}" for line in report.estimate), ""]
    lines += verification_section(report)
    counts = report.outcome_counts()
    lines += ["## Trials", ""]
    lines += _table(["outcome", "trials"], [[name, str(n)] for name, n in counts.items()])
    met = sum(p.eligible for p in report.points)
    lines += ["", f"{len(report.points)} operating points measured; {met} from complete trials meet every SLO.", ""]
    planner = kv_plan_summary(report.trial_table)
    if planner:
        lines += [planner + ".", ""]
    if report.trial_table:
        lines += ["### All trials", ""]
        lines += _table(TRIAL_HEADINGS, [trial_cells(row) for row in report.trial_table])
        lines += ["", TRIALS_NOTE, ""]
        limits = limit_lines(report.trial_table)
        if limits:
            lines += ["### What limited each trial", "", *(f"- {line}" for line in limits), "", DIAGNOSIS_NOTE, ""]
        warm = warm_cache_lines(report.trial_table)
        if warm:
            lines += ["### Warm prefix cache", "", *(f"- {line}" for line in warm), ""]
        behind = client_bound_lines(report.trial_table)
        if behind:
            lines += ["### Load client fell behind", "", *(f"- {line}" for line in behind), "", CLIENT_BOUND_NOTE, ""]
        failures = failed_request_lines(report.trial_table)
        if failures:
            lines += ["### Failed requests", "", *(f"- {line}" for line in failures), "", FAILED_REQUESTS_NOTE, ""]
        drafted = speculation_lines(report.trial_table) + list(report.speculative_gain)
        if drafted:
            lines += ["### Speculative decoding", "", *(f"- {line}" for line in drafted), ""]
            if report.speculative_gain:
                lines += [SPECULATIVE_GAIN_NOTE, ""]
        parsed = structured_lines(report.trial_table)
        if parsed:
            lines += ["### Structured output", "", *(f"- {line}" for line in parsed), "", STRUCTURED_NOTE, ""]
    lines += asks_section(report)
    lines += quality_section(report)
    lines += spread_section(report)
    lines += conversation_section(report)
    lines += serve_check_section(report.serve_check)
    reasons = report.failure_reasons()
    if reasons:
        lines += ["### Why trials did not complete", ""]
        lines += _table(
            ["outcome", "reason", "trials"], [[r.outcome, r.reason, ", ".join(r.trial_ids)] for r in reasons]
        )
        lines.append("")
    if report.not_read:
        lines += ["### Trials not read", ""]
        lines += [f"- `{item.path}`: {item.why}" for item in report.not_read]
        lines.append("")
    if report.device_time:
        lines += ["## Device time", "", *(f"- {line}" for line in report.device_time), ""]
    for index, front in enumerate(report.fronts):
        lines += _front_section(report, front, indexed_by_export=index == 0)
    return "\n".join(lines).rstrip() + "\n"
