"""The CPU seconds a command's whole process tree spent, daemons and orphans included.

``/usr/bin/time`` counts only the children its command waited for: a Ray head's GCS, raylet and workers, stopped by
process id after their parent has gone, end as orphans of init and are not counted. This script makes itself a
child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so every orphaned descendant is reparented to it, reaps each as it
ends, and reads its own ``RUSAGE_CHILDREN``: user + system seconds of every process reaped by a wait up the tree.

That alone misses Ray's workers: the raylet ignores ``SIGCHLD`` (``SigIgn`` in its ``/proc/PID/status``), so the kernel
reaps its workers (Serve's replicas and controller, Tune's trials, the dashboard agent) without adding their time, or
that of the vLLM engines they reaped, to anyone's ``RUSAGE_CHILDREN``: a Serve-trials e2e module counted 302 core-s
that way against 702 read process by process (2026-12-07, load 10). So the script also reads every process of the
tree every ``SAMPLE_S`` (psutil, its own user + system seconds) and keeps the last reading of each; the line gives the
larger of the two sums, the sampled one missing at most the last ``SAMPLE_S`` of each process and those that lived
less.

    python bench/tree_cpu.py -- python -m pytest tests/integration/test_study.py -q -n 0 -p no:cacheprovider

prints one line on stderr: wall seconds, core-seconds and the load average before and after (the host is shared: a
number without the load beside it says little). The command's exit status is this script's. ``--by-process N`` (before
``--``) adds the N costliest kinds of process as read per process, one a line: a Ray worker by its title (the last it
had other than ``ray::IDLE``: ``ray::ServeReplica:llm:LLMServer:m``, ``ray::ServeController``), any other by its script
or ``-m`` module (``agent.py``: the dashboard agent), a ``-c`` by its first argument (``python -c serve``: servetune's
vLLM API server, ``python -c run``: lm-eval), with how many such processes there were.

A process whose parent ignores SIGCHLD is reaped by the kernel and its times are added to no one: Ray's raylet does
so, and its workers (a Serve module's replicas and Serve's controller and proxy: 160 of a module's 210 core-seconds,
by a per-process poll) were missing from ``RUSAGE_CHILDREN``. Where the host's cgroup-v1 ``cpuacct`` hierarchy is
writable (root), the command runs in a cpuacct group of its own, which every descendant joins at its birth, and the
group's usage is the number printed (``cgroup``: exact), the two sums above beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

PR_SET_CHILD_SUBREAPER = 36
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
#: How long orphans of the command get to exit after it did, before the line is printed without them.
GRACE_S = 60
#: How often every process of the tree is read (its own CPU seconds).
SAMPLE_S = 0.5


def kind_of(cmdline: list[str], name: str) -> str:
    """What a process is, in a word: a Ray worker's title, else the script or ``-m`` module its interpreter runs (a
    ``-c`` by the first argument after its code: ``python -c serve``), else its executable's name."""
    if cmdline and cmdline[0].startswith("ray::"):
        return cmdline[0].split(" ", 1)[0]
    for index, arg in enumerate(cmdline[1:], 1):
        if arg == "-m" and index + 1 < len(cmdline):
            return cmdline[index + 1]
        if arg.endswith(".py"):
            return Path(arg).name
        if arg == "-c":  # by its first argument (vLLM's server: serve; lm-eval: run), else the code's first words
            words = cmdline[index + 2 : index + 3] or (
                cmdline[index + 1].split()[:3] if index + 1 < len(cmdline) else []
            )
            return f"{name} -c {' '.join(words)[:60]}".rstrip()
    return name


class Sampler(threading.Thread):
    """The last reading of each process under this one: (pid, start time) -> its own user + system seconds, and what
    the process was (:func:`kind_of`: a Ray worker's last title other than ``ray::IDLE``)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: dict[tuple[int, float], float] = {}
        self.kinds: dict[tuple[int, float], str] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.read()
            self.stop.wait(SAMPLE_S)

    def read(self) -> None:
        for proc in psutil.Process().children(recursive=True):
            try:
                with proc.oneshot():
                    times = proc.cpu_times()
                    key = (proc.pid, proc.create_time())
                    self.seen[key] = times.user + times.system
                    kind = kind_of(proc.cmdline(), proc.name())
                    if kind != "ray::IDLE" or key not in self.kinds:
                        self.kinds[key] = kind
            except psutil.Error:
                continue

    def total(self) -> float:
        self.stop.set()
        self.join()
        self.read()
        return sum(self.seen.values())

    def by_kind(self) -> list[tuple[str, float, int]]:
        """(kind, core-seconds, processes) for each kind of process read, costliest first."""
        sums: dict[str, list[float]] = {}
        for key, used in self.seen.items():
            entry = sums.setdefault(self.kinds.get(key, "?"), [0.0, 0])
            entry[0] += used
            entry[1] += 1
        return sorted(((kind, used, int(n)) for kind, (used, n) in sums.items()), key=lambda k: -k[1])


def main(argv: list[str]) -> int:
    top = 0
    if argv[:1] == ["--by-process"] and len(argv) > 1 and argv[1].isdigit():
        top, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: tree_cpu.py [--by-process N] -- COMMAND [ARG ...]", file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("tree_cpu.py: prctl(PR_SET_CHILD_SUBREAPER) failed (Linux only)", file=sys.stderr)
        return 2
    group = cpu_group()
    load_before = os.getloadavg()
    began = time.monotonic()
    sampler = Sampler()
    proc = subprocess.Popen(argv, preexec_fn=None if group is None else lambda: join(group))
    sampler.start()
    status = reap_until(proc)  # the command; then the orphans handed to this process, for up to GRACE_S
    wall = time.monotonic() - began
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break  # none left
        if pid == 0:
            time.sleep(0.2)
    left = [p.pid for p in psutil.Process().children()]
    sampled = sampler.total()
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    reaped = used.ru_utime + used.ru_stime
    load_after = os.getloadavg()
    counted = (f"{max(sampled, reaped):.1f} core-s (read per process {sampled:.1f}, reaped {reaped:.1f}: user "
               f"{used.ru_utime:.0f}, sys {used.ru_stime:.0f})")  # fmt: skip
    if group is not None:
        counted = (f"{int((group / 'cpuacct.usage').read_text()) / 1e9:.1f} core-s (cgroup; read per process "
                   f"{sampled:.1f}, reaped {reaped:.1f})")  # fmt: skip
        with contextlib.suppress(OSError):  # a process left running is still in it
            group.rmdir()
    print(f"tree_cpu: wall {wall:.0f} s, {counted}; load before {load_before[0]:.2f} {load_before[1]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f}"
          + (f"; still running, not counted: pids {left}" if left else ""), file=sys.stderr)  # fmt: skip
    for kind, used, n in sampler.by_kind()[:top]:
        print(f"tree_cpu:   {used:7.1f} core-s  {n:3d} x {kind}", file=sys.stderr)
    return status


def reap_until(proc: subprocess.Popen) -> int:
    """The command's exit status, once it has ended; each orphan handed to this subreaper meanwhile is reaped as it
    ends. Left a zombie until the command ended, it still "runs" for anyone who waits on it by process id: a test's
    stop of a process tree (``psutil.wait_procs``) then waited out both its 10 s grace periods, and the unit test of
    ``tests/ray_heads.py``'s ``run_tree`` took 23 s under this script against 4 s under ``make test``."""
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode


def cpu_group() -> Path | None:
    """A new cpuacct cgroup for the command, or None where the hierarchy is not there or not writable."""
    group = CPUACCT / f"tree_cpu-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        return None
    return group


def join(group: Path) -> None:
    """In the command's process before it runs: into ``group`` (its descendants follow)."""
    (group / "cgroup.procs").write_text(str(os.getpid()))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
