"""The suite runs in tiers, fastest first, and says what each tier took.

``unit`` (pure, seconds), then ``integration`` (real processes, Ray, MLflow, the fake engine), then ``e2e``
(the real vLLM CPU build): a failure in a fast tier shows in minutes instead of after the real-vLLM tests,
which pytest's own order (folders alphabetically: e2e first) ran first. Within a tier the order is pytest's.
The terminal summary gives each tier's wall-clock time (from its first test's set-up to its last test's
teardown) and test count, so ``make test`` shows where its time goes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

TIERS = ("unit", "integration", "e2e")


def tier_of(path: Path) -> str:
    """The tier a test file belongs to: the first folder under ``tests/`` that names one, else ``other``."""
    return next((part for part in path.parts if part in TIERS), "other")


def tier_rank(item: pytest.Item) -> int:
    tier = tier_of(Path(str(item.path)))
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


@dataclass
class TierClock:
    started: float | None = None
    ended: float | None = None
    tests: int = 0
    failed: set[str] = field(default_factory=set)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.started is None or self.ended is None else self.ended - self.started


@dataclass(eq=False)  # pluggy keeps plugins in sets
class Tiers:
    """A pytest plugin: orders the collected tests by tier and times each tier."""

    clocks: dict[str, TierClock] = field(default_factory=dict)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=tier_rank)  # stable: pytest's order within a tier

    def _clock(self, nodeid_path: str) -> TierClock:
        return self.clocks.setdefault(tier_of(Path(nodeid_path)), TierClock())

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        clock = self._clock(location[0])
        if clock.started is None:
            clock.started = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        clock = self._clock(location[0])
        clock.ended = time.monotonic()
        clock.tests += 1

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self._clock(report.location[0]).failed.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.clocks:
            return
        terminalreporter.section("time per tier")
        order = sorted(self.clocks, key=lambda t: TIERS.index(t) if t in TIERS else len(TIERS))
        for tier in order:
            clock = self.clocks[tier]
            failed = f", {len(clock.failed)} failed" if clock.failed else ""
            terminalreporter.write_line(f"{tier:<12} {clock.wall_s:8.1f} s  {clock.tests} tests{failed}")
