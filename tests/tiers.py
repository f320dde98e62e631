"""The suite runs in tiers, fastest first, and says what each tier took.

``unit`` (pure, seconds), then ``integration`` (real processes, Ray, MLflow, the fake engine), then ``e2e``
(the real vLLM CPU build): a failure in a fast tier shows in minutes instead of after the real-vLLM tests,
which pytest's own order (folders alphabetically: e2e first) ran first. Within a tier the order is pytest's.
The terminal summary gives each tier's wall-clock time (from its first test's set-up to its last test's
teardown), test count and how busy the host's cores were meanwhile, so ``make test`` shows where its time goes and
how far more processes could take it: a tier whose cores were busy all along is bound by its CPU work (core-seconds
over cores), not by how its tests are spread over processes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

TIERS = ("unit", "integration", "e2e")

#: Seconds the slowest test files take on a quiet two-core host (``--durations`` of a clean-clone run, set-up and
#: calls summed). Within a tier they start first, longest first: ``make test`` runs two pytest processes a file at a
#: time each (pytest-xdist ``--dist loadfile`` keeping this order, ``--no-loadscope-reorder``), and a long file left
#: for the end would run alone while the other process waits. A file not listed counts as quick. Out-of-date numbers
#: only cost time, never a result.
SLOW_FILES_S = {
    "tests/e2e/test_serve_check_vllm_cpu.py": 350,
    "tests/e2e/test_serve_trials_vllm_cpu.py": 320,
    "tests/e2e/test_study_vllm_cpu.py": 205,
    "tests/e2e/test_multinode_vllm_cpu.py": 115,
    "tests/e2e/test_verify_vllm_cpu.py": 110,
    "tests/e2e/test_bench_vllm_cpu.py": 60,
    "tests/integration/test_multinode.py": 310,
    "tests/integration/test_ray_job_submit.py": 120,
    "tests/integration/test_export_deploy_serve.py": 155,
    "tests/integration/test_study.py": 150,
    "tests/integration/test_rolling_update_serve.py": 340,
    "tests/integration/test_packing.py": 140,
    "tests/integration/test_verify_top.py": 115,
    "tests/integration/test_gpu_type_ray.py": 95,
    "tests/integration/test_serve_check_ray.py": 120,
    "tests/integration/test_serve_builder_ray.py": 50,
    "tests/integration/test_verify_disconnects.py": 75,
    "tests/integration/test_ray_token_auth.py": 70,
    "tests/integration/test_verify_cli.py": 65,
    "tests/integration/test_hub_models.py": 60,
    "tests/integration/test_local_ray_token.py": 68,
    "tests/integration/test_local_ray_start_retry.py": 45,
    "tests/integration/test_recheck_cli.py": 57,
    "tests/integration/test_engine_lifecycle.py": 41,
    "tests/integration/test_mlflow_tracking.py": 40,
    "tests/integration/test_study_prune.py": 36,
    "tests/integration/test_recheck_paired.py": 35,
    "tests/integration/test_verify_fake.py": 33,
}


def tier_of(path: Path) -> str:
    """The tier a test file belongs to: the first folder under ``tests/`` that names one, else ``other``."""
    return next((part for part in path.parts if part in TIERS), "other")


def tier_rank(item: pytest.Item) -> int:
    tier = tier_of(Path(str(item.path)))
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


def run_order(item: pytest.Item) -> tuple[int, float]:
    """Where a test runs: its tier (fastest first), then its file's known cost (:data:`SLOW_FILES_S`, longest first)."""
    return tier_rank(item), -SLOW_FILES_S.get(item.nodeid.split("::", 1)[0], 0)


def busy_core_s() -> float:
    """Seconds the host's cores have spent busy since boot, all processes (not idle, not waiting on I/O)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


@dataclass
class TierClock:
    started: float | None = None
    ended: float | None = None
    busy_from: float = 0.0
    busy_to: float = 0.0
    tests: int = 0
    failed: set[str] = field(default_factory=set)

    @property
    def wall_s(self) -> float:
        return 0.0 if self.started is None or self.ended is None else self.ended - self.started

    def cores(self, cpus: int) -> str:
        """How busy the host's ``cpus`` were over the tier, and the shortest time that CPU work allows."""
        busy = self.busy_to - self.busy_from
        if self.wall_s <= 0 or busy <= 0:
            return ""
        return f"  cores {busy / (self.wall_s * cpus):.0%} busy ({busy:,.0f} core-s: at least {busy / cpus:,.0f} s)"


@dataclass(eq=False)  # pluggy keeps plugins in sets
class Tiers:
    """A pytest plugin: orders the collected tests by tier and times each tier."""

    clocks: dict[str, TierClock] = field(default_factory=dict)

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items.sort(key=run_order)  # stable: pytest's order among the quick files of a tier, and within a file

    def _clock(self, nodeid_path: str) -> TierClock:
        return self.clocks.setdefault(tier_of(Path(nodeid_path)), TierClock())

    def pytest_runtest_logstart(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        clock = self._clock(location[0])
        if clock.started is None:
            clock.started, clock.busy_from = time.monotonic(), busy_core_s()

    def pytest_runtest_logfinish(self, nodeid: str, location: tuple[str, int | None, str]) -> None:
        clock = self._clock(location[0])
        clock.ended, clock.busy_to = time.monotonic(), busy_core_s()
        clock.tests += 1

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self._clock(report.location[0]).failed.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.clocks:
            return
        terminalreporter.section("time per tier")
        order = sorted(self.clocks, key=lambda t: TIERS.index(t) if t in TIERS else len(TIERS))
        cpus = psutil.cpu_count() or 1
        for tier in order:
            clock = self.clocks[tier]
            failed = f", {len(clock.failed)} failed" if clock.failed else ""
            line = f"{tier:<12} {clock.wall_s:8.1f} s  {clock.tests} tests{failed}{clock.cores(cpus)}"
            terminalreporter.write_line(line)
