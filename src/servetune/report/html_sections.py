"""The HTML page's sections that draw their own data as tables: the quality probe, the verification (its
summary line under the recommendation and its section), serve-check, which GPU, the conversations and the
answers without what they asked; with the table helpers
the page's other tables use (:func:`head_html`, :func:`rows_html`)."""

from __future__ import annotations

import html
from collections.abc import Sequence

from servetune.report import conversations as talks
from servetune.report.asks import ASKS_NOTE, ask_cells, ask_headings
from servetune.report.build import StudyReport
from servetune.report.gpus import GPU_HEADINGS, gpu_cells, gpu_notes
from servetune.report.markdown import VERIFY_HINT
from servetune.report.quality import QUALITY_NOTE, quality_cells, quality_headings, rule_summary, suite_names
from servetune.report.serving import LAYOUT_HEADINGS, ROUTER_HEADINGS, ROUTER_NOTE, SCALING_HEADINGS, ServeSection
from servetune.report.verification import Verification


def head_html(headings: Sequence[str]) -> str:
    return "<thead><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headings) + "</tr></thead>"


def quality_html(report: StudyReport) -> str:
    """The quality probe's table, and section 2's rule when the recommendation is at a lower precision."""
    e = html.escape
    suites = suite_names(report.quality_table)
    body = "".join(
        f"<tr class='{'failed' if row.passed is False else ''}'>" + "".join(f"<td>{e(c)}</td>" for c in quality_cells(row, suites)) + "</tr>"
        for row in report.quality_table
    )  # fmt: skip
    out = f"<h2 id='quality'>Quality</h2><table id='quality-table'>{head_html(quality_headings(suites))}<tbody>{body}</tbody></table>"
    out += f"<p class='muted'>{e(QUALITY_NOTE)}</p>"
    if report.precision_rule is not None:
        marks = {True: "PASS", False: "FAIL", None: "NOT MEASURED"}
        items = "".join(f"<li><b>{marks[c.held]}</b>: {e(c.text)}</li>" for c in report.precision_rule)
        out += f"<p id='precision-rule'>{e(rule_summary(report.precision_rule))}</p><ul>{items}</ul>"
    return out


def rows_html(
    headings: Sequence[str], rows: Sequence[Sequence[str]], row_class: Sequence[str] = (), table_id: str = ""
) -> str:
    e = html.escape
    body = "".join(
        (f"<tr class='{e(row_class[i])}'>" if i < len(row_class) else "<tr>") + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )  # fmt: skip
    ident = f" id='{e(table_id)}'" if table_id else ""
    return f"<table{ident}>{head_html(headings)}<tbody>{body}</tbody></table>"


def verification_summary_html(
    v: Verification | None, several: Sequence[Verification] = (), conclusion: str = ""
) -> str:
    """One line under the recommendation: the verdict, or that verify has not run; with several
    verified points, each point's verdict and what they mean together."""
    e = html.escape
    if len(several) > 1:
        verdicts = " · ".join(
            f"<span class='verdict {e(x.verdict.replace(' ', '-'))}'>{e(x.subject)}: {e(x.verdict)}</span>"
            for x in several
        )
        said = f"<br>{e(conclusion)}" if conclusion else ""
        return f"<p><b>Verification</b> ({len(several)} points): {verdicts} (<a href='#verification'>details</a>){said}</p>"
    if v is None:
        return ""
    if not v.found:
        return (
            f"<p class='muted'>Not verified yet: <code>{e(v.command)}</code> (<a href='#verification'>below</a>).</p>"
        )
    if v.problem:
        return "<p class='muted'>verify.json could not be read (<a href='#verification'>below</a>).</p>"
    return (f"<p class='verdict {e(v.verdict.replace(' ', '-'))}'><b>Verification: {e(v.verdict)}</b> · {e(v.subject)}"
            f"{' · ' + e(v.counts_line) if v.checklist else ''} (<a href='#verification'>details</a>)</p>")  # fmt: skip


def verification_html(v: Verification | None, several: Sequence[Verification] = (), conclusion: str = "") -> str:
    """The section: verdict, stability, scenarios, checklist; or how to run verify. With several
    verified points: a row per point, what the verdicts mean together, then each point's details."""
    e = html.escape
    if len(several) > 1:
        parts = ["<h2 id='verification'>Verification</h2>", f"<p>{len(several)} points verified:</p>",
                 rows_html(["point", "verdict", "file", "why"], [[x.subject, x.verdict, str(x.path), x.problem or x.reason or "-"] for x in several],
                            [x.verdict.replace(" ", "-") for x in several], "verified-points")]  # fmt: skip
        if conclusion:
            parts.append(f"<p><b>{e(conclusion)}</b></p>")
        for index, x in enumerate(several, 1):
            parts.append(f"<h3 id='verified-{index}'>{index}. {e(x.subject)}: {e(x.verdict)}</h3>")
            parts += (
                [f"<p><code>{e(str(x.path))}</code> could not be read: {e(x.problem)}.</p>"]
                if x.problem
                else _verified_html(x, "h4", f"-{index}")
            )
        return "\n".join(parts)
    if v is None:
        return ""
    parts = ["<h2 id='verification'>Verification</h2>"]
    if not v.found:
        return parts[0] + f"<p>Not verified yet. Run <code>{e(v.command)}</code>: {e(VERIFY_HINT)}.</p>"
    if v.problem:
        return (
            parts[0]
            + f"<p><code>{e(str(v.path))}</code> could not be read: {e(v.problem)}. Run <code>{e(v.command)}</code> again.</p>"
        )
    return "\n".join(parts + _verified_html(v, "h3", ""))


def _verified_html(v: Verification, heading: str, suffix: str) -> list[str]:
    """One verification's verdict, stability, scenarios and checklist (table ids end with ``suffix``)."""
    e = html.escape
    reason = f". {e(v.reason.rstrip('.'))}" if v.reason else ""
    parts = [
        f"<p class='verdict {e(v.verdict.replace(' ', '-'))}'><b>{e(v.verdict.capitalize())}</b>: {e(v.subject)}{reason}.</p>"
    ]
    if v.limited_by:
        parts.append(f"<p>What limited it in the verification (soak and peak): {e(v.limited_by)}</p>")
    parts += [
        f"<{heading}>Stability</{heading}>",
        rows_html(["number", "value"], v.stability, table_id="stability" + suffix),
    ]
    if v.scenarios:
        rows = [[r.name, r.result, r.numbers, r.reason] for r in v.scenarios]
        parts += [f"<{heading}>Scenarios</{heading}>", rows_html(["scenario", "result", "numbers", "reason"], rows,
                                                   [r.result.replace(" ", "-") for r in v.scenarios], "scenarios" + suffix)]  # fmt: skip
    if v.checklist:
        rows = [[r.id, r.text, r.status, r.evidence] for r in v.checklist]
        parts += [f"<{heading}>Acceptance checklist ({e(v.counts_line)})</{heading}>",
                  rows_html(["#", "item", "status", "evidence"], rows, [r.css_class for r in v.checklist], "checklist" + suffix)]  # fmt: skip
    else:
        parts.append("<p class='muted'>verify.json holds no acceptance checklist.</p>")
    return parts


def serve_check_html(section: ServeSection) -> str:
    """serve-check's scaling rows and routers, as the Markdown summary has them."""
    e = html.escape

    def table(headings: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
        head = "".join(f"<th>{e(h)}</th>" for h in headings)
        body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    parts = ["<h2 id='serve-check'>Ray Serve (serve-check)</h2>"]
    if section.problem:
        return parts[0] + f"<p><code>{e(str(section.path))}</code> could not be read: {e(section.problem)}.</p>"
    parts.append(f"<p class='muted'>Trial {e(section.trial_id)} deployed as a Ray Serve LLM application.</p>")
    if section.stopped:
        parts.append(
            f"<p><strong>serve-check stopped before every part ran ({e(section.stopped)}): below is what finished.</strong></p>"
        )
    if section.scaling:
        parts.append(table(SCALING_HEADINGS, section.scaling))
    if section.routers:
        parts += [
            f"<h3>Routers: {e(section.routing_title)}</h3>",
            table(ROUTER_HEADINGS, section.routers),
            f"<p class='muted'>{e(ROUTER_NOTE)}</p>",
        ]
        if section.engines:
            parts.append("<ul>" + "".join(f"<li>{e(note)}</li>" for note in section.engines) + "</ul>")
        if section.verdict:
            parts.append(f"<p><b>Verdict:</b> {e(section.verdict)}</p>")
    if section.layouts:
        parts += [f"<h3>Layouts: {e(section.layouts_title)}</h3>", table(LAYOUT_HEADINGS, section.layouts)]
        parts.append("<ul>" + "".join(f"<li>{e(note)}</li>" for note in section.layout_notes) + "</ul>")
    return "\n".join(parts)


def which_gpu_html(report: StudyReport) -> str:
    """The "which GPU" table and its sentences ('' where no trial names a GPU type)."""
    section = report.which_gpu
    if section is None:
        return ""
    e = html.escape
    target = f" for {section.target_rps:g} req/s" if section.target_rps is not None else ""
    body = "".join(
        "<tr" + (" class='muted'" if row.estimated else "") + ">"
        + "".join(f"<td>{e(cell)}</td>" for cell in gpu_cells(row)) + "</tr>"
        for row in section.rows
    )  # fmt: skip
    notes = "".join(f"<li>{e(line)}</li>" for line in gpu_notes(section))
    return f"<h2 id='which-gpu'>Which GPU{e(target)}</h2><table>{head_html(GPU_HEADINGS)}<tbody>{body}</tbody></table><ul>{notes}</ul>"


def conversations_html(report: StudyReport) -> str:
    """The recommended trial's multi-turn levels in full, then a row per multi-turn level of every trial (folded
    under the recommended trial's tables, open without a recommendation); '' where no level had conversations."""
    e = html.escape
    parts = []
    if report.conversations:
        parts.append(f"<h2 id='conversations'>Conversations ({e(report.conversations[0].trial_id)})</h2>")
        for t in report.conversations:
            parts += [f"<p>{e(t.caption)}</p>", rows_html(talks.CONVERSATION_HEADINGS, talks.conversation_cells(t)),
                      rows_html(talks.TURN_HEADINGS, talks.turn_cells(t))]  # fmt: skip
    if talks.others_shown(report.conversations, report.every_conversation):
        if not parts:
            parts.append("<h2 id='conversations'>Conversations</h2>")
        trials = len({t.trial_id for t in report.every_conversation})
        point = report.recommendation.point
        marked = ["recommended" if point is not None and t.trial_id == point.trial_id else ""
                  for t in report.every_conversation]  # fmt: skip
        table = rows_html(talks.SUMMARY_HEADINGS, talks.summary_cells(report.every_conversation), marked,
                          "every-conversation")  # fmt: skip
        opened = "" if report.conversations else " open"
        parts.append(f"<details{opened}><summary>Conversations of every trial ({trials}), a row per level</summary>"
                     f"{table}</details>")  # fmt: skip
    if not parts:
        return ""
    return "\n".join([*parts, f"<p class='muted'>{e(talks.CONVERSATION_NOTE)}</p>"])


def asks_html(report: StudyReport) -> str:
    """Every level whose answers lacked what their requests asked, a row per trial and level ('' where none)."""
    if not report.asks:
        return ""
    point = report.recommendation.point
    marked = ["recommended" if point is not None and row.trial_id == point.trial_id else "" for row in report.asks]
    return (
        "<h3 id='asks'>Answers without what they asked</h3>"
        + rows_html(ask_headings(report.asks), ask_cells(report.asks), marked, "asks-table")
        + f"<p class='muted'>{html.escape(ASKS_NOTE)}</p>"
    )
