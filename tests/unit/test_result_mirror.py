import json
from types import SimpleNamespace

from servetune.config.space import SearchSpace
from servetune.study.mirror import RESULT_KEY, ResultMirror, final_report
from servetune.trial.context import StudyContext, resolve_levels
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
    (tmp_path / "trials" / "abc123" / "result.json").write_text(
        result.model_copy(update={"reason": "mine"}).model_dump_json()
    )
    mirror.on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    assert load_result(tmp_path / "trials" / "abc123").reason == "mine"
    assert RESULT_KEY in report and report["servetune_trial_id"] == "abc123"


def test_a_trial_whose_process_died_is_recorded_as_failed(tmp_path):
    space = SearchSpace.model_validate(
        {"name": "s", "model": "m", "workload": "cpu-tiny", "engine_args": {"enforce_eager": True}}
    )
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload))
    (tmp_path / "error.txt").write_text(
        "Traceback...\nray.exceptions.NodeDiedError: the node running this trial died\n"
    )
    dead = SimpleNamespace(
        trial_id="tune_1", config={"params": {"max_num_seqs": 4}}, error_file=str(tmp_path / "error.txt")
    )
    ResultMirror(context).on_trial_error(0, [], dead)
    spec = context.spec_for({"max_num_seqs": 4})
    result = load_result(spec.trial_dir)
    assert result.outcome == "FAILED" and "NodeDiedError" in result.reason and result.params == {"max_num_seqs": 4}
    assert result.engine_args == {"enforce_eager": True, "max_num_seqs": 4}


def test_the_trial_s_files_come_back_in_its_final_report_and_leave_tune_s_logs(tmp_path):
    from servetune.study.mirror import ENGINE_LOG_CARRIED, FILES_KEY, carried_files

    space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny"})
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path / "driver", "m", resolve_levels(space, workload))
    node = tmp_path / "node" / "abc123"  # the trial's directory on its node
    node.mkdir(parents=True)
    (node / "requests.jsonl").write_text('{"level": 0}\n')
    (node / "quality.jsonl").write_text('{"prompt": 0}\n')
    (node / "lm_eval_results.json").write_text('{"results": {}}\n')
    (node / "engine.log").write_bytes(b"start\n" + b"x" * ENGINE_LOG_CARRIED + b"\nthe end\n")
    (node / "core.1234").write_bytes(b"not carried")
    files, fetch = carried_files(node)
    assert fetch == {}  # with no node to fetch from, everything rides in the report
    assert set(files) == {"requests.jsonl", "quality.jsonl", "lm_eval_results.json", "engine.log"}
    assert files["engine.log"].endswith("the end\n") and "start" not in files["engine.log"]
    assert files["engine.log"].startswith(f"[servetune: the engine log's last {ENGINE_LOG_CARRIED} of")
    result = trial("abc123", {"max_num_seqs": 8}, [level(1, 100, 50)])
    report = {**final_report(result, context), FILES_KEY: json.dumps({**files, "../escape": "no"})}
    ResultMirror(context).on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
    kept = tmp_path / "driver" / "trials" / "abc123"
    assert (kept / "requests.jsonl").read_text() == '{"level": 0}\n' and (kept / "quality.jsonl").exists()
    assert (kept / "lm_eval_results.json").read_text() == '{"results": {}}\n'
    assert (kept / "engine.log").read_text() == files["engine.log"]
    assert load_result(kept) == result
    assert FILES_KEY not in report  # taken out before Tune's loggers write the report again
    assert not (tmp_path / "driver" / "trials" / "escape").exists() and not (tmp_path / "driver" / "escape").exists()


def test_files_past_the_inline_limit_are_named_for_the_driver_to_fetch_from_the_trials_node(tmp_path):
    from servetune.study.mirror import INLINE_LIMIT, carried_files

    (tmp_path / "requests.jsonl").write_text("x" * (INLINE_LIMIT + 1))
    (tmp_path / "quality.jsonl").write_text('{"prompt": 0}\n')
    inline, fetch = carried_files(tmp_path, "node-1")
    assert set(inline) == {"quality.jsonl"}
    assert fetch == {"node_id": "node-1", "files": {"requests.jsonl": str((tmp_path / "requests.jsonl").resolve())}}
