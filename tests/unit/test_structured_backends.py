"""A structured-outputs backend whose library does not load beside the engines' vLLM is refused before any engine
starts (issue #41 item 5: lm-format-enforcer 0.11.3 under vLLM 0.32 answered every structured request with HTTP 500).

The engines' interpreter is a wrapper of this one whose path puts a stand-in ``lmformatenforcer`` first: its vLLM
integration fails the way 0.11.3's does (its own "vllm is not installed" over the missing vLLM module), whatever
version this environment has.
"""

from __future__ import annotations

import sys
from html import escape as html_escape

import pytest

from servetune.engine import args as engine_args
from servetune.engine.args import load_argspecs, structured_backend_problems
from servetune.load.client import stream_error
from servetune.metrics import RequestRecord
from servetune.report.build import build_report
from servetune.report.html import render_html
from servetune.report.markdown import render_markdown
from servetune.report.study import load_study
from servetune.results import LevelResult
from servetune.summary import summarize
from tests.builders import level, study_info, trial, write_space, write_study

#: What this module's spaces have beneath builders.SPACE_HEAD.
BASE = """\
engine_args: {max_model_len: 1024}
"""


@pytest.fixture
def engine_python(tmp_path):
    """An interpreter (this one) whose engines would import a stand-in lm-format-enforcer that fails to load."""
    site = tmp_path / "site"
    package = site / "lmformatenforcer" / "integrations"
    package.mkdir(parents=True)
    (site / "lmformatenforcer" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "vllm.py").write_text(
        "try:\n    from vllm_moved_away.tokenizer import MistralTokenizer\nexcept ImportError:\n"
        "    raise ImportError('vllm is not installed. Please install it with \"pip install vllm\"')\n"
    )
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_backend_whose_library_fails_to_load_is_named_with_the_innermost_cause(engine_python, monkeypatch):
    monkeypatch.setitem(engine_args.STRUCTURED_BACKEND_MODULES, "outlines", ("servetune_absent_pkg", "absent-pkg"))
    problems = structured_backend_problems(["auto", "xgrammar", "lm-format-enforcer", "outlines"], engine_python)
    assert set(problems) == {"lm-format-enforcer", "outlines"}  # auto is vLLM's pick; xgrammar loads here
    why = problems["lm-format-enforcer"]
    # the cause under the library's own message, not "vllm is not installed"
    assert "No module named 'vllm_moved_away'" in why and "vllm is not installed" not in why
    assert "HTTP 500" in why and engine_python in why
    assert (
        problems["outlines"] == f"absent-pkg is not installed beside vLLM in {engine_python} (pip install absent-pkg)"
    )


def test_no_listed_backend_or_an_interpreter_that_cannot_be_asked_is_no_problem(tmp_path):
    assert structured_backend_problems(["auto"], str(tmp_path / "no-python")) == {}
    assert structured_backend_problems(["lm-format-enforcer"], str(tmp_path / "no-python")) == {}


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("params: {structured_outputs_config.backend: [xgrammar, lm-format-enforcer]}\n",
         "params.structured_outputs_config.backend"),
        ("engine_args: {max_model_len: 1024, structured_outputs_config.backend: lm-format-enforcer}\n",
         "engine_args.structured_outputs_config.backend"),
    ],
)  # fmt: skip
def test_run_refuses_the_backend_in_one_line_naming_file_and_field_before_any_engine(
    tmp_path, capsys, engine_python, text, field
):
    from servetune.cli import main

    if load_argspecs() is None:
        pytest.skip("needs vLLM here: without it the engines' interpreter is not asked")
    path = write_space(tmp_path, BASE + text)
    storage = tmp_path / "results"
    argv = ["run", str(path), "--dry-run", "--storage", str(storage), "--python", engine_python]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"error: {path}: {field}: lm-format-enforcer: " in err, err
    assert "No module named 'vllm_moved_away'" in err
    assert not storage.exists()
    write_space(tmp_path, BASE + "params: {structured_outputs_config.backend: [xgrammar, guidance]}\n")
    assert main(argv) == 0


def failing_structured_level(concurrency: float) -> LevelResult:
    """A level whose structured class failed as vLLM 0.32 fails it under lm-format-enforcer 0.11.3 (the stream's
    error event with code 500, the HTTP status already 200) while the chat class was answered."""
    kind, text = stream_error({"message": "Internal server error", "type": "InternalServerError", "code": 500})
    records = [
        RequestRecord(index=i, sent=0.1 * i, input_tokens=8, max_tokens=16, request_class="tool_call",
                      end=0.1 * i + 0.05, error_kind=kind, error=text)
        for i in range(3)
    ] + [
        RequestRecord(index=3 + i, sent=0.1 * i, input_tokens=8, max_tokens=16, request_class="chat",
                      chunk_times=[0.1 * i + 0.02, 0.1 * i + 0.03], end=0.1 * i + 0.04, output_tokens=2, ok=True)
        for i in range(5)
    ]  # fmt: skip
    return LevelResult(summary=summarize(records, {"concurrency": concurrency}), server_metrics={})


def test_a_level_records_why_its_structured_requests_failed_and_the_report_says_so(tmp_path):
    failing = failing_structured_level(4)
    s = failing.summary
    assert (s.failed, s.completed, s.errors_by_kind) == (3, 5, {"http_5xx": 3})
    assert s.error_examples == {"http_5xx": "HTTP 500 (in the stream): Internal server error"}
    assert s.failed_by_class == {"tool_call": 3}  # the chat class was answered
    report = build_report(
        load_study(write_study(tmp_path / "s", study_info(), [trial("t1", {"max_num_seqs": 8}, [failing]),
                                                              trial("t2", {"max_num_seqs": 16}, [level(4, 500, 300)])]))
    )  # fmt: skip
    line = (
        "trial t1, concurrency 4: 3 of 8 requests failed: http_5xx 3 (HTTP 500 (in the stream): Internal server "
        "error); by request class: tool_call 3"
    )
    section = render_markdown(report).split("### Failed requests", 1)[1].split("###", 1)[0]
    assert f"- {line}" in section and "trial t2" not in section
    html = render_html(report)
    assert "<h3>Failed requests</h3>" in html and html_escape(line) in html


def test_a_report_whose_requests_all_succeeded_has_no_failed_requests_section(tmp_path):
    report = build_report(
        load_study(write_study(tmp_path / "s", study_info(), [trial("t2", {}, [level(4, 500, 300)])]))
    )
    assert "Failed requests" not in render_markdown(report) and "Failed requests" not in render_html(report)


def test_bench_refuses_the_backend_in_one_line_before_starting_the_engine(tmp_path, capsys, engine_python):
    from servetune.cli import main

    if load_argspecs() is None:
        pytest.skip("needs vLLM here: bench asks the engines' interpreter only where vLLM is")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the refusal comes before anything reads it
    argv = ["bench", "--model", str(model), "--python", engine_python,
            "--engine-arg", "structured_outputs_config.backend=lm-format-enforcer"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "--engine-arg structured_outputs_config.backend: lm-format-enforcer: lm-format-enforcer does not load" in err
    assert "No module named 'vllm_moved_away'" in err
