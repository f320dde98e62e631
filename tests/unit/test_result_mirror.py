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
    mirror = ResultMirror(context)
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), {"level_index": 0})  # a level report: nothing
    assert not (tmp_path / "trials").exists()
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    assert load_result(tmp_path / "trials" / "abc123") == result
    # A result the trial wrote itself (shared storage) is never overwritten.
    (tmp_path / "trials" / "abc123" / "result.json").write_text(result.model_copy(update={"reason": "mine"}).model_dump_json())
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    assert load_result(tmp_path / "trials" / "abc123").reason == "mine"
    assert RESULT_KEY in report and report["servetune_trial_id"] == "abc123"


def test_a_trial_whose_process_died_is_recorded_as_failed(tmp_path):
    space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny", "engine_args": {"enforce_eager": True}})
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload))
    (tmp_path / "error.txt").write_text("Traceback...\nray.exceptions.NodeDiedError: the node running this trial died\n")
    dead = SimpleNamespace(trial_id="tune_1", config={"params": {"max_num_seqs": 4}}, error_file=str(tmp_path / "error.txt"))
    ResultMirror(context).on_trial_error(0, [], dead)
    spec = context.spec_for({"max_num_seqs": 4})
    result = load_result(spec.trial_dir)
    assert result.outcome == "FAILED" and "NodeDiedError" in result.reason and result.params == {"max_num_seqs": 4}
    assert result.engine_args == {"enforce_eager": True, "max_num_seqs": 4}
