"""VllmServer's process handling, with the fake server standing in for vLLM's entry point."""

import re
import time

import pytest

from servetune.engine.server import VllmServer, group_members
from servetune.errors import EngineStartError
from servetune.testing.fake_openai import write_fake_python
from tests.processes import processes_mentioning


@pytest.fixture
def fake_python(tmp_path):
    """An 'interpreter' that runs the fake server whatever module it is asked to run."""
    return str(write_fake_python(tmp_path))


def server(fake_python, tmp_path, **engine_args):
    return VllmServer("fake-model", engine_args, {"SERVETUNE_TEST": "1"}, log_path=tmp_path / "engine.log",
                      python=fake_python, startup_timeout_s=engine_args.pop("timeout", 120), stop_grace_s=1.0)  # fmt: skip


def test_starts_reports_kv_and_leaves_nothing(fake_python, tmp_path):
    srv = server(fake_python, tmp_path, kv_tokens=1000)
    with srv:
        assert srv.alive() and srv.startup_s is not None
        assert srv.url.startswith("http://127.0.0.1:")
        assert srv.kv_capacity().tokens == 1000
        assert srv.command()[1] == "-c" and srv.command()[3:5] == ["serve", "fake-model"]  # vllm serve MODEL
        pgid = srv.process.pid
        assert group_members(pgid)
        ipc_dir = srv.ipc_dir  # the engine's own socket directory, with the socket it made there
        assert ipc_dir is not None and len(list(ipc_dir.iterdir())) == 1
    assert not group_members(pgid) and not srv.alive()
    assert not ipc_dir.exists()


def test_a_socket_directory_the_user_chose_is_kept(fake_python, tmp_path, monkeypatch):
    chosen = tmp_path / "sockets"
    chosen.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(chosen))
    with server(fake_python, tmp_path) as srv:
        assert srv.ipc_dir is None
    assert len(list(chosen.iterdir())) == 1  # vLLM's to clear, as without servetune


def test_startup_failure_carries_the_log_tail(fake_python, tmp_path):
    srv = server(fake_python, tmp_path, fail_startup=True)
    with pytest.raises(EngineStartError) as info, srv:
        pass
    assert "injected startup failure" in info.value.log_tail
    assert "ValueError: injected startup failure" in str(info.value).splitlines()[0]
    assert not group_members(srv.process.pid)


def test_startup_timeout_stops_the_group(fake_python, tmp_path):
    srv = server(fake_python, tmp_path, startup_delay_s=60, timeout=1.5)
    with pytest.raises(EngineStartError, match=r"did not become healthy within 1\.5 s"), srv:
        pass
    assert not group_members(srv.process.pid)


def test_children_that_ignore_sigterm_are_killed(fake_python, tmp_path):
    srv = server(fake_python, tmp_path, stubborn_child=True)
    with srv:
        pgid = srv.process.pid
        time.sleep(0.3)
        assert len(group_members(pgid)) >= 2
    assert not group_members(pgid)


def test_a_process_sigkill_cannot_end_is_named_and_the_stop_goes_on(fake_python, tmp_path, monkeypatch):
    """A process stuck in the kernel (after a GPU fault) outlives SIGKILL; here one that the group listing keeps
    reporting stands in for it. The stop gives up on it after ``kill_wait_s``, names it, and returns."""
    import servetune.engine.server as server_module

    srv = server(fake_python, tmp_path, stubborn_child=True)
    srv.stop_grace_s, srv.kill_wait_s = 0.5, 1.0
    real_members = server_module.group_members
    stuck = 2**22 + 12345  # beyond any pid this host hands out
    with srv:
        pgid = srv.process.pid
        monkeypatch.setattr(server_module, "group_members", lambda group: [*real_members(group), stuck])
        started = time.monotonic()
    assert time.monotonic() - started < 15
    assert srv.stuck_pids == [stuck] and not real_members(pgid)  # the rest of the group is gone
    assert f"survived SIGKILL for 1 s (stuck in the kernel?): pid {stuck}" in srv.log_text()


def test_a_relative_pythonpath_reaches_the_engines_processes_absolute(fake_python, tmp_path, monkeypatch):
    """A job's runtime env sets ``PYTHONPATH: src``; the trial runs elsewhere (its Tune directory). The reaper and
    the engine get the entry as the trial's interpreter resolved it, so they import the submitted servetune."""
    import sys

    import psutil

    job_src = tmp_path / "job" / "src"
    job_src.mkdir(parents=True)
    (tmp_path / "trial").mkdir()
    monkeypatch.setenv("PYTHONPATH", "src")
    # As Python resolved it in the job's directory: PYTHONPATH's entries come right after the script's folder.
    monkeypatch.setattr(sys, "path", [sys.path[0], str(job_src), *sys.path[1:]])
    monkeypatch.chdir(tmp_path / "trial")
    with server(fake_python, tmp_path) as srv:
        seen = psutil.Process(srv.process.pid).environ()["PYTHONPATH"]
    assert seen == str(job_src)


def test_a_crash_is_seen(fake_python, tmp_path):
    with server(fake_python, tmp_path, crash_after_s=0.5) as srv:
        deadline = time.monotonic() + 15  # the crash comes 0.5 s after the app started; a loaded host may be late
        while srv.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not srv.alive()
        # Through the reaper, as if the engine had been started directly (the reaper exits once it cleared the group).
        assert srv.process.wait(timeout=15) == -9, srv.process.returncode


LAUNCHER = """
import sys, time
from servetune.engine.server import VllmServer
srv = VllmServer("fake-model", {"stubborn_child": True}, log_path=sys.argv[2], python=sys.argv[1], stop_grace_s=1.0)
srv.__enter__()
print(srv.process.pid, flush=True)
time.sleep(300)
"""


def test_a_killed_launcher_takes_the_engine_s_whole_group_with_it(fake_python, tmp_path):
    # What a killed trial or driver leaves: vLLM's server dies, but its children (here one that
    # even ignores SIGTERM) get no signal of their own. The reaper clears them.
    import signal
    import subprocess
    import sys

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, fake_python, str(tmp_path / "engine.log")],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pgid = int(launcher.stdout.readline())
        deadline = time.monotonic() + 10
        while len(group_members(pgid)) < 3 and time.monotonic() < deadline:  # reaper, server, child
            time.sleep(0.1)
        assert len(group_members(pgid)) >= 3
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 15
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_members(pgid)
    assert "killed 1 engine process(es) still running 1 s after SIGTERM" in (tmp_path / "engine.log").read_text()


def test_a_reaper_killed_outright_still_clears_the_group(fake_python, tmp_path):
    # Ray SIGKILLs a worker's direct children when the worker exits; the reaper is one.
    import os
    import signal

    srv = server(fake_python, tmp_path, stubborn_child=True)
    with srv:
        pgid = srv.process.pid
        deadline = time.monotonic() + 10
        while len(group_members(pgid)) < 4 and time.monotonic() < deadline:  # reaper, guard, server, child
            time.sleep(0.1)
        assert len(group_members(pgid)) >= 4
        ipc_dir = srv.ipc_dir
        assert ipc_dir is not None and ipc_dir.is_dir()
        os.kill(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 15
        while (group_members(pgid) or ipc_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_members(pgid)
        assert not ipc_dir.exists()  # the guard removed it, not the stop below
    # The stubborn child ignores SIGTERM, so at least it needed SIGKILL; on a loaded host the server itself may
    # not have exited within the grace either (2 seen with three test processes on two cores).
    stopped = re.search(
        r"the engine's reaper died; stopped its group \((\d+) process\(es\) needed SIGKILL\)",
        (tmp_path / "engine.log").read_text(),
    )
    assert stopped is not None and int(stopped.group(1)) >= 1


def test_a_crash_is_seen_at_once_though_the_reaper_is_still_clearing(fake_python, tmp_path):
    import os
    import signal

    import psutil

    # A child that ignores SIGTERM holds the reaper's clearing for its whole grace (1 s, stop_grace_s), so
    # the reaper lives on for 1.2 s or more after the kill: a deadline of 0.6 s still tells the engine's own
    # state from the reaper's, and leaves a killed process 0.6 s to be scheduled to exit on a busy host
    # (0.15 s before, below the reaper's 0.2 s poll, was the host's scheduling as much as the code).
    with server(fake_python, tmp_path, stubborn_child=True) as srv:
        assert srv.alive()
        engine = next(c for c in psutil.Process(srv.process.pid).children() if "--guard" not in c.cmdline())
        os.kill(engine.pid, signal.SIGKILL)
        # The reaper notices within its 0.2 s poll and then clears the group; the engine is a
        # zombie (or gone) at once, and that is what alive() looks at.
        deadline = time.monotonic() + 0.6
        while srv.alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not srv.alive()


def engine_env(srv: VllmServer) -> dict[str, str]:
    """The environment the engine process itself runs with (under the reaper)."""
    import psutil

    (engine,) = [p for p in psutil.Process(srv.process.pid).children() if "--guard" not in p.cmdline()]
    return engine.environ()


def test_engines_side_by_side_run_on_cores_of_their_own_and_let_them_go_when_stopped(
    fake_python, tmp_path, monkeypatch
):
    """On the CPU build each bare engine claims a core per rank (engine/cores.py): two at once never share
    one, a stopped engine's cores are free again, a bind the user set is kept, and GPUs bind nothing."""
    import os

    from servetune.engine.cores import BIND

    monkeypatch.setattr("servetune.engine.cores.lock_dir", lambda: tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6})
    monkeypatch.delenv(BIND, raising=False)

    def cpu(name, ranks, **env):
        return VllmServer("fake-model", {}, env, log_path=tmp_path / name / "engine.log", python=fake_python,
                          stop_grace_s=1.0, cpu_ranks=ranks)  # fmt: skip

    with cpu("a", 1) as one, cpu("b", 2) as two:
        assert (one.cpu_binding, two.cpu_binding) == ("4", "5|6")
        assert engine_env(one)[BIND] == "4" and engine_env(two)[BIND] == "5|6"
        with cpu("c", 1) as none_free:  # every core taken: one rank is left to vLLM's own binding
            assert none_free.cpu_binding is None and BIND not in engine_env(none_free)
        with cpu("d", 2) as crowded:  # ... and several ranks are bound as export binds them (vLLM's would refuse)
            assert crowded.cpu_binding == "4|5"
    with cpu("e", 2) as again:  # the stopped engines let their cores go
        assert again.cpu_binding == "4|5"
        with cpu("f", 1, **{BIND: "6"}) as users:  # the user's bind wins, and claims nothing
            assert users.cpu_binding == "6" and engine_env(users)[BIND] == "6"
        with cpu("g", 1) as last:
            assert last.cpu_binding == "6"
    gpu = VllmServer(
        "fake-model", {}, {}, log_path=tmp_path / "gpu" / "engine.log", python=fake_python, stop_grace_s=1.0
    )
    with gpu:
        assert gpu.cpu_binding is None and BIND not in engine_env(gpu)


def test_an_engine_started_by_a_ray_actor_does_not_inherit_rays_omp_threads(
    local_ray, fake_python, tmp_path, monkeypatch
):
    """Ray gives a trial's actor OMP_NUM_THREADS = its CPUs; vLLM leaves a set value alone and serves with that
    many torch threads, where `vllm serve` serves with one. The engine an actor starts gets the environment it
    would get from a shell; a value the user set (the space's env, or the actor's own environment) is kept."""
    import ray

    @ray.remote(num_cpus=2)
    class Trial:  # as Tune's trainable: an actor holding the trial's CPUs
        def threads(self, env, log):
            import os

            import psutil

            from servetune.engine.server import VllmServer

            with VllmServer("fake-model", {}, env, log_path=log, python=fake_python, stop_grace_s=1.0) as srv:
                (engine,) = [p for p in psutil.Process(srv.process.pid).children() if "--guard" not in p.cmdline()]
                return os.environ.get("OMP_NUM_THREADS"), engine.environ().get("OMP_NUM_THREADS")

    trial = Trial.remote()
    assert ray.get(trial.threads.remote({}, tmp_path / "a.log")) == ("2", None)  # Ray set 2; the engine has none
    assert ray.get(trial.threads.remote({"OMP_NUM_THREADS": "3"}, tmp_path / "b.log")) == ("2", "3")  # the space's env
    ray.kill(trial)  # its CPUs back, for the next
    users = Trial.options(runtime_env={"env_vars": {"OMP_NUM_THREADS": "4"}}).remote()
    assert ray.get(users.threads.remote({}, tmp_path / "c.log")) == ("4", "4")  # set before Ray: not Ray's
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the driver is no Ray worker: what its shell set is kept
    with VllmServer("fake-model", {}, {}, log_path=tmp_path / "d.log", python=fake_python, stop_grace_s=1.0) as srv:
        assert engine_env(srv).get("OMP_NUM_THREADS") == "2"


class Busy:
    def ready(self) -> bool:
        return True


def test_doctor_starts_an_engine_in_a_task_pinned_to_its_node_and_says_why_one_did_not_run(local_ray, fake_python):
    """``servetune doctor --engine`` (doctor.start_engines) on the module's Ray, the fake engine standing in for vLLM:
    a start in a task pinned to the node, its report back; a start asking a GPU the node has not is refused by Ray,
    and one that waits for a CPU another task holds is cancelled at its deadline; each says so. Nothing is left
    behind. (The real engine on the real CPU build: by hand, docs/commands/doctor.md.)"""
    import ray

    from servetune.doctor import EngineTarget, start_engines

    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    (report,) = start_engines([EngineTarget(node, "CPU", 0)], timeout_s=60, python=str(fake_python)).values()
    assert report["started"] and report["kv_tokens"] > 0, report
    (none,) = start_engines([EngineTarget(node, "H100", 1)], timeout_s=60, python=str(fake_python)).values()
    assert none["error"] == "the node cannot give a task 1 GPU(s) and a CPU (Ray: not schedulable)", none
    busy = ray.remote(num_cpus=2)(Busy).remote()  # holds the node's CPUs: the next start waits for one
    ray.get(busy.ready.remote())
    try:
        (stuck,) = start_engines(
            [EngineTarget(node, "CPU", 0)], timeout_s=1, python=str(fake_python), margin_s=2
        ).values()
    finally:
        ray.kill(busy)
    assert not stuck["started"] and stuck["error"].startswith("no answer within 3 s"), stuck
    assert processes_mentioning(fake_python) == []
