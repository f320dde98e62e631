"""A test session that leaves ``~/.ray/auth_token`` behind fails, naming the file.

Ray 2.60 writes that file on a plain local ``ray.init()``; from then on every ``ray start --head`` on this host
turns token authentication on, and later Ray tests (``ray job submit`` from a plain shell) fail far from the cause.
servetune's own local clusters keep their token in the environment (``local_ray``), so a session that finds the
file absent at its start and present at its end has a test (or a helper it runs) that started Ray the plain way.

Registered in the session's one controlling process: the whole session's there, or, under pytest-xdist, the
controller's, whose start comes before the workers' and whose end after theirs, so a file any worker's test writes
is caught once. Workers do not judge: each sees only its own span, and a worker's exit status is not the run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def auth_token_path() -> Path:
    """Where Ray writes its token: ``~/.ray/auth_token`` under this process's home."""
    return Path.home() / ".ray" / "auth_token"


def created(path: Path, existed_at_start: bool) -> bool:
    """Whether the session made ``path``: absent when it started, present now."""
    return not existed_at_start and path.exists()


def failed_status(status: int) -> int:
    """The session's exit status with the file left behind: a pass (or nothing collected) becomes a failure; an
    interruption, internal or usage error keeps its own code."""
    if status in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        return int(pytest.ExitCode.TESTS_FAILED)
    return int(status)


def message(path: Path) -> str:
    return (
        f"{path} was created during this test session (absent at its start): a test started Ray with a plain "
        "ray.init(), and later Ray tests on this host then meet token authentication. Remove the file, and start "
        "Ray as servetune.local_ray does (its token in the environment)."
    )


def register(config: pytest.Config, path: Path | None = None) -> None:
    """Register the guard in the session's controlling process (not in a pytest-xdist worker)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(RayTokenGuard(path or auth_token_path()), "servetune-ray-token-guard")


class RayTokenGuard:
    """The pytest plugin: notes whether the file exists at the session's start, judges at its end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.existed_at_start = True  # until the session starts: never judged before then

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.existed_at_start = self.path.exists()

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not created(self.path, self.existed_at_start):
            return
        session.exitstatus = failed_status(session.exitstatus)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write("\n")  # after the progress dots, which end no line
            reporter.write_sep("!", "Ray's auth token left behind", red=True, bold=True)
            reporter.write_line(message(self.path), red=True, bold=True)
        else:
            print(message(self.path))
