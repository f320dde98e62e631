"""Reading a study directory, and the made-up studies the other report tests build on."""

from __future__ import annotations

import subprocess
import sys

import pytest

from servetune.errors import UserError
from servetune.report import build_report, load_study
from tests.builders import demo_study, study_info, write_study


def test_loads_every_trial_and_lists_the_ones_without_a_result(tmp_path):
    study = load_study(demo_study(tmp_path / "demo"))
    assert study.info.name == "demo"
    assert sorted(t.trial_id for t in study.trials) == ["t16", "t256", "t32", "t64"]
    assert [n.path.name for n in study.not_read] == ["t-running"]
    assert "no result.json" in study.not_read[0].why


def test_counts_by_outcome_include_not_read(tmp_path):
    report = build_report(load_study(demo_study(tmp_path / "demo")))
    assert report.outcome_counts() == {"COMPLETE": 2, "INFEASIBLE": 1, "FAILED": 1, "not read": 1}
    reasons = {r.outcome: r for r in report.failure_reasons()}
    assert reasons["FAILED"].trial_ids == ("t64",) and "CUDA out of memory" in reasons["FAILED"].reason
    assert [t.trial_id for t in report.trials if t.out_of_memory] == ["t256", "t64"]


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda root: None, "no such study directory"),
        (lambda root: root.mkdir() or None, "study.json: no such file"),
        (lambda root: (root.mkdir(), (root / "study.json").write_text("{")), "study.json: not valid JSON"),
        (lambda root: (root.mkdir(), (root / "study.json").write_text('{"name": "x"}')), "study.json: created: Field required"),
    ],
)  # fmt: skip
def test_bad_study_dir_is_one_clear_line(tmp_path, damage, needle):
    root = tmp_path / "study"
    damage(root)
    with pytest.raises(UserError) as err:
        load_study(root)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_broken_result_names_the_file_and_field_or_is_counted_when_skipping(tmp_path):
    root = demo_study(tmp_path / "demo")
    broken = root / "trials" / "t32" / "result.json"
    broken.write_text(broken.read_text().replace('"outcome": "COMPLETE"', '"outcome": "DONE"'))
    with pytest.raises(UserError) as err:
        load_study(root)
    assert str(err.value).startswith(f"{broken}: outcome: Input should be 'COMPLETE'")
    study = load_study(root, skip_unreadable=True)
    assert sorted(n.path.name for n in study.not_read) == ["t-running", "t32"]
    assert "outcome" in next(n for n in study.not_read if n.path.name == "t32").why


def test_unknown_objective_or_slo_metric_is_a_user_error(tmp_path):
    root = write_study(tmp_path / "a", study_info(objectives=[("ttft_p99", "min")]), [])
    with pytest.raises(UserError, match=r"objectives\.0: unknown metric 'ttft_p99'"):
        build_report(load_study(root))
    root = write_study(tmp_path / "b", study_info(slo=["ttft_p99 <= 3"]), [])
    with pytest.raises(UserError, match=r"slo\[0\]: unknown metric 'ttft_p99'"):
        build_report(load_study(root))


def test_empty_study_has_no_recommendation(tmp_path):
    report = build_report(load_study(write_study(tmp_path / "e", study_info(), [])))
    assert report.points == () and report.recommendation.point is None
    assert "no configuration met every SLO" in report.recommendation.reason


def test_report_reads_from_disk_only_no_trial_study_engine_server_ray_or_vllm():
    code = (
        "import sys, servetune.report, servetune.report.html, servetune.report.png, servetune.report.export\n"
        "bad = ('servetune.trial', 'servetune.study', 'servetune.engine.server', 'ray', 'vllm', 'torch')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in bad or m.startswith(bad[:3])))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
