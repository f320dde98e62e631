"""A test's Ray head (tests/ray_heads.py) is asked about its nodes and jobs over the dashboard's HTTP API from the test's
own process, with the shell's token where it has one, not by a Python process of its own that imports Ray each time.
Without Ray: a stand-in dashboard answers what Ray 2.60's does (``GET /nodes?view=summary``: each node's
``GcsNodeInfo`` under ``raylet``, ray/dashboard/modules/node/datacenter.py; ``GET /api/jobs/<id>``: ``JobDetails``)."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ray_heads import LocalCluster, RayHead, RayNode

SUMMARY = {
    "result": True,
    "msg": "Node summary fetched.",
    "data": {
        "summary": [
            {"raylet": {"nodeId": "aa", "state": "ALIVE", "resourcesTotal": {"CPU": 0.0},
                        "rayletSocketName": "/tmp/st-ray-head/session_x/sockets/raylet"}},
            {"raylet": {"nodeId": "bb", "state": "ALIVE", "resourcesTotal": {"CPU": 3.0, "GPU": 2.0},
                        "rayletSocketName": "/tmp/st-rayw-one/session_x/sockets/raylet"}},
            {"raylet": {"nodeId": "cc", "state": "DEAD", "resourcesTotal": {"CPU": 3.0},
                        "rayletSocketName": "/tmp/st-rayw-gone/session_x/sockets/raylet"}},
        ]
    },
}  # fmt: skip
JOB = {"type": "SUBMISSION", "submission_id": "servetune-test-1", "status": "RUNNING", "message": "Job is running.",
       "driver_info": {"id": "02000000", "node_ip_address": "127.0.0.1", "pid": "42"}}  # fmt: skip


@pytest.fixture
def dashboard() -> Iterator[tuple[str, list[tuple[str, str | None]]]]:
    """A stand-in dashboard on 127.0.0.1; yields its URL and each request's path and Authorization header."""
    seen: list[tuple[str, str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            body = {"/nodes?view=summary": SUMMARY, "/api/jobs/servetune-test-1": JOB}.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def no_subprocess(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "run", refused)
    monkeypatch.setattr(subprocess, "Popen", refused)


def head_at(url: str, home: Path, **env: str) -> RayHead:
    return RayHead(url, "127.0.0.1:1", home, {"HOME": str(home), **env})


def test_the_live_nodes_are_read_from_the_dashboard_in_this_process(dashboard, no_subprocess, tmp_path):
    url, seen = dashboard
    worker = RayNode(proc=None, temp_dir=Path("/tmp/st-rayw-one"), num_cpus=3, num_gpus=2)  # type: ignore[arg-type]
    cluster = LocalCluster(head_at(url, tmp_path), [worker])
    assert cluster.nodes() == [
        {"id": "aa", "resources": {"CPU": 0.0}, "socket": "/tmp/st-ray-head/session_x/sockets/raylet"},
        {"id": "bb", "resources": {"CPU": 3.0, "GPU": 2.0}, "socket": "/tmp/st-rayw-one/session_x/sockets/raylet"},
    ]  # the dead node left out, as ray.nodes()'s "Alive" did
    assert cluster.node_id_of(worker) == "bb"
    assert seen == [("/nodes?view=summary", None)] * 2  # no token in the shell: none sent


def test_a_jobs_status_is_read_from_the_job_server_with_the_shells_token(dashboard, no_subprocess, tmp_path):
    url, seen = dashboard
    head = head_at(url, tmp_path, RAY_AUTH_TOKEN="secret")
    assert head.job_info("servetune-test-1") == {
        "status": "RUNNING",
        "driver_joined": True,
        "message": "Job is running.",
    }
    assert seen == [("/api/jobs/servetune-test-1", "Bearer secret")]
