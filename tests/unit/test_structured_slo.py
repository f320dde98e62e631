"""``structured_valid`` as an SLO bound (a floor), in the report, and the agent scenario's backends (issue #41 item 5)."""

from __future__ import annotations

import pytest

from servetune.config.settings import Objective
from servetune.config.slo import Slo, SloBound
from servetune.errors import UserError
from servetune.metrics import STRUCTURED_VALID
from servetune.report.build import build_report
from servetune.report.html import render_html
from servetune.report.markdown import render_markdown
from servetune.report.points import parse_slo_lines
from servetune.report.study import load_study
from servetune.results import LevelResult
from servetune.space_file import load_space
from servetune.study.objectives import objectives_and_constraints, told_level
from tests.builders import level, study_info, trial, write_study


def parsed(result: LevelResult, share: float | None) -> LevelResult:
    """``result`` with ``share`` of its structured answers parsed as asked (None: it asked for none)."""
    return result.model_copy(update={"summary": result.summary.model_copy(update={"structured_valid": share})})


def test_a_floor_on_structured_valid_breaks_below_it_and_names_it():
    slo = Slo.parse("ttft_ms.p99=2000,structured_valid.min=0.99")
    (floor,) = [b for b in slo.bounds if b.metric == STRUCTURED_VALID]
    assert floor.lower and floor.limit == 0.99 and str(floor) == "structured_valid >= 0.99"
    assert slo.request_bounds_ms() == {"ttft_ms": 2000}  # not a per-request latency: goodput ignores it
    at = level(8, 400, 300)
    assert slo.violations(parsed(at, 1.0).summary) == []
    assert slo.violations(parsed(at, 0.99).summary) == []  # the floor itself meets it
    assert slo.violations(parsed(at, 0.95).summary) == ["structured_valid = 0.95 < 0.99"]
    assert slo.violations(at.summary) == ["structured_valid not measured"]


@pytest.mark.parametrize(
    "text, needle",
    [
        ("structured_valid=0.99", "structured_valid takes a lower bound: structured_valid.min=0.99"),
        ("structured_valid.p99=0.99", "structured_valid takes a lower bound"),
        ("structured_valid.min=1.5", "less than or equal to 1"),
        ("ttft_ms.min=100", "unknown statistic 'min'"),
    ],
)
def test_a_bad_floor_is_one_clear_line(text, needle):
    with pytest.raises(UserError, match=needle) as info:
        Slo.parse(text)
    assert "\n" not in str(info.value)


def test_only_structured_valid_takes_a_floor_and_it_takes_nothing_else():
    with pytest.raises(ValueError, match="takes an upper bound"):
        SloBound(metric="ttft_ms", stat="p99", min=0.5)
    with pytest.raises(ValueError, match="takes a lower bound"):
        SloBound(metric=STRUCTURED_VALID, max=0.5)


def test_the_search_is_told_how_far_below_the_floor_a_level_is():
    slo = Slo.parse("ttft_ms.p99=2000,structured_valid.min=0.99")
    low = parsed(level(8, 400, 300, violations=("structured_valid = 0.9 < 0.99",)), 0.90)
    high = parsed(level(16, 700, 600), 1.0)
    result = trial("t", {"max_num_seqs": 16}, [low, high])
    _, slack = objectives_and_constraints(result, [Objective(metric="goodput", mode="max")], slo)
    assert slack[1] <= 0  # its best level meets the floor
    broken = trial("b", {"max_num_seqs": 16}, [parsed(level(8, 400, 300), 0.5), parsed(level(16, 700, 600), 0.9)])
    assert told_level(broken, slo) == 1  # the level that broke the floor least
    _, slack = objectives_and_constraints(broken, [Objective(metric="goodput", mode="max")], slo)
    assert slack[1] == pytest.approx(1 - 0.9 / 0.99) and slack[1] > 0


HEAD = "name: t\nmodel: tiny\ndevice: cpu\nengine_args: {max_model_len: 1024}\n"


def test_the_space_refuses_a_floor_its_workload_cannot_measure(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(HEAD + "workload: cpu-tiny\nslo: {structured_valid: {min: 0.99}}\n")
    with pytest.raises(UserError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(f"{path}: slo.structured_valid: the workload 'cpu-tiny' asks for no structured output")
    assert "\n" not in message
    path.write_text(HEAD + "workload: agent\nslo: {error_rate: 0.01, structured_valid: {min: 0.99}}\n")
    bounds = load_space(path).slo_bounds.bounds
    assert [str(b) for b in bounds] == ["error_rate <= 0.01", "structured_valid >= 0.99"]
    path.write_text(HEAD + "workload: agent\nslo: {structured_valid: 0.99}\n")
    with pytest.raises(UserError, match=r"slo\.structured_valid"):
        load_space(path)


def test_the_run_command_says_so_in_one_line_without_a_traceback(tmp_path, capsys, no_ray):
    from servetune.cli import main

    path = tmp_path / "space.yaml"
    path.write_text(HEAD + "workload: cpu-tiny\nslo: {structured_valid: {min: 0.99}}\n")
    code = main(["run", str(path), "--dry-run", "--storage", str(tmp_path / "r")])  # in-process: no traceback
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "slo.structured_valid: the workload 'cpu-tiny' asks for no structured output" in err


def structured_trials():
    """t16 measured structured output at each level and broke the floor at the highest load; t32 asked for none."""
    broke = ("structured_valid = 0.9 < 0.95",)
    return [
        trial(
            "t16",
            {"max_num_seqs": 16},
            [parsed(level(8, 400, 300), 0.975), parsed(level(16, 700, 600, violations=broke), 0.9)],
        ),
        trial("t32", {"max_num_seqs": 32}, [level(8, 500, 300), level(16, 800, 500)]),
    ]


def test_the_report_shows_structured_valid_where_measured_in_markdown_and_html(tmp_path):
    floor = SloBound(metric=STRUCTURED_VALID, min=0.95)
    info = study_info(slo=["ttft_ms_p99 <= 2000", str(floor)], slo_bounds=[SloBound(metric="ttft_ms", stat="p99", max=2000), floor])  # fmt: skip
    report = build_report(load_study(write_study(tmp_path / "s", info, structured_trials())))
    rows = {row.trial_id: row for row in report.trial_table}
    assert rows["t32"].structured is None  # it asked for no structured output: nothing to show
    shown = rows["t16"].structured
    assert rows["t16"].numbers_level == "concurrency 8"  # the best level meeting the SLO
    assert shown == "97.5% of structured answers parsed as asked; lowest 90.0% at concurrency 16"
    text = render_markdown(report)
    section = text.split("### Structured output", 1)[1]
    assert f"trial t16 ({rows['t16'].numbers_level}): {shown}" in section and "trial t32" not in section
    assert "`structured_valid >= 0.95`" in text  # the SLO line names the floor
    html = render_html(report)
    assert "<h3>Structured output</h3>" in html and "97.5% of structured answers parsed as asked" in html
    assert "structured_valid &gt;= 0.95" in html
    assert "structured output parsed: 97.5%" in html  # a point's hover


def test_a_report_without_structured_output_has_no_such_section(tmp_path):
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), [structured_trials()[1]])))
    assert "Structured output" not in render_markdown(report) and "Structured output" not in render_html(report)


def test_slo_lines_read_back_a_floor_from_its_text():
    (line,) = parse_slo_lines(["structured_valid >= 0.99"])
    assert line.lower and line.max == 0.99 and str(line) == "structured_valid >= 0.99"


def test_bench_refuses_a_floor_its_workload_cannot_measure(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "servetune", "bench", "--workload", "cpu-tiny", "--slo", "structured_valid.min=0.9",
         "--url", "http://127.0.0.1:9", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--slo structured_valid: the workload 'cpu-tiny' asks for no structured output" in done.stderr


def test_mlflow_gets_structured_valid_per_level_where_measured():
    from servetune.tracking.fields import level_metrics

    measured, free = level_metrics(structured_trials()[0]), level_metrics(structured_trials()[1])
    assert [values[STRUCTURED_VALID] for values in measured] == [0.975, 0.9]
    assert all(STRUCTURED_VALID not in values for values in free)
