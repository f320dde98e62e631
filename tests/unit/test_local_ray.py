"""Starting a Ray of this machine's own (local_ray.py), without Ray running: a token of its own in the
process's environment, never written to ``~/.ray``, unless the user has authentication settings of their own;
and every place in servetune and its bench scripts that starts a local Ray starts it through here.
(With Ray running: tests/integration/test_local_ray_token.py.)"""

import ast
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from servetune import local_ray
from servetune.local_ray import start_local_ray, token_for_local_cluster
from tests.builders import bench_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_a_local_cluster_gets_a_token_of_its_own_and_none_is_written(home):
    env: dict[str, str] = {}
    assert token_for_local_cluster(env)
    assert len(env["RAY_AUTH_TOKEN"]) >= 32 and "RAY_AUTH_MODE" not in env  # ray.init() turns the mode on itself
    assert not (home / ".ray").exists()
    other: dict[str, str] = {}
    token_for_local_cluster(other)
    assert other["RAY_AUTH_TOKEN"] != env["RAY_AUTH_TOKEN"]  # one per process, not a shared secret


@pytest.mark.parametrize("name, value", [("RAY_AUTH_MODE", "disabled"), ("RAY_AUTH_MODE", "token"),
                                         ("RAY_AUTH_TOKEN", "mine"), ("RAY_AUTH_TOKEN_PATH", "/secrets/ray")])  # fmt: skip
def test_a_users_own_authentication_settings_are_kept(home, name, value):
    env = {name: value}
    assert not token_for_local_cluster(env)
    assert env == {name: value}


def test_a_users_token_file_is_used_as_ray_would(home):
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("x" * 32)
    env: dict[str, str] = {}
    assert not token_for_local_cluster(env) and env == {}


def test_a_local_ray_is_started_after_the_token_rule_with_the_sigterm_handler_kept(monkeypatch):
    """The rule, then a new Ray here ("local", not a `ray start` running on this machine), no dashboard unless
    asked; Ray's own SIGTERM handler (exit 15) does not replace the command's (exit 143, teardown on the way)."""
    import ray

    calls = []

    def ours(signum, frame):
        raise SystemExit(128 + signum)

    def rays_init(**kwargs):
        calls.append(("init", kwargs))
        signal.signal(signal.SIGTERM, lambda signum, frame: __import__("sys").exit(signum))

    monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: calls.append(("token", None)))
    monkeypatch.setattr(ray, "init", rays_init)
    before = signal.signal(signal.SIGTERM, ours)
    try:
        start_local_ray(num_cpus=3, log_to_driver=False)
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, before)
    start_local_ray(include_dashboard=True)
    assert calls == [
        ("token", None), ("init", {"address": "local", "include_dashboard": False, "num_cpus": 3, "log_to_driver": False}),
        ("token", None), ("init", {"address": "local", "include_dashboard": True}),
    ]  # fmt: skip


def test_bench_packing_starts_its_local_ray_through_the_token_rule(monkeypatch):
    """bench/packing.py left ~/.ray/auth_token behind: its study's Ray is started as `servetune run` starts one."""
    started = []

    class Stop(Exception):
        pass

    def start(**kwargs):
        started.append(kwargs)
        raise Stop

    monkeypatch.setattr(local_ray, "start_local_ray", start)
    with pytest.raises(Stop):
        bench_script("packing").run_study(context=None, points=[], gpus=4, cpus=6)
    assert started == [
        {"num_gpus": 4, "num_cpus": 6, "logging_level": "WARNING", "log_to_driver": False, "configure_logging": True}
    ]


def ray_init_calls(path: Path) -> list[ast.Call]:
    """The ``ray.init(...)`` calls of a Python file."""
    return [
        node
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "init"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "ray"
    ]


def test_no_command_or_bench_script_starts_a_local_ray_but_through_the_token_rule():
    """Every ``ray.init`` of servetune and of bench/ outside local_ray.py joins a cluster by address (a
    variable: --address, $RAY_ADDRESS); one without, or with address="local", would start a local Ray whose
    token Ray writes to ~/.ray/auth_token: start_local_ray starts those."""
    starts = []
    for path in sorted([*(ROOT / "src" / "servetune").rglob("*.py"), *(ROOT / "bench").glob("*.py")]):
        if path == ROOT / "src" / "servetune" / "local_ray.py":
            continue
        for call in ray_init_calls(path):
            address = next((k.value for k in call.keywords if k.arg == "address"), None)
            if address is None or isinstance(address, ast.Constant):
                starts.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert starts == []
    assert len(ray_init_calls(ROOT / "src" / "servetune" / "local_ray.py")) == 1


TIMED_OUT = Exception(
    "The current node timed out during startup. This could happen because some of the raylet failed to startup or "
    "the GCS has become overloaded."
)  # Ray 2.60's words (ray/_private/node.py)


class Watch:
    """What start_retrying is given to watch each try: counts the tries watched and the stops."""

    def __init__(self) -> None:
        self.watched = 0
        self.stopped = 0

    def __call__(self) -> "Watch":
        self.watched += 1
        return self

    def stop(self) -> int:
        self.stopped += 1
        return 4


def starts(*outcomes: Exception | None):
    """A start that raises the next of ``outcomes`` (None: it started), counting its calls."""
    left = list(outcomes)

    def start() -> None:
        start.calls += 1  # type: ignore[attr-defined]
        if (outcome := left.pop(0)) is not None:
            raise outcome

    start.calls = 0  # type: ignore[attr-defined]
    return start


def test_a_start_that_timed_out_is_stopped_and_made_again_saying_so(caplog):
    start, watch = starts(TIMED_OUT, None), Watch()
    with caplog.at_level("WARNING", logger="servetune.local_ray"):
        local_ray.start_retrying(start, watch)
    assert (start.calls, watch.watched, watch.stopped) == (2, 2, 1)
    [line] = caplog.messages
    assert "did not start within Ray's 30 s" in line and "stopped the 4 processes" in line and "try 2 of 3" in line


def test_a_start_that_keeps_timing_out_is_stopped_each_time_and_raised_after_its_tries(caplog):
    start, watch = starts(TIMED_OUT, TIMED_OUT, TIMED_OUT, None), Watch()
    with caplog.at_level("WARNING", logger="servetune.local_ray"), pytest.raises(Exception, match="timed out during"):
        local_ray.start_retrying(start, watch)
    assert (start.calls, watch.stopped) == (local_ray.START_TRIES, local_ray.START_TRIES)  # the last one's too
    assert len(caplog.messages) == local_ray.START_TRIES - 1


@pytest.mark.parametrize("failure", [
    Exception("Failed to start the GCS server"),  # another of Ray's plain Exceptions
    RuntimeError("The current node timed out during startup"),  # its words, not its type
    ValueError("When connecting to an existing cluster, num_cpus and num_gpus must not be provided."),
    ConnectionError("could not connect"),
])  # fmt: skip
def test_any_other_failure_is_raised_at_once_and_nothing_is_stopped(failure):
    start, watch = starts(failure, None), Watch()
    with pytest.raises(type(failure)):
        local_ray.start_retrying(start, watch)
    assert (start.calls, watch.stopped) == (1, 0)


def test_a_local_start_that_timed_out_is_made_again_with_the_gcs_port_wait_raised_during_each(monkeypatch):
    """start_local_ray goes through start_retrying, with Ray's wait for the GCS port (an environment variable it
    reads) at 120 s during ray.init unless the user set it, and the environment as it was after."""
    import ray

    seen: list[str | None] = []

    def rays_init(**kwargs):
        seen.append(os.environ.get(local_ray.GCS_PORT_WAIT))
        if len(seen) == 1:
            raise TIMED_OUT

    monkeypatch.setattr(local_ray, "token_for_local_cluster", lambda: None)
    monkeypatch.setattr(ray, "init", rays_init)
    monkeypatch.delenv(local_ray.GCS_PORT_WAIT, raising=False)
    start_local_ray(num_cpus=1)
    assert seen == ["120", "120"] and local_ray.GCS_PORT_WAIT not in os.environ
    monkeypatch.setenv(local_ray.GCS_PORT_WAIT, "7")
    start_local_ray(num_cpus=1)
    assert seen[-1] == "7"


def test_what_a_start_left_is_stopped_by_process_id_and_what_ran_before_it_is_not(tmp_path):
    """ChildProcesses stops this process's children started since it was made whose command line names the owner
    (Ray's package directory, here a stand-in), and their descendants, a stopped (SIGSTOP) one too, and reaps them; a
    child that ran before, or one started meanwhile that is not the owner's (another thread's), it leaves alone."""
    import psutil

    owner = str(tmp_path / "ray")  # as Ray's processes name its package directory in their command lines
    started: list[subprocess.Popen] = []
    try:
        started.append(before := subprocess.Popen(["sh", "-c", "sleep 60; :", owner]))
        watch = local_ray.ChildProcesses(owner)
        started.append(tree := subprocess.Popen(["sh", "-c", "sleep 60 & sleep 61; wait", owner]))
        started.append(stopped := subprocess.Popen(["sh", "-c", "sleep 62; :", owner]))
        started.append(other := subprocess.Popen(["sleep", "63"]))
        deadline = time.monotonic() + 10
        while len(psutil.Process(tree.pid).children()) < 2 or not psutil.Process(stopped.pid).children():
            assert time.monotonic() < deadline, "sh did not start its sleeps"
            time.sleep(0.05)
        stopped.send_signal(signal.SIGSTOP)
        grandchildren = psutil.Process(tree.pid).children() + psutil.Process(stopped.pid).children()
        assert watch.stop() == 5
        assert tree.poll() is not None and stopped.poll() is not None
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in grandchildren)
        assert before.poll() is None and other.poll() is None
    finally:
        for proc in started:  # whatever an assertion left running
            proc.kill()
            proc.wait()
