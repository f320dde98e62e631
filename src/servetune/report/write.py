"""Write a study's report files: the HTML page, the Markdown summary and the PNG fronts."""

from __future__ import annotations

from pathlib import Path

from servetune.errors import UserError
from servetune.report.build import StudyReport, build_report
from servetune.report.markdown import render_markdown
from servetune.report.study import load_study


def write_report(study_dir: Path, out: Path | None = None, price_per_device_hour: float | None = None,
                 skip_unreadable: bool = False, target_rps: float | None = None) -> tuple[StudyReport, list[Path]]:  # fmt: skip
    """Build the report from disk and write it to ``out`` (default STUDY_DIR/report)."""
    from servetune.report.html import render_html
    from servetune.report.png import write_pngs

    report = build_report(load_study(study_dir, skip_unreadable), price_per_device_hour, target_rps)
    out = out if out is not None else Path(study_dir) / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
        html_file, md_file = out / "report.html", out / "summary.md"
        html_file.write_text(render_html(report), encoding="utf-8")
        md_file.write_text(render_markdown(report), encoding="utf-8")
        return report, [html_file, md_file, *write_pngs(report, out)]
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write the report: {exc.strerror or exc}") from None


def recommendation_lines(report: StudyReport, study_dir: Path) -> list[str]:
    from servetune.report.recommend import describe

    rec = report.recommendation
    if rec.point is None:
        return [f"recommendation: none: {rec.reason}"]
    return [
        f"recommendation: {describe(rec.point)}",
        f"  why: {rec.reason}",
        *([f"  {report.asks_warning[0].lower()}{report.asks_warning[1:]}"] if report.asks_warning else []),
        f"  export: servetune export {study_dir} --pick best --format vllm",
        *(
            f"  next: {command}  (a tie within the noise: measures the two round by round)"
            for command in rec.next_steps
        ),
    ]


def verification_line(report: StudyReport) -> str:
    """``verification: rejected (trial t16 at concurrency 16; 3 FAIL, ...)``, or how to run verify."""
    if len(report.verifications) > 1:
        each = "; ".join(
            f"{v.subject}: {'could not be read' if v.problem else v.verdict}" for v in report.verifications
        )
        return f"verification: {each}" + (
            f". {report.verification_conclusion}" if report.verification_conclusion else ""
        )
    v = report.verification
    if v is None or not v.found:
        return f"verification: none yet: {v.command if v is not None else 'servetune verify STUDY_DIR'}"
    if v.problem:
        return f"verification: {v.path} could not be read: {v.problem}"
    counts = f"; {v.counts_line}" if v.checklist else ""
    return f"verification: {v.verdict} ({v.subject}{counts})"
