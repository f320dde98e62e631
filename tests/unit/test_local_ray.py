"""Starting a Ray of this machine's own (local_ray.py), without Ray running: a token of its own in the
process's environment, never written to ``~/.ray``, unless the user has authentication settings of their own;
and every place in servetune and its bench scripts that starts a local Ray starts it through here.
(With Ray running: tests/integration/test_local_ray_token.py.)"""

import ast
import signal
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
