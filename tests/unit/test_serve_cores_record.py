"""What a Serve replica's core claim got reaches its trial's record (``environment.cpu_binding`` or
``environment.cpu_unclaimed``, a bare engine's words): the replica's callback tells it to Ray's key-value store under
its application and unique id (serve/claims.py), and the trial's engine reads its running replicas' (serve/trial.py),
never the ``LLMConfig`` the replicas hold (unpickling it imports vLLM)."""

import asyncio
import os
import types

import pytest

pytest.importorskip("ray.llm._internal.common.callbacks.base", reason="needs ray[serve,llm]")

from servetune.serve import claims, cores
from servetune.serve import trial as serve_trial
from servetune.serve.claims import replica_cores
from servetune.serve.cluster import ServeCluster
from servetune.serve.cores import BIND, ClaimCores, claim
from servetune.serve.plan import CLAIM_CORES
from servetune.serve.trial import ServeEngine
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import cores_record
from tests.builders import space_from


@pytest.fixture(autouse=True)
def store(monkeypatch):
    """Ray's key-value store, as a dict of (namespace, key) -> value, and the replica context a callback runs in:
    replica ``r<n>`` of the application ``app``, the n-th to ask."""
    import ray.experimental.internal_kv as kv
    from ray import serve

    kept: dict[tuple[bytes, bytes], bytes] = {}
    bytes_of = lambda value: value.encode() if isinstance(value, str) else value  # noqa: E731

    def put(key, value, overwrite=True, *, namespace=None):
        kept.pop((bytes_of(namespace), bytes_of(key)), None)  # the key told last is the last one
        kept[(bytes_of(namespace), bytes_of(key))] = bytes_of(value)

    monkeypatch.setattr(kv, "_internal_kv_put", put)
    monkeypatch.setattr(kv, "_internal_kv_get",
                        lambda key, *, namespace=None: kept.get((bytes_of(namespace), bytes_of(key))))  # fmt: skip

    def delete(key, *, del_by_prefix=False, namespace=None):
        gone = [k for k in kept if k[0] == bytes_of(namespace) and
                (k[1].startswith(bytes_of(key)) if del_by_prefix else k[1] == bytes_of(key))]  # fmt: skip
        for k in gone:
            del kept[k]
        return len(gone)

    monkeypatch.setattr(kv, "_internal_kv_del", delete)
    asked = iter(range(1, 1000))
    monkeypatch.setattr(serve, "get_replica_context",
                        lambda: types.SimpleNamespace(app_name="app",
                                                      replica_id=types.SimpleNamespace(unique_id=f"r{next(asked)}")))  # fmt: skip
    return kept


def last_told(store) -> dict[str, str]:
    """What the replica that told its claim last told, read as its trial reads it (``claims.told``)."""
    namespace, key = [k for k in store if not k[1].endswith(b"/" + claims.STARTED.encode())][-1]
    assert namespace == claims.NAMESPACE.encode()
    app, replica = key.decode().rsplit("/", 1)
    (told,) = claims.told(app, [replica])
    return told


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


def replica_config(ranks: int, engine_kwargs=None, env_vars=None):
    """The ``LLMConfig`` a replica holds, as servetune deploys it on a local Ray (the callback's kwargs included)."""
    from ray.serve.llm import LLMConfig

    return LLMConfig(model_loading_config={"model_id": "m", "model_source": "/nowhere"},
                     engine_kwargs=engine_kwargs or {}, runtime_env={"env_vars": env_vars or {}},
                     callback_config={"callback_class": CLAIM_CORES, "callback_kwargs": {"ranks": ranks}})  # fmt: skip


def claimed(store, ranks: int, bind: str = "auto", engine_kwargs=None, env_vars=None) -> dict[str, str]:
    """What one replica of ``ranks`` ranks tells, read back from the store as its trial reads it; ``bind``: the
    replica process's ``VLLM_CPU_OMP_THREADS_BIND`` (a process of its own each: one claim's is not another's)."""
    os.environ[BIND] = bind
    config = replica_config(ranks, engine_kwargs, env_vars)
    callback = ClaimCores(llm_config=config, ranks=ranks)
    callback.llm_config = types.SimpleNamespace(callback_config=config.callback_config,  # no engine config to resolve
                                                engine_kwargs=config.engine_kwargs, runtime_env=config.runtime_env,
                                                get_engine_config=lambda: types.SimpleNamespace(actual_hf_model_id="m"))  # fmt: skip
    asyncio.run(callback.on_before_node_init())
    return last_told(store)


def test_a_replica_tells_the_cores_it_claimed_or_why_it_claimed_none(host, store):
    assert claimed(store, 1) == {"cpu_binding": "0"}  # a core of its own
    assert claimed(store, 1) == {"cpu_binding": "1"}
    crowded = claimed(store, 1)  # both cores held by the replicas before it: left to vLLM's own binding
    assert "cpu_binding" not in crowded and os.environ[BIND] == "auto"
    assert crowded["cpu_unclaimed"].startswith("no 1 of the 2 cores free") and str(host) in crowded["cpu_unclaimed"]
    assert crowded["cpu_unclaimed"].endswith("vLLM binds it itself")
    two = claimed(store, 2)  # several ranks without free cores: on the first cores, as export binds them, and says so
    assert two["cpu_binding"] == "0|1" and two["cpu_unclaimed"].endswith("bound to shared cores 0|1")


def test_a_replica_with_the_users_binding_tells_it_and_one_without_usable_locks_says_so(host, store, monkeypatch):
    assert claimed(store, 1, bind="1") == {"cpu_binding": "1"} and cores.HELD == []  # the user's, kept: nothing claimed

    def unusable():
        raise PermissionError(13, "Permission denied", "/tmp/servetune-cpu-cores")

    monkeypatch.setattr("servetune.serve.cores.lock_dir", unusable)
    assert claimed(store, 1) == {
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


class Deployed(ServeCluster):
    """A cluster whose one deployment has the running replicas ``replicas`` (Serve's unique ids); nothing else of Serve
    is read. Its replicas' configurations must not be asked for (unpickling one imports vLLM)."""

    url = "http://127.0.0.1:1"

    def __init__(self, replicas):
        super().__init__(None, {})
        self.replicas = replicas
        self.deleted = []

    def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
        return 1.0

    def delete(self, name):
        self.deleted.append(name)

    def engine_replicas(self, name, deployment_prefix="LLMServer", live_only=True):
        return []

    def served_per_replica(self, name, deployment_prefix="LLMServer"):
        return {}

    def replica_engines(self, name, deployment_prefix="LLMServer"):
        return []

    def replica_pids(self, name):
        return []

    def replica_ids(self, name, deployment_prefix="LLMServer"):
        return list(self.replicas)

    def replica_logs(self, name, max_bytes=0, leave_out=()):
        return ""

    def replica_llm_configs(self, name, deployment_prefix="LLMServer", timeout_s=60.0):
        raise AssertionError("a trial reads its replicas' claims, not their configurations")


def serve_spec(tmp_path, replicas: int):
    """One trial through Serve with ``replicas`` replicas on the CPU build."""
    space = space_from(tmp_path, f"hardware: {{devices_per_node: 2}}\nparams:\n  serve.num_replicas: [{replicas}]\n")
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, "/models/tiny", resolve_levels(space, workload))
    return context.spec_for({"serve.num_replicas": replicas})


def entered(tmp_path, monkeypatch, replicas, device="cpu") -> ServeEngine:
    """A trial through Serve entered on :class:`Deployed` ``replicas``, its claims told under the trial's name."""
    import dataclasses

    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    spec = dataclasses.replace(serve_spec(tmp_path, len(replicas) or 1), device=device)
    return ServeEngine(spec, tmp_path, Deployed(replicas)).__enter__()


def tell_as(monkeypatch, app: str, replica: str, record, tell=claims.tell) -> None:
    """What replica ``replica`` of ``app`` tells (serve/claims.py ``tell``, or ``tell_started``, in that replica's
    context)."""
    from ray import serve

    context = types.SimpleNamespace(app_name=app, replica_id=types.SimpleNamespace(unique_id=replica))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context)
    tell(record)


def test_a_trial_through_serve_records_its_running_replicas_cores_as_a_bare_engine_does(host, store, tmp_path,
                                                                                       monkeypatch):  # fmt: skip
    name = serve_trial.app_name(serve_spec(tmp_path, 2))
    tell_as(monkeypatch, name, "a", {"cpu_binding": "0"})
    tell_as(monkeypatch, name, "b", {"cpu_binding": "1"})
    tell_as(monkeypatch, name, "gone", {"cpu_unclaimed": "a replica Serve replaced while deploying"})
    tell_as(monkeypatch, "another-app", "c", {"cpu_binding": "9"})
    engine = entered(tmp_path, monkeypatch, ["a", "b"])  # running: a and b only
    assert cores_record(engine) == {"cpu_binding": "0, 1"}  # what trial/runner.py puts in result.environment
    engine.__exit__(None, None, None)

    _, others = claim(2, [0, 1], host)  # other engines on the host hold both cores
    crowded = claimed(store, 1)  # a replica's own claim, told to the store
    tell_as(monkeypatch, serve_trial.app_name(serve_spec(tmp_path, 1)), "d", crowded)  # a one-replica trial's
    engine = entered(tmp_path, monkeypatch, ["d"])
    record = cores_record(engine)
    assert "cpu_binding" not in record and record["cpu_unclaimed"].startswith("no 1 of the 2 cores free")
    engine.__exit__(None, None, None)
    for handle in others:
        handle.close()


def test_a_deleted_application_forgets_its_replicas_claims_and_no_other(store, monkeypatch):
    tell_as(monkeypatch, "app-1", "a", {"cpu_binding": "0"})
    tell_as(monkeypatch, "app-10", "b", {"cpu_binding": "1"})  # a name the first is a prefix of
    claims.forget("app-1")
    assert claims.told("app-1", ["a"]) == [{}] and claims.told("app-10", ["b"]) == [{"cpu_binding": "1"}]


def test_replicas_that_told_nothing_or_cannot_answer_leave_the_record_without_cores(tmp_path, store, monkeypatch):
    engine = entered(tmp_path, monkeypatch, ["a"])  # no claim told (a replica without the callback)
    assert cores_record(engine) == {}
    engine.__exit__(None, None, None)

    import ray.experimental.internal_kv as kv

    def unreachable(key, *, namespace=None):
        raise ConnectionError("the GCS did not answer")

    monkeypatch.setattr(kv, "_internal_kv_get", unreachable)
    engine = entered(tmp_path, monkeypatch, ["a"])  # deployed all the same
    assert cores_record(engine) == {}
    engine.__exit__(None, None, None)


def test_a_gpu_trial_through_serve_asks_its_replicas_nothing_of_cores(tmp_path, store, monkeypatch):
    name = serve_trial.app_name(serve_spec(tmp_path, 1))
    tell_as(monkeypatch, name, "a", {"cpu_binding": "0"})  # were one told: a GPU trial does not read it
    engine = entered(tmp_path, monkeypatch, ["a"], device="gpu")
    assert cores_record(engine) == {}
    engine.__exit__(None, None, None)


def test_the_memory_followed_is_the_llm_replicas_not_the_lowest_pid(tmp_path, store, monkeypatch):
    """After the host's pids wrap, the lowest pid of the application's processes may be any small child (seen: a
    12 MiB process, so verify's soak followed no engine): the trial follows its first LLM replica on this host."""

    class Wrapped(Deployed):
        def replica_pids(self, name):
            return [1, os.getpid()]  # 1: a process that is not the replica

        def replica_engines(self, name, deployment_prefix="LLMServer"):
            return [(os.getpid(), [])]

    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    engine = ServeEngine(serve_spec(tmp_path, 1), tmp_path, Wrapped(["a"])).__enter__()
    assert engine.process is not None and engine.process.pid == os.getpid()
    engine.__exit__(None, None, None)


# --- what a replica was started with, told beside its claim: a rollout's check reads it, not the replica's LLMConfig


def test_a_replica_tells_what_it_was_started_with_and_no_secret(host, store):
    told = claimed(store, 1, engine_kwargs={"max_num_seqs": 4, "api_key": "sk-secret-1", "enforce_eager": True},
                   env_vars={"HF_TOKEN": "hf_secret_2", "WANDB_API_KEY": "w-secret-3", "VLLM_CPU_KVCACHE_SPACE": "2"})  # fmt: skip
    assert told == {"cpu_binding": "0"}  # the claim, as before, under its own key
    for secret in (b"sk-secret-1", b"hf_secret_2", b"w-secret-3"):
        assert all(secret not in value for value in store.values())  # nowhere in the store
    (started,) = claims.told_started("app", ["r1"])
    assert started["engine_kwargs"]["max_num_seqs"] == 4 and started["engine_kwargs"]["enforce_eager"] is True
    assert started["env_vars"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    hashed = claims.started_with({"api_key": "sk-secret-1"}, {"HF_TOKEN": "hf_secret_2"})
    assert started["engine_kwargs"]["api_key"] == hashed["engine_kwargs"]["api_key"]
    assert started["env_vars"]["HF_TOKEN"] == hashed["env_vars"]["HF_TOKEN"]
    assert started["env_vars"]["HF_TOKEN"].startswith(claims.HASHED) and len(started["env_vars"]["HF_TOKEN"]) == 71
    assert claims.told_started("app", ["r9"]) == [{}]  # a replica that told nothing
    claims.forget("app")  # the application deleted: what its replicas were started with goes with their claims
    assert claims.told_started("app", ["r1"]) == [{}] and claims.told("app", ["r1"]) == [{}]


def moved_to(engine: ServeEngine, monkeypatch, told: dict[str, dict]) -> None:
    """Each replica of ``told`` (Serve's unique id -> (engine_kwargs, env_vars)) tells what it was started with, as
    its callback does, under the trial's application."""
    for replica, (kwargs, env) in told.items():
        tell_as(monkeypatch, engine.name, replica,
                types.SimpleNamespace(engine_kwargs=kwargs, runtime_env={"env_vars": env}), claims.tell_started)  # fmt: skip


def test_replicas_on_deployed_reads_what_the_replicas_told_not_their_llm_configs(tmp_path, store, monkeypatch):
    """Deployed.replica_llm_configs raises: the check must not unpickle a replica's LLMConfig (it imports vLLM)."""
    engine = entered(tmp_path, monkeypatch, ["a", "b", "c"])
    engine.deployed = {"engine_kwargs": {"max_num_seqs": 8, "api_key": "sk-new"},
                       "runtime_env": {"env_vars": {"SERVETUNE_FAKE_TTFT_MS": "60", "HF_TOKEN": "hf_new"}}}  # fmt: skip
    new = ({"max_num_seqs": 8, "api_key": "sk-new", "max_model_len": 1024},
           {"SERVETUNE_FAKE_TTFT_MS": "60", "HF_TOKEN": "hf_new", "OTHER": "x"})  # fmt: skip
    moved_to(engine, monkeypatch, {
        "a": new,
        "b": ({"max_num_seqs": 4, "api_key": "sk-new"}, {"SERVETUNE_FAKE_TTFT_MS": "60", "HF_TOKEN": "hf_new"}),
        "c": ({"max_num_seqs": 8, "api_key": "sk-new"}, {"SERVETUNE_FAKE_TTFT_MS": "60", "HF_TOKEN": "hf_old"}),
    })  # fmt: skip
    assert engine.replicas_on_deployed() == (3, 1)  # b runs the old arguments, c another token (compared by hash)
    moved_to(engine, monkeypatch, {"b": new, "c": new})  # Serve replaced them
    assert engine.replicas_on_deployed() == (3, 3)
    engine.__exit__(None, None, None)


def test_replicas_that_told_nothing_are_read_as_before_from_their_llm_configs(tmp_path, store, monkeypatch):
    """A replica without servetune's callback (GPUs, a cluster joined, an older servetune's deployment) told nothing:
    every replica's LLMConfig is read from Serve, as before."""
    asked = []

    class Held(Deployed):
        def replica_llm_configs(self, name, deployment_prefix="LLMServer", timeout_s=60.0):
            asked.append(name)
            return [{"engine_kwargs": {"max_num_seqs": 8}, "env_vars": {"X": "1"}, "callback_class": None},
                    {"engine_kwargs": {"max_num_seqs": 4}, "env_vars": {"X": "1"}, "callback_class": None}]  # fmt: skip

    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    engine = ServeEngine(serve_spec(tmp_path, 2), tmp_path, Held(["a", "b"])).__enter__()
    engine.deployed = {"engine_kwargs": {"max_num_seqs": 8}, "runtime_env": {"env_vars": {"X": "1"}}}
    moved_to(engine, monkeypatch, {"a": ({"max_num_seqs": 8}, {"X": "1"})})  # b told nothing
    assert engine.replicas_on_deployed() == (2, 1) and asked == [engine.name]
    engine.__exit__(None, None, None)


def test_the_records_of_core_claims_say_them_once_and_keep_their_files_shape():
    """Every record that keeps a CPU build's core claims inherits the two fields (results/levels.py ``ClaimedCores``)
    rather than declaring its own; a serve-check.json record in the shape written before reads and writes back the same."""
    from servetune.results import BenchResult, ClaimedCores
    from servetune.serve.layouts import LayoutRun
    from servetune.serve.ramp import RampResult
    from servetune.serve.result import ReplicaRun
    from servetune.serve.routing import RouterRun
    from servetune.verify.recheck import Recheck

    for record in (BenchResult, LayoutRun, RampResult, ReplicaRun, RouterRun, Recheck):
        assert issubclass(record, ClaimedCores), record
        assert not {"cpu_binding", "cpu_unclaimed"} & set(record.__annotations__), record  # not declared again
        assert record.model_fields["cpu_unclaimed"].default is None
    written = {"replicas": 2, "ready_s": 31.5, "engines_reused": None, "levels": [],
               "requests_per_replica": {"a": 3}, "cpu_binding": "0, 1", "cpu_unclaimed": None}  # fmt: skip
    assert ReplicaRun.model_validate(written).model_dump() == written
