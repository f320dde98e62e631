"""Speculative decoding as search parameters: speculative.* -> one --speculative-config (config/speculative.py)."""

import json

import pytest

from servetune.engine.args import engine_argv, load_argspecs
from servetune.errors import UserError
from tests.builders import space_from, write_space

#: What this module's spaces have beneath builders.SPACE_HEAD.
BASE = """\
engine_args: {max_model_len: 1024}
"""


def space(tmp_path, text, argspecs=None):
    return space_from(tmp_path, BASE + text, argspecs)


def test_methods_and_fields_become_one_speculative_config_and_none_passes_no_flag(tmp_path):
    s = space(
        tmp_path,
        """
params:
  speculative.method: [none, ngram, suffix]
  speculative.num_speculative_tokens: [2, 4]
engine_args: {max_model_len: 1024, speculative.prompt_lookup_max: 3}
""",
    )
    engine, _ = s.engine_params({"speculative.method": "ngram", "speculative.num_speculative_tokens": 4})
    assert engine == {
        "max_model_len": 1024,
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    }
    argv = engine_argv(engine, load_argspecs())
    flag = argv.index("--speculative-config")
    assert json.loads(argv[flag + 1]) == engine["speculative_config"]
    engine, _ = s.engine_params({"speculative.method": "none", "speculative.num_speculative_tokens": 4})
    assert engine == {"max_model_len": 1024}
    assert "--speculative-config" not in engine_argv(engine)
    # none with 2 or 4 drafted tokens is the baseline's engine (the fixed prompt_lookup_max too): the baseline runs it
    kept, rejected = s.grid()
    assert len(kept) == 2 * 2 and {p["speculative.method"] for p in kept} == {"ngram", "suffix"}
    assert [p["speculative.method"] for p, _ in rejected] == ["none", "none"]
    assert all(reasons[0].startswith("runs the same engine as the baseline") for _, reasons in rejected)
    without_baseline = s.model_copy(update={"search": s.search.model_copy(update={"baseline": False})})
    kept, [(repeat, reasons)] = without_baseline.grid()  # without one, the first none point runs
    assert len(kept) == 1 + 2 * 2 and repeat["speculative.num_speculative_tokens"] == 4
    assert "runs the same engine as speculative.method=none, speculative.num_speculative_tokens=2" in reasons[0]
    # and with nothing else varied, none is the baseline's engine: the baseline runs it
    alone = space(tmp_path, "params: {speculative.method: [none, ngram]}\n")
    kept, [(repeat, reasons)] = alone.grid()
    assert kept == [{"speculative.method": "ngram"}] and repeat == {"speculative.method": "none"}
    assert reasons == [
        "runs the same engine as the baseline (vLLM defaults) (a speculative.* field does nothing without speculation)"
    ]


def test_space_passes_vllms_own_parser(tmp_path):
    specs = load_argspecs()
    if specs is None:
        pytest.skip("no vLLM in this interpreter")
    s = space(tmp_path, "params: {speculative.method: [ngram], speculative.prompt_lookup_min: [1, 2]}\n", specs)
    assert [p["speculative.prompt_lookup_min"] for p in s.grid()[0]] == [1, 2]


def test_a_constraint_reads_speculative_fields(tmp_path):
    s = space(
        tmp_path,
        """
params:
  speculative.method: [ngram]
  speculative.num_speculative_tokens: [1, 2, 3, 4]
constraints: ['speculative.num_speculative_tokens <= 2']
""",
    )
    assert [p["speculative.num_speculative_tokens"] for p in s.grid()[0]] == [1, 2]


def test_points_vllm_would_refuse_are_rejected_with_their_reason(tmp_path):
    s = space(
        tmp_path,
        """
params:
  speculative.method: [ngram, eagle]
  speculative.prompt_lookup_min: [2, 4]
  speculative.prompt_lookup_max: [3]
""",
    )
    kept, rejected = s.grid()
    assert kept == [
        {"speculative.method": "ngram", "speculative.prompt_lookup_min": 2, "speculative.prompt_lookup_max": 3}
    ]
    reasons = {r for _, broken in rejected for r in broken}
    assert "speculative.method=eagle drafts with a second checkpoint: set speculative.model" in reasons
    assert "speculative.prompt_lookup_min (4) is above speculative.prompt_lookup_max (3)" in reasons


def test_mtp_is_refused_for_a_checkpoint_without_mtp_heads_and_accepted_with_them(tmp_path):
    with pytest.raises(UserError) as info:
        space(tmp_path, "params: {speculative.method: [none, mtp], speculative.num_speculative_tokens: [1]}\n")
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")) and "\n" not in message
    assert "params.speculative.method: mtp needs a checkpoint with multi-token-prediction heads" in message
    model = tmp_path / "mtp-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}))
    s = space(tmp_path, f"params: {{speculative.method: [mtp], model: ['{model}']}}\n")
    assert s.grid()[0][0]["speculative.method"] == "mtp"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("params: {speculative.method: [ngram, medusa2]}\n", "speculative.method: expected one of none, ngram"),
        ("params: {speculative.method: [ngram], speculative.num_speculative_tokens: [0]}\n", "expected a whole number"),
        (
            "params: {speculative.method: [ngram], speculative.lookahead: [2]}\n",
            "speculative.lookahead: not a speculative",
        ),
        ("params: {speculative.num_speculative_tokens: [2]}\n", "give speculative.method too"),
        (
            "params: {speculative.method: [ngram]}\nengine_args: {speculative_config: {method: ngram}}\n",
            "give speculative decoding one way",
        ),
        ("engine_args: {speculative.method: eagle}\n", "drafts with a second checkpoint"),
    ],
)
def test_bad_speculative_fields_are_one_line_naming_file_and_field(tmp_path, text, needle):
    with pytest.raises(UserError) as info:
        space(tmp_path, text)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")) and "\n" not in message
    assert needle in message, message


def test_run_refuses_suffix_decoding_in_one_line_where_vllms_interpreter_lacks_arctic_inference(tmp_path, capsys):
    import importlib.util

    from servetune.cli import main

    if load_argspecs() is None or importlib.util.find_spec("arctic_inference") is not None:
        pytest.skip("needs vLLM here, without Arctic Inference (as vLLM 0.32's CPU build installs)")
    path = write_space(tmp_path, BASE + "params: {speculative.method: [none, ngram, suffix]}\n")
    storage = tmp_path / "results"
    assert main(["run", str(path), "--dry-run", "--storage", str(storage)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(path) in err
    assert "params.speculative.method: suffix decoding needs Arctic Inference beside vLLM" in err
    write_space(tmp_path, BASE + "params: {speculative.method: [none, ngram]}\n")
    assert main(["run", str(path), "--dry-run", "--storage", str(storage)]) == 0
    assert "2 trial(s) would run" in " ".join(capsys.readouterr().out.split())  # the baseline (none), ngram
    assert not storage.exists()


def test_mtp_reads_a_hub_models_config_from_the_local_hugging_face_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "hub" / "models--org--dense" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "hub" / "models--org--dense" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--dense" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    text = "params: {speculative.method: [mtp], model: [org/dense, org/not-cached]}\n"
    with pytest.raises(UserError, match="mtp needs a checkpoint with multi-token-prediction heads; org/dense's config"):
        space(tmp_path, text)
    # a model whose config is not at hand is not fetched: vLLM judges it at start-up
    assert space(tmp_path, "params: {speculative.method: [mtp], model: [org/not-cached]}\n").grid()[0]


def test_every_field_of_vllms_speculative_config_is_passed_or_said_why_not():
    """vLLM 0.32's SpeculativeConfig, read from the installed vLLM's source (no import): each field a user gives is a
    speculative.<field> servetune passes, else NOT_PASSED says why."""
    import ast
    import importlib.util
    from pathlib import Path

    from servetune.config.speculative import FIELDS, NOT_PASSED

    found = importlib.util.find_spec("vllm")
    if found is None or found.origin is None:
        pytest.skip("no vLLM in this interpreter")
    tree = ast.parse((Path(found.origin).parent / "config" / "speculative.py").read_text())
    [config] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"]
    fields = {n.target.id for n in config.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert set(FIELDS) | set(NOT_PASSED) == fields and not set(FIELDS) & set(NOT_PASSED)


def test_the_batch_size_schedule_and_the_other_fields_reach_the_speculative_config(tmp_path):
    s = space(
        tmp_path,
        """
params:
  speculative.method: [ngram]
  speculative.num_speculative_tokens_per_batch_size: [[[1, 8, 4], [9, 256, 1]], [[1, 256, 2]]]
engine_args:
  max_model_len: 1024
  speculative.num_speculative_tokens: 4
  speculative.suffix_decoding_max_cached_requests: 0
  speculative.rejection_sample_method: standard
  speculative.enforce_eager: true
""",
    )
    kept, _ = s.grid()
    assert len(kept) == 2
    engine, _ = s.engine_params(kept[0])
    assert engine["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 4, "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 256, 1]],
        "suffix_decoding_max_cached_requests": 0, "rejection_sample_method": "standard", "enforce_eager": True,
    }  # fmt: skip
    argv = engine_argv(engine, load_argspecs())
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == engine["speculative_config"]


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("num_speculative_tokens_per_batch_size", "[[1, 8]]", "a list of [first batch size, last, draft tokens]"),
        ("num_speculative_tokens_per_batch_size", "[[8, 1, 2]]", "a list of [first batch size, last, draft tokens]"),
        ("num_speculative_tokens_per_batch_size", "[[2, 8, 2]]", "the ranges from batch 1 on, none overlapping"),
        ("num_speculative_tokens_per_batch_size", "[[1, 8, 2], [8, 9, 1]]", "none overlapping"),
        ("synthetic_acceptance_rates", "[0.9, 1.5]", "a list of numbers from 0 to 1"),
        ("suffix_decoding_max_cached_requests", "-1", "a whole number, 0 or more"),
        ("dspark_draft_topk", "0", "a whole number, 1 or more"),
    ],
)
def test_a_bad_value_of_a_newer_field_is_one_line_naming_it(tmp_path, field, value, needle):
    with pytest.raises(UserError) as info:
        space(tmp_path, f"params: {{speculative.method: [ngram]}}\nengine_args: {{speculative.{field}: {value}}}\n")
    message = str(info.value)
    assert "\n" not in message and f"speculative.{field}" in message and needle in message, message
