"""Ray 2.60's token authentication, met the way the README's commands meet it (fake engine, real Ray).

Each test has a HOME of its own (so ``~/.ray/auth_token`` is the test's) and a user's shell: no
``RAY_AUTH_MODE`` set. The trials run the fake engine, so no vLLM starts. The README's commands
in a plain shell after a local study (no token: a head without authentication) are
tests/integration/test_ray_job_submit.py's, which shares one such head between its tests; a head
in token mode cannot be shared with them (the mode is fixed when the head starts).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.processes import processes_mentioning
from tests.ray_heads import ray_head, user_env

JOB_TIMEOUT_S = 300
#: Ray's wait for a GCS that does not answer (its ``py_gcs_connect_timeout_s``, 30 s by default, and about 10 s of
#: connection attempts before it): the refused run gets it raised to this, far past the run's own limit below, so a
#: refusal that waited on it instead of coming at once could not finish in time, however busy the host.
RAY_CONNECT_TIMEOUT_S = 3600
REFUSAL_LIMIT_S = 300

SPACE = """
name: {name}
model: {model}
device: cpu
workload: cpu-tiny
load: {{levels: [1], requests_per_level: 4, warmup_requests: 1, startup_timeout_s: 60}}
slo: {{ttft_ms: {{p99: 500}}}}
hardware: {{devices_per_node: 1}}
price_per_device_hour: 0.05
params:
  env.SERVETUNE_FAKE_TTFT_MS: [5]
search: {{algorithm: grid, baseline: false}}
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def write_space(directory: Path, name: str, model: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "space.yaml"
    path.write_text(SPACE.format(name=name, model=model))
    return path


def servetune_run(space: Path, storage: Path, fake: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "servetune",
        "run",
        str(space),
        "--storage",
        str(storage),
        "--python",
        str(fake),
        *flags,
    ]


def submit(head, job_dir: Path, argv: list[str], env: dict[str, str], timeout_s: float = JOB_TIMEOUT_S) -> dict:
    """``ray job submit --no-wait`` of ``argv`` with ``job_dir`` as its working dir, from the shell ``env``; the job's
    info once it ended (``RayHead.wait_for_job``), within ``timeout_s``."""
    submission_id = f"servetune-test-{uuid.uuid4().hex[:8]}"
    done = head.ray("job", "submit", "--address", head.dashboard_url, "--working-dir", str(job_dir),
                    "--submission-id", submission_id, "--no-wait", "--", *argv, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return head.wait_for_job(submission_id, timeout_s, env=env)


def test_a_head_in_token_mode_asks_for_one_line_then_works(tmp_path, home, tiny_model, fake_python):
    """A user who already has ~/.ray/auth_token: ``ray start --head`` turns token authentication on."""
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token

    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(generate_new_authentication_token())
    fake = fake_python
    shell = user_env(home)
    space = write_space(tmp_path / "driver", "joined", tiny_model)
    with ray_head(shell) as head:
        # servetune run --address, from the plain shell: one line that says what to set, at once (not after Ray's
        # connect timeout, raised here to RAY_CONNECT_TIMEOUT_S: a run that waited on it would pass its limit).
        waiting = {**shell, "RAY_py_gcs_connect_timeout_s": str(RAY_CONNECT_TIMEOUT_S)}
        try:
            refused = subprocess.run(servetune_run(space, tmp_path / "results", fake, "--address", head.gcs_address),
                                     capture_output=True, text=True, env=waiting, cwd=tmp_path, timeout=REFUSAL_LIMIT_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"not refused within {REFUSAL_LIMIT_S} s: waiting on Ray's connect timeout "
                        f"({RAY_CONNECT_TIMEOUT_S} s here) rather than refused at once?")  # fmt: skip
        assert refused.returncode == 2, refused.stderr[-3000:]
        error_lines = [line for line in refused.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
        assert error_lines == [
            f"servetune run: error: the Ray cluster at {head.gcs_address} requires token authentication: set RAY_AUTH_MODE=token "
            "(Ray then sends the token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)"
        ], refused.stderr[-3000:]

        # The line the README and the error say: both ways in then work.
        token_shell = {**shell, "RAY_AUTH_MODE": "token"}
        joined = subprocess.run(servetune_run(space, tmp_path / "results", fake, "--address", head.gcs_address),
                                capture_output=True, text=True, env=token_shell, cwd=tmp_path, timeout=300)  # fmt: skip
        assert joined.returncode == 0, joined.stderr[-3000:]
        job_dir = tmp_path / "job"
        write_space(job_dir, "submitted", tiny_model)
        info = submit(head, job_dir, servetune_run(Path("space.yaml"), tmp_path / "results", fake), token_shell)
    assert info["status"] == "SUCCEEDED", f"job {info['status']} ({info['message']}):\n{info['logs'][-4000:]}"
    assert info["driver_joined"]
    for name in ("joined", "submitted"):
        assert len(list((tmp_path / "results" / name / "trials").glob("*/result.json"))) == 1, name
    assert processes_mentioning(fake) == []
