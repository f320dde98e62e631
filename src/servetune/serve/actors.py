"""An application's replica actors as Ray's GCS actor table knows them, and what they leave on this host:
their processes (vLLM's engine cores among them), their workers' log files, and waiting for process ids to be
gone. ``serve/cluster.py`` reads them for serve-check, a trial through Serve and verify.

The GCS actor table is read directly (``ray._private.state.actors``): ``ray.util.state`` would need the
dashboard, which serve-check does not start. Ray is imported where it is used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import psutil

#: Seconds of slack around a replica actor's lifetime when its worker log files are matched by pid:
#: before its start (the clocks of the GCS and of this host), and after its end (late flushes).
WORKER_LOG_SLACK_S = 5.0
WORKER_LOG_AFTER_END_S = 60.0


def replica_actors(name: str, deployment_prefix: str = "", live_only: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """The application's replica actors (of the deployments whose names start with ``deployment_prefix``), as
    (actor id, the GCS actor table's entry): live ones only, or every one the GCS still knows (dead ones too)."""
    import ray

    prefix = f"ServeReplica:{name}:{deployment_prefix}"
    return [(str(actor_id), actor) for actor_id, actor in ray._private.state.actors().items()
            if (not live_only or actor.get("State") == "ALIVE") and str(actor.get("ActorClassName", "")).startswith(prefix)]  # fmt: skip


def replica_lifetimes(name: str) -> list[dict[str, Any]]:
    """Every replica actor of the application's deployments the GCS knows (dead ones too), oldest first: its
    ``deployment``, Serve's ``replica`` id, ``engine`` (an LLM deployment's, else the ingress's), and when its actor
    started and ended (``started_s``, ``ended_s``: the wall clock, seconds; None: not yet). An actor starts before its
    replica serves: a replica's engine starts inside it."""
    lives = []
    for _, actor in replica_actors(name, live_only=False):
        deployment = str(actor.get("ActorClassName", "")).split(":", 2)[-1]
        started, ended = int(actor.get("StartTime") or 0), int(actor.get("EndTime") or 0)
        lives.append({"deployment": deployment, "replica": str(actor.get("Name", "")).rsplit("#", 1)[-1],
                      "engine": deployment.startswith("LLMServer"), "started_s": started / 1000 if started else None,
                      "ended_s": ended / 1000 if ended else None})  # fmt: skip
    return sorted(lives, key=lambda life: (life["started_s"] or 0.0, life["replica"]))


def is_engine_core(process: psutil.Process) -> bool:
    """vLLM names its engine core process ``VLLM::EngineCore`` (setproctitle)."""
    try:
        return "EngineCore" in process.name() or "EngineCore" in " ".join(process.cmdline())
    except psutil.Error:
        return False


def node_of(actor: Mapping[str, Any]) -> str:
    """The node id the GCS actor table places ``actor`` on; empty while it is not placed."""
    node = str((actor.get("Address") or {}).get("NodeID") or "")
    return node if node.strip("0") else ""


def on_this_host(actor: Mapping[str, Any], unknown: bool = False) -> bool:
    """Whether the actor runs (or ran) on this host; ``unknown`` when the GCS has no address for it."""
    import ray

    ip = (actor.get("Address") or {}).get("IPAddress")
    return unknown if not ip else ip == ray.util.get_node_ip_address()


def replica_pids(name: str) -> list[int]:
    """Process ids of the application's live replica actors on this host and everything they started
    (vLLM's engine). Replicas on other hosts are left to Serve's teardown: their pids mean nothing here."""
    pids: list[int] = []
    for _, actor in replica_actors(name):
        if on_this_host(actor) and actor.get("Pid"):
            pids.append(int(actor["Pid"]))
            with contextlib.suppress(psutil.Error):
                pids += [child.pid for child in psutil.Process(actor["Pid"]).children(recursive=True)]
    return sorted(set(pids))


def replica_engines(name: str, deployment_prefix: str = "LLMServer") -> list[tuple[int, list[int]]]:
    """The application's live LLM replicas on this host: (the replica actor's pid, the pids of the vLLM engine
    processes it started: children named after vLLM's EngineCore, else every child)."""
    out = []
    for _, actor in replica_actors(name, deployment_prefix):
        if not (on_this_host(actor) and actor.get("Pid")):
            continue
        children: list[psutil.Process] = []
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(int(actor["Pid"])).children(recursive=True)
        engines = [c.pid for c in children if is_engine_core(c)] or [c.pid for c in children]
        out.append((int(actor["Pid"]), engines))
    return out


def worker_files(actor: Mapping[str, Any]) -> list[Path]:
    """A replica actor's worker stderr and stdout files (``worker-<id>-<job>-<pid>.err``), if it ran on this
    host. Files are named by pid, which the OS reuses: only files last written while the actor lived
    are its own (from its start, less a few seconds, to a minute after its end, or now: what its
    engine's processes flush as they exit still counts). A dead actor whose address the GCS cleared
    is taken to be on this host."""
    import ray

    node = ray._private.worker._global_node
    pid = int(actor.get("Pid") or 0)
    if node is None or not pid or not on_this_host(actor, unknown=True):
        return []
    start_s = int(actor.get("StartTime") or 0) / 1000 - WORKER_LOG_SLACK_S
    end_s = (int(actor.get("EndTime") or 0) / 1000 or time.time()) + WORKER_LOG_AFTER_END_S
    logs = Path(node.get_logs_dir_path())
    files = []
    for path in sorted(logs.glob(f"worker-*-{pid}.*")):
        with contextlib.suppress(OSError):
            if path.suffix in (".err", ".out") and start_s <= path.stat().st_mtime <= end_s:
                files.append(path)
    return files


def replica_logs(name: str, max_bytes: int = 4 << 20, leave_out: Collection[str] = ()) -> str:
    """Everything the application's LLM replicas on this node wrote to their workers' stderr and stdout
    (vLLM's log: start-up phases, KV-cache size), replica after replica, each file's last ``max_bytes``.
    Replicas Serve replaced are included (the GCS keeps dead actors), except the actor ids in
    ``leave_out`` (an earlier deployment of the same name, replicas that failed while deploying)."""
    text = []
    for actor_id, actor in replica_actors(name, "LLMServer", live_only=False):
        if actor_id in leave_out:
            continue
        for path in worker_files(actor):
            with contextlib.suppress(OSError), path.open("rb") as f:
                f.seek(max(path.stat().st_size - max_bytes, 0))
                text.append(f.read().decode(errors="replace"))
    return "\n".join(text)


def log_tail(name: str, lines: int = 40) -> str:
    """The last lines the application's replicas wrote on this node: their workers' stdout and
    stderr (vLLM's own log and tracebacks) and Serve's replica logs, oldest file first."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return ""
    logs = Path(node.get_logs_dir_path())
    files = [f for _, actor in replica_actors(name, live_only=False) for f in worker_files(actor)]
    files += list((logs / "serve").glob(f"replica_{name}_*"))
    text: list[str] = []
    for path in sorted(files, key=lambda p: p.stat().st_mtime)[-4:]:
        with contextlib.suppress(OSError):
            text += [line for line in path.read_text(errors="replace").splitlines()[-lines:] if line.strip()]
    return "\n".join(text[-lines:])


def alive(pids: list[int]) -> list[int]:
    """The ids in ``pids`` still running (a zombie is not)."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(pid)
    return found


#: Where Python's ``multiprocessing.shared_memory`` makes its segments, and the prefix of the names it gives them.
SHARED_MEMORY = Path("/dev/shm")
SHARED_MEMORY_PREFIX = "psm_"


def shared_memory_of(pids: Collection[int]) -> set[Path]:
    """The ``multiprocessing.shared_memory`` segments the processes ``pids`` map (``/proc/PID/maps``): a vLLM engine's
    message queues between its engine core and workers (``shm_broadcast``, two a replica on the CPU build, 160 and
    240 MB of address space each). vLLM unlinks them when its engine is closed in order; the engine of a replica that
    Serve stopped did not, and each Serve replica of the Serve-trials e2e module left its two in ``/dev/shm``."""
    found = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # gone, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            path = Path(fields[-1]) if len(fields) == 6 else None
            if path is not None and path.parent == SHARED_MEMORY and path.name.startswith(SHARED_MEMORY_PREFIX):
                found.add(path)  # a segment unlinked already reads "... (deleted)": no such name
    return found


def remove_shared_memory(paths: Collection[Path]) -> list[Path]:
    """Unlink the segments ``paths`` that still exist (their processes gone: the memory is freed once the last
    mapping goes, so one still mapped somewhere keeps working); the ones removed."""
    removed = []
    for path in sorted(paths):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    return removed


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Wait until none of ``pids`` runs; the ones still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = alive(left)
    return left


#: The actors a Serve instance runs (its controller and a proxy per node), named in Ray's ``serve`` namespace.
SERVE_ACTOR_PREFIXES = ("SERVE_CONTROLLER_ACTOR", "SERVE_PROXY_ACTOR")


def wait_serve_gone(timeout_s: float = 30.0) -> bool:
    """Wait until no Serve controller or proxy actor is named any more (``serve.shutdown`` returns while they are
    still being killed, and a ``serve.start`` in that gap finds the dying proxy by its name); whether they went."""
    import ray.util

    deadline = time.monotonic() + timeout_s
    while True:
        named = ray.util.list_named_actors(all_namespaces=True)
        if not any(str(a.get("name", "")).startswith(SERVE_ACTOR_PREFIXES) for a in named if isinstance(a, dict)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
