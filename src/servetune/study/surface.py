"""A recorded response surface: a search space's grid measured once for real, each point a trial's result.

A surface is every point of a search space's grid (lists for every parameter, no ranges), each answered by a
trial's ``result.json``, stored with how it was made (:meth:`Surface.dump`, :meth:`Surface.load`). The replay
(study/replay.py) answers a search's proposals from it.

The score of a trial is its goodput at its headline level (at its capacity where the capacity search found one,
else its best goodput that met the SLO; 0 when none did, or when it failed or did not fit).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from servetune.config.space import Range, SearchSpace
from servetune.errors import UserError
from servetune.results import TrialResult

SCORE_METRIC = "goodput"
#: What a surface keeps of a trial's result: enough for objectives, constraints and the score.
DROPPED_FIELDS = {"log_tail", "environment", "capacity"}


def key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def score(result: TrialResult) -> float:
    """A trial's goodput at its best level (results.py ``best_level``: at its capacity where the capacity search
    found a bracket, else the highest meeting the SLO); 0 if it has none."""
    best = result.best if result.outcome == "COMPLETE" else None
    value = best.metrics.get(SCORE_METRIC) if best is not None else None
    return float(value) if value is not None else 0.0


@dataclass
class Surface:
    """A search space and a recorded result for every point of its grid."""

    space: SearchSpace
    results: dict[str, TrialResult]  # by key(params)
    made_by: dict[str, Any]

    @classmethod
    def from_results(
        cls, space: SearchSpace, results: Iterable[TrialResult], made_by: dict[str, Any] | None = None
    ) -> Surface:
        if any(isinstance(values, Range) for values in space.params.values()):
            raise UserError(f"search space '{space.name}': a surface needs lists for every parameter, not ranges")
        by_key = {key(r.params): r for r in results}
        kept, _ = space.grid()
        missing = [p for p in kept if key(p) not in by_key]
        if missing:
            raise UserError(
                f"search space '{space.name}': {len(missing)} of {len(kept)} grid points have no result, e.g. {missing[0]}"
            )
        return cls(space, {key(p): by_key[key(p)] for p in kept}, dict(made_by or {}))

    @classmethod
    def load(cls, path: Path) -> Surface:
        try:
            data = json.loads(Path(path).read_text())
            space = SearchSpace.model_validate(yaml.safe_load(data["space"]))
            results = [TrialResult.model_validate(r) for r in data["trials"]]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path}: not a recorded surface ({str(err).splitlines()[0]})") from None
        return cls.from_results(space, results, data.get("made_by"))

    def dump(self, path: Path, space_text: str) -> None:
        trials = [r.model_dump(mode="json", exclude=DROPPED_FIELDS) for r in self.results.values()]
        data = {"made_by": self.made_by, "space": space_text, "trials": trials}
        Path(path).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")

    @property
    def best_score(self) -> float:
        best = max(score(r) for r in self.results.values())
        if best <= 0:
            raise UserError(
                f"search space '{self.space.name}': no recorded trial met the SLO, so there is no optimum to find"
            )
        return best

    def score_of(self, params: dict[str, Any]) -> float:
        return score(self.results[key(params)])
