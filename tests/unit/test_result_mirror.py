from types import SimpleNamespace

from servetune.config.space import SearchSpace
from servetune.study.context import StudyContext, resolve_levels
from servetune.study.driver import RESULT_KEY, ResultMirror, final_report
from servetune.trial.runner import load_result
from tests.builders import level, trial


def test_the_driver_keeps_a_copy_of_each_result(tmp_path):
    space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny"})
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload))
    result = trial("abc123", {"max_num_seqs": 8}, [level(1, 100, 50)])
    report = final_report(result, context)
    mirror = ResultMirror(tmp_path)
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), {"level_index": 0})  # a level report: nothing
    assert not (tmp_path / "trials").exists()
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    assert load_result(tmp_path / "trials" / "abc123") == result
    # A result the trial wrote itself (shared storage) is never overwritten.
    (tmp_path / "trials" / "abc123" / "result.json").write_text(result.model_copy(update={"reason": "mine"}).model_dump_json())
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    assert load_result(tmp_path / "trials" / "abc123").reason == "mine"
    assert RESULT_KEY in report and report["servetune_trial_id"] == "abc123"
