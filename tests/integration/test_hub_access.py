"""``servetune run`` asks the hub whether it serves a hub model to the trials' token before anything starts
(servetune/hub.py), through huggingface_hub itself pointed at a hub on 127.0.0.1 (``HF_ENDPOINT``). A dry run asks
it only with ``--hub`` (cli/run_hub.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from servetune.engine.server import free_port
from tests.conftest import serve_fake

SPACE = """
name: hub
model: {model}
device: cpu
workload: cpu-tiny
load: {{levels: [2]}}
slo: {{ttft_ms: {{p99: 2000}}}}
engine_args: {{max_model_len: 512}}
env: {{VLLM_CPU_KVCACHE_SPACE: 1{token}}}
params: {{max_num_seqs: [4]}}
"""


class FakeHub:
    """The hub's ``auth-check``: ``org/gated`` is gated, ``org/missing`` is not there, anything else is served."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.requests: list[str] = []  # every request, of any path

    def app(self) -> web.Application:
        @web.middleware
        async def record(request: web.Request, handler):
            self.requests.append(f"{request.method} {request.path}")
            return await handler(request)

        async def auth_check(request: web.Request) -> web.Response:
            repo = f"{request.match_info['org']}/{request.match_info['name']}"
            self.seen.append((repo, request.headers.get("Authorization", "")))
            if repo == "org/gated":
                return web.Response(status=401, headers={"X-Error-Code": "GatedRepo"})
            if repo == "org/missing":
                return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound"})
            return web.json_response({})

        app = web.Application(middlewares=[record])
        app.router.add_get("/api/models/{org}/{name}/auth-check", auth_check)
        return app


def run(tmp_path: Path, endpoint: str, model: str, *extra: str, token: str = ""):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.format(model=model, token=f", HF_TOKEN: {token}" if token else ""))
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"))  # no stored token either
    return subprocess.run([sys.executable, "-m", "servetune", "run", str(space), "--storage", str(tmp_path / "results"),
                           *extra], capture_output=True, text=True, timeout=300, env=env)  # fmt: skip


def test_a_gated_or_missing_model_ends_the_run_in_one_line_before_anything_is_written(tmp_path):
    hub = FakeHub()
    with serve_fake(hub) as endpoint:
        gated = run(tmp_path, endpoint, "org/gated")
        missing = run(tmp_path, endpoint, "org/missing")
    assert gated.returncode != 0 and "Traceback" not in gated.stderr, gated.stderr
    (line,) = [ln for ln in gated.stderr.splitlines() if ln.strip()]
    assert "model org/gated: gated on the hub" in line and "without a token" in line
    assert "org/missing: not on the hub" in missing.stderr and missing.returncode != 0
    assert not (tmp_path / "results").exists()  # no study directory, no Ray started
    assert [repo for repo, _ in hub.seen] == ["org/gated", "org/missing"]


def test_a_served_model_goes_on_with_the_spaces_token_which_is_never_printed(tmp_path):
    hub = FakeHub()
    with serve_fake(hub) as endpoint:
        plain = run(tmp_path, endpoint, "org/open", "--dry-run", token="hf_secret_for_the_test")
        assert plain.returncode == 0 and hub.requests == [], plain.stderr[-2000:]  # a dry run asks no hub
        assert "hub access not asked for org/open" in " ".join(plain.stdout.split())
        done = run(tmp_path, endpoint, "org/open", "--dry-run", "--hub", token="hf_secret_for_the_test")
    assert done.returncode == 0, done.stderr[-2000:]
    assert hub.seen == [("org/open", "Bearer hf_secret_for_the_test")]
    assert "hf_secret_for_the_test" not in done.stdout + done.stderr


def test_an_unreachable_hub_is_a_warning_not_a_verdict(tmp_path):
    done = run(tmp_path, f"http://127.0.0.1:{free_port()}", "org/open", "--dry-run", "--hub")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning: model org/open: could not ask the hub for access" in " ".join(done.stderr.split())
