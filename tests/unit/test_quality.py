"""The quality probe's parts that need no engine: items and their rules, suites, the space's
``quality:`` section, scoring against the reference, and quality as a constraint and in reports."""

import json

import pytest

from servetune.errors import UserError
from servetune.quality.items import QualityItem, read_suite
from servetune.quality.probe import common_prefix_share, compare, make_plan
from servetune.quality.suites import SHIPPED, agreement_prompts, recall_items, shipped_dir, shipped_items, suite_text
from servetune.report.conclusion import conclude
from servetune.report.points import outline, trial_points
from servetune.report.quality import lower_precision, precision_rule
from servetune.report.recommend import recommend
from servetune.results import QualityResult, ReferenceAnswers
from servetune.space_file import load_space
from servetune.study.early_stop import FinishedPoints
from servetune.study.objectives import objectives_and_constraints
from servetune.study.searcher import constraint_names
from tests.builders import level, trial

SPACE = """
name: q
model: tiny
device: cpu
workload: cpu-tiny
hardware: {{devices_per_node: 2}}
engine_args: {{max_model_len: 1024}}
params:
  dtype: [float32, bfloat16]
  max_num_seqs: [4, 16]
slo: {{ttft_ms: {{p99: 1000}}}}
{quality}
"""


def space(tmp_path, quality: str):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE.format(quality=quality))
    return load_space(path)


# --- items -----------------------------------------------------------------------------------


def test_rules_score_answers():
    assert QualityItem(prompt="2+2=", expected="4").passes(" 4, and more")
    assert not QualityItem(prompt="2+2=", expected="4").passes(" 5")
    assert QualityItem(prompt="x", regex=r"^\s*[A-Z]+\b").passes(" PARIS is")
    assert not QualityItem(prompt="x", regex=r"^\s*[A-Z]+\b").passes(" paris")
    schema = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
    item = QualityItem(prompt="x", json_schema=schema)
    assert item.passes('```json\n{"name": "Ada"}\n```')
    assert item.passes('Sure: {"name": "Ada"} there you go')
    assert not item.passes('{"name": 3}')
    assert not item.passes("no json here")
    assert not item.passes(None)


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        # json.loads's other ValueError (no .msg): an integer past Python's 4300-digit limit
        ('{"prompt": "x", "expected": ' + "1" * 5000 + "}", "bad.jsonl:2: not valid JSON (Exceeds the limit"),
        ('{"prompt": "x"}', "bad.jsonl:2: give exactly one of 'expected', 'regex' or 'json_schema'"),
        (
            '{"prompt": "x", "messages": [{"role": "user", "content": "y"}], "expected": "1"}',
            "bad.jsonl:2: give exactly one of 'prompt' or 'messages'",
        ),
        ('{"prompt": "x", "regex": "("}', "bad.jsonl:2: regex: regex does not compile"),
        (
            '{"prompt": "x", "json_schema": {"type": "nonsense"}}',
            "bad.jsonl:2: json_schema: json_schema is not a valid JSON Schema",
        ),
        ('{"prompt": "x", "expected": "1", "answer": 2}', "bad.jsonl:2: answer: unknown key"),
        ("[1, 2]", "bad.jsonl:2: expected a JSON object"),
    ],
)
def test_a_bad_suite_line_names_the_file_and_line(tmp_path, line, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "expected": "1"}\n' + line + "\n")
    with pytest.raises(UserError) as exc:
        read_suite(path)
    assert needle in str(exc.value)


def test_shipped_suites_are_what_the_generator_makes():
    for name in SHIPPED:
        path = shipped_dir() / f"{name}.jsonl"
        assert path.read_text() == suite_text(shipped_items(name)), (
            f"regenerate: python -m servetune.quality.suites ({name})"
        )
        assert len(read_suite(path)) >= 12
    assert agreement_prompts(8) == agreement_prompts(8) and len(set(agreement_prompts(32))) == 32


def test_recall_items_fit_the_window_at_three_lengths_and_depths():
    count = len  # one token per character, like the tiny model's tokenizer
    items = recall_items(count, max_model_len=1024, limit=16384)
    assert len(items) == 9
    lengths = sorted({count(i.prompt) for i in items})
    assert max(lengths) <= 1024 - 16 and min(lengths) < 400
    for item in items:
        assert f"The secret code is {item.expected}." in item.prompt
    capped = recall_items(count, max_model_len=100_000, limit=2000)
    assert max(count(i.prompt) for i in capped) <= 2000


# --- the space's quality section ---------------------------------------------------------------


def test_quality_section_defaults_and_bounds(tmp_path):
    s = space(
        tmp_path,
        "quality: {suites: [agreement, json, recall], max_drop: {agreement: 0.1, nll_delta: 0.5, recall: null}}",
    )
    assert s.quality_bounds == {"agreement": 0.1, "json": 0.02, "nll_delta": 0.5}
    assert s.quality_reference == {}
    assert constraint_names(s) == ["ttft_ms_p99", "quality.agreement", "quality.json", "quality.nll_delta", "ran"]


@pytest.mark.parametrize(
    "quality, needle",
    [
        ("quality: {suites: [mmlu]}", "quality.suites[0]: unknown suite 'mmlu'"),
        ("quality: {suites: [missing.jsonl]}", "quality.suites[0]: suite 'missing.jsonl':"),
        ("quality: {suites: [agreement], max_drop: {json: 0.1}}", "max_drop: 'json' is not a listed suite"),
        ("quality: {reference: {dtype: float16, max_num_seqs: 4}}", "quality.reference: dtype='float16' is not among"),
        (
            "quality: {reference: {dtype: float32}}",
            "quality.reference: give a value for every parameter (missing: max_num_seqs)",
        ),
        (
            "quality: {reference: {block_size: 16, dtype: float32, max_num_seqs: 4}}",
            "quality.reference: 'block_size' is not a parameter",
        ),
        ("quality: {suites: [bad.jsonl]}", "quality.suites[0]: "),
        ("quality: {suites: [agreement]}\nsearch: {algorithm: tpe}\nconstraints: [modle != 'x']", "'modle' is neither"),
    ],
)
def test_bad_quality_section_is_one_line(tmp_path, quality, needle):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(UserError) as exc:
        space(tmp_path, quality)
    assert needle in str(exc.value) and str(exc.value).startswith(str(tmp_path / "space.yaml"))
    assert "\n" not in str(exc.value)


def test_user_suite_is_read_into_the_plan(tmp_path):
    (tmp_path / "mine.jsonl").write_text(json.dumps({"prompt": "1+1=", "expected": "2"}) + "\n")
    s = space(tmp_path, "quality: {suites: [agreement, mine.jsonl], reference: {dtype: float32, max_num_seqs: 4}}")
    plan = make_plan(s.quality, tmp_path, s.quality_reference)
    assert plan.suites == ["agreement", "mine"] and plan.items["mine"][0].expected == "2"
    assert plan.bounds == {"agreement": 0.05, "mine": 0.02}
    assert plan.digest_key()["reference"] == {"dtype": "float32", "max_num_seqs": 4}


# --- scoring against the reference -----------------------------------------------------------


def reference(**overrides) -> ReferenceAnswers:
    fields = {"trial_id": "ref", "params": {}, "prompt_ids": [[1, 2], [3, 4]],
              "continuations": [[5, 6, 7, 8], [9, 10, 11, 12]], "nll": [2.0, 3.0], "scores": {"json": 0.5}}  # fmt: skip
    return ReferenceAnswers(**{**fields, **overrides})


def test_common_prefix_share():
    assert common_prefix_share([5, 6, 7, 8], [5, 6, 7, 8]) == 1.0
    assert common_prefix_share([5, 6, 0, 8], [5, 6, 7, 8]) == 0.5  # what follows a difference does not count
    assert common_prefix_share([0, 6, 7, 8], [5, 6, 7, 8]) == 0.0
    assert common_prefix_share([], []) == 1.0


def test_the_reference_against_itself_passes_everything():
    ref = reference()
    result = compare(ref.continuations, ref.nll, ref.scores, ref, {"agreement": 0.0, "json": 0.0, "nll_delta": 0.0})
    assert (result.agreement, result.exact_match, result.nll_delta, result.passed) == (1.0, 1.0, 0.0, True)


def test_a_divergent_trial_fails_the_bounds_it_breaks():
    ref = reference()
    result = compare([[5, 6, 0, 0], [9, 10, 11, 12]], [2.5, 3.5], {"json": 0.25}, ref,
                     {"agreement": 0.05, "json": 0.5, "nll_delta": 1.0})  # fmt: skip
    assert result.agreement == pytest.approx(0.75) and result.exact_match == 0.5
    assert result.nll_delta == pytest.approx(0.5) and result.drops["json"] == pytest.approx(0.25)
    assert result.passed is False and result.failures == ["agreement dropped 0.25 > 0.05"]
    loose = compare([[5, 6, 0, 0], [9, 10, 11, 12]], [2.5, 3.5], {"json": 0.25}, ref, {"agreement": 0.3})
    assert loose.passed is True


def test_a_score_that_was_not_measured_fails_its_bound():
    result = compare([[], []], [None, None], {}, reference(), {"nll_delta": 1.0, "json": 0.1})
    assert result.failures == ["nll_delta not measured", "json not measured"]


@pytest.mark.parametrize(
    ("logprobs", "expected"),
    [
        ([None, {"7": {"logprob": -1.0}}, {"8": {"logprob": -3.0}}], 2.0),  # one entry per prompt token
        (None, None),  # a server without prompt_logprobs: not measured, never a perfect 0
        ([None, {"7": {"logprob": -1.0}}], None),  # fewer entries than the continuation's tokens
    ],
)
def test_nll_needs_a_logprob_for_every_token_of_the_continuation(logprobs, expected):
    import asyncio

    from servetune.quality.probe import _Probe

    class Answered(_Probe):
        async def post(self, path, body):
            return {"choices": [{"prompt_logprobs": logprobs}]}

    async def nll():
        return await Answered(None, "http://unused", "m", 1, 1.0).nll([5], [7, 8])

    assert asyncio.run(nll()) == expected


# --- quality as a constraint, in early stopping and in the report ----------------------------


def probed(trial_id: str, params: dict, passed: bool, agreement: float, out_tps: float = 1000.0, **engine):
    t = trial(trial_id, params, [level(8, out_tps, 300)])
    t.best_level_index = 0
    t.engine_args.update(engine)
    drops = {"agreement": 1 - agreement}
    t.quality = QualityResult(reference_trial="ref", agreement=agreement, drops=drops, bounds={"agreement": 0.05},
                              failures=[] if passed else [f"agreement dropped {1 - agreement:.3g} > 0.05"], passed=passed)  # fmt: skip
    return t


def test_quality_slack_reaches_the_search(tmp_path):
    s = space(tmp_path, "quality: {suites: [agreement]}")
    good, bad = probed("a", {}, True, 0.99), probed("b", {}, False, 0.6)
    _, good_constraints = objectives_and_constraints(good, s.search.objectives, s.slo_bounds, s.quality_bounds)
    _, bad_constraints = objectives_and_constraints(bad, s.search.objectives, s.slo_bounds, s.quality_bounds)
    assert len(good_constraints) == len(constraint_names(s))
    assert good_constraints[1] < 0 < bad_constraints[1]
    bad.quality = None  # no probe result: the bound counts as broken
    assert objectives_and_constraints(bad, s.search.objectives, s.slo_bounds, s.quality_bounds)[1][1] == 1.0


def test_a_trial_failing_quality_is_never_recommended_and_stops_no_one():
    fast_bad = probed("fast", {"dtype": "bfloat16"}, False, 0.6, out_tps=3000, dtype="bfloat16")
    slow_good = probed("slow", {"dtype": "float32"}, True, 1.0, out_tps=1000, dtype="float32")
    trials = [fast_bad, slow_good]
    points = [p for t in trials for p in trial_points(t)]
    rec = recommend(points, [outline(t) for t in trials])
    assert rec.point is not None and rec.point.trial_id == "slow"
    assert next(p for p in points if p.trial_id == "fast").why_apart.startswith("quality failed: agreement dropped")
    assert conclude(fast_bad, trials).verdict == "eliminate"
    board = FinishedPoints(trials)
    assert {p.trial_id for p in board.points()} == {"slow"}


def test_section_2_rule_for_a_lower_precision_winner():
    ref = probed("ref", {"kv_cache_dtype": "auto"}, True, 1.0, out_tps=1000, dtype="bfloat16")
    fp8 = probed("fp8", {"kv_cache_dtype": "fp8"}, True, 0.97, out_tps=1300, dtype="bfloat16", kv_cache_dtype="fp8")
    assert lower_precision(fp8, ref) and not lower_precision(ref, fp8)
    points = [p for t in (ref, fp8) for p in trial_points(t)]
    winner = next(p for p in points if p.trial_id == "fp8")
    checks = precision_rule(winner, [ref, fp8], points)
    assert checks is not None and checks[0].held is True
    gain = next(c for c in checks if "15% more goodput" in c.text)
    assert gain.held is True  # 1300 against 1000 output tokens/s: 30% more
    slower = probed("fp8", {"kv_cache_dtype": "fp8"}, True, 0.97, out_tps=1100, dtype="bfloat16", kv_cache_dtype="fp8")
    points = [p for t in (ref, slower) for p in trial_points(t)]
    checks = precision_rule(next(p for p in points if p.trial_id == "fp8"), [ref, slower], points)
    assert next(c for c in checks if "15% more goodput" in c.text).held is False
    assert precision_rule(next(p for p in points if p.trial_id == "ref"), [ref, slower], points) is None


def test_the_probe_has_its_own_share_of_device_time():
    from servetune.accounting import device_time_lines, time_accounting

    t = probed("a", {}, True, 1.0)
    t.duration_s, t.startup_s, t.devices = 100.0, 30.0, 2
    t.quality.duration_s = 10.0
    out = time_accounting([t])
    measured = t.levels[0].measured_s
    assert out["quality_device_seconds"] == pytest.approx(20.0)
    assert out["other_device_seconds"] == pytest.approx(200 - 2 * measured - 60 - 20)
    assert "10% quality probe" in device_time_lines([t], "gpu", 1)[0]
    t.quality = None
    assert time_accounting([t])["quality_device_seconds"] == 0 and "quality" not in device_time_lines([t], "gpu", 1)[0]


def test_the_record_and_mlflow_carry_the_quality_results():
    from servetune.tracking.fields import trial_metrics
    from servetune.tracking.record import quality_tags, quality_text

    t = probed("a", {}, False, 0.6)
    t.quality.suites = {"arithmetic": 0.5, "json": 0.25, "tools": 0.75, "recall": 1.0}
    tags = quality_tags(t)
    assert tags["quality"].startswith("FAIL: agreement dropped") and tags["quality.reference_trial"] == "ref"
    assert (
        tags["quality.task_accuracy"] == "50% (arithmetic)" and tags["quality.structured_output"] == "50% (json, tools)"
    )
    assert tags["quality.long_context_recall"] == "100% (recall)"
    assert "agreement 60%" in quality_text(t) and "against trial ref" in quality_text(t)
    metrics = {m.key: m.value for m in trial_metrics(t)}
    assert metrics["quality/agreement"] == 0.6 and metrics["quality/passed"] == 0.0 and metrics["quality/json"] == 0.25
    t.quality = None
    assert quality_tags(t) == {"quality": "not evaluated"} and not any(
        k.startswith("quality/") for k in (m.key for m in trial_metrics(t))
    )


def test_servetune_run_with_a_bad_suite_line_exits_2_before_anything_starts(tmp_path, capsys, no_ray):
    from servetune.cli import main

    (tmp_path / "mine.jsonl").write_text('{"prompt": "1+1=", "expected": "2"}\n{"prompt": "2+2=", "expectd": "4"}\n')
    (tmp_path / "space.yaml").write_text(SPACE.format(quality="quality: {suites: [agreement, mine.jsonl]}"))
    code = main(["run", str(tmp_path / "space.yaml"), "--storage", str(tmp_path / "out")])  # in-process: no traceback
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert f"quality.suites[1]: {tmp_path / 'mine.jsonl'}:2: expectd: unknown key" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_kept_reference_is_reused_only_for_the_same_configuration(tmp_path):
    from servetune.study.driver import REFERENCE_FILE, read_reference

    assert read_reference(tmp_path, {}) is None
    (tmp_path / REFERENCE_FILE).parent.mkdir()
    (tmp_path / REFERENCE_FILE).write_text(reference(params={"dtype": "float32"}).model_dump_json())
    assert read_reference(tmp_path, {"dtype": "float32"}).continuations == reference().continuations
    assert read_reference(tmp_path, {"dtype": "bfloat16"}) is None and read_reference(tmp_path, {}) is None
    # The reference trial as the probe is now: a probe that changed (a suite added) has another id.
    assert read_reference(tmp_path, {"dtype": "float32"}, "ref") is not None
    assert read_reference(tmp_path, {"dtype": "float32"}, "0123456789ab") is None
    (tmp_path / REFERENCE_FILE).write_text("{")
    with pytest.raises(UserError, match=r"reference\.json"):
        read_reference(tmp_path, {"dtype": "float32"})


def test_checkpoints_as_a_parameter_each_checked_with_its_own_weights(tmp_path):
    from servetune.study.driver import resolve_models
    from servetune.trial.context import StudyContext, resolve_levels
    from servetune.trial.runner import capacity_check

    path = tmp_path / "space.yaml"
    path.write_text("""
name: ckpt
model: meta-llama/Llama-3.1-8B-Instruct
workload: chat
hardware: {devices_per_node: 1, gpu: L4}
engine_args: {max_model_len: 8192}
params:
  model: [meta-llama/Llama-3.1-8B-Instruct, RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8, hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4]
constraints:
  - model != 'nobody/none'
quality: {reference: {model: meta-llama/Llama-3.1-8B-Instruct}}
""")
    space = load_space(path)
    assert space.engine_params({"model": "x/y"})[0] == {"max_model_len": 8192}  # not an engine argument
    models = resolve_models(space, tmp_path, tmp_path)
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload), models=models)
    specs = {name: context.spec_for({"model": name}) for name in space.params["model"]}
    assert {name: s.model for name, s in specs.items()} == {name: name for name in space.params["model"]}
    assert len({s.trial_id for s in specs.values()}) == 3
    kv = {name: capacity_check(s).kv_cache_tokens for name, s in specs.items()}
    bf16, fp8, awq = (kv[name] for name in space.params["model"])
    assert bf16 < fp8 < awq  # lighter weights leave more of the L4's 24 GB to the KV cache
    with pytest.raises(UserError, match=r"params\.model: 'nowhere' is neither a directory nor a hub id"):
        bad = space.model_copy(update={"params": {"model": ["nowhere"]}})
        resolve_models(bad, tmp_path, tmp_path)


def test_a_reference_that_gave_no_answers_stops_the_study_with_why(tmp_path):
    from servetune.study.driver import REFERENCE_FILE, keep_reference
    from servetune.trial.context import StudyContext, resolve_levels
    from servetune.trial.runner import new_result

    s = space(tmp_path, "quality: {suites: [agreement], reference: {dtype: float32, max_num_seqs: 4}}")
    workload = s.resolved_workload(tmp_path)
    plan = make_plan(s.quality, tmp_path, s.quality_reference)
    context = StudyContext(s, workload, tmp_path, "m", resolve_levels(s, workload), quality=plan)
    with pytest.raises(
        UserError, match=r"the reference trial \(dtype=float32, max_num_seqs=4\) gave no answers.*it did not run"
    ):
        keep_reference(context)
    spec = context.spec_for(s.quality_reference)
    failed = new_result(spec, "FAILED", "engine start: vLLM exited with code 1")
    spec.trial_dir.mkdir(parents=True)
    (spec.trial_dir / "result.json").write_text(failed.model_dump_json())
    with pytest.raises(UserError, match="gave no answers to compare with: engine start: vLLM exited with code 1"):
        keep_reference(context)
    assert not (tmp_path / REFERENCE_FILE).exists()  # nothing kept from a reference that did not answer
    answered = failed.model_copy(update={"outcome": "COMPLETE", "reason": None, "quality": QualityResult(
        reference_trial=spec.trial_id, passed=True, reference_answers=reference(trial_id=spec.trial_id))})  # fmt: skip
    (spec.trial_dir / "result.json").write_text(answered.model_dump_json())
    kept = keep_reference(context)
    assert kept.quality.reference.continuations == reference().continuations and (tmp_path / REFERENCE_FILE).exists()
