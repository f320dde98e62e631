"""The live table of a running study (a Tune callback on the driver) and the closing summary."""

from __future__ import annotations

import math
import sys
from typing import Any

from ray.tune import Callback
from ray.tune.stopper import Stopper
from rich.console import Console
from rich.live import Live
from rich.table import Table

from servetune.config.space import SearchSpace
from servetune.metrics import COST_METRIC, GOODPUT, OUTPUT_THROUGHPUT, TPOT_P99, TTFT_P99
from servetune.report.labels import capacity_text
from servetune.report.params import config_label
from servetune.results import OUTCOMES, TrialResult


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


class LiveTable(Callback):
    """Each trial's state, configuration, goodput at its headline level (results/trial.py best_level: at its
    capacity where one was found) and P99 latencies, while the study runs."""

    def __init__(self, space: SearchSpace, console: Console) -> None:
        self.space = space
        self.console = console
        self.rows: dict[str, dict[str, Any]] = {}
        self.live: Live | None = None
        self.interactive = console.is_terminal

    def __getstate__(self) -> dict[str, Any]:
        # Tune pickles its callbacks into the experiment state; a console and a live display
        # are not data, and a restored table starts without them.
        return {"space": self.space, "rows": self.rows}

    def __setstate__(self, state: dict[str, Any]) -> None:
        LiveTable.__init__(self, state["space"], stderr_console())
        self.rows = state["rows"]

    def setup(
        self,
        stop: Stopper | None = None,
        num_samples: int | None = None,
        total_num_samples: int | None = None,
        **info: Any,
    ) -> None:
        if self.interactive:
            self.live = Live(self.table(), console=self.console, refresh_per_second=2, transient=False)
            self.live.start()

    def _row(self, trial) -> dict[str, Any]:
        return self.rows.setdefault(
            trial.trial_id, {"params": trial.config.get("params", {}), "state": "RUNNING", "levels": 0}
        )

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self._row(trial)
        self._update(f"started: {config_label(trial.config.get('params', {}))}")

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        row = self._row(trial)
        row["id"] = result.get("servetune_trial_id", row.get("id"))  # our hash (Tune overwrites "trial_id")
        if "quality_passed" in result:
            row["quality"] = "pass" if result["quality_passed"] else "FAIL"
        if "outcome" in result:
            row.update(state=result["outcome"], reason=result.get("reason", ""), goodput=result.get("best_goodput"),
                       ttft=result.get("best_ttft_ms_p99"), tpot=result.get("best_tpot_ms_p99"), levels=result.get("levels_run", 0))  # fmt: skip
            self._update(
                f"{row['id']} {row['state']}: goodput {_fmt(row['goodput'], 2)} req/s {row.get('reason', '')}".rstrip()
            )
        elif "level_index" in result:
            row["levels"] = result["level_index"] + 1
            if result.get("meets_slo") and (row.get("goodput") or 0) <= (result.get(GOODPUT) or 0):
                row.update(goodput=result.get(GOODPUT), ttft=result.get(TTFT_P99), tpot=result.get(TPOT_P99))
            self._update(None)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        row = self._row(trial)
        row.update(state="FAILED", reason="the trial process died")
        self._update(f"{row.get('id', trial.trial_id)} FAILED: the trial process died")

    def on_experiment_end(self, trials, **info) -> None:
        if self.live is not None:
            self.live.update(self.table())
            self.live.stop()

    def _update(self, line: str | None) -> None:
        if self.live is not None:
            self.live.update(self.table())
        elif line:
            self.console.print(line)

    def table(self) -> Table:
        table = Table(title=f"study {self.space.name}", title_justify="left")
        quality = self.space.quality is not None
        for col in (
            "trial",
            "state",
            "configuration",
            "levels",
            "goodput",
            "TTFT p99",
            "TPOT p99",
            *(("quality",) if quality else ()),
        ):
            table.add_column(col)
        for trial_id, row in self.rows.items():
            table.add_row(row.get("id") or trial_id, row["state"], config_label(row["params"]), str(row["levels"]),
                          _fmt(row.get("goodput"), 2), _fmt(row.get("ttft")), _fmt(row.get("tpot")),
                          *((row.get("quality", "-"),) if quality else ()))  # fmt: skip
        return table


def summary_table(results: list[TrialResult], space: SearchSpace, top: int = 5) -> Table:
    """The best configurations under the SLO, by the first objective."""
    objective = space.search.objectives[0]
    meeting = [(r, r.best) for r in results if r.best is not None and not quality_failed(r)]
    missing = -math.inf if objective.mode == "max" else math.inf  # a point without the metric sorts last
    meeting.sort(key=lambda rb: rb[1].metrics.get(objective.metric, missing), reverse=objective.mode == "max")
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    pruned = f", {counts['PRUNED']} pruned" if counts["PRUNED"] else ""
    table = Table(
        title=f"best configurations under the SLO (by {objective.metric}, {objective.mode}) — "
        f"{counts['COMPLETE']} complete, {counts['INFEASIBLE']} infeasible, {counts['FAILED']} failed{pruned}; "
        f"{len(meeting)} met the SLO"
        + (f", {sum(map(quality_failed, results))} failed the quality probe" if space.quality else ""),
        title_justify="left",
    )
    columns = ["trial", "configuration", "level", "goodput", "out tok/s", "TTFT p99", "TPOT p99", "$/Mtok"]
    searched = any(r.capacity_at_slo is not None for r, _ in meeting[:top])
    for col in columns + (["capacity at the SLO"] if searched else []):
        table.add_column(col)
    for result, best in meeting[:top]:
        m = best.metrics
        level = ", ".join(f"{k} {v:g}" for k, v in best.level.items())
        table.add_row(result.trial_id, config_label(result.params), level, _fmt(m.get(GOODPUT), 2), _fmt(m.get(OUTPUT_THROUGHPUT)),
                      _fmt(m.get(TTFT_P99)), _fmt(m.get(TPOT_P99)), _fmt(m.get(COST_METRIC), 3),
                      *([capacity_text(result.capacity_at_slo)] if searched else []))  # fmt: skip
    return table


def quality_failed(result: TrialResult) -> bool:
    """The trial's quality probe broke a bound (a trial without a probe has not failed one)."""
    return result.quality is not None and result.quality.passed is False


def stderr_console() -> Console:
    return Console(stderr=True, width=None if sys.stderr.isatty() else 200)
