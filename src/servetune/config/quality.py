"""The search space's ``quality:`` section: what each trial's quality probe runs, and how much
quality a configuration may lose against the reference before it fails the constraint.

::

    quality:
      suites: [agreement, json, recall, arithmetic]   # shipped suites, or paths to JSONL files
      reference: baseline       # the baseline trial (vLLM's defaults), or a params mapping
      max_drop: {agreement: 0.05, json: 0.02, recall: 0.02}

A drop is the reference's score minus the trial's, on a 0..1 scale: for ``agreement`` one minus
the mean share of the reference's tokens the trial reproduced before its first difference, for a
task suite the share of items the reference passed and the trial did not. ``exact_match`` (the
share of prompts whose continuation matched entirely) and ``nll_delta`` (how much less likely,
in nats per token, the trial finds the reference's continuations) may be bounded too. Every
listed suite is a constraint: with the default bound (0.05 for agreement, 0.02 for a task suite)
unless ``max_drop`` gives one, or ``null`` to measure it without a bound.

Optionally, lm-evaluation-harness tasks (``pip install servetune[lm-eval]``) run against the
trial's server through lm-eval's ``local-completions`` model, offline (``quality/lm_eval.py``);
each task's primary metric is the score ``lm_eval/<task>``, bounded like a suite::

      lm_eval: {tasks: [my_task], include_path: ./lm_eval_tasks, limit: 50, num_fewshot: 0}
      max_drop: {lm_eval/my_task: 0.02}

A trial with speculative decoding is also held to losslessness (``quality/lossless.py``): its greedy
agreement continuations must equal the reference's token for token, but for at most
``speculative_max_mismatch`` of the prompts (default 0.1; numerical near-ties), else its quality fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Bounds a suite gets when ``max_drop`` does not name it.
DEFAULT_MAX_DROP = {"agreement": 0.05}
DEFAULT_SUITE_MAX_DROP = 0.02
#: Scores derived from the agreement suite that ``max_drop`` may bound as well.
AGREEMENT_SCORES = ("exact_match", "nll_delta")
#: The share of a speculative trial's greedy prompts that may differ from the reference's (numerical near-ties).
DEFAULT_SPECULATIVE_MAX_MISMATCH = 0.1
#: lm-eval tasks score as ``lm_eval/<task>``.
LM_EVAL_PREFIX = "lm_eval/"


class LmEvalSpec(BaseModel):
    """lm-evaluation-harness tasks each trial runs against its server (checked where it is installed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: tuple[str, ...]  # task names, found in ``include_path`` or among lm-eval's own
    include_path: str | None = None  # a folder of task YAMLs, relative to the space file; on every node
    limit: int | None = Field(default=None, ge=1)  # items per task (all when unset)
    num_fewshot: int | None = Field(default=None, ge=0)  # the task's own default when unset
    timeout_s: float = Field(default=1800.0, gt=0)  # the whole lm-eval run; past it the scores are not measured

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        if not tasks:
            raise ValueError("list at least one task")
        if len(set(tasks)) != len(tasks):
            raise ValueError("a task is listed twice")
        for task in tasks:
            if not task or any(c in task for c in ",= \t"):
                raise ValueError(f"'{task}' is not a task name")
        return tasks


class QualitySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    suites: tuple[str, ...] = ("agreement", "json", "recall", "arithmetic")
    reference: Literal["baseline"] | dict[str, Any] = "baseline"
    max_drop: dict[str, float | None] = {}
    prompts: int = Field(default=32, ge=1, le=2000)  # agreement prompts
    tokens: int = Field(default=16, ge=1, le=1024)  # agreement: tokens compared per prompt
    concurrency: int = Field(default=16, ge=1, le=1024)  # probe requests in flight
    recall_max_tokens: int = Field(default=16384, ge=64)  # longest recall prompt, tokens
    lm_eval: LmEvalSpec | None = None  # lm-evaluation-harness tasks, scored as ``lm_eval/<task>``
    # speculative trials: the share of greedy agreement prompts allowed to differ from the reference (quality/lossless.py)
    speculative_max_mismatch: float = Field(default=DEFAULT_SPECULATIVE_MAX_MISMATCH, ge=0, le=1)

    @field_validator("suites")
    @classmethod
    def _suites(cls, suites: tuple[str, ...]) -> tuple[str, ...]:
        if not suites:
            raise ValueError("list at least one suite")
        if len(set(suites)) != len(suites):
            raise ValueError("a suite is listed twice")
        return suites

    @field_validator("max_drop")
    @classmethod
    def _positive(cls, bounds: dict[str, float | None]) -> dict[str, float | None]:
        for name, bound in bounds.items():
            if bound is not None and bound < 0:
                raise ValueError(f"{name}: a drop bound must be 0 or more")
        return bounds

    @model_validator(mode="after")
    def _known_bounds(self) -> QualitySpec:
        names = set(self.score_names())
        allowed = names | (set(AGREEMENT_SCORES) if "agreement" in names else set())
        for name in self.max_drop:
            if name not in allowed:
                raise ValueError(f"max_drop: '{name}' is not a listed suite ({', '.join(sorted(allowed))})")
        return self

    def bounds(self) -> dict[str, float]:
        """Every bounded score and its largest allowed drop."""
        out: dict[str, float] = {}
        for name in self.score_names():
            out[name] = DEFAULT_MAX_DROP.get(name, DEFAULT_SUITE_MAX_DROP)
        out.update({k: v for k, v in self.max_drop.items() if v is not None})
        return {k: v for k, v in out.items() if self.max_drop.get(k, 0.0) is not None}

    def score_names(self) -> list[str]:
        """Every suite's score name, the lm-eval tasks' (``lm_eval/<task>``) after them."""
        tasks = self.lm_eval.tasks if self.lm_eval is not None else ()
        return [suite_name(s) for s in self.suites] + [LM_EVAL_PREFIX + t for t in tasks]


def suite_name(suite: str) -> str:
    """A suite's name in scores: the shipped name, or a user file's stem (``evals/mine.jsonl`` -> ``mine``)."""
    return Path(suite).stem if suite.endswith(".jsonl") else suite
