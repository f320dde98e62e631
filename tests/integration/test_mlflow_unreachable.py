"""When MLflow cannot be used the study still completes: seconds lost, one line said, nothing raised."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from io import StringIO
from types import SimpleNamespace

from servetune.engine.server import free_port
from servetune.tracking import sync_study
from servetune.tracking.callback import MlflowCallback
from tests.builders import demo_study

# What "seconds, not minutes" is told by: MLflow's own retries of one call (7, backoff factor 2) take about
# 4 minutes (mlflow/environment_variables.py, MLFLOW_HTTP_REQUEST_MAX_RETRIES), and each of the four trials
# logs through them. A quarter of that tells servetune's bounded path from MLflow's defaults with room for a
# busy host, where starting the client (importing MLflow: seconds on two cores) is most of the time measured.
SECONDS_NOT_MINUTES = 60.0


def drive(callback: MlflowCallback) -> None:
    """A whole study as Tune would call the hooks."""
    callback.setup(stop=None, num_samples=4, total_num_samples=4)
    for i in range(4):
        trial = SimpleNamespace(trial_id=f"ray_{i}", config={"params": {}}, last_result={"trial_id": f"ray_{i}"})
        callback.on_trial_complete(iteration=i, trials=[], trial=trial)
    callback.on_experiment_end(trials=[])


def test_a_closed_port_costs_seconds_one_line_and_says_how_to_upload_later(tmp_path):
    root = demo_study(tmp_path / "demo")
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    out = StringIO()
    started = time.monotonic()
    callback = MlflowCallback(root, url, stream=out)
    drive(callback)
    assert time.monotonic() - started < SECONDS_NOT_MINUTES
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and callback.disabled
    assert lines[0].startswith(f"MLflow at {url} is unreachable (")
    assert f"servetune report {root} --log-to-mlflow --tracking-uri {url}" in lines[0]

    started = time.monotonic()
    report = sync_study(root, url)
    assert time.monotonic() - started < SECONDS_NOT_MINUTES
    assert not report.ok and "unreachable" in report.error and report.logged == []
    assert report.summary().startswith(f"MLflow at {url} is unreachable (") and report.summary().endswith(
        "(nothing logged)"
    )


class _Broken(BaseHTTPRequestHandler):
    """Answers /health like MLflow, and every API call with a server error."""

    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 500)

    def do_POST(self) -> None:
        self._answer(500)

    def _answer(self, status: int) -> None:
        body = b"OK" if status == 200 else b'{"error_code": "INTERNAL_ERROR", "message": "database is locked"}'
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def broken_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Broken)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_a_server_that_answers_health_but_fails_calls_stops_the_callback_quickly(tmp_path):
    root = demo_study(tmp_path / "demo")
    out = StringIO()
    with broken_server() as url:
        started = time.monotonic()
        callback = MlflowCallback(root, url, stream=out)
        drive(callback)
        elapsed = time.monotonic() - started
    lines = out.getvalue().splitlines()
    assert elapsed < SECONDS_NOT_MINUTES and len(lines) == 1 and callback.disabled
    assert lines[0].startswith("MLflow logging stopped (") and "--log-to-mlflow" in lines[0]
