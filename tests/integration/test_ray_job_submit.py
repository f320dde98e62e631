"""Studies submitted with ``ray job submit`` to a Ray cluster, as on a real one.

As the README has it, from a user's shell (a HOME of the test's own, no ``RAY_AUTH_MODE``) on a
machine where a local study ran before (``make demo``: here ``servetune run`` with the fake
engine): a Ray head starts on 127.0.0.1 with two declared GPUs (``ray start --head --block``,
its own ports and temp dir); ``ray job submit --no-wait`` sends ``python -m servetune run`` with a
small working directory; ``servetune run`` joins that cluster through the ``RAY_ADDRESS`` the job
supervisor sets. The module's tests share the shell, the head (a head start is half a minute
of this host) and one job (``job``): a study whose trial starts vLLM's CPU build on the tiny model
(about a minute) and runs the quality probe as the study's reference, the README's ``ray job
submit`` as it stands. One test reads that the job succeeded and its driver joined this cluster,
the other the trial's result.json. (Later trials compared with the reference's answers:
tests/e2e/test_study_vllm_cpu.py, the same with_parameters path through Ray.) Where vLLM is not
installed the job runs the study on the fake engine instead, for the first test alone. The head is
stopped by process id (tests/ray_heads.py).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from servetune.results import TrialResult
from tests.integration.test_ray_token_auth import servetune_run, submit, write_space
from tests.processes import processes_mentioning
from tests.ray_heads import RayHead, ray_head, user_env

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 600


@dataclass(frozen=True)
class Shell:
    """A user's shell after a local study (``servetune run`` without --address, the fake engine)."""

    env: dict[str, str]
    local_results: Path  # the local study's --storage
    token_after_local: bool  # ~/.ray/auth_token existed once the local study was done
    fake: Path  # the fake engine's Python


@pytest.fixture(scope="module")
def shell(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, fake_python: Path) -> Shell:
    """The user's shell, after a local study on this machine. Ray 2.60 used to leave
    ~/.ray/auth_token behind, and every later ``ray start --head`` then asked for the token."""
    base = tmp_path_factory.mktemp("shell")
    home = base / "home"
    home.mkdir()
    fake = fake_python
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))  # the local cluster's, short for Ray's sockets
    try:
        local = subprocess.run(servetune_run(write_space(base / "local", "local", tiny_model), base / "results", fake),
                               capture_output=True, text=True, env=user_env(home, RAY_TMPDIR=str(ray_tmpdir)), cwd=base,
                               timeout=300)  # fmt: skip
    finally:
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    assert local.returncode == 0, local.stderr[-3000:]
    return Shell(user_env(home), base / "results", (home / ".ray" / "auth_token").exists(), fake)


@pytest.fixture(scope="module")
def head(shell: Shell) -> Iterator[RayHead]:
    with ray_head(shell.env) as started:
        yield started


@dataclass(frozen=True)
class Job:
    """The module's one ``ray job submit`` and what it left: its info (``RayHead.wait_for_job``) and its study."""

    info: dict
    storage: Path  # the study's --storage
    vllm: bool  # the trial started vLLM's CPU build (False: the fake engine, where vLLM is not installed)


@pytest.fixture(scope="module")
def job(shell: Shell, head: RayHead, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Job:
    """``ray job submit --no-wait`` from the user's shell, its working dir the space file only (not the repository),
    polled to its end. With vLLM's CPU build installed, the study below on it (``small_space``); without, a study on
    the fake engine (``--python``), so the README's commands are still checked there. The two tests read this one
    job, where the first test once submitted a fake-engine job of its own beside the second's (30 s of
    the module's 156, 2026-12-07)."""
    base = tmp_path_factory.mktemp("job")
    job_dir, storage = base / "job", base / "results"
    job_dir.mkdir()
    vllm = importlib.util.find_spec("vllm") is not None
    if vllm:
        (job_dir / "space.yaml").write_text(small_space())
        argv = [sys.executable, "-m", "servetune", "run", "space.yaml", "--storage", str(storage)]
    else:
        write_space(job_dir, "job-submit", tiny_model)
        argv = servetune_run(Path("space.yaml"), storage, shell.fake)
    return Job(submit(head, job_dir, argv, shell.env, JOB_TIMEOUT_S), storage, vllm)


def test_after_a_local_study_the_readme_cluster_commands_work_as_they_are(shell: Shell, job: Job) -> None:
    """``make demo`` (a local study), then ``ray start --head`` and ``ray job submit``, from one plain shell."""
    assert (shell.local_results / "local" / "trials").is_dir()
    assert not shell.token_after_local, "the local study left a token that switches later clusters to token mode"
    info = job.info
    assert info["status"] == "SUCCEEDED", f"job {info['status']} ({info['message']}):\n{info['logs'][-4000:]}"
    assert info["driver_joined"], "servetune run did not join the cluster it was submitted to"
    assert list((job.storage / "job-submit" / "trials").glob("*/result.json"))
    assert processes_mentioning(shell.fake) == []
    assert not _vllm_pids(job.storage), "a vLLM server outlived its trial"


def small_space() -> str:
    """cpu-tiny made fast: one trial (max_num_seqs 2, the quality reference), two load levels, no baseline."""
    space = yaml.safe_load((ROOT / "search_spaces" / "cpu-tiny.yaml").read_text())
    space.update(
        name="job-submit",
        params={"max_num_seqs": [2]},
        constraints=[],
        search={"algorithm": "grid", "baseline": False},
        quality={"suites": ["agreement", "arithmetic"], "reference": {"max_num_seqs": 2}},
    )
    space["load"].update(levels=[1, 4], requests_per_level=16, repeats=1)
    return yaml.safe_dump(space, sort_keys=False)


@pytest.mark.e2e
def test_study_runs_as_a_ray_job(job: Job) -> None:
    if not job.vllm:
        pytest.skip("the trials start vLLM (the CPU build: pip install servetune[cpu])")
    info, storage = job.info, job.storage
    logs = info["logs"]
    assert info["status"] == "SUCCEEDED", f"job {info['status']} ({info['message']}):\n{logs[-4000:]}"
    assert info["driver_joined"], "servetune run did not join the cluster it was submitted to"

    paths = sorted(storage.glob("job-submit/trials/*/result.json"))
    results = [TrialResult.model_validate_json(p.read_text()) for p in paths]
    assert [r.params["max_num_seqs"] for r in results] == [2], logs[-4000:]
    for r in results:
        seqs, took, start = r.params["max_num_seqs"], r.duration_s or 0, r.startup_s or 0
        print(f"trial max_num_seqs={seqs}: {r.outcome} in {took:.0f} s (engine start {start:.0f} s)")
        assert r.outcome == "COMPLETE", (r.reason, r.log_tail)
        assert r.device == "cpu" and r.devices == 1 and r.levels
        assert r.engine_args["max_num_seqs"] == r.params["max_num_seqs"]
        assert r.kv_capacity is not None  # read from vLLM's own start-up log
        first = r.levels[0].summary
        assert first.completed > 0 and first.output_throughput > 0
        # After the ladder (1 and 4 clients) the capacity search went on on the job's engine (trial/capacity.py), and
        # bisected the knee from what the capacity left of the same budget (load.capacity_levels, 4).
        capacity = r.capacity_at_slo
        assert capacity is not None and capacity.unit == "concurrency", capacity
        beyond = capacity.extra_levels + (r.knee.extra_levels if r.knee is not None else 0)
        assert 0 < len(r.levels) - beyond <= 2 and beyond <= 4, (len(r.levels), capacity, r.knee)
    # The quality reference ran its probe inside the job and the driver kept its answers for later trials.
    reference = results[0]
    assert (
        reference.quality.reference_trial == reference.trial_id
        and reference.quality.agreement == 1.0
        and reference.quality.passed
    )
    assert reference.quality.reference_answers and (storage / "job-submit" / "quality" / "reference.json").exists()
    assert "quality: the reference (max_num_seqs=2) runs first" in logs, logs[-4000:]
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
