"""The speculative step in the estimate (estimate/speculative.py): drafts cost passes, verification costs 1 + k
tokens, and a step yields the accepted length, so the gain is large at small batches and falls as they grow."""

from __future__ import annotations

import json

import pytest

from servetune import cli
from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.estimate import Load, estimate, replica_from_plan
from servetune.estimate.roofline import draft_s
from servetune.estimate.speculative import DEFAULT_ACCEPTANCE, accepted_length

TARGET = "meta-llama/Llama-3.1-8B-Instruct"
DRAFT = "meta-llama/Llama-3.2-1B-Instruct"
ARGS = {"max_model_len": 4096, "max_num_seqs": 256}
HW = resolve_hardware("gpu", "H100-SXM")


def spec(method: str = "draft_model", k: int = 3) -> dict:
    config = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        config["model"] = DRAFT
    return {**ARGS, "speculative_config": json.dumps(config)}


def tpot(args: dict, concurrency: int, acceptance: float | None = None) -> float:
    draft = load_model_arch(DRAFT) if "draft_model" in str(args.get("speculative_config")) else None
    load = Load(input_tokens=512, output_tokens=256, concurrency=concurrency)
    return estimate(load_model_arch(TARGET), args, HW, load, acceptance=acceptance, draft=draft).tpot_ms


@pytest.mark.parametrize(("a", "k", "length"), [(0.0, 3, 1.0), (1.0, 3, 4.0), (0.5, 2, 1.75), (0.8, 1, 1.8)])
def test_a_step_yields_one_token_plus_the_expected_accepted_drafts(a, k, length):
    assert accepted_length(a, k) == pytest.approx(length)


def test_an_acceptance_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match=r"acceptance 1\.2"):
        accepted_length(1.2, 3)


def test_at_one_request_the_step_is_bound_by_the_weights_and_tpot_falls_by_most_of_the_accepted_length():
    base, drafted = tpot(ARGS, 1), tpot(spec(), 1, acceptance=0.8)
    assert drafted < base / 2 < base / accepted_length(0.8, 3) * 1.5 * 2  # 2.95 tokens a step, less the drafts' cost
    assert drafted > base / accepted_length(0.8, 3)  # never more than the accepted length: drafting costs


def test_drafts_that_are_never_accepted_are_pure_cost_at_every_batch():
    for concurrency in (1, 16, 64, 256):
        assert tpot(spec(), concurrency, acceptance=0.0) > tpot(ARGS, concurrency)


def test_the_gain_falls_as_the_batch_grows_and_too_many_draft_tokens_turn_it_negative():
    # from 16 in flight on, the verification's FLOPs count: the ratio to no drafter only grows
    ratios = [tpot(spec(k=7), c, acceptance=0.6) / tpot(ARGS, c) for c in (1, 16, 64, 256)]
    assert ratios[1:] == sorted(ratios[1:]), ratios
    assert max(ratios[:2]) < 0.9 and ratios[-1] > 1.0, ratios  # the guide's "too many draft tokens" as a number
    assert tpot(spec(k=3), 256, acceptance=0.6) < tpot(spec(k=7), 256, acceptance=0.6)


def test_text_methods_draft_without_a_gpu_pass_and_the_target_reads_its_own_kv_alone():
    arch, tokens = load_model_arch(TARGET), 768
    ngram = plan_capacity(arch, spec("ngram"), HW, request_tokens=tokens)
    rep = replica_from_plan(arch, ngram, spec("ngram"))
    assert rep.speculation is not None and rep.speculation.gpu_passes == 0 and draft_s(rep, _eff(), 8, 600) == 0.0
    draft_args, draft = spec(), load_model_arch(DRAFT)
    planned = plan_capacity(arch, draft_args, HW, request_tokens=tokens, draft=draft)
    rep = replica_from_plan(arch, planned, draft_args)
    assert planned.draft is not None and planned.draft.kv_bytes_per_token > 0
    # decode_s reads the target's KV alone (a full-attention model: every layer reads the whole context)
    assert rep.kv.per_sequence(600) == 600 * (planned.kv_bytes_per_token - planned.draft.kv_bytes_per_token)
    assert rep.speculation is not None and rep.speculation.gpu_passes == 3 and draft_s(rep, _eff(), 8, 600) > 0


def _eff():
    from servetune.estimate import load_factors

    return load_factors().for_class("hopper")


def test_the_estimate_says_whether_the_acceptance_was_measured_or_assumed(capsys):
    plan = ["plan", "--model", TARGET, "--gpu", "H100-SXM", "--max-model-len", "4096", "--estimate", "--input-tokens",
            "512", "--output-tokens", "256", "--concurrency", "4", "--json",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}']  # fmt: skip
    assert cli.main(plan) == 0
    assumed = json.loads(capsys.readouterr().out)["estimate"]
    assert assumed["accepted_length"] == pytest.approx(accepted_length(DEFAULT_ACCEPTANCE["ngram"], 3))
    assert assumed["acceptance_source"].startswith("assumed (ngram")
    assert cli.main([*plan, "--acceptance", "0.9"]) == 0
    measured = json.loads(capsys.readouterr().out)["estimate"]
    assert measured["acceptance_source"] == "measured" and measured["tpot_ms"] < assumed["tpot_ms"]
