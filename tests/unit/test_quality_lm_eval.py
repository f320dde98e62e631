"""lm-evaluation-harness tasks as quality scores, without an engine: the space's ``quality.lm_eval``
section and its checks, lm-eval's command line, reading its results JSON, and the timeout."""

import json
import sys
import time

import pytest

from servetune.errors import UserError
from servetune.quality import lm_eval
from servetune.quality.lm_eval import LmEvalPlan, lm_eval_argv, primary_scores, run_lm_eval, sample_rows
from servetune.quality.probe import compare, make_plan
from servetune.results import ReferenceAnswers
from servetune.space_file import load_space
from servetune.study.searcher import constraint_names
from tests.processes import processes_mentioning
from tests.unit.test_quality import SPACE

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: items.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 8}}
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

#: The parts of lm-eval 0.4.13's results JSON that servetune reads (the shape it wrote for tiny_echo).
RESULTS = {
    "results": {
        "mine": {"alias": "mine", "exact_match,none": 0.4, "exact_match_stderr,none": 0.2449},
        "filtered": {
            "alias": "filtered",
            "acc,strict": 0.25,
            "acc_stderr,strict": 0.1,
            "acc,none": 0.75,
            "acc_stderr,none": 0.1,
        },
        "ppl": {"alias": "ppl", "word_perplexity,none": 31.5},
        "loose": {"alias": "loose", "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.1},
    },
    "configs": {
        "mine": {"metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
        "filtered": {"metric_list": [{"metric": "acc"}, {"metric": "f1"}]},
        "ppl": {"metric_list": [{"metric": "word_perplexity"}]},
        "loose": {"metric_list": [{"metric": "exact_match"}]},
    },
    "higher_is_better": {"mine": {"exact_match": True}, "ppl": {"word_perplexity": False}},
}


def space(tmp_path, quality: str):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE.format(quality=quality))
    return load_space(path)


def task_folder(tmp_path, *names: str):
    folder = tmp_path / "lm_eval_tasks"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / f"{name}.yaml").write_text(TASK.format(name=name))
    (folder / "items.jsonl").write_text(
        "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    return folder


# --- the space's section ----------------------------------------------------------------------


def test_lm_eval_tasks_are_bounded_scores_and_constraints(tmp_path):
    pytest.importorskip("lm_eval")
    task_folder(tmp_path, "mine", "other")
    s = space(tmp_path, "quality: {suites: [agreement], lm_eval: {tasks: [mine, other], include_path: lm_eval_tasks, limit: 3},"
                        " max_drop: {lm_eval/mine: 0.1, lm_eval/other: null}}")  # fmt: skip
    assert s.quality_bounds == {"agreement": 0.05, "lm_eval/mine": 0.1}
    assert constraint_names(s) == ["ttft_ms_p99", "quality.agreement", "quality.lm_eval/mine", "ran"]
    plan = make_plan(s.quality, tmp_path, {})
    assert plan.lm_eval.include_path == str(tmp_path / "lm_eval_tasks") and plan.lm_eval.limit == 3
    before = plan.digest_key()
    (tmp_path / "lm_eval_tasks" / "items.jsonl").write_text('{"question": "9+1=", "answer": "10"}\n')
    assert make_plan(s.quality, tmp_path, {}).digest_key() != before  # other task data: another trial id
    no_lm_eval = make_plan(space(tmp_path, "quality: {suites: [agreement]}").quality, tmp_path, {})
    assert "lm_eval" not in no_lm_eval.digest_key()  # trials of spaces without lm-eval keep their ids


@pytest.mark.parametrize(
    "quality, needle",
    [
        ("lm_eval: {tasks: []}", "list at least one task"),
        ("lm_eval: {tasks: [mine, mine], include_path: lm_eval_tasks}", "a task is listed twice"),
        ("lm_eval: {tasks: [mine], include_path: lm_eval_tasks, limit: 0}", "limit"),
        ("lm_eval: {tasks: [mine], include_path: lm_eval_tasks, tsks: 1}", "tsks"),
        ("lm_eval: {tasks: [mine], include_path: nowhere}", "quality.lm_eval: include_path: "),
        ("lm_eval: {tasks: [mine]}, max_drop: {lm_eval/other: 0.1}", "max_drop: 'lm_eval/other' is not a listed suite"),
    ],
)
def test_a_bad_lm_eval_section_is_one_line(tmp_path, quality, needle):
    task_folder(tmp_path, "mine")
    with pytest.raises(UserError) as exc:
        space(tmp_path, "quality: {suites: [agreement], " + quality + "}")
    assert (
        needle in str(exc.value)
        and str(exc.value).startswith(str(tmp_path / "space.yaml"))
        and "\n" not in str(exc.value)
    )


def test_lm_eval_not_installed_says_which_extra(tmp_path, monkeypatch):
    task_folder(tmp_path, "mine")
    monkeypatch.setattr(lm_eval, "find_spec", lambda name: None)
    with pytest.raises(UserError) as exc:
        space(tmp_path, "quality: {lm_eval: {tasks: [mine], include_path: lm_eval_tasks}}")
    assert (
        str(exc.value)
        == f"{tmp_path / 'space.yaml'}: quality.lm_eval: lm-eval is not installed: pip install servetune[lm-eval]"
    )


def test_an_unknown_task_is_named_before_any_engine_starts(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    task_folder(tmp_path, "mine")
    real = lm_eval._known_tasks
    # lm-eval's own index takes many seconds to build; the include path's is built for real.
    monkeypatch.setattr(
        lm_eval, "_known_tasks", lambda include, defaults: {"gsm8k"} if defaults else real(include, False)
    )
    with pytest.raises(UserError) as exc:
        space(tmp_path, "quality: {lm_eval: {tasks: [mine, mien], include_path: lm_eval_tasks}}")
    assert "quality.lm_eval: tasks: unknown task 'mien' (in " in str(exc.value)
    assert space(tmp_path, "quality: {lm_eval: {tasks: [mine, gsm8k], include_path: lm_eval_tasks}}").quality.lm_eval


# --- running it and reading what it wrote ------------------------------------------------------


def test_the_command_points_local_completions_at_the_trial_server(tmp_path):
    plan = LmEvalPlan(tasks=["mine", "other"], include_path="/tasks", limit=5, num_fewshot=0)
    argv = lm_eval_argv(plan, "http://127.0.0.1:8123", "served", "/models/tiny", tmp_path, 512, 4, python="/py")
    assert argv[:2] == ["/py", "-c"] and argv[3:7] == ["run", "--model", "local-completions", "--model_args"]
    assert argv[2].rstrip().endswith("cli_evaluate()")  # lm-eval's own CLI, after OWN_TASKS_ONLY
    args = dict(kv.split("=", 1) for kv in argv[7].split(","))
    assert args["base_url"] == "http://127.0.0.1:8123/v1/completions" and args["model"] == "served"
    assert args["tokenizer"] == "/models/tiny" and args["tokenized_requests"] == "False" and args["max_length"] == "512"
    assert argv[argv.index("--tasks") + 1] == "mine,other" and argv[argv.index("--include_path") + 1] == "/tasks"
    assert argv[argv.index("--limit") + 1] == "5" and argv[argv.index("--num_fewshot") + 1] == "0"


def test_tasks_all_in_the_include_path_leave_lm_eval_s_own_index_out(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from servetune.quality.lm_eval import OWN_TASKS_ONLY

    folder = task_folder(tmp_path, "mine")
    monkeypatch.setattr(TaskManager, "__init__", TaskManager.__init__)  # undone after the test
    original = TaskManager.__init__
    monkeypatch.setattr(sys, "argv", ["-c", "run", "--tasks", "mine,hellaswag", "--include_path", str(folder)])
    exec(OWN_TASKS_ONLY, {})
    assert TaskManager.__init__ is original  # a task of lm-eval's own: its index is needed
    monkeypatch.setattr(sys, "argv", ["-c", "run", "--tasks", "mine", "--include_path", str(folder)])
    exec(OWN_TASKS_ONLY, {})
    assert TaskManager(include_path=str(folder)).all_tasks == ["mine"]  # as lm-eval's CLI builds it: no default task


def test_each_task_scores_its_primary_metric():
    scores, errors = primary_scores(RESULTS, ["mine", "filtered", "ppl", "loose", "absent"])
    assert scores == {"lm_eval/mine": 0.4, "lm_eval/filtered": 0.75, "lm_eval/loose": 0.5}  # unfiltered where it can
    assert errors == ["lm-eval: task ppl's word_perplexity (31.5) is not a 0..1 score where higher is better",
                      "lm-eval: no metric for task absent in its results"]  # fmt: skip


def test_samples_become_quality_rows(tmp_path):
    sample = {"doc_id": 2, "arguments": {"gen_args_0": {"arg_0": "2+1=", "arg_1": {"until": ["\n"]}}},
              "target": "3", "filtered_resps": ["3"], "exact_match": 1.0}  # fmt: skip
    (tmp_path / "samples_mine_2026-12-01T07-00-00.jsonl").write_text(json.dumps(sample) + "\n")
    assert sample_rows(tmp_path, ["mine"], RESULTS) == [
        {"suite": "lm_eval/mine", "id": "mine-2", "prompt": "2+1=", "answer": "3", "target": "3", "passed": True}
    ]


def test_lm_eval_scores_are_bounded_against_the_reference():
    ref = ReferenceAnswers(trial_id="ref", params={}, scores={"lm_eval/mine": 0.6})
    result = compare([], [], {"lm_eval/mine": 0.2}, ref, {"lm_eval/mine": 0.1})
    assert result.drops["lm_eval/mine"] == pytest.approx(0.4) and result.failures == ["lm_eval/mine dropped 0.4 > 0.1"]
    assert compare([], [], {}, ref, {"lm_eval/mine": 0.1}).failures == ["lm_eval/mine not measured"]


def test_a_run_past_its_timeout_is_stopped_with_its_process_group(tmp_path):
    pytest.importorskip("lm_eval")
    folder = task_folder(tmp_path, "mine")
    plan = LmEvalPlan(tasks=["mine"], include_path=str(folder), timeout_s=2)
    started = time.monotonic()
    outcome = run_lm_eval(plan, "http://127.0.0.1:9", "m", "/nowhere", tmp_path / "out")  # killed while importing
    assert time.monotonic() - started < 10 and outcome.scores == {}
    assert outcome.errors[0].startswith("lm-eval: no result after 2 s (stopped; log in ")
    assert processes_mentioning("lm_eval", tmp_path / "out") == []  # lm-eval and anything it started


def test_a_reference_without_an_lm_eval_score_stops_the_study_with_why(tmp_path):
    from servetune.results import QualityResult
    from servetune.study.driver import REFERENCE_FILE, keep_reference
    from servetune.trial.context import StudyContext, resolve_levels
    from servetune.trial.runner import new_result

    task_folder(tmp_path, "mine")
    s = space(tmp_path, "quality: {suites: [agreement], lm_eval: {tasks: [mine], include_path: lm_eval_tasks},"
                        " reference: {dtype: float32, max_num_seqs: 4}}")  # fmt: skip
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(
        s,
        workload,
        tmp_path,
        "m",
        resolve_levels(s, workload),
        quality=make_plan(s.quality, tmp_path, s.quality_reference),
    )
    spec = context.spec_for(s.quality_reference)
    answers = ReferenceAnswers(
        trial_id=spec.trial_id, params=s.quality_reference, prompt_ids=[[1]], continuations=[[2]], nll=[0.5]
    )
    probe = QualityResult(
        reference_trial=spec.trial_id, reference_answers=answers, errors=["lm-eval exited 1: no data"]
    )
    spec.trial_dir.mkdir(parents=True)
    (spec.trial_dir / "result.json").write_text(
        new_result(spec, "COMPLETE").model_copy(update={"quality": probe}).model_dump_json()
    )
    with pytest.raises(UserError, match=r"has no lm_eval/mine score to compare with: lm-eval exited 1: no data"):
        keep_reference(context)
    assert not (tmp_path / REFERENCE_FILE).exists()
    answers.scores = {"lm_eval/mine": 0.5}
    (spec.trial_dir / "result.json").write_text(
        new_result(spec, "COMPLETE").model_copy(update={"quality": probe}).model_dump_json()
    )
    assert keep_reference(context).quality.reference.scores == {"lm_eval/mine": 0.5}


def test_an_lm_eval_that_sigkill_does_not_end_is_left_after_a_bounded_wait():
    """A process stuck in the kernel outlives SIGKILL: the trial goes on rather than wait on it for good."""
    import subprocess

    class Stuck:
        pid = 2**22 + 12345  # beyond any pid this host hands out: its group is gone already

        def __init__(self) -> None:
            self.waits: list[float | None] = []

        def wait(self, timeout: float | None = None) -> int:
            self.waits.append(timeout)
            if timeout is None:
                raise AssertionError("an unbounded wait would hang here")
            raise subprocess.TimeoutExpired("lm_eval", timeout)

    stuck = Stuck()
    lm_eval._kill_group(stuck, wait_s=0.5)  # type: ignore[arg-type]
    assert stuck.waits == [0.5]
