"""A test's Ray nodes (tests/ray_heads.py) stop without Ray's drain on SIGTERM, and a cluster's workers stop side by
side. Without Ray: the process starts and stops are stand-ins."""

import tempfile
import threading
from contextlib import contextmanager

from tests import ray_heads


def test_every_ray_start_runs_without_the_drain_and_the_shell_keeps_its_environment(monkeypatch, tmp_path):
    """Ray 2.60's ``ray start --block`` drains its node on SIGTERM (up to 30 s) before it reaps its processes: a head
    stopped whole waited there on a GCS already gone, 10 s of every head's stop (the stop's grace)."""
    started: list[tuple[str, dict]] = []

    class Popen:
        pid = 0

        def __init__(self, argv, env, **kwargs):
            started.append((argv[2], env))

    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(ray_heads.tempfile, "mkdtemp", lambda prefix, dir: mkdtemp(prefix=prefix, dir=tmp_path))
    monkeypatch.setattr(ray_heads.subprocess, "Popen", Popen)
    shell = {"HOME": str(tmp_path)}
    _, head = ray_heads._start_head(shell, 0, 0)
    ray_heads._start_worker(head, shell, 3, 2, proxy_port=8123)
    assert [kind for kind, _ in started] == ["--head", "--address"]
    for _, env in started:
        assert env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] == "0" and env["HOME"] == str(tmp_path), env
    assert started[1][1]["RAY_SERVE_WORKER_PROXY_HTTP_PORT"] == "8123"
    assert head.env == shell  # the shell the tests run their commands from is the user's, as it was


class Running:
    def poll(self) -> None:
        return None


def test_a_clusters_workers_are_stopped_side_by_side_then_the_head(monkeypatch, tmp_path):
    """Each worker's stop waits for the other's to begin (a barrier): one after another, the first would wait alone
    until the barrier's bound and break it."""
    together = threading.Barrier(2, timeout=60)
    stopped: list[str] = []

    @contextmanager
    def head(env, num_cpus, num_gpus):
        yield ray_heads.RayHead.__new__(ray_heads.RayHead)
        stopped.append("head")

    def start(head, env, num_cpus, num_gpus, resources=None, ip="127.0.0.1", proxy_port=None):
        temp_dir = tmp_path / f"worker{num_cpus}"
        temp_dir.mkdir()
        return ray_heads.RayNode(Running(), temp_dir, num_cpus, num_gpus, ip)  # type: ignore[arg-type]

    def stop(proc, marker):
        together.wait()
        stopped.append(marker.rsplit("/", 1)[-1])

    monkeypatch.setattr(ray_heads, "ray_head", head)
    monkeypatch.setattr(ray_heads, "_start_worker", start)
    monkeypatch.setattr(ray_heads, "stop_process_tree", stop)
    monkeypatch.setattr(ray_heads.LocalCluster, "nodes", lambda self: [{}] * (1 + len(self.workers)))
    with ray_heads.ray_cluster({}, [(2, 2), (3, 2)]) as cluster:
        assert len(cluster.workers) == 2
    assert sorted(stopped[:2]) == ["worker2", "worker3"] and stopped[2:] == ["head"], stopped
