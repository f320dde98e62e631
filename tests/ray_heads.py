"""A Ray head a test starts as a user would (``ray start --head``), in a user's environment.

The head runs on 127.0.0.1 with its own ports and temp dir (``ray start --head --block``), and
is stopped by process id: its whole process tree, then anything left that names its temp dir
(``ray stop`` would stop every Ray cluster on the machine, not only this one).

Every node's ``ray start`` runs with :data:`NO_DRAIN`: Ray 2.60's ``ray start --block``, on SIGTERM, first asks the
GCS to drain its node and waits for that (up to 30 s) before it stops its processes and reaps them. Stopped as here,
the whole tree at once, the head's GCS is gone before it answers, so the head's ``ray start`` sat in that wait with its
children exited but not reaped (zombies, alive to a wait on their pid) until the stop's 10 s grace ran out: 10 s of
every head's stop, with nothing to drain (a test's cluster serves no traffic once its tests are done).

``user_env`` is the environment of a user's shell with a HOME of the test's own, so Ray's
``~/.ray/auth_token`` is the test's and not this machine's: no ``RAY_AUTH_*`` or ``RAY_ADDRESS``
set, as in the README.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.client
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from servetune.engine.server import free_port
from servetune.local_ray import STARTUP_TIMED_OUT, stop_processes

RAY = Path(sys.executable).with_name("ray")  # the venv's, so Ray's workers run the venv's Python
START_TIMEOUT_S = 120
#: Set in the environment of every ``ray start`` here (not the shell's): no drain on SIGTERM ("0 disables draining
#: (immediate teardown)", ray._private.ray_constants), so a node's stop waits on nothing but its processes' exits.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def skip_without_ray_serve_llm() -> None:
    """Skip the calling test module where Ray Serve LLM (``ray[serve,llm]``, vLLM with it) is not installed, found
    without importing it (``pytest.importorskip`` would): its import costs about 10 s of CPU (vLLM's), which a test
    process that only reads what a driver of its own wrote does not need."""
    try:
        found = all(importlib.util.find_spec(name) for name in ("ray.serve.llm", "vllm"))
    except ModuleNotFoundError:  # no Ray at all
        found = False
    if not found:
        pytest.skip("Ray Serve LLM (ray[serve,llm]) is not installed", allow_module_level=True)


def user_env(home: Path, **extra: str) -> dict[str, str]:
    """A user's shell: this environment with HOME=``home`` and nothing of Ray's authentication set.

    vLLM's argument table stays cached where it is (``XDG_CACHE_HOME``), so a new HOME does not
    cost an import of vLLM.
    """
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_TMPDIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("XDG_CACHE_HOME", str(Path.home() / ".cache"))
    env.update(HOME=str(home), RAY_USAGE_STATS_ENABLED="0", **extra)
    return env


@dataclass(frozen=True)
class RayHead:
    dashboard_url: str
    gcs_address: str
    temp_dir: Path
    env: dict[str, str]  # the shell the head was started from

    def ray(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(RAY), *argv], capture_output=True, text=True, env=env or self.env, timeout=timeout)

    def job_info(self, submission_id: str, env: dict[str, str] | None = None) -> dict:
        """The job's status, whether its driver joined the cluster, and Ray's message about it: ``GET
        /api/jobs/<id>`` on the head's job server, what ``JobSubmissionClient.get_job_info`` (and so ``ray job
        status``) asks, sent over HTTP from this process with the token of the shell ``env`` where it has one. A
        Python process importing Ray to ask it cost about a core-second, once every poll of a job's life."""
        request = urllib.request.Request(f"{self.dashboard_url}/api/jobs/{submission_id}",
                                         headers=_auth_headers(env or self.env))  # fmt: skip
        with _DIRECT.open(request, timeout=120) as response:
            details = json.load(response)
        joined = details.get("driver_info") is not None
        return {"status": details["status"], "driver_joined": joined, "message": details.get("message")}

    def wait_for_job(self, submission_id: str, timeout_s: float, env: dict[str, str] | None = None) -> dict:
        """Poll until the job ends (stopping it past ``timeout_s``); its info and its log."""
        deadline = time.monotonic() + timeout_s
        info = self.job_info(submission_id, env)
        try:
            while info["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                assert time.monotonic() < deadline, f"the job did not finish within {timeout_s} s"
                time.sleep(3)
                info = self.job_info(submission_id, env)
        finally:
            if info["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                self.ray(
                    "job", "stop", "--address", self.dashboard_url, submission_id, env=env
                )  # servetune tears vLLM down
        info["logs"] = self.ray("job", "logs", "--address", self.dashboard_url, submission_id, env=env).stdout
        return info


#: Starts of a test's Ray head, the first included. Retried only where its ``ray start`` exited on a Ray start timing
#: out (:data:`RETRIED`); each try waits Ray's fixed 30 s again (servetune.local_ray.STARTUP_TIMED_OUT).
START_TRIES = 3
#: What a ``ray start --head`` that timed out while starting leaves in its output, on a busy host: its node's raylet
#: not registered within Ray's 30 s, or a Ray process of the head gone at start (Ray's client server, which gives up
#: if its raylet has not registered in 30 s, as a loaded CI host once saw).
RETRIED = (STARTUP_TIMED_OUT, "Some Ray subprocesses exited unexpectedly")


@contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 2, num_gpus: int = 2) -> Iterator[RayHead]:
    """``ray start --head --block`` from a shell with ``env``; lists its jobs (as ``ray job list`` would) before it
    yields.

    A ``ray start`` that exits on Ray's start timing out, or on a Ray process of the head exiting while it started
    (:data:`RETRIED`: Ray says so of any such process, a port clash's too), is stopped (its process tree) and started
    again with fresh ports and temp dir, saying so in one line on stderr, up to :data:`START_TRIES` starts; another
    exit (a bad argument) fails the test at once."""
    for attempt in range(1, START_TRIES + 1):
        proc, head = _start_head(env, num_cpus, num_gpus)
        try:
            exited = _wait_for_head(proc, head)
        except BaseException:
            _stop_head(proc, head)
            raise
        if exited is None:
            break
        _stop_head(proc, head)
        _fail_or_retry("ray start --head", proc.returncode, exited, attempt)
    try:
        yield head
    finally:
        _stop_head(proc, head)


def start_timed_out(log_tail: str) -> bool:
    """Whether a ``ray start`` that exited says Ray's start timed out (:data:`RETRIED`), not another failure."""
    return any(marker in log_tail for marker in RETRIED)


def _fail_or_retry(command: str, returncode: int | None, exited: str, attempt: int) -> None:
    """After the ``attempt``-th start of ``command`` exited (its output's tail ``exited``, already stopped): fail the
    test where it was the last try or not Ray's start timing out, else say in one line that it starts again."""
    if attempt == START_TRIES or not start_timed_out(exited):
        pytest.fail(f"ray start exited with {returncode} (try {attempt} of {START_TRIES}):\n{exited}")
    print(f"tests: {command} timed out while starting (try {attempt} of {START_TRIES}); stopped, starting it again",
          file=sys.stderr, flush=True)  # fmt: skip


def _start_head(env: dict[str, str], num_cpus: int, num_gpus: int) -> tuple[subprocess.Popen, RayHead]:
    # A short path: Ray's unix sockets live under it and must stay within 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    argv = [
        str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
        "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
        "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
        "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--disable-usage-stats", "--temp-dir", str(temp_dir),
    ]  # fmt: skip
    with open(temp_dir / "ray-start.log", "w") as log:  # ray start writes to its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**env, **NO_DRAIN},
                                start_new_session=True)  # fmt: skip
    return proc, RayHead(f"http://127.0.0.1:{dashboard_port}", f"127.0.0.1:{gcs_port}", temp_dir, env)


def _wait_for_head(proc: subprocess.Popen, head: RayHead) -> str | None:
    """None once the head's job server lists its jobs (``GET /api/jobs/``, what ``ray job list`` asks: asked here
    over HTTP, not by a ``ray`` process that imports Ray for each poll); the tail of its log if ``ray start``
    exited first."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while (answer := _list_jobs(head)) is not None:
        if proc.poll() is not None:
            return (head.temp_dir / "ray-start.log").read_text()[-3000:]
        if time.monotonic() > deadline:
            pytest.fail(f"no answer from {head.dashboard_url} in {START_TIMEOUT_S} s: {answer}")
        time.sleep(0.5)
    return None


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the head is on 127.0.0.1: no HTTP proxy


def _list_jobs(head: RayHead) -> str | None:
    """None when the head's job server answers its job list; else why not. Asked with the head's token where the
    shell has one (as ``ray job list`` sends it: ``Authorization: Bearer``), whatever its mode: this only waits."""
    request = urllib.request.Request(f"{head.dashboard_url}/api/jobs/", headers=_auth_headers(head.env))
    try:
        with _DIRECT.open(request, timeout=10) as response:
            json.load(response)  # a list of jobs: the job server, not a page of another
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timed out, an HTTP error
        return str(exc)
    return None


def _auth_headers(env: dict[str, str]) -> dict[str, str]:
    """The header Ray's clients send from a shell with ``env`` where it has a token (``Authorization: Bearer``)."""
    return {"Authorization": f"Bearer {token}"} if (token := _auth_token(env)) else {}


def _auth_token(env: dict[str, str]) -> str | None:
    """The token Ray's clients would send from a shell with ``env`` (Ray 2.60: ``RAY_AUTH_TOKEN``, the file at
    ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``)."""
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"].strip()
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path(env["HOME"]) / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _stop_head(proc: subprocess.Popen, head: RayHead) -> None:
    stop_process_tree(proc, str(head.temp_dir))
    shutil.rmtree(head.temp_dir, ignore_errors=True)


def stop_process_tree(proc: subprocess.Popen, marker: str | None) -> None:
    """SIGTERM the process and its descendants, SIGKILL what is left, then any process naming ``marker``. A process
    already reaped has no tree (its id may be another's by now): only ``marker`` finds what it left."""
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)] if proc.poll() is None else []
    except psutil.NoSuchProcess:
        procs = []
    stop_processes(procs, grace_s=10.0)  # children first
    stragglers = []
    for p in psutil.process_iter(["cmdline"]) if marker else ():
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                p.kill()
                stragglers.append(p)
        except psutil.Error:
            continue
    psutil.wait_procs(stragglers, timeout=10)
    if proc.poll() is None:
        proc.wait(timeout=10)


def run_tree(
    argv: Sequence[str], timeout: float, marker: str | None = None, **popen: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **popen)`` whose process tree is
    stopped by process id however it ends, ``timeout`` included (:func:`stop_process_tree`; ``marker``, a Ray temp
    dir the command starts its local Ray under, also finds what was orphaned before).

    ``subprocess.run`` on its timeout kills only its own child: a ``servetune run`` stopped that way left its local
    Ray's DashboardAgent and RuntimeEnvAgent running, children of a raylet that outlived the driver. Here the
    command runs in a session of its own and its descendants are listed while it still runs, then stopped."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **popen)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        stop_process_tree(proc, marker)  # listed while the command still runs: every descendant, then the command
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the tree (orphaned before) holds its output open
            stdout, stderr = "", ""
        raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from exc
    except BaseException:
        stop_process_tree(proc, marker)
        raise
    if marker is not None:
        stop_process_tree(proc, marker)  # anything of its Ray's the command's own shut-down left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@dataclass
class RayNode:
    """A node of a test's cluster: its ``ray start --block`` process and its own temp dir."""

    proc: subprocess.Popen
    temp_dir: Path
    num_cpus: int
    num_gpus: int
    ip: str = "127.0.0.1"
    proxy_port: int | None = None  # Serve's HTTP proxy on this node binds this port (RAY_SERVE_WORKER_PROXY_HTTP_PORT)

    def raylet(self) -> psutil.Process:
        """The node's raylet (a child of its ``ray start --block``)."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        found = [p for p in kids if p.name() == "raylet"]
        assert found, f"no raylet under {self.proc.pid}"
        return found[0]


@dataclass
class LocalCluster:
    """A head and worker nodes on this machine, each with its own resources, ports and temp dir."""

    head: RayHead
    workers: list[RayNode]

    @property
    def address(self) -> str:
        return self.head.gcs_address

    def nodes(self) -> list[dict]:
        """The live nodes as the cluster sees them: id, resources, raylet socket (under the node's temp dir). Asked
        over HTTP of the head's dashboard (``GET /nodes?view=summary``: each node's ``GcsNodeInfo``, as the GCS
        keeps it), not by a driver of its own: a Python process importing Ray and joining the cluster as a job cost
        a few core-seconds a call, and the cluster's start polls it once a second."""
        request = urllib.request.Request(f"{self.head.dashboard_url}/nodes?view=summary",
                                         headers=_auth_headers(self.head.env))  # fmt: skip
        with _DIRECT.open(request, timeout=120) as response:
            summary = json.load(response)["data"]["summary"]
        return [{"id": node["raylet"]["nodeId"], "resources": node["raylet"]["resourcesTotal"],
                 "socket": node["raylet"]["rayletSocketName"]}
                for node in summary if node["raylet"].get("state") == "ALIVE"]  # fmt: skip

    def node_id_of(self, worker: RayNode) -> str:
        return next(n["id"] for n in self.nodes() if str(worker.temp_dir) in n["socket"])


@contextmanager
def ray_cluster(
    env: dict[str, str],
    workers: Sequence[tuple[int, int] | tuple[int, int, dict[str, float]]],
    head_cpus: int = 0,
    resources: dict[str, float] | None = None,
    own_addresses: bool = False,
) -> Iterator[LocalCluster]:
    """A head (``head_cpus`` CPUs, no GPU: the driver's node, as in cluster/) and one worker node
    per (CPUs, GPUs) in ``workers``, each joined with ``ray start --address --block`` and declaring
    ``resources`` besides (e.g. the ``accelerator_type:H100`` Ray gives a GPU node), or a worker's own
    given as (CPUs, GPUs, resources) (nodes of two GPU types); yields once every node is up. Stopped by process
    id: the workers side by side, then the head.

    ``own_addresses``: each worker is a host of its own as far as Ray and Serve can tell, on one machine: the i-th
    at 127.0.0.(i+2) (all of 127/8 is loopback on Linux), its Serve HTTP proxy on a port of its own (Serve's proxies
    bind ``http_options.host`` with SO_REUSEPORT, so on one host proxies sharing a port would share its connections:
    ``RAY_SERVE_WORKER_PROXY_HTTP_PORT`` in the worker's environment moves its proxy to its own port)."""
    started: list[RayNode] = []
    with ray_head(env, num_cpus=head_cpus, num_gpus=0) as head:
        try:
            starts: list[Callable[[], RayNode]] = []
            for worker in workers:
                own = worker[2] if len(worker) == 3 else resources
                at = f"127.0.0.{len(starts) + 2}" if own_addresses else "127.0.0.1"
                starts.append(functools.partial(_start_worker, head, env, worker[0], worker[1], own, at,
                                                free_port() if own_addresses else None))  # fmt: skip
                started.append(starts[-1]())
            tries = [1] * len(started)
            cluster = LocalCluster(head, started)
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(cluster.nodes()) < 1 + len(workers):
                for i, node in enumerate(started):
                    if node.proc.poll() is None:
                        continue
                    # As a head's (ray_head): timed out joining on a busy host, stopped and started again afresh.
                    exited = (node.temp_dir / "ray-start.log").read_text()[-3000:]
                    stop_process_tree(node.proc, str(node.temp_dir))
                    shutil.rmtree(node.temp_dir, ignore_errors=True)
                    _fail_or_retry("ray start --address", node.proc.returncode, exited, tries[i])
                    started[i], tries[i] = starts[i](), tries[i] + 1
                    deadline = max(deadline, time.monotonic() + START_TIMEOUT_S)
                assert time.monotonic() < deadline, f"the worker nodes did not join in {START_TIMEOUT_S} s"
                time.sleep(1)
            yield cluster
        finally:
            with concurrent.futures.ThreadPoolExecutor(max(1, len(started))) as pool:  # side by side, then the head
                list(pool.map(_stop_node, started))


def _stop_node(node: RayNode) -> None:
    stop_process_tree(node.proc, str(node.temp_dir))
    shutil.rmtree(node.temp_dir, ignore_errors=True)


def _start_worker(
    head: RayHead, env: dict[str, str], num_cpus: int, num_gpus: int, resources: dict[str, float] | None = None,
    ip: str = "127.0.0.1", proxy_port: int | None = None,
) -> RayNode:  # fmt: skip
    temp_dir = Path(tempfile.mkdtemp(prefix="st-rayw-", dir="/tmp"))
    argv = [
        str(RAY), "start", "--address", head.gcs_address, "--block", "--node-ip-address", ip,
        "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus), "--temp-dir", str(temp_dir), "--disable-usage-stats",
        "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
        "--metrics-export-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
        "--dashboard-agent-grpc-port", str(free_port()), "--runtime-env-agent-port", str(free_port()),
    ]  # fmt: skip
    if resources:
        argv += ["--resources", json.dumps(resources)]
    env = {**env, **NO_DRAIN}
    if proxy_port is not None:
        env = {**env, "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(proxy_port)}
    with open(temp_dir / "ray-start.log", "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return RayNode(proc, temp_dir, num_cpus, num_gpus, ip, proxy_port)


def trial_dirs_on(node_dir: Path) -> dict[str, Path]:
    """The trial directories a study's trials made under a node's own temp dir, by trial id."""
    return {p.name: p for p in node_dir.glob("session_*/artifacts/*/*/working_dirs/*/servetune/trials/*") if p.is_dir()}


@dataclass(frozen=True)
class LostNode:
    """What :func:`lose_a_node_mid_trial` did: the node it killed, the trial running there, how the driver ended."""

    victim: RayNode
    trial_id: str
    returncode: int
    output: str


def lose_a_node_mid_trial(cluster: LocalCluster, argv: list[str], cwd: Path, running: Callable[[Path], bool],
                          find_s: float, finish_s: float, before_kill: Callable[[], None] = lambda: None) -> LostNode:  # fmt: skip
    """Run ``servetune run`` (``argv``, its output in ``cwd/driver.log``) on the cluster; once a trial
    directory on a worker is ``running`` (and has no result yet), call ``before_kill``, kill that
    worker's raylet (the node is lost, and with it the trial's worker) and wait for the driver."""
    log_path = cwd / "driver.log"
    with log_path.open("w") as log:
        driver = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=cluster.head.env,
                                  start_new_session=True)  # fmt: skip
        try:
            found = _running_trial(cluster, driver, log_path, running, find_s)
            before_kill()
            found[0].raylet().kill()
            driver.wait(timeout=finish_s)
        finally:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
    return LostNode(*found, driver.returncode, log_path.read_text())


def _running_trial(cluster: LocalCluster, driver: subprocess.Popen, log_path: Path, running: Callable[[Path], bool],
                   timeout_s: float) -> tuple[RayNode, str]:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert driver.poll() is None, "the study ended before a trial ran:\n" + log_path.read_text()[-3000:]
        for worker in cluster.workers:
            for trial_id, trial_dir in trial_dirs_on(worker.temp_dir).items():
                if running(trial_dir) and not (trial_dir / "result.json").exists():
                    return worker, trial_id
        time.sleep(0.2)
    pytest.fail(f"no trial was running on a worker after {timeout_s:g} s")


def last_json(stdout: str) -> Any:
    """The last line of a Ray driver's output that is a JSON object or list: Ray may print lines after the driver's
    own (a crashed raylet's backtrace, as CI once saw)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(("{", "[")):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    raise AssertionError(f"no JSON line in the driver's output: {stdout[-2000:]}")
