"""The quality probe: a trial's engine answers the study's fixed probe set; scores against the reference.

It runs on the engine the trial already started, before the load ladder, through the same
OpenAI-compatible API the load uses (greedy, temperature 0):

1. ``agreement``: each prompt's continuation as token ids (``return_token_ids``);
2. teacher forcing: the reference's continuation appended to the prompt, scored with
   ``prompt_logprobs``: how likely this configuration finds the reference's tokens (nats per token);
3. every item of the task suites, scored by its rule (``quality/items.py``);
4. optionally, lm-evaluation-harness tasks (``quality/lm_eval.py``), as ``lm_eval/<task>`` scores.

The reference trial (which the study runs first) answers the same set; its answers travel to the
other trials inside their spec (``QualityPlan.reference``), so nodes need no shared disk, and
are kept in ``STUDY/quality/reference.json`` for ``--resume``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict

from servetune.config.quality import QualitySpec, suite_name
from servetune.quality.items import QualityItem
from servetune.quality.lm_eval import LmEvalPlan, run_lm_eval
from servetune.quality.lossless import DEFAULT_MAX_MISMATCH, apply_lossless, check_lossless
from servetune.quality.suites import BUILT, agreement_prompts, load_suite, recall_items
from servetune.results import QualityResult, ReferenceAnswers

RECORD = ConfigDict(extra="ignore")


class QualityPlan(BaseModel):
    """A trial's probe: the suites, the bounds, and the reference's answers (None: this trial is the reference)."""

    model_config = RECORD

    suites: list[str]  # names, in order (agreement and recall are built, the others carry items)
    items: dict[str, list[QualityItem]] = {}  # task suites read from JSONL
    bounds: dict[str, float] = {}
    prompts: int = 32
    tokens: int = 16
    concurrency: int = 16
    recall_max_tokens: int = 16384
    reference_params: dict[str, Any] = {}  # the reference configuration, as the space names it
    reference: ReferenceAnswers | None = None  # its answers; None while it has not run (this trial is it)
    lm_eval: LmEvalPlan | None = None  # lm-evaluation-harness tasks, run after the suites
    speculative_max_mismatch: float = DEFAULT_MAX_MISMATCH  # speculative trials (quality/lossless.py)
    reference_speculation: str | None = None  # the reference's speculative method (None: it runs without)

    def digest_key(self) -> dict[str, Any]:
        """What decides the probe's measurement (part of the trial's id)."""
        key = {
            "suites": self.suites, "items": {k: [i.model_dump(mode="json") for i in v] for k, v in self.items.items()},
            "prompts": self.prompts, "tokens": self.tokens, "recall_max_tokens": self.recall_max_tokens,
            "bounds": self.bounds, "reference": self.reference_params,
        }  # fmt: skip
        if self.lm_eval is not None:  # absent without lm-eval tasks, so earlier trials keep their ids
            key["lm_eval"] = self.lm_eval.digest_key()
        if self.speculative_max_mismatch != DEFAULT_MAX_MISMATCH:  # likewise absent at the default
            key["speculative_max_mismatch"] = self.speculative_max_mismatch
        return key


def make_plan(
    spec: QualitySpec,
    base_dir: Path,
    reference_params: dict[str, Any],
    reference: ReferenceAnswers | None = None,
    reference_speculation: str | None = None,
) -> QualityPlan:
    """The probe every trial of a study runs (suites read here, once, on the driver); ``reference_speculation``
    is the reference's speculative method, where it runs one."""
    names = [suite_name(s) for s in spec.suites]
    items = {suite_name(s): load_suite(s, base_dir) for s in spec.suites if suite_name(s) not in BUILT}
    return QualityPlan(
        suites=names, items=items, bounds=spec.bounds(), prompts=spec.prompts, tokens=spec.tokens,
        concurrency=spec.concurrency, recall_max_tokens=spec.recall_max_tokens,
        reference_params=dict(reference_params), reference=reference,
        lm_eval=LmEvalPlan.from_spec(spec.lm_eval, base_dir) if spec.lm_eval is not None else None,
        speculative_max_mismatch=spec.speculative_max_mismatch, reference_speculation=reference_speculation,
    )  # fmt: skip


class _Probe:
    def __init__(
        self, session: aiohttp.ClientSession, url: str, model: str, concurrency: int, timeout_s: float
    ) -> None:
        self.session, self.url, self.model = session, url, model
        self.gate = asyncio.Semaphore(concurrency)
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.errors: list[str] = []

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        async with self.gate:
            try:
                async with self.session.post(
                    self.url + path, json={"model": self.model, **body}, timeout=self.timeout
                ) as r:
                    data = await r.json(content_type=None)
                    if r.status != 200:
                        message = data.get("error", data) if isinstance(data, dict) else data
                        message = message.get("message", message) if isinstance(message, dict) else message
                        self._error(f"HTTP {r.status}: {str(message)[:200]}")
                        return None
                    return data
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                self._error(f"{type(exc).__name__}: {str(exc)[:200]}")
                return None

    def _error(self, text: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(text)

    async def max_model_len(self) -> int | None:
        try:
            async with self.session.get(self.url + "/v1/models", timeout=self.timeout) as r:
                data = await r.json(content_type=None)
            return int(data["data"][0]["max_model_len"])
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, IndexError, TypeError):
            return None

    async def continue_prompt(self, prompt: str, tokens: int) -> tuple[list[int], list[int]] | None:
        data = await self.post(
            "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "return_token_ids": True}
        )
        if data is None:
            return None
        choice = data["choices"][0]
        return list(choice.get("prompt_token_ids") or []), list(choice.get("token_ids") or [])

    async def nll(self, prompt_ids: list[int], continuation: list[int]) -> float | None:
        """Mean negative log-likelihood per token of ``continuation`` after ``prompt_ids`` (teacher forcing)."""
        if not continuation:
            return None
        data = await self.post(
            "/v1/completions",
            {"prompt": prompt_ids + continuation, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0},
        )
        if data is None:
            return None
        entries = (data["choices"][0].get("prompt_logprobs") or [])[len(prompt_ids) :]
        if len(entries) != len(continuation):  # no prompt_logprobs, or not one per token: not measured
            return None
        total = 0.0
        for token, entry in zip(continuation, entries, strict=True):
            found = (entry or {}).get(str(token))
            if found is None:
                return None
            total -= float(found["logprob"])
        return total / len(continuation)

    async def answer(self, item: QualityItem) -> str | None:
        if item.prompt is not None:
            data = await self.post(
                "/v1/completions", {"prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0}
            )
            return None if data is None else data["choices"][0].get("text")
        messages = [m.model_dump() for m in item.messages or ()]
        data = await self.post(
            "/v1/chat/completions", {"messages": messages, "max_tokens": item.max_tokens, "temperature": 0}
        )
        return None if data is None else (data["choices"][0].get("message") or {}).get("content")


async def run_probe(url: str, model: str, plan: QualityPlan, count_tokens: Callable[[str], int], trial_id: str,
                    params: dict[str, Any], timeout_s: float = 300.0, tokenizer: str | None = None,
                    out_dir: Path | None = None,
                    speculation: str | None = None) -> tuple[QualityResult, list[dict[str, Any]]]:  # fmt: skip
    """Answer the probe set on the server at ``url`` and score it against the plan's reference.

    ``speculation``: the trial's speculative method; its greedy continuations are then checked against the
    reference's for losslessness (``quality/lossless.py``).

    Returns the result and a row per prompt (suite, id, prompt, answer, passed), the trial's
    ``quality.jsonl``. lm-eval's tasks (when the plan has some) load ``tokenizer`` (the model's
    folder or hub id; ``model`` when None) and write their output under ``out_dir``."""
    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        probe = _Probe(session, url, model, plan.concurrency, timeout_s)
        reference = plan.reference
        window = reference.max_model_len if reference is not None else await probe.max_model_len()
        items = dict(plan.items)
        if "recall" in plan.suites and window:
            items["recall"] = recall_items(count_tokens, window, plan.recall_max_tokens)
        prompts = agreement_prompts(plan.prompts) if "agreement" in plan.suites else []
        generated = await asyncio.gather(*(probe.continue_prompt(p, plan.tokens) for p in prompts))
        prompt_ids = [g[0] if g else [] for g in generated]
        continuations = [g[1] if g else [] for g in generated]
        if reference is not None:  # the reference's tokens after the reference's prompt ids
            forced = zip(reference.prompt_ids, reference.continuations, strict=True)
        else:
            forced = zip(prompt_ids, continuations, strict=True)
        nll = list(await asyncio.gather(*(probe.nll(p, c) for p, c in forced)))
        names = list(items)
        answers = {name: list(await asyncio.gather(*(probe.answer(i) for i in items[name]))) for name in names}
    # Each answer scored once.
    passed = {name: [item.passes(a) for item, a in zip(items[name], answers[name], strict=True)] for name in names}
    scores = {name: sum(passed[name]) / max(len(items[name]), 1) for name in names}
    lm_eval_rows: list[dict[str, Any]] = []
    if plan.lm_eval is not None:
        if out_dir is None:
            raise ValueError("lm-eval tasks need an output folder")
        outcome = await asyncio.to_thread(run_lm_eval, plan.lm_eval, url, model, tokenizer or model, out_dir, window,
                                          plan.concurrency)  # fmt: skip
        scores.update(outcome.scores)
        probe.errors += outcome.errors
        lm_eval_rows = outcome.rows
    if reference is None:
        reference = ReferenceAnswers(trial_id=trial_id, params=params, max_model_len=window, prompt_ids=prompt_ids,
                                     continuations=continuations, nll=nll, scores=scores)  # fmt: skip
    result = compare(continuations, nll, scores, reference, plan.bounds)
    if speculation is not None and reference.trial_id != trial_id:
        check = check_lossless(continuations, reference, speculation, plan.reference_speculation,
                               plan.speculative_max_mismatch)  # fmt: skip
        apply_lossless(result, check)
    result.duration_s = round(time.monotonic() - started, 3)
    result.errors = probe.errors
    result.answers = {"agreement": list(continuations), **answers}
    result.reference_answers = reference if reference.trial_id == trial_id else None
    rows: list[dict[str, Any]] = []
    for index, (prompt, tokens) in enumerate(zip(prompts, continuations, strict=True)):
        expected = reference.continuations[index] if index < len(reference.continuations) else None
        rows.append({"suite": "agreement", "id": f"agreement-{index}", "prompt": prompt, "answer_token_ids": tokens,
                     "reference_token_ids": expected, "agreement": common_prefix_share(tokens, expected or []),
                     "nll": nll[index] if index < len(nll) else None})  # fmt: skip
    for name in names:
        for item, answer, ok in zip(items[name], answers[name], passed[name], strict=True):
            rows.append({"suite": name, "id": item.id, "prompt": item.prompt if item.prompt is not None else
                         [m.model_dump() for m in item.messages or ()], "answer": answer, "passed": ok})  # fmt: skip
    return result, rows + lm_eval_rows


def common_prefix_share(answer: list[int], reference: list[int]) -> float:
    """The share of the reference's tokens reproduced before the first difference."""
    if not reference:
        return 1.0 if not answer else 0.0
    same = 0
    for a, b in zip(answer, reference, strict=False):  # an answer may be shorter or longer
        if a != b:
            break
        same += 1
    return same / len(reference)


def compare(continuations: list[list[int]], nll: list[float | None], scores: dict[str, float], reference: ReferenceAnswers,
            bounds: dict[str, float]) -> QualityResult:  # fmt: skip
    """Scores, drops against the reference, and the verdict on the bounds."""
    agreement = exact = nll_delta = None
    drops: dict[str, float] = {}
    if reference.continuations:
        # Over the prompts both were probed with: a stored reference may hold more or fewer (a resumed
        # study whose quality.prompts changed), and the rows below pair them by index the same way.
        shares = [common_prefix_share(a, r) for a, r in zip(continuations, reference.continuations, strict=False)]
        agreement = sum(shares) / len(shares) if shares else 0.0
        exact = sum(a == r for a, r in zip(continuations, reference.continuations, strict=False)) / max(len(shares), 1)
        pairs = [(n, r) for n, r in zip(nll, reference.nll, strict=False) if n is not None and r is not None]
        nll_delta = sum(n - r for n, r in pairs) / len(pairs) if pairs else None
        drops["agreement"], drops["exact_match"] = 1.0 - agreement, 1.0 - exact
        if nll_delta is not None:
            drops["nll_delta"] = nll_delta
    for name, score in scores.items():
        if name in reference.scores:
            drops[name] = reference.scores[name] - score
    failures = []
    for name, bound in bounds.items():
        drop = drops.get(name)
        if drop is None:
            failures.append(f"{name} not measured")
        elif drop > bound + 1e-9:
            failures.append(f"{name} dropped {drop:.3g} > {bound:g}")
    return QualityResult(
        reference_trial=reference.trial_id, agreement=agreement, exact_match=exact, nll_delta=nll_delta,
        suites=scores, drops=drops, bounds=dict(bounds), failures=failures, passed=not failures,
    )  # fmt: skip
