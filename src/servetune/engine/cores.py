"""Cores of its own for each engine servetune starts on vLLM's CPU build.

On the CPU build a device is a core: a trial of TP x DP x PP ranks reserves as many cores (DESIGN.md),
and is priced for them. vLLM binds its OpenMP threads itself (``VLLM_CPU_OMP_THREADS_BIND=auto``) to
the cores of one NUMA node, the first of them first, and every engine started with the same
environment makes the same choice: two trials side by side ran on the same core, and a one-rank
engine on a many-core host ran on every core but one, not on the core it reserved.

So each engine claims free cores, a rank per core, before it starts: a lock file per core in a
directory shared by every engine on the host (``flock``: held for the claimant's life, let go by the
kernel however it ends), and ``VLLM_CPU_OMP_THREADS_BIND`` set to them (``0|1`` for two ranks). A bind
the user set is kept. Too few free cores: one rank keeps vLLM's own binding; several are bound to the
first cores, as ``export`` binds them (vLLM's own would refuse several ranks on one NUMA node). A
bare engine claims in :class:`~servetune.engine.server.VllmServer`; a Serve replica in its process
(serve/cores.py). Cores are logical CPUs, taken one per physical core first (:func:`physical_first`):
on a host with SMT, a rank shares a physical core with another only when no whole core is free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import IO, NamedTuple

BIND = "VLLM_CPU_OMP_THREADS_BIND"
#: A lock directory of one's own, for processes that share a host but not its cores' accounting (two test
#: processes side by side, each checking that its own engines got cores of their own). Inherited by the
#: engines, Ray workers and Serve replicas the process starts.
LOCK_DIR_ENV = "SERVETUNE_CPU_LOCK_DIR"


def lock_dir() -> Path:
    """Where this host's core locks are (shared by every engine on it, bare or a Serve replica), or
    ``$SERVETUNE_CPU_LOCK_DIR`` where that is set."""
    path = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "servetune-cpu-cores")
    path.mkdir(parents=True, exist_ok=True)
    return path


SYSFS_CPU = Path("/sys/devices/system/cpu")


def id_list(text: str) -> list[int]:
    """The kernel's CPU list format: ``0-3,8,10-11``."""
    ids: list[int] = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        ids.extend(range(int(first), int(last or first) + 1))
    return ids


def physical_first(allowed: list[int], sysfs: Path | None = None) -> list[int]:
    """``allowed`` with the first thread of every physical core before any core's second (SMT siblings, from
    ``cpuN/topology/thread_siblings_list``), each group in CPU order, as vLLM's own binding takes one logical CPU
    per core. Where the kernel does not say, CPU order."""
    sysfs = sysfs or SYSFS_CPU

    def key(cpu: int) -> tuple[int, int]:
        try:
            siblings = sorted(id_list((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()))
        except (OSError, ValueError):
            return 0, cpu
        return (siblings.index(cpu) if cpu in siblings else 0), cpu

    return sorted(allowed, key=key)


def claim(count: int, allowed: list[int], directory: Path) -> tuple[list[int], list[IO[str]]]:
    """The first ``count`` cores of ``allowed`` (:func:`physical_first`) no other process holds, and their held
    locks; nothing (all let go) when fewer are free."""
    held: list[tuple[int, IO[str]]] = []
    for core in physical_first(allowed):
        if len(held) == count:
            break
        handle: IO[str] = open(directory / f"core-{core}.lock", "a")  # noqa: SIM115 - held for the claimant's life
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        held.append((core, handle))
    if len(held) < count:
        for _, handle in held:
            handle.close()
        return [], []
    return [core for core, _ in held], [handle for _, handle in held]


def binding(ranks: int, claimed: list[int], allowed: list[int]) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``ranks`` ranks: the cores it claimed, a rank per core;
    without a claim, several ranks on the first allowed cores and one rank left to vLLM (None)."""
    if claimed:
        return "|".join(map(str, claimed))
    return "|".join(map(str, physical_first(allowed)[:ranks])) if ranks > 1 else None


def cores_words(cpu_binding: str | None = None, cpu_unclaimed: str | None = None) -> str:
    """What an engine's (or a deployment's replicas') core claim got, in the words every record and summary gives it
    after what ran there: ``, bound to cores 0|1`` and `` (no cores of its own, measured on shared cores: why)``;
    empty for neither. Numbers measured on shared cores are not comparable with those of an engine that had its own.
    Named as the records name them, so that a record of the two (serve/claims.py ``running_cores``) is
    ``cores_words(**record)``."""
    bound = f", bound to cores {cpu_binding}" if cpu_binding else ""
    return bound + (f" (no cores of its own, measured on shared cores: {cpu_unclaimed})" if cpu_unclaimed else "")


class Claim(NamedTuple):
    """What a bare engine about to start got: its binding, the locks its starter holds until the engine is gone, and
    why it claimed no cores of its own (None when it did): the trial records it beside its binding."""

    binding: str | None
    held: list[IO[str]]
    unclaimed: str | None = None


def claim_now(ranks: int) -> Claim:
    """The binding of a bare engine about to start (:class:`Claim`). No wait: the study's scheduler (Ray) gives a
    trial its cores only once the trial before it let them go; other processes' engines on the host may hold them."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        directory = lock_dir()
        claimed, held = claim(ranks, allowed, directory)
    except OSError as exc:  # the lock directory cannot be used: as without free cores
        return Claim(binding(ranks, [], allowed), [], locks_unusable(exc))
    if claimed:
        return Claim(binding(ranks, claimed, allowed), held)
    bind = binding(ranks, [], allowed)
    return Claim(bind, [], none_free(ranks, allowed, directory, bind))


def locks_unusable(exc: OSError) -> str:
    """Why an engine claimed no cores when the lock directory cannot be used (``cpu_unclaimed``)."""
    return f"core locks unusable ({exc})"


def none_free(ranks: int, allowed: list[int], directory: Path, bind: str | None, waited_s: float = 0.0) -> str:
    """Why an engine of ``ranks`` ranks claimed no cores when other engines held them (``cpu_unclaimed``), after
    ``waited_s`` seconds of waiting for them (a Serve replica's), and how it is bound instead (``bind``)."""
    left = f"bound to shared cores {bind}" if bind else "vLLM binds it itself"
    after = f" after {waited_s:.0f} s" if waited_s else ""
    return f"no {ranks} of the {len(allowed)} cores free{after}: other engines hold their locks in {directory}; {left}"


def bound_cores(bind: str) -> list[int]:
    """The cores a ``VLLM_CPU_OMP_THREADS_BIND`` value names (``0|1``, ``0-3|4-7``); none for ``auto``/``nobind``."""
    if bind.strip() in ("", "auto", "nobind"):
        return []
    return sorted({core for rank in bind.split("|") for core in id_list(rank)})


def held_by_engines(allowed: list[int], directory: Path) -> set[int]:
    """The cores of ``allowed`` whose lock some engine holds now (this process's own included: a lock is held per
    open file, so probing a core this process's engine claimed fails too). A probe that got the lock lets it go."""
    held: set[int] = set()
    for core in allowed:
        try:
            with open(directory / f"core-{core}.lock", "a") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.add(core)
    return held


class ClientCores(NamedTuple):
    """The cores a load client runs on apart from the engine it measures (empty: left where it was), and why not
    where it is left (the record's ``client_unpinned``)."""

    cores: list[int]
    unpinned: str | None = None


def client_cores(bind: str | None, allowed: list[int], held: Collection[int] = (),
                 sysfs: Path | None = None) -> ClientCores:  # fmt: skip
    """Where a load client runs beside a CPU engine bound to ``bind`` (its ``VLLM_CPU_OMP_THREADS_BIND``), so that
    the engine's OpenMP threads and the client do not take turns on one core: the cores of ``allowed`` (this
    process's) the engine's ranks are not bound to, less their SMT siblings where other cores are left, less the cores
    other engines hold (``held``) where cores are left without them. None (left unpinned, and why) for an engine not
    bound to known cores (a GPU engine, vLLM's own binding) and where the engine is bound to every allowed core."""
    if not bind or not (engine := bound_cores(bind)):
        return ClientCores([], f"the engine is not bound to known cores ({bind or 'no CPU binding'})")
    free = [core for core in allowed if core not in engine]
    if not free:
        return ClientCores([], f"the engine's ranks are bound to every core this process may use ({len(allowed)})")
    apart = [core for core in free if not set(_siblings(core, sysfs)) & set(engine)]
    free = apart or free
    return ClientCores([core for core in free if core not in held] or free)


def _siblings(core: int, sysfs: Path | None) -> list[int]:
    """The logical CPUs that share ``core``'s physical core, itself included (just itself where the kernel does not say)."""
    try:
        return id_list(((sysfs or SYSFS_CPU) / f"cpu{core}" / "topology" / "thread_siblings_list").read_text())
    except (OSError, ValueError):
        return [core]


def thread_ids() -> list[int]:
    """This process's threads (Linux: ``/proc/self/task``); just the calling one where that cannot be read."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


@contextlib.contextmanager
def pinned_to(cores: list[int]) -> Iterator[None]:
    """Run this process (every thread it has now, and those they start) on ``cores`` inside, as it was after; nothing
    for no cores. Processes it starts inside inherit the pin."""
    if not cores:
        yield
        return
    original = os.sched_getaffinity(0)
    before: dict[int, set[int]] = {}
    for tid in thread_ids():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
    try:
        yield
    finally:
        for tid in thread_ids():  # those started inside got the pin: they get the process's own back
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, original))


def client_cores_here(bind: str | None) -> ClientCores:
    """:func:`client_cores` for this process beside an engine bound to ``bind``, the other engines' cores read from
    the host's core locks (none where the lock directory cannot be used)."""
    allowed = sorted(os.sched_getaffinity(0))
    try:
        held = held_by_engines(allowed, lock_dir())
    except OSError:
        held = set()
    return client_cores(bind, allowed, held)


def client_record(pin: ClientCores) -> dict[str, str]:
    """What a record says of where the load client ran: ``client_cores`` (``1``, ``2,3``), or ``client_unpinned``
    and why."""
    if pin.cores:
        return {"client_cores": ",".join(map(str, pin.cores))}
    return {"client_unpinned": pin.unpinned or "no cores apart from the engine's"}
