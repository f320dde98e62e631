"""Commands that start a Ray of their own leave no ``~/.ray/auth_token`` behind (Ray 2.60 writes one on a plain
local ``ray.init()``, and every later ``ray start --head`` then turns token authentication on, so the README's
``ray job submit`` from a plain shell is refused). ``servetune run``'s is tests/integration/test_ray_job_submit.py's.

Each test runs in a user's shell (tests/ray_heads.py ``user_env``: a HOME of the test's own, no ``RAY_AUTH_*``
set) with a Ray temp dir of its own, checked empty of Ray's processes afterwards. No engine serves: verify's Serve
deployment is given 1 s to start, so it fails once the local Ray and Serve are up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.processes import still_running_after
from tests.ray_heads import user_env

pytest.importorskip("ray.serve")

STUDY = Path(__file__).parent.parent / "data" / "cpu-tiny-study"
WINNER = "e57a166985b8"  # the one trial of the stored study meeting the SLO


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture
def shell(home: Path) -> Iterator[dict[str, str]]:
    """A user's shell; the local Ray's temp dir is the test's (short: Ray's sockets live under it), so what it
    left running can be told from other tests' Ray processes."""
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    try:
        yield user_env(home, RAY_TMPDIR=str(ray_tmpdir))
    finally:
        assert still_running_after(30, ray_tmpdir) == [], "the command's local Ray outlived it"
        shutil.rmtree(ray_tmpdir, ignore_errors=True)


def study_through_serve(root: Path, model: Path) -> Path:
    """The stored CPU study, its model the tiny one here, its winner measured through Ray Serve (one replica),
    its engines given 1 s to start."""
    shutil.copytree(STUDY, root)
    info = json.loads((root / "study.json").read_text())
    (root / "study.json").write_text(json.dumps({**info, "model": str(model)}))
    space = yaml.safe_load((root / "space.yaml").read_text())
    space["load"]["startup_timeout_s"] = 1
    result_path = root / "trials" / WINNER / "result.json"
    result = json.loads(result_path.read_text())
    result["model"] = str(model)
    # Serve replicas replace data parallelism: a space varies one of them.
    space["params"].pop("data_parallel_size")
    space["constraints"] = [c for c in space["constraints"] if "data_parallel_size" not in c]
    space["params"]["serve.num_replicas"] = [1]
    result["params"]["serve.num_replicas"] = 1
    (root / "space.yaml").write_text(yaml.safe_dump(space))
    result_path.write_text(json.dumps(result))
    return root


def servetune(*argv: object, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)  # fmt: skip


def test_verify_through_serve_on_a_local_ray_leaves_no_token(tmp_path, home, shell, tiny_model):
    """The verify run the issue saw leave the file: a trial measured through Serve, verified on a local Ray."""
    study = study_through_serve(tmp_path / "study", tiny_model)
    done = servetune("verify", study, "--duration", "5", "--no-runner-up", "--json", tmp_path / "verify.json",
                     "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}", env=shell, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1 and "through Ray Serve (1 replica)" in done.stderr, done.stderr[-3000:]
    assert "not RUNNING after 1 s" in json.loads((tmp_path / "verify.json").read_text())["reasons"][0]
    assert not (home / ".ray" / "auth_token").exists()


def test_serve_checks_local_ray_leaves_no_token(tmp_path, home, shell):
    """serve-check's local Ray and Serve (``ServeCluster`` without an address, as ``servetune serve-check`` and the
    verify above start them), up and torn down. The command costs a deployment more (about a minute here), and
    starts no Ray but through ``ServeCluster`` (no ``ray.init`` of its own: tests/unit/test_local_ray.py)."""
    script = (
        "from servetune.serve.cluster import ServeCluster\n"
        "with ServeCluster(None, {'CPU': 3}) as cluster:\n"
        "    print('started', cluster.started_ray, 'applications', sorted(cluster.applications()), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=shell, cwd=tmp_path,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "started True applications []" in done.stdout.splitlines(), done.stdout  # (Ray's own lines follow)
    assert not (home / ".ray" / "auth_token").exists()


def test_a_local_ray_started_as_the_bench_scripts_start_one_leaves_no_token(tmp_path, home, shell):
    """bench/packing.py (which left the file) and bench/serve_floor.py start their Ray with ``start_local_ray``, as
    ``run``, ``verify`` and ``serve-check`` do: here as packing.py calls it, GPUs declared."""
    script = (
        "import ray\n"
        "from servetune.local_ray import start_local_ray\n"
        "start_local_ray(num_gpus=2, num_cpus=1, logging_level='WARNING', log_to_driver=False, configure_logging=True)\n"
        "print('GPUs', ray.cluster_resources().get('GPU'), flush=True)\n"
        "ray.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=shell, cwd=tmp_path,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "GPUs 2.0" in done.stdout.splitlines(), done.stdout
    assert not (home / ".ray" / "auth_token").exists()


def test_doctor_on_a_local_ray_leaves_no_token(tmp_path, home, shell):
    """``servetune doctor`` with no cluster given checks a local Ray it starts for the check (``init_ray``, as
    ``run`` starts its own): the node's checks come back, and no token is left."""
    done = servetune("doctor", "--json", tmp_path / "doctor.json", env=shell, cwd=tmp_path)
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr[-3000:]
    checks = json.loads((tmp_path / "doctor.json").read_text())
    assert any(c["name"] == "vllm version" for c in checks), checks  # the node's task ran on that Ray
    assert not (home / ".ray" / "auth_token").exists()
