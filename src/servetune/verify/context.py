"""What the acceptance checks read, gathered once, and the small readers they share.

Numbers come from ``verify.json`` as plain JSON; :func:`number` and :func:`flag` take a value
only when it has the right type, so a missing or odd field makes an item NOT CHECKED rather than
an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from servetune.report.study import LoadedStudy
from servetune.results import LevelResult, TrialResult

Status = Literal["PASS", "FAIL", "NOT CHECKED"]
PASS: Status = "PASS"
FAIL: Status = "FAIL"
NOT_CHECKED: Status = "NOT CHECKED"


@dataclass(frozen=True)
class Context:
    """What every item may read, gathered once."""

    study_dir: Path
    result: TrialResult
    verify: Mapping[str, Any] | None
    study: LoadedStudy | None
    study_problem: str  # why the study could not be read ('' when it was)
    level_index: int | None

    @property
    def level(self) -> LevelResult | None:
        return None if self.level_index is None else self.result.levels[self.level_index]

    @property
    def gpu(self) -> bool:
        return self.result.device == "gpu"

    @property
    def trials(self) -> list[TrialResult]:
        """The study's trials, the verified one as given (it alone when the study could not be read)."""
        if self.study is None:
            return [self.result]
        others = [t for t in self.study.trials if t.trial_id != self.result.trial_id]
        return [self.result, *others]

    def scenario(self, name: str) -> tuple[Mapping[str, Any] | None, str]:
        """(the scenario's numbers, '') or (None, why it is missing)."""
        if self.verify is None:
            return None, "verify did not run (servetune verify STUDY_DIR)"
        scenarios = self.verify.get("scenarios")
        found = scenarios.get(name) if isinstance(scenarios, Mapping) else None
        if not isinstance(found, Mapping):
            return None, f"verify.json has no {name} scenario"
        return found, ""

    def stability(self) -> Mapping[str, Any]:
        found = self.verify.get("stability") if self.verify is not None else None
        return found if isinstance(found, Mapping) else {}


Check = Callable[[Context], tuple[Status, str]]


def number(values: Mapping[str, Any] | None, key: str) -> float | None:
    value = values.get(key) if values is not None else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def flag(values: Mapping[str, Any] | None, key: str) -> bool | None:
    value = values.get(key) if values is not None else None
    return value if isinstance(value, bool) else None


def verdict(values: Mapping[str, Any]) -> str:
    """``passed (reason)`` / ``failed (reason)`` / ``no verdict`` for a scenario."""
    passed = flag(values, "passed")
    word = "no verdict" if passed is None else "passed" if passed else "failed"
    reason = values.get("reason")
    return f"{word} ({reason})" if isinstance(reason, str) and reason else word


def amount(value: float | None, unit: str = "") -> str:
    return "?" if value is None else f"{value:,.0f}{unit}" if abs(value) >= 100 else f"{value:.3g}{unit}"


def pct(value: float | None) -> str:
    return "?" if value is None else f"{value:.0%}"


def to_float(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def value_order(value: str) -> tuple[int, float, str]:
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)
