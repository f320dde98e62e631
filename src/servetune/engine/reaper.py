"""The keeper of an engine's process group: nothing of it outlives the process that launched it.

``python -m servetune.engine.reaper LAUNCHER_PID --grace S -- ARGV...`` runs as the leader of a
new session (:class:`~servetune.engine.server.VllmServer` starts it so) and starts ARGV, the
engine, in its own process group. vLLM's server starts a DP coordinator, engine cores and
workers; they get no signal when the server is killed, and were found running half an hour
after a killed study, holding memory and taking CPU from the trials measured next. So the
reaper stays beside the engine and clears the whole group:

- when the launcher dies, however it dies (``PR_SET_PDEATHSIG`` sends the reaper SIGTERM);
- when the reaper itself is killed outright, as Ray does to a worker's direct children: a
  guard, the reaper's own child in the group, then clears it (:func:`guard`);
- when it is sent SIGTERM, SIGINT or SIGHUP (``VllmServer.stop`` signals the group);
- when the engine exits by itself, so none of its children lingers.

Clearing is SIGTERM to the group, ``--grace`` seconds for it to leave, then SIGKILL to what
is left, then removing the ``--remove`` directory (the engine's sockets, which a killed vLLM
leaves). The reaper then exits as the engine did: with its exit code, or by the signal that
ended it, so that ``Popen.returncode`` reads as if the engine had been started directly.
Only the standard library and psutil: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def set_parent_death_signal(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent dies (no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def group_processes(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def others_in_group() -> list[psutil.Process]:
    """Live (non-zombie) processes of this process group, this one left out."""
    me = os.getpid()
    return [proc for proc in group_processes(os.getpgrp()) if proc.pid != me]


def clear_group(grace_s: float) -> int:
    """SIGTERM the rest of the group, wait up to ``grace_s``, SIGKILL what is left; how many were left."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # the group's signals are not for the reaper now
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(os.getpgrp(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    left = others_in_group()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = others_in_group()
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(left, timeout=5)
    return len(left)


def exit_like(returncode: int) -> None:
    """Leave with the engine's exit code, or die of the signal that ended it."""
    if returncode < 0:
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        time.sleep(1)  # a signal that does not end a process lands here
    sys.exit(returncode if returncode >= 0 else 128 - returncode)


def remove(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def guard(reaper_pid: int, grace_s: float, scratch: str | None = None) -> None:
    """The reaper's own keeper: clears the group if the reaper is killed outright.

    Ray kills a worker's direct children with SIGKILL when the worker exits (not their
    children: ``RAY_kill_child_processes_on_worker_exit``), and the reaper is one. The guard,
    the reaper's child in the same group, gets SIGUSR1 when the reaper dies and then clears
    the group. SIGTERM (the group being stopped the ordinary way) ends it quietly.
    """
    died = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: died.set())
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != reaper_pid:
        died.set()
    died.wait()
    left = clear_group(grace_s)
    remove(scratch)
    print(
        f"servetune: the engine's reaper died; stopped its group ({left} process(es) needed SIGKILL)",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m servetune.engine.reaper", description=__doc__.split("\n\n")[0])
    parser.add_argument("launcher_pid", type=int, help="the process whose death ends the engine")
    parser.add_argument("--grace", type=float, default=20.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--remove", metavar="DIR", help="a directory of the engine's to remove once it is gone")
    parser.add_argument("--guard", action="store_true", help=argparse.SUPPRESS)  # the reaper's keeper (see guard)
    argv = sys.argv[1:] if argv is None else argv
    if "--guard" in argv:
        args = parser.parse_args(argv)
        guard(args.launcher_pid, args.grace, args.remove)
        return
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the engine's command after --")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]

    stop = threading.Event()
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: stop.set())
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != args.launcher_pid:  # the launcher died before the death signal was armed
        sys.exit(128 + signal.SIGTERM)

    keeper = ["--remove", args.remove] if args.remove else []
    subprocess.Popen(
        [sys.executable, "-m", "servetune.engine.reaper", str(os.getpid()), "--grace", f"{args.grace:g}", *keeper,
         "--guard"]
    )  # fmt: skip
    engine = subprocess.Popen(command)  # same group, stdio and environment as the reaper
    while engine.poll() is None and not stop.is_set():
        stop.wait(0.2)
    left = clear_group(args.grace)
    remove(args.remove)
    if left:
        print(
            f"servetune: killed {left} engine process(es) still running {args.grace:g} s after SIGTERM",
            file=sys.stderr,
            flush=True,
        )
    exit_like(engine.wait())


if __name__ == "__main__":
    main()
