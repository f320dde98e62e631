"""What a Serve replica's core claim got reaches its trial's record (``environment.cpu_binding`` or
``environment.cpu_unclaimed``, a bare engine's words): the replica's callback keeps it in the ``LLMConfig`` it holds
(serve/cores.py ``tell``), Serve hands that config back pickled (``LLMServer.llm_config``, read by
``ServeCluster.replica_llm_configs``), and the trial's engine reads every replica's (serve/trial.py)."""

import asyncio
import os
import pickle
import types

import pytest

pytest.importorskip("ray.llm._internal.common.callbacks.base", reason="needs ray[serve,llm]")

from servetune.serve import cores
from servetune.serve import trial as serve_trial
from servetune.serve.cluster import ServeCluster
from servetune.serve.cores import BIND, ClaimCores, claim
from servetune.serve.plan import CLAIM_CORES, CLAIMED
from servetune.serve.trial import ServeEngine, replica_cores
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import cores_record
from tests.builders import space_from


@pytest.fixture
def host(tmp_path, monkeypatch):
    """Two cores, their locks in ``tmp_path``, no wait for cores a replaced replica holds; what the callbacks claimed
    let go after the test."""
    monkeypatch.setattr("servetune.serve.cores.lock_dir", lambda: tmp_path)
    monkeypatch.setattr("servetune.serve.cores.WAIT_S", 0.0)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv(BIND, "auto")  # restored after the test, whatever the callback sets
    monkeypatch.setattr(cores, "HELD", [])
    yield tmp_path
    for handle in cores.HELD:
        handle.close()


def replica_config(ranks: int):
    """The ``LLMConfig`` a replica holds, as servetune deploys it on a local Ray (the callback's kwargs included)."""
    from ray.serve.llm import LLMConfig

    return LLMConfig(model_loading_config={"model_id": "m", "model_source": "/nowhere"},
                     callback_config={"callback_class": CLAIM_CORES, "callback_kwargs": {"ranks": ranks}})  # fmt: skip


def claimed(ranks: int, bind: str = "auto") -> dict[str, str]:
    """What one replica of ``ranks`` ranks tells, read back from its config as Serve hands it over (pickled); ``bind``:
    the replica process's ``VLLM_CPU_OMP_THREADS_BIND`` (a process of its own each: one claim's is not another's)."""
    os.environ[BIND] = bind
    config = replica_config(ranks)
    callback = ClaimCores(llm_config=config, ranks=ranks)
    callback.llm_config = types.SimpleNamespace(callback_config=config.callback_config,  # no engine config to resolve
                                                get_engine_config=lambda: types.SimpleNamespace(actual_hf_model_id="m"))  # fmt: skip
    asyncio.run(callback.on_before_node_init())
    return pickle.loads(pickle.dumps(config)).callback_config.callback_kwargs[CLAIMED]


def test_a_replica_tells_the_cores_it_claimed_or_why_it_claimed_none(host):
    assert claimed(1) == {"cpu_binding": "0"}  # a core of its own
    assert claimed(1) == {"cpu_binding": "1"}
    crowded = claimed(1)  # both cores held by the replicas before it: left to vLLM's own binding
    assert "cpu_binding" not in crowded and os.environ[BIND] == "auto"
    assert crowded["cpu_unclaimed"].startswith("no 1 of the 2 cores free") and str(host) in crowded["cpu_unclaimed"]
    assert crowded["cpu_unclaimed"].endswith("vLLM binds it itself")
    two = claimed(2)  # several ranks without free cores: on the first cores, as export binds them, and says so
    assert two["cpu_binding"] == "0|1" and two["cpu_unclaimed"].endswith("bound to shared cores 0|1")


def test_a_replica_with_the_users_binding_tells_it_and_one_without_usable_locks_says_so(host, monkeypatch):
    assert claimed(1, bind="1") == {"cpu_binding": "1"} and cores.HELD == []  # the user's, kept: nothing claimed

    def unusable():
        raise PermissionError(13, "Permission denied", "/tmp/servetune-cpu-cores")

    monkeypatch.setattr("servetune.serve.cores.lock_dir", unusable)
    assert claimed(1) == {
        "cpu_unclaimed": "core locks unusable ([Errno 13] Permission denied: '/tmp/servetune-cpu-cores')"
    }


def test_the_replicas_records_combine_into_the_trials():
    assert replica_cores([{"cpu_binding": "0"}]) == {"cpu_binding": "0"}  # one replica: as a bare engine's
    assert replica_cores([{"cpu_binding": "0|1"}, {"cpu_binding": "2|3"}]) == {"cpu_binding": "0|1, 2|3"}
    crowded = replica_cores([{"cpu_binding": "0"}, {"cpu_unclaimed": "no 1 of the 1 cores free"}])
    assert crowded == {"cpu_binding": "0, auto", "cpu_unclaimed": "replica 2 of 2: no 1 of the 1 cores free"}
    assert replica_cores([{"cpu_unclaimed": "why"}, {"cpu_unclaimed": "why"}]) == {
        "cpu_unclaimed": "replica 1 of 2: why; replica 2 of 2: why"
    }  # none bound: no binding to record
    assert replica_cores([{}, {}]) == {} and replica_cores([]) == {}  # no callback (GPUs, a cluster joined)


class Handle:
    """Serve's handle of an LLM deployment, broadcasting ``llm_config`` to replicas holding ``configs``."""

    def __init__(self, configs):
        self.configs = configs

    def broadcast(self, method):
        assert method == "llm_config"
        return types.SimpleNamespace(results=lambda timeout_s: [pickle.loads(pickle.dumps(c)) for c in self.configs])


class Deployed(ServeCluster):
    """A cluster whose one deployment has the replicas ``configs``; nothing else of Serve is read."""

    url = "http://127.0.0.1:1"

    def __init__(self, configs):
        super().__init__(None, {})
        self.configs = configs

    def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
        return 1.0

    def delete(self, name):
        pass

    def engine_replicas(self, name, deployment_prefix="LLMServer", live_only=True):
        return []

    def served_per_replica(self, name, deployment_prefix="LLMServer"):
        return {}

    def replica_pids(self, name):
        return []

    def replica_ids(self, name, deployment_prefix="LLMServer"):
        return []

    def replica_logs(self, name, max_bytes=0, leave_out=()):
        return ""


def serve_spec(tmp_path, replicas: int):
    """One trial through Serve with ``replicas`` replicas on the CPU build."""
    space = space_from(tmp_path, f"hardware: {{devices_per_node: 2}}\nparams:\n  serve.num_replicas: [{replicas}]\n")
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, "/models/tiny", resolve_levels(space, workload))
    return context.spec_for({"serve.num_replicas": replicas})


def entered(tmp_path, monkeypatch, configs) -> ServeEngine:
    monkeypatch.setattr("servetune.serve.cluster._llm_handles", lambda name, prefix: [Handle(configs)])
    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    return ServeEngine(serve_spec(tmp_path, len(configs) or 1), tmp_path, Deployed(configs)).__enter__()


def test_a_trial_through_serve_records_its_replicas_cores_as_a_bare_engine_does(host, tmp_path, monkeypatch):
    bound = [replica_config(1), replica_config(1)]
    for config in bound:
        cores.tell(config, {"cpu_binding": "0"} if config is bound[0] else {"cpu_binding": "1"})
    engine = entered(tmp_path, monkeypatch, bound)
    assert cores_record(engine) == {"cpu_binding": "0, 1"}  # what trial/runner.py puts in result.environment
    engine.__exit__(None, None, None)

    _, others = claim(2, [0, 1], host)  # other engines on the host hold both cores
    replica = replica_config(1)
    replica.callback_config.callback_kwargs[CLAIMED] = claimed(1)  # the replica's own claim, then Serve's handing over
    engine = entered(tmp_path, monkeypatch, [replica])
    record = cores_record(engine)
    assert "cpu_binding" not in record and record["cpu_unclaimed"].startswith("no 1 of the 2 cores free")
    engine.__exit__(None, None, None)
    for handle in others:
        handle.close()


def test_replicas_that_told_nothing_or_cannot_answer_leave_the_record_without_cores(tmp_path, monkeypatch):
    engine = entered(tmp_path, monkeypatch, [replica_config(1)])  # no claim told (a GPU replica has no callback)
    assert cores_record(engine) == {}
    engine.__exit__(None, None, None)

    def unanswered(name, prefix):
        raise TimeoutError("the replicas did not answer")

    monkeypatch.setattr("servetune.serve.cluster._llm_handles", unanswered)
    engine = ServeEngine(engine.spec, tmp_path, Deployed([])).__enter__()  # deployed all the same
    assert cores_record(engine) == {}
    engine.__exit__(None, None, None)


def test_a_gpu_trial_through_serve_asks_its_replicas_nothing_of_cores(tmp_path, monkeypatch):
    import dataclasses

    asked = []
    monkeypatch.setattr("servetune.serve.cluster._llm_handles", lambda name, prefix: asked.append(name) or [])
    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    spec = dataclasses.replace(serve_spec(tmp_path, 1), device="gpu")
    engine = ServeEngine(spec, tmp_path, Deployed([])).__enter__()
    assert cores_record(engine) == {} and asked == []  # a GPU deployment's replicas claim no cores: none asked
    engine.__exit__(None, None, None)
