"""Each Serve replica's engine on the CPU build claims cores of its own (``serve/cores.py``): a core per rank,
a lock per core, the first free ones taken (waiting for a replica being replaced), let go when the holder
ends; a bind the user set is kept."""

import asyncio
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("ray.llm._internal.common.callbacks.base", reason="needs ray[serve,llm]")

from servetune.report.export import ray_serve_app
from servetune.report.points import ReportPoint
from servetune.serve import cores
from servetune.serve.cores import BIND, ClaimCores, claim
from servetune.serve.plan import CLAIM_CORES, CLAIM_CORES_ENV, llm_config


def test_replicas_take_distinct_cores_and_a_full_host_gives_none(tmp_path):
    first, held_a = claim(1, [0, 1, 2], tmp_path)
    second, _held_b = claim(1, [2, 1, 0], tmp_path)  # the locks stay held while referenced
    assert first == [0] and second == [1]
    assert claim(2, [0, 1, 2], tmp_path) == ([], [])  # one core left for a two-rank replica: nothing taken
    third, _held_c = claim(1, [0, 1, 2], tmp_path)  # ... and that try let go of what it had taken
    assert third == [2]
    for handle in held_a:
        handle.close()  # a replica that ended
    assert claim(1, [0, 1, 2], tmp_path)[0] == [0]


def test_a_core_held_by_another_process_is_let_go_when_it_ends(tmp_path):
    code = (f"import sys, time; from pathlib import Path; from servetune.serve.cores import claim; "
            f"cores, held = claim(1, [0, 1], Path({str(tmp_path)!r})); print(cores, flush=True); time.sleep(60)")  # fmt: skip
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "[0]"
        assert claim(1, [0, 1], tmp_path)[0] == [1]
    finally:
        holder.kill()
        holder.wait()
    assert claim(1, [0], tmp_path)[0] == [0]  # killed: the kernel let its lock go


def test_the_callback_binds_the_engine_it_starts_unless_the_user_did(tmp_path, monkeypatch):
    monkeypatch.setattr("servetune.serve.cores.lock_dir", lambda: tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3, 5, 7, 9, 11})
    monkeypatch.setenv(BIND, "auto")  # vLLM's default; restored after the test whatever the callback sets
    monkeypatch.setattr(cores, "HELD", [])
    callback = ClaimCores(llm_config=None, ranks=2)
    asyncio.run(callback.on_before_node_init())
    assert os.environ[BIND] == "3|5" and len(cores.HELD) == 2  # a core per rank, the first free
    pickle.dumps(callback)  # Ray pickles the callback with its config: it holds no file
    monkeypatch.setenv(BIND, "7")
    asyncio.run(ClaimCores(llm_config=None, ranks=1).on_before_node_init())
    assert os.environ[BIND] == "7" and len(cores.HELD) == 2
    for handle in cores.HELD:
        handle.close()


def test_a_claim_waits_for_cores_a_replaced_replica_still_holds(tmp_path, monkeypatch):
    monkeypatch.setattr("servetune.serve.cores.lock_dir", lambda: tmp_path)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(BIND, "auto")
    monkeypatch.setattr(cores, "HELD", [])
    _, old = claim(2, [0, 1], tmp_path)  # replicas Serve is stopping hold every core
    # The clock starts before the timer does: taken after it, a busy host's pause between the two (the timer's
    # thread running first) came off the wait measured, and a claim that waited its full 1.5 s read under 1.4.
    started = time.monotonic()
    threading.Timer(1.5, lambda: [h.close() for h in old]).start()
    asyncio.run(ClaimCores(llm_config=None, ranks=1).on_before_node_init())
    assert os.environ[BIND] == "0" and time.monotonic() - started >= 1.4  # waited, then bound (not vLLM's own choice)
    for handle in cores.HELD:
        handle.close()


def test_several_ranks_without_free_cores_are_bound_as_export_binds_them(tmp_path, monkeypatch):
    monkeypatch.setattr("servetune.serve.cores.lock_dir", lambda: tmp_path)
    monkeypatch.setattr("servetune.serve.cores.WAIT_S", 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(BIND, "auto")
    _, others = claim(2, [0, 1], tmp_path)
    asyncio.run(ClaimCores(llm_config=None, ranks=2).on_before_node_init())
    assert os.environ[BIND] == "0|1"  # vLLM's auto would refuse two ranks on one NUMA node
    monkeypatch.setenv(BIND, "auto")
    asyncio.run(ClaimCores(llm_config=None, ranks=1).on_before_node_init())
    assert os.environ[BIND] == "auto"  # one rank: vLLM's own binding
    for handle in others:
        handle.close()


def test_only_servetunes_own_cpu_deployments_on_a_local_ray_carry_the_callback(monkeypatch):
    cpu = ReportPoint(trial_id="t1", params={}, engine_args={"tensor_parallel_size": 2}, model="/m", device="cpu")
    monkeypatch.delenv(CLAIM_CORES_ENV, raising=False)
    assert "callback_config" not in llm_config(cpu, 2)  # a cluster servetune joins: vLLM binds as it does
    monkeypatch.setenv(CLAIM_CORES_ENV, "1")
    assert llm_config(cpu, 2)["callback_config"] == {"callback_class": CLAIM_CORES, "callback_kwargs": {"ranks": 2}}
    gpu = ReportPoint(trial_id="t1", params={}, engine_args={}, model="/m", device="gpu")
    assert "callback_config" not in llm_config(gpu, 2)
    assert "callback_config" not in ray_serve_app(cpu)["applications"][0]["args"]["llm_configs"][0]  # what users ship


class _Config:
    """What the callback reads of an ``LLMConfig``: its engine config's model id."""

    def __init__(self, model: str) -> None:
        self.model = model

    def get_engine_config(self):
        return type("EngineConfig", (), {"actual_hf_model_id": self.model})()


def test_a_local_model_directory_skips_the_node_initialization_a_hub_id_keeps_it(tmp_path, monkeypatch):
    """Ray Serve LLM's node initialization only hands a local directory back as given, from a worker of its
    own: skipped for one, kept for a hub id (which it downloads)."""
    monkeypatch.setattr("servetune.serve.cores.lock_dir", lambda: tmp_path / "locks")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setenv(BIND, "7")  # the user's binding: no core is claimed, the model is still judged
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    local = ClaimCores(llm_config=_Config(str(tmp_path)), ranks=1)
    asyncio.run(local.on_before_node_init())
    assert local.ctx.run_init_node is False and (tmp_path / "torch" / "kernels").is_dir()
    hub = ClaimCores(llm_config=_Config("Qwen/Qwen3-0.6B"), ranks=1)
    asyncio.run(hub.on_before_node_init())
    assert hub.ctx.run_init_node is True
    gone = ClaimCores(llm_config=_Config(str(tmp_path / "missing")), ranks=1)
    asyncio.run(gone.on_before_node_init())
    assert gone.ctx.run_init_node is True  # not a directory here: Ray Serve LLM's own path decides


def test_a_replica_imports_its_claim_without_the_search_space_or_capacity():
    """Every Serve replica servetune starts imports the callback (and a fake-engine test's, the fake engine): what
    they need of servetune, not config/ and capacity/ (60 modules, 0.1-0.5 s of a core per replica), which
    secrets.py pulled in for one constant."""
    code = ("import sys, servetune.serve.cores, servetune.testing.serve_engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('servetune.config', 'servetune.capacity'))))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
