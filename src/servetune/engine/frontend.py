"""The front end's CPU over a level: how busy vLLM's API server kept its core.

``vllm serve`` answers HTTP, tokenizes and streams on one asyncio event loop in its own process; on vLLM's CPU
build (and on GPUs) the engine core and its workers are processes of their own, so the API server's own CPU
seconds (user + system, every thread of it, not its children's) are the front end's. With
``api_server_count`` above 1 the ``vllm serve`` process starts that many API servers (titled
``VLLM::APIServer_N``) and only supervises them: each is read on its own.

A level's share is read twice, at its start and its end (no sampling thread): the CPU seconds each process
spent in between over the seconds in between, of the busiest one, whose ceiling is about one core (its event
loop; a few helper threads can take it slightly past). A process that started or ended in between is left out.
A reading may say what each process is (``roles``: a Serve trial's front end is several kinds of process,
serve/frontend.py); the busiest one's role is then the level's ``frontend_process``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

#: What vLLM's set_process_title gives each API server that ``vllm serve`` starts (``VLLM::APIServer_0``, ...).
API_SERVER_TITLE = "::APIServer"


#: A front-end process in a reading: its pid on this host; ``"<node id>:<pid>"`` for one another Ray node read
#: (serve/frontend.py), whose pids and clock are that node's.
ProcessKey = int | str


@dataclass(frozen=True)
class CpuReading:
    """The front end's processes' CPU seconds (by :data:`ProcessKey`) at one moment (``time.perf_counter()``
    seconds), and what each process is where the reader says (``proxy``, ``ingress``, ``replica`` for Serve; none
    for vLLM). ``clocks``: for a process read on another node, that node's ``perf_counter()`` when it was read (a
    clock of its own: only a difference of two of its readings means anything)."""

    at_s: float
    cpu_s: dict[ProcessKey, float]
    roles: dict[ProcessKey, str] = field(default_factory=dict)
    clocks: dict[ProcessKey, float] = field(default_factory=dict)

    def read_at(self, key: ProcessKey) -> float:
        """When ``key`` was read, on its own node's clock."""
        return self.clocks.get(key, self.at_s)


def front_end(serve_pid: int) -> list[psutil.Process]:
    """The ``vllm serve`` process and the API servers it started (empty: it is gone)."""
    try:
        serve = psutil.Process(serve_pid)
        children = serve.children(recursive=True)
    except psutil.Error:
        return []
    servers = []
    for child in children:
        try:
            if any(API_SERVER_TITLE in part for part in child.cmdline()):
                servers.append(child)
        except psutil.Error:
            continue
    return [serve, *servers]


def read_cpu(processes: list[psutil.Process], roles: dict[int, str] | None = None) -> CpuReading | None:
    """The processes' CPU seconds now (None: none of them could be read); ``roles``: what each pid is."""
    cpu_s: dict[ProcessKey, float] = {}
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        cpu_s[process.pid] = times.user + times.system
    found: dict[ProcessKey, str] = {pid: role for pid, role in (roles or {}).items() if pid in cpu_s}
    return CpuReading(time.perf_counter(), cpu_s, found) if cpu_s else None


def busiest(before: CpuReading | None, after: CpuReading | None) -> tuple[float, str | None] | None:
    """The largest share of the window between two readings that one front-end process spent on a CPU (1.0: a full
    core), counting the processes read at both, and that process's role (None where the readings name none); None
    where either reading or the window is missing."""
    if before is None or after is None or after.at_s <= before.at_s:
        return None
    shares = {}
    for key in before.cpu_s.keys() & after.cpu_s.keys():
        window = after.read_at(key) - before.read_at(key)  # a process on another node: that node's clock
        if window > 0:
            shares[key] = (after.cpu_s[key] - before.cpu_s[key]) / window
    if not shares:
        return None
    key = max(shares, key=lambda k: (shares[k], -k if isinstance(k, int) else 0, str(k)))  # a tie: the lowest pid
    return shares[key], before.roles.get(key) or after.roles.get(key)


def busiest_share(before: CpuReading | None, after: CpuReading | None) -> float | None:
    """:func:`busiest`'s share alone."""
    found = busiest(before, after)
    return found[0] if found is not None else None
