"""Speculative decoding held to losslessness (quality/lossless.py): a speculative trial's greedy continuations
against the non-speculative reference's, prompt by prompt, on the probe's own path."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from servetune.config.quality import QualitySpec
from servetune.quality.lossless import apply_lossless, check_lossless, method_of, unchecked_reason
from servetune.quality.probe import QualityPlan, make_plan, run_probe
from servetune.quality.suites import agreement_prompts
from servetune.results import QualityResult, ReferenceAnswers
from tests.builders import completions_server, space_from, write_space

PROMPTS = 32


def greedy(index: int) -> list[int]:
    """The reference's greedy continuation of prompt ``index``."""
    return [index, index + 1, index + 2, index + 3]


def reference(continuations: list[list[int]] | None = None) -> ReferenceAnswers:
    answers = continuations or [greedy(i) for i in range(PROMPTS)]
    return ReferenceAnswers(trial_id="ref", params={}, prompt_ids=[[1, 2]] * len(answers), continuations=answers,
                            nll=[None] * len(answers))  # fmt: skip


def diverging(count: int) -> list[list[int]]:
    """The reference's answers with the last token of the first ``count`` prompts changed (a late near-tie flip)."""
    return [[*greedy(i)[:-1], 999] if i < count else greedy(i) for i in range(PROMPTS)]


def test_equal_greedy_outputs_pass_and_are_recorded() -> None:
    check = check_lossless(reference().continuations, reference(), "ngram", None)
    assert check is not None and check.passed is True
    assert (check.prompts, check.mismatched, check.mismatch_rate) == (PROMPTS, [], 0.0)


@pytest.mark.parametrize(("flipped", "passes"), [(3, True), (4, False)])
def test_a_mismatch_rate_beyond_the_allowed_one_fails_the_quality(flipped: int, passes: bool) -> None:
    check = check_lossless(diverging(flipped), reference(), "ngram", None, max_mismatch=0.1)
    assert check is not None and check.mismatched == list(range(flipped))
    result = apply_lossless(QualityResult(reference_trial="ref", passed=True), check)
    assert result.lossless is check and result.passed is passes
    if not passes:
        (reason,) = result.failures
        assert reason.startswith("speculative decoding (ngram) changed greedy outputs: 4 of 32 prompts differ")
        assert "12.5% > 10.0% allowed" in reason


def test_a_reference_that_speculates_too_is_recorded_not_judged() -> None:
    check = check_lossless(diverging(10), reference(), "eagle", "ngram")
    assert check is not None and check.passed is None and check.reference_method == "ngram"
    result = apply_lossless(QualityResult(reference_trial="ref", passed=True), check)
    assert result.passed is True and result.failures == []


def test_the_method_is_read_from_the_engine_argument() -> None:
    assert method_of({"method": "ngram", "num_speculative_tokens": 3}) == "ngram"
    assert method_of('{"method": "mtp"}') == "mtp"
    assert method_of(None) is None and method_of({"method": "none"}) is None


def test_the_allowed_rate_comes_from_the_quality_section_and_keeps_trial_ids_at_its_default(tmp_path) -> None:
    default = make_plan(QualitySpec(suites=("agreement",)), tmp_path, {})
    strict = make_plan(QualitySpec(suites=("agreement",), speculative_max_mismatch=0.0), tmp_path, {}, None, "ngram")
    assert default.speculative_max_mismatch == 0.1 and "speculative_max_mismatch" not in default.digest_key()
    assert strict.speculative_max_mismatch == 0.0 and strict.reference_speculation == "ngram"
    assert strict.digest_key()["speculative_max_mismatch"] == 0.0


async def _probe_against(answers: dict[str, list[int]], speculation: str | None) -> QualityResult:
    """run_probe on a local OpenAI-style server whose greedy answers are ``answers`` by prompt."""

    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["temperature"] == 0  # the probe's agreement is greedy
        prompt = body["prompt"]
        if isinstance(prompt, list):  # teacher forcing: no logprobs here, so the NLL is not measured
            return web.json_response({"choices": [{"prompt_logprobs": None}]})
        return web.json_response({"choices": [{"prompt_token_ids": [1, 2], "token_ids": answers[prompt]}]})

    plan = QualityPlan(suites=["agreement"], prompts=PROMPTS, tokens=4, reference=reference())
    async with completions_server(complete) as url:
        result, rows = await run_probe(url, "m", plan, len, "trial", {}, timeout_s=10, speculation=speculation)
    assert len(rows) == PROMPTS
    return result


def test_the_probe_checks_a_speculative_trial_and_only_a_speculative_one() -> None:
    prompts = agreement_prompts(PROMPTS)
    answers = dict(zip(prompts, diverging(5), strict=True))
    speculative = asyncio.run(_probe_against(answers, "ngram"))
    assert speculative.lossless is not None and speculative.lossless.mismatched == [0, 1, 2, 3, 4]
    assert speculative.passed is False and speculative.failures[-1].startswith("speculative decoding (ngram)")
    plain = asyncio.run(_probe_against(answers, None))
    assert plain.lossless is None and plain.passed is True  # no bounds in this plan: only speculation is judged
    assert json.loads(speculative.model_dump_json())["lossless"]["mismatch_rate"] == pytest.approx(5 / 32)


def test_a_space_whose_speculative_trials_would_go_unchecked_says_why_and_run_warns_in_one_line(tmp_path, capsys):
    head = "engine_args: {max_model_len: 1024}\nparams: {speculative.method: [none, ngram]}\n"
    unchecked = {
        "": "the space has no quality section",
        "quality: {suites: [json]}\n": "quality.suites lists no agreement",
        "quality: {suites: [agreement], reference: {speculative.method: ngram}}\n": "the quality reference speculates",
    }
    for quality, why in unchecked.items():
        reason = unchecked_reason(space_from(tmp_path, head + quality))
        assert reason is not None and reason.startswith("speculative trials (ngram) are not checked for losslessness")
        assert why in reason, reason
    assert unchecked_reason(space_from(tmp_path, head + "quality: {suites: [agreement]}\n")) is None
    assert unchecked_reason(space_from(tmp_path, "params: {max_num_seqs: [4, 8]}\n")) is None  # nothing speculates
    from servetune.cli import main

    path = write_space(tmp_path, head)
    assert main(["run", str(path), "--dry-run", "--storage", str(tmp_path / "results")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {path}: {unchecked_reason(space_from(tmp_path, head))}"]
