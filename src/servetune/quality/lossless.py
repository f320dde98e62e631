"""Speculative decoding must not change what the model says: greedy outputs against the non-speculative reference.

Speculative decoding is lossless in exact arithmetic: the target model verifies every drafted token, and
under greedy sampling (temperature 0) it keeps exactly the tokens it would have produced itself. vLLM documents
the caveats ("Lossless guarantees of Speculative Decoding",
https://docs.vllm.ai/en/v0.19.0/features/speculative_decoding/): lossless "up to the precision limits of
hardware numerics", and a different batch shape (the verification step scores 1 + k tokens per request) may
move logits by rounding, which flips a greedy choice only where two tokens are nearly tied. So on a fixed
prompt set a speculative trial's greedy continuations should equal the reference's token for token, with at
most a few prompts diverging at a near tie.

The rule, on the agreement suite's prompts (``quality/probe.py``: greedy, the same prompts for every trial):
a prompt *mismatches* when its continuation differs from the reference's anywhere. With speculation on and
the reference without it, a mismatch rate above ``max_mismatch`` (``quality.speculative_max_mismatch``,
default 0.1: 3 of 32 prompts pass, 4 fail) fails the trial's quality, as a defect of the configuration,
not a trade-off. A reference that speculates too is recorded but not judged: it proves nothing about
losslessness.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from servetune.config.quality import DEFAULT_SPECULATIVE_MAX_MISMATCH as DEFAULT_MAX_MISMATCH
from servetune.results import LosslessCheck, QualityResult, ReferenceAnswers

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace


def method_of(speculative_config: Mapping[str, Any] | str | None) -> str | None:
    """The speculative method of a ``speculative_config`` engine argument (None: no speculation)."""
    if isinstance(speculative_config, str):
        try:
            speculative_config = json.loads(speculative_config)
        except json.JSONDecodeError:
            return "unknown"
    if not isinstance(speculative_config, Mapping):
        return None
    method = speculative_config.get("method")
    return None if method in (None, "none") else str(method)


def check_lossless(
    continuations: list[list[int]],
    reference: ReferenceAnswers,
    method: str,
    reference_method: str | None,
    max_mismatch: float = DEFAULT_MAX_MISMATCH,
) -> LosslessCheck | None:
    """Compare a speculative trial's greedy continuations with the reference's, prompt by prompt (None: the
    reference has no agreement answers to compare with)."""
    pairs = list(zip(continuations, reference.continuations, strict=False))
    if not pairs:
        return None
    mismatched = [index for index, (answer, expected) in enumerate(pairs) if answer != expected]
    rate = len(mismatched) / len(pairs)
    judged = reference_method is None
    return LosslessCheck(
        method=method, reference_trial=reference.trial_id, reference_method=reference_method, prompts=len(pairs),
        mismatched=mismatched, mismatch_rate=rate, max_mismatch=max_mismatch,
        passed=rate <= max_mismatch + 1e-9 if judged else None,
    )  # fmt: skip


def apply_lossless(result: QualityResult, check: LosslessCheck | None) -> QualityResult:
    """Record the check on the probe's result; a failed check fails the trial's quality with its reason."""
    if check is None:
        return result
    result.lossless = check
    if check.passed is False:
        result.failures.append(
            f"speculative decoding ({check.method}) changed greedy outputs: {len(check.mismatched)} of {check.prompts} "
            f"prompts differ from the reference without speculation ({check.mismatch_rate:.1%} > "
            f"{check.max_mismatch:.1%} allowed for numerical near-ties): a defect, not a trade-off"
        )
        result.passed = False
    return result


def unchecked_reason(space: SearchSpace) -> str | None:
    """Why the space's speculative trials would go unchecked for losslessness (:func:`check_lossless` needs the
    agreement suite's greedy answers and a reference without a drafter); None where they are checked or none
    speculates. ``run`` says it in a warning line: a study would otherwise pass them in silence."""
    methods = [m for m in space.speculative_methods() if m != "none"]
    if not methods:
        return None
    why = "speculative trials (" + ", ".join(methods) + ") are not checked for losslessness: "
    if space.quality is None:
        return why + "the space has no quality section (add quality: {suites: [agreement]})"
    if "agreement" not in space.quality.suites:
        return why + "quality.suites lists no agreement (their greedy answers are compared with the reference's)"
    reference = space.quality_reference or {}
    if "speculative_config" in space.engine_params(reference)[0]:
        return why + "the quality reference speculates too (give quality.reference speculative.method: none)"
    return None
