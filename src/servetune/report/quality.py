"""The report's quality section: every trial's probe against the reference, and section 2's rule.

The tuning checklist (section 2) accepts a lower precision only when four things hold at once:
the quality drop is within its threshold; at least 15% more goodput (or concurrency) at the same
SLO; a lower cost per token; and P99 latency and the error rate no worse. When the recommended
configuration runs at a lower precision than the quality reference, the report states the rule
with the measured numbers and whether it held.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from servetune.metrics import COST_METRIC, GOODPUT, TPOT_P99, TTFT_P99
from servetune.report.params import short_config, varied_params
from servetune.report.points import ReportPoint
from servetune.results import TrialResult

#: Section 2: the least goodput gain that pays for a lower precision.
MIN_GAIN = 0.15
ERROR_RATE = "error_rate"

_BITS = {"float32": 32, "float": 32, "bfloat16": 16, "float16": 16, "half": 16, "auto": 16}
_QUANT_BITS = {
    "fp8": 8,
    "int8": 8,
    "w8a8": 8,
    "awq": 4,
    "gptq": 4,
    "awq_marlin": 4,
    "gptq_marlin": 4,
    "bitsandbytes": 4,
}


@dataclass(frozen=True)
class QualityRow:
    trial_id: str
    config: str
    reference: bool
    agreement: float | None
    exact_match: float | None
    nll_delta: float | None
    suites: Mapping[str, float]
    passed: bool | None
    failures: tuple[str, ...]
    seconds: float | None

    @property
    def verdict(self) -> str:
        if self.reference:
            return "reference"
        if self.passed is None:
            return "not measured"
        return "pass" if self.passed else "FAIL: " + "; ".join(self.failures)


def quality_rows(trials: Sequence[TrialResult]) -> list[QualityRow]:
    """A row per trial that ran the probe, the reference first, then by agreement (highest first)."""
    varied = varied_params(t.params for t in trials)
    rows = []
    for trial in trials:
        q = trial.quality
        if q is None:
            continue
        rows.append(QualityRow(
            trial_id=trial.trial_id, config=short_config(trial.params, varied), reference=q.reference_trial == trial.trial_id,
            agreement=q.agreement, exact_match=q.exact_match, nll_delta=q.nll_delta, suites=dict(q.suites),
            passed=q.passed, failures=tuple(q.failures), seconds=q.duration_s,
        ))  # fmt: skip
    return sorted(
        rows, key=lambda r: (not r.reference, -(r.agreement if r.agreement is not None else -1.0), r.trial_id)
    )


def suite_names(rows: Sequence[QualityRow]) -> list[str]:
    names: list[str] = []
    for row in rows:
        names += [n for n in row.suites if n not in names]
    return names


def quality_cells(row: QualityRow, suites: Sequence[str]) -> list[str]:
    def share(value: float | None) -> str:
        return "-" if value is None else f"{value:.0%}"

    nll = "-" if row.nll_delta is None else f"{row.nll_delta:+.4f}"
    seconds = "-" if row.seconds is None else f"{row.seconds:.1f}"
    return [row.trial_id, row.config, share(row.agreement), share(row.exact_match), nll,
            *(share(row.suites.get(s)) for s in suites), seconds, row.verdict]  # fmt: skip


def quality_headings(suites: Sequence[str]) -> list[str]:
    return ["trial", "configuration", "agreement", "exact match", "NLL Δ (nats/token)", *suites, "probe s", "verdict"]


QUALITY_NOTE = (
    "Agreement: the mean share of the reference's greedy tokens a trial reproduced before its first "
    "difference; exact match: the share of prompts continued exactly alike; NLL Δ: how much less likely "
    "the trial finds the reference's tokens (teacher-forced, nats per token; 0 for the same numerics). "
    "Suites: the share of items passed. A trial that drops more than a bound allows is kept out of the "
    "fronts and the recommendation."
)


def precision_bits(engine_args: Mapping[str, Any]) -> tuple[int, int]:
    """(weight bits, KV-cache bits) a launch computes with, from dtype, quantization and kv_cache_dtype."""
    quantization = str(engine_args.get("quantization") or "").lower()
    dtype_bits = _BITS.get(str(engine_args.get("dtype") or "auto").lower(), 16)
    weights = _QUANT_BITS.get(quantization, dtype_bits) if quantization else dtype_bits
    kv = str(engine_args.get("kv_cache_dtype") or "auto").lower()
    return weights, (8 if kv.startswith(("fp8", "int8")) else dtype_bits)


def lower_precision(trial: TrialResult, reference: TrialResult) -> bool:
    mine, theirs = precision_bits(trial.engine_args), precision_bits(reference.engine_args)
    return mine != theirs and all(m <= t for m, t in zip(mine, theirs, strict=True))


@dataclass(frozen=True)
class RuleCheck:
    text: str
    held: bool | None  # None: not measured


def precision_rule(
    recommended: ReportPoint, trials: Sequence[TrialResult], points: Sequence[ReportPoint]
) -> list[RuleCheck] | None:
    """Section 2's rule for the recommendation, when it runs at a lower precision than the reference (else None)."""
    trial = next((t for t in trials if t.trial_id == recommended.trial_id), None)
    if trial is None or trial.quality is None:
        return None
    reference = next((t for t in trials if t.trial_id == trial.quality.reference_trial), None)
    if reference is None or reference.trial_id == trial.trial_id or not lower_precision(trial, reference):
        return None
    theirs = [p for p in points if p.trial_id == reference.trial_id and p.meets_slo and p.outcome == "COMPLETE"]
    best = max(theirs, key=lambda p: p.value(GOODPUT) or 0.0, default=None)
    checks = [RuleCheck("quality within its thresholds" + ("" if trial.quality.passed else ": " + "; ".join(trial.quality.failures)),
                        trial.quality.passed)]  # fmt: skip
    if best is None:
        return [
            *checks,
            RuleCheck("the reference met the SLO at no level: throughput, cost and latency cannot be compared", None),
        ]
    checks.append(_compare(f"at least {MIN_GAIN:.0%} more goodput at the same SLO", recommended.value(GOODPUT), best.value(GOODPUT),
                           lambda mine, ref: mine >= ref * (1 + MIN_GAIN), "req/s"))  # fmt: skip
    checks.append(_compare("lower cost per million output tokens", recommended.value(COST_METRIC), best.value(COST_METRIC),
                           lambda mine, ref: mine < ref, "USD"))  # fmt: skip
    for metric, name in ((TTFT_P99, "TTFT P99"), (TPOT_P99, "TPOT P99")):
        checks.append(
            _compare(
                f"{name} no worse", recommended.value(metric), best.value(metric), lambda mine, ref: mine <= ref, "ms"
            )
        )
    checks.append(
        _compare(
            "error rate no worse",
            recommended.value(ERROR_RATE),
            best.value(ERROR_RATE),
            lambda mine, ref: mine <= ref,
            "",
        )
    )
    return checks


def _compare(text: str, mine: float | None, ref: float | None, rule, unit: str) -> RuleCheck:
    if mine is None or ref is None:
        return RuleCheck(f"{text}: not measured", None)
    return RuleCheck(
        f"{text}: {mine:.4g} against the reference's {ref:.4g}{' ' + unit if unit else ''}", bool(rule(mine, ref))
    )


def rule_summary(checks: Sequence[RuleCheck]) -> str:
    held = all(c.held for c in checks)
    return ("Section 2's rule for a lower precision holds" if held else
            "Section 2's rule for a lower precision does not hold") + " (the recommendation computes at a lower precision than the quality reference):"  # fmt: skip
