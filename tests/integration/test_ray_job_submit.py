"""A study submitted with ``ray job submit`` to a Ray cluster, as on a real one (real vLLM, CPU build).

A Ray head starts on 127.0.0.1 with two declared GPUs (``ray start --head --block``, its own
ports, temp dir and authentication token); ``ray job submit --no-wait`` sends
``python -m servetune run`` with a small working directory; ``servetune run`` joins that
cluster through the ``RAY_ADDRESS`` the job supervisor sets; two trials start vLLM's CPU build
on the tiny model (about a minute each). The test checks the job succeeded, its driver joined
this cluster, and both trials' result.json.
The cluster is stopped by process id: its whole process tree, then anything left that names its
temp dir (``ray stop`` would stop every Ray cluster on the machine, not only this one).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from servetune.engine.server import free_port
from servetune.results import TrialResult

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm", reason="the trials start vLLM (the CPU build: pip install servetune[cpu])")

ROOT = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")  # the venv's, so Ray's workers run the venv's Python
START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 600


# Asks the cluster about a job, in a process that has the cluster's token in its environment
# (this one may have imported Ray already, with its authentication settings fixed).
JOB_INFO = r"""
import json, sys
from ray.job_submission import JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
if len(sys.argv) > 2:
    info = client.get_job_info(sys.argv[2])
    joined = info.driver_info is not None
    print(json.dumps({"status": info.status.value, "driver_joined": joined, "message": info.message}))
"""


@dataclass(frozen=True)
class RayHead:
    dashboard_url: str
    gcs_address: str
    temp_dir: Path
    env: dict[str, str]  # for the CLI: this cluster's token, no RAY_ADDRESS

    def ray(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(RAY), *argv], capture_output=True, text=True, env=self.env, timeout=timeout)

    def job_info(self, submission_id: str) -> dict:
        done = subprocess.run([sys.executable, "-c", JOB_INFO, self.dashboard_url, submission_id],
                              capture_output=True, text=True, env=self.env, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


def ray_env() -> dict[str, str]:
    """This environment, without a RAY_ADDRESS or token of another cluster, with a token of its own.

    Ray 2.60 turns token authentication on when ~/.ray/auth_token exists; a token in the
    environment makes the test independent of that file.
    """
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=generate_new_authentication_token())
    return env


def stop_process_tree(proc: subprocess.Popen, marker: str) -> None:
    """SIGTERM the process and its descendants, SIGKILL what is left, then any process naming ``marker``."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    for p in reversed(procs):  # children first
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)
    stragglers = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                p.kill()
                stragglers.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(stragglers, timeout=10)
    if proc.poll() is None:
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
    # A short path: Ray's unix sockets live under it and must stay within 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    argv = [
        str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
        "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
        "--num-cpus", "2", "--num-gpus", "2", "--disable-usage-stats", "--temp-dir", str(temp_dir),
    ]  # fmt: skip
    env = ray_env()
    log = open(temp_dir / "ray-start.log", "w")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    head = RayHead(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", temp_dir, env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (listed := head.ray("job", "list", "--address", head.dashboard_url, "--log-style", "record")).returncode:
            if proc.poll() is not None:
                log_tail = (temp_dir / "ray-start.log").read_text()[-3000:]
                pytest.fail(f"ray start exited with {proc.returncode}:\n{log_tail}")
            if time.monotonic() > deadline:
                pytest.fail(f"no answer from {head.dashboard_url} in {START_TIMEOUT_S} s: {listed.stderr[-1000:]}")
            time.sleep(1)
        yield head
    finally:
        stop_process_tree(proc, str(temp_dir))
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def small_space() -> str:
    """cpu-tiny made fast: two trials (max_num_seqs 2 and 8), two load levels, no baseline."""
    space = yaml.safe_load((ROOT / "search_spaces" / "cpu-tiny.yaml").read_text())
    space.update(
        name="job-submit",
        params={"max_num_seqs": [2, 8]},
        constraints=[],
        search={"algorithm": "grid", "baseline": False},
    )
    space["load"].update(levels=[1, 4], requests_per_level=16)
    return yaml.safe_dump(space, sort_keys=False)


def test_study_runs_as_a_ray_job(ray_head: RayHead, tmp_path: Path) -> None:
    job_dir = tmp_path / "job"  # the working dir Ray uploads: the space file only, not the repository
    job_dir.mkdir()
    (job_dir / "space.yaml").write_text(small_space())
    storage = tmp_path / "results"
    submission_id = f"servetune-test-{uuid.uuid4().hex[:8]}"
    done = ray_head.ray(
        "job", "submit", "--address", ray_head.dashboard_url, "--working-dir", str(job_dir),
        "--submission-id", submission_id, "--no-wait",
        "--", sys.executable, "-m", "servetune", "run", "space.yaml", "--storage", str(storage),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    deadline = time.monotonic() + JOB_TIMEOUT_S
    info = ray_head.job_info(submission_id)
    try:
        while info["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
            assert time.monotonic() < deadline, f"the job did not finish within {JOB_TIMEOUT_S} s"
            time.sleep(3)
            info = ray_head.job_info(submission_id)
    finally:
        if info["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
            ray_head.ray("job", "stop", "--address", ray_head.dashboard_url, submission_id)  # servetune tears vLLM down
    logs = ray_head.ray("job", "logs", "--address", ray_head.dashboard_url, submission_id).stdout
    assert info["status"] == "SUCCEEDED", f"job {info['status']} ({info['message']}):\n{logs[-4000:]}"
    assert info["driver_joined"], "servetune run did not join the cluster it was submitted to"

    paths = sorted(storage.glob("job-submit/trials/*/result.json"))
    results = [TrialResult.model_validate_json(p.read_text()) for p in paths]
    assert sorted(r.params["max_num_seqs"] for r in results) == [2, 8], logs[-4000:]
    for r in results:
        seqs, took, start = r.params["max_num_seqs"], r.duration_s or 0, r.startup_s or 0
        print(f"trial max_num_seqs={seqs}: {r.outcome} in {took:.0f} s (engine start {start:.0f} s)")
        assert r.outcome == "COMPLETE", (r.reason, r.log_tail)
        assert r.device == "cpu" and r.devices == 1 and r.levels
        assert r.engine_args["max_num_seqs"] == r.params["max_num_seqs"]
        assert r.kv_capacity is not None  # read from vLLM's own start-up log
        first = r.levels[0].summary
        assert first.completed > 0 and first.output_throughput > 0
    assert (storage / "job-submit" / "study.json").exists()
    assert "job-submit" in logs  # the study's summary table reached the job's log
    assert not _vllm_pids(storage), "a vLLM server outlived its trial"


def _vllm_pids(storage: Path) -> list[int]:
    """Processes still serving the study's tiny model (none once the trials are done)."""
    model_dir = str(storage / "job-submit" / "models")
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if model_dir in " ".join(p.info["cmdline"] or []) and "vllm" in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            continue
    return found
