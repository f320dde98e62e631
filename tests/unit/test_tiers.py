"""The suite runs unit, then integration, then e2e tests, and times each tier (tests/tiers.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]

PROBE = """
import os


def test_{name}():
    with open(os.environ["ORDER"], "a") as f:
        f.write("{tier}\\n")
    assert "{tier}" != os.environ.get("FAIL_TIER")
"""


def probe_session(tmp_path: Path, fail_tier: str = "") -> tuple[subprocess.CompletedProcess, list[str]]:
    """pytest, with tests/tiers.py's plugin, on a probe tree whose folders sort e2e < integration < unit."""
    for tier, names in {"e2e": ["a", "b"], "integration": ["c"], "unit": ["d", "e"]}.items():
        (tmp_path / "tests" / tier).mkdir(parents=True)
        for name in names:
            (tmp_path / "tests" / tier / f"test_{name}.py").write_text(PROBE.format(name=name, tier=tier))
    (tmp_path / "conftest.py").write_text(
        "from tests.tiers import Tiers\n\n\ndef pytest_configure(config):\n"
        "    config.pluginmanager.register(Tiers(), 'servetune-tiers')\n"
    )
    order = tmp_path / "order"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(
        ORDER=str(order), FAIL_TIER=fail_tier, PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "tests")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    return done, order.read_text().split()


def test_fast_tiers_run_first_and_each_tier_is_timed(tmp_path):
    done, order = probe_session(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert order == ["unit", "unit", "integration", "e2e", "e2e"]  # pytest alone runs e2e first
    summary = done.stdout[done.stdout.index("time per tier") :].splitlines()[1:4]
    assert [line.split()[0] for line in summary] == ["unit", "integration", "e2e"], summary
    assert [line.split()[3] for line in summary] == ["2", "1", "2"], summary  # tests per tier
    assert done.stdout.rstrip().splitlines()[-1].startswith("5 passed"), done.stdout[-500:]  # still pytest's last line


def test_a_tiers_failures_are_counted_in_its_line(tmp_path):
    done, _ = probe_session(tmp_path, fail_tier="integration")
    assert done.returncode == 1
    lines = done.stdout[done.stdout.index("time per tier") :].splitlines()
    assert any(line.startswith("integration") and "1 tests, 1 failed" in line for line in lines), lines


def test_a_tiers_line_says_how_busy_the_cores_were_and_the_time_that_cpu_work_allows():
    from tests.tiers import TierClock

    clock = TierClock(started=100.0, ended=1100.0, busy_from=50.0, busy_to=1550.0)  # 1,500 core-s in 1,000 s
    assert clock.cores(2) == "  cores 75% busy (1,500 core-s: at least 750 s)"
    assert TierClock(started=1.0, ended=1.0).cores(2) == ""  # nothing timed: nothing said


def test_within_a_tier_the_known_slow_files_start_first_longest_first():
    from types import SimpleNamespace

    from tests.tiers import SLOW_FILES_S, run_order

    def item(nodeid: str) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid, path=ROOT / nodeid.split("::")[0])

    slow = sorted((f for f in SLOW_FILES_S if f.startswith("tests/e2e/")), key=SLOW_FILES_S.__getitem__)
    quick = "tests/e2e/test_quick_one.py::test_x"
    names = [quick, *(f"{f}::test_y" for f in slow), "tests/unit/test_z.py::test_z", "tests/integration/test_w.py::t"]
    ordered = [i.nodeid for i in sorted(map(item, names), key=run_order)]
    assert ordered[:2] == ["tests/unit/test_z.py::test_z", "tests/integration/test_w.py::t"]  # tiers first
    assert ordered[2:] == [f"{f}::test_y" for f in reversed(slow)] + [quick]  # then the longest e2e file first
