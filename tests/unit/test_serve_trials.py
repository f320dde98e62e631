"""``serve.num_replicas`` in a search space: trials through Ray Serve, without Ray (the e2e test deploys them)."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from servetune.cli import main
from servetune.config.space import SearchSpace
from servetune.device_ledger import devices_by_node
from servetune.errors import UserError
from servetune.report.export import ray_serve_app
from servetune.report.points import ReportPoint
from servetune.serve.trial import trial_llm_config
from servetune.space_file import load_space
from servetune.study.packing import resolve_max_concurrent
from servetune.study.ray_cluster import local_serve_cpus
from servetune.trial.context import StudyContext, bundle, resolve_levels
from tests.builders import space_from, write_space

FIXTURE = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
FIXTURE_TRIAL = "e57a166985b8"

#: What this module's spaces have beneath builders.SPACE_HEAD.
BASE = """\
hardware: {devices_per_node: 2}
engine_args: {max_model_len: 1024}
env: {VLLM_CPU_KVCACHE_SPACE: 1, HF_TOKEN: hf_secret}
search: {max_concurrent: 4}
"""


def space(tmp_path, text):
    return space_from(tmp_path, BASE + text)


def serve_spec(tmp_path, replicas: int):
    """The spec of one trial through Serve with ``replicas`` replicas, from a space that varies only them."""
    s = space(tmp_path, f"params:\n  serve.num_replicas: [{replicas}]\n")
    workload = s.resolved_workload(tmp_path)
    return StudyContext(s, workload, tmp_path, "/models/tiny", resolve_levels(s, workload)).spec_for(
        {"serve.num_replicas": replicas}
    )


def test_replicas_and_tensor_parallelism_under_a_budget(tmp_path):
    s = space(
        tmp_path,
        """
params:
  serve.num_replicas: [1, 2, 4]
  tensor_parallel_size: [1, 2]
constraints: ["serve.num_replicas * tensor_parallel_size <= 4"]
""",
    )
    kept, _ = s.grid()
    assert sorted((p["serve.num_replicas"], p["tensor_parallel_size"]) for p in kept) == [
        (1, 1),
        (1, 2),
        (2, 1),
        (2, 2),
        (4, 1),
    ]
    assert s.through_serve and s.devices({"serve.num_replicas": 2, "tensor_parallel_size": 2}) == 4  # priced for all
    # Replicas spread over nodes: only one replica's engine must fit a node (2 devices here).
    assert s.constraint_violations({"serve.num_replicas": 4, "tensor_parallel_size": 1}) == []
    engine, _ = s.engine_params({"serve.num_replicas": 2, "tensor_parallel_size": 2})
    assert engine == {"max_model_len": 1024, "tensor_parallel_size": 2}  # not an engine argument
    assert bundle(s, {"serve.num_replicas": 2}) == {"CPU": 1.0}  # the load client; Serve holds the devices
    assert resolve_max_concurrent(s, [8.0]) == 4  # as asked: the trials take their devices from the study's ledger


@pytest.mark.parametrize(("params", "words"), [
    ("serve.max_ongoing: [1]", "params: serve.max_ongoing: the Serve parameters are serve.num_replicas and serve.stream_batching_interval_ms"),
    ("serve.num_replicas: [1]\n  serve.stream_batching_interval_ms: [-1, 50]", "serve.stream_batching_interval_ms: list the intervals"),
    ("serve.num_replicas: [1]\n  serve.stream_batching_interval_ms: [.inf]", "serve.stream_batching_interval_ms: list the intervals"),
    ("serve.num_replicas: [1]\n  serve.stream_batching_interval_ms: [50, 50.0]", "serve.stream_batching_interval_ms: an interval is listed twice"),
    ("serve.num_replicas: [1]\n  serve.stream_batching_interval_ms: {low: 0, high: 50}", "serve.stream_batching_interval_ms: list the intervals"),
    ("serve.stream_batching_interval_ms: [0, 50]", "only trials through Serve batch their streams; list serve.num_replicas too"),
    ("serve.num_replicas: [0, 2]", "serve.num_replicas: list the replica counts"),
    ("serve.num_replicas: {low: 1, high: 4}", "serve.num_replicas: list the replica counts"),
    ("serve.num_replicas: [1, 2]\n  data_parallel_size: [1, 2]", "params.serve.num_replicas: Serve replicas replace data_parallel_size"),
])  # fmt: skip
def test_bad_serve_parameters_are_one_line_naming_the_file(tmp_path, params, words):
    with pytest.raises(UserError) as err:
        space(tmp_path, f"params:\n  {params}\n")
    assert str(err.value).startswith(str(tmp_path / "space.yaml")) and words in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_each_replica_count_is_its_own_trial_deployed_at_that_count(tmp_path):
    s = space(tmp_path, "params:\n  serve.num_replicas: [1, 2]\n")
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(s, workload, tmp_path, "/models/tiny", resolve_levels(s, workload))
    one, two = context.spec_for({"serve.num_replicas": 1}), context.spec_for({"serve.num_replicas": 2})
    assert (one.serve_replicas, two.serve_replicas) == (1, 2) and one.trial_id != two.trial_id
    assert two.devices == 2 and "VLLM_CPU_OMP_THREADS_BIND" not in two.extra_env  # Serve places the replicas
    config = trial_llm_config(two)
    autoscaling = config["deployment_config"]["autoscaling_config"]
    assert autoscaling["min_replicas"] == autoscaling["max_replicas"] == 2
    assert config["model_loading_config"] == {"model_id": "/models/tiny", "model_source": "/models/tiny"}
    assert config["placement_group_config"] == {"bundles": [{"CPU": 1}]}  # one rank: one core
    env = config["runtime_env"]["env_vars"]
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["HF_TOKEN"] == "hf_secret"  # deployed as given, not masked
    # A bare-engine study's trial ids are untouched by the field.
    bare = SearchSpace.model_validate(
        {"name": "t", "model": "m", "workload": "cpu-tiny", "params": {"max_num_seqs": [4]}}
    )
    assert context.spec_for({}).serve_replicas is None and not bare.through_serve


def test_the_stream_batching_interval_is_its_own_trial_deployed_and_exported_at_that_interval(tmp_path):
    s = space(tmp_path, "params:\n  serve.num_replicas: [1]\n  serve.stream_batching_interval_ms: [0, 50]\n")
    kept, _ = s.grid()
    assert sorted(p["serve.stream_batching_interval_ms"] for p in kept) == [0, 50]
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(s, workload, tmp_path, "/models/tiny", resolve_levels(s, workload))
    none, fifty = (context.spec_for({"serve.num_replicas": 1, "serve.stream_batching_interval_ms": v}) for v in (0, 50))
    plain = context.spec_for({"serve.num_replicas": 1})
    assert (none.stream_batching_ms, fifty.stream_batching_ms, plain.stream_batching_ms) == (0.0, 50.0, None)
    assert len({none.trial_id, fifty.trial_id, plain.trial_id}) == 3  # Ray's default (unset) is a trial of its own
    assert none.engine_args == plain.engine_args  # not an engine argument
    assert trial_llm_config(none)["experimental_configs"] == {"stream_batching_interval_ms": 0}
    assert "experimental_configs" not in trial_llm_config(plain)  # Ray Serve LLM's default
    point = ReportPoint(
        trial_id="t1", params={"serve.num_replicas": 2, "serve.stream_batching_interval_ms": 12.5}, model="/m"
    )
    assert ray_serve_app(point)["applications"][0]["args"]["llm_configs"][0]["experimental_configs"] == {
        "stream_batching_interval_ms": 12.5
    }


def test_serve_check_deploys_at_the_stream_batching_interval_asked(tmp_path):
    from servetune.cli.serve_check_run import with_stream_batching
    from servetune.serve.plan import llm_config
    from servetune.serve.study import read_picked

    study = tmp_path / "study"
    shutil.copytree(FIXTURE, study)
    picked = with_stream_batching(read_picked(study, FIXTURE_TRIAL), 0)
    assert llm_config(picked.point, 2)["experimental_configs"] == {"stream_batching_interval_ms": 0}
    for bad in (-5, float("inf")):
        with pytest.raises(UserError, match=rf"--stream-batching-ms {bad:g}: a finite interval of 0 ms or more"):
            with_stream_batching(picked, bad)


def test_a_local_ray_declares_what_the_largest_trial_needs_for_each_trial_in_flight(tmp_path):
    s = space(tmp_path, "params:\n  serve.num_replicas: [1, 2]\n  tensor_parallel_size: [1, 2]\n")
    # 4 in flight x (2 replicas x (2 cores + the replica actor) + the ingress + the load client)
    assert local_serve_cpus(s) == max(4 * (2 * 3 + 1 + 1), os.cpu_count())
    one = SearchSpace.model_validate({**s.model_dump(), "search": {**s.search.model_dump(), "max_concurrent": 1}})
    assert local_serve_cpus(one) == max(2 * 3 + 1 + 1, os.cpu_count())


def test_trials_in_flight_through_serve_fill_the_clusters_devices_together(tmp_path):
    s = space(tmp_path, "params:\n  serve.num_replicas: [2, 4]\n  tensor_parallel_size: [1, 2]\n")
    gpu = SearchSpace.model_validate(
        {**s.model_dump(), "device": "gpu", "search": {"algorithm": "tpe", "max_concurrent": "auto"}}
    )
    # The smallest trial takes 2 devices (2 replicas of TP 1); replicas spread over nodes, so 3 + 3 GPUs hold 3 of them.
    assert resolve_max_concurrent(gpu, [3.0, 3.0]) == 3 and resolve_max_concurrent(gpu, [8.0]) == 4
    # A replica stays inside one node: two nodes of 3 GPUs hold two TP2 replicas, not three.
    tp2 = SearchSpace.model_validate(
        {**gpu.model_dump(), "params": {"serve.num_replicas": [1], "tensor_parallel_size": [2]}}
    )
    assert resolve_max_concurrent(tp2, [3.0, 3.0]) == 2 and resolve_max_concurrent(tp2, [6.0]) == 3
    bare = SearchSpace.model_validate({**gpu.model_dump(), "params": {"tensor_parallel_size": [2, 4]}})
    assert resolve_max_concurrent(bare, [3.0, 3.0]) == 2  # a bare trial stays on one node
    cpu_auto = SearchSpace.model_validate({**s.model_dump(), "search": {"max_concurrent": "auto"}})
    assert resolve_max_concurrent(cpu_auto, [2.0]) == 1  # on CPU, one at a time unless asked
    # The ledger's capacity: the cluster's GPUs; on the CPU stand-in, devices_per_node cores of each node.
    assert devices_by_node(
        gpu.device, gpu.hardware.devices_per_node, {"a": {"GPU": 8.0, "CPU": 96.0}, "b": {"CPU": 4.0}}
    ) == {"a": 8, "b": 0}
    assert devices_by_node(s.device, s.hardware.devices_per_node, {"a": {"CPU": 32.0}, "b": {"CPU": 1.0}}) == {
        "a": 2,
        "b": 1,
    }


def test_the_export_of_a_trial_through_serve_keeps_its_replicas():
    point = ReportPoint(trial_id="t1", params={"serve.num_replicas": 3}, engine_args={"max_num_seqs": 8},
                        model="/m", device="gpu", level={"concurrency": 24})  # fmt: skip
    config = ray_serve_app(point)["applications"][0]["args"]["llm_configs"][0]
    fixed = config["deployment_config"]["autoscaling_config"]
    assert fixed == {"min_replicas": 3, "max_replicas": 3, "target_ongoing_requests": 8}


def test_autoscaling_from_a_trial_through_serve_is_per_replica():
    from servetune.report.autoscale import derive_autoscaling

    knee = ReportPoint(trial_id="s2", params={"serve.num_replicas": 2}, level={"concurrency": 16.0},
                       metrics={"request_throughput": 40.0})  # fmt: skip
    a = derive_autoscaling([knee], ["ttft_ms_p99 <= 500"], peak=64)
    assert a.target_ongoing_requests == 8 and a.throughput_per_replica == 20.0 and a.max_replicas == 8
    assert "/ 2 Serve replicas" in a.reasons["knee"]


def test_a_studys_verification_through_serve_deploys_on_the_studys_ray_and_verify_on_its_own(tmp_path, monkeypatch):
    from servetune.verify import run
    from servetune.verify.choose import select

    path = write_space(
        tmp_path,
        BASE.replace("search: {max_concurrent: 4}", "search: {verify: {top: 1}}")
        + "params:\n  serve.num_replicas: [1, 2]\n",
    )
    assert load_space(path).search.verify.top == 1  # search.verify of trials through Serve: verified through Serve
    chosen = select(serve_study(tmp_path, 2), FIXTURE_TRIAL).winner
    made = []

    class Engine:
        def __init__(self, spec, trial_dir, cluster=None):
            made.append(("engine", spec.serve_replicas, cluster))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            made.append(("left", None, None))

    class Cluster:
        def __init__(self, address, resources):
            made.append(("cluster", address, None))

        def __enter__(self):
            return own_ray

        def nodes(self):  # a CPU node: nothing to pin the replicas to
            return [{"CPU": 4.0}]

        def __exit__(self, *exc):
            made.append(("stopped", None, None))

    own_ray = Cluster(None, {})
    made.clear()
    monkeypatch.setattr(run, "ServeEngine", Engine)
    monkeypatch.setattr(run, "ServeCluster", Cluster)
    log = tmp_path / "v" / "engine.log"
    monkeypatch.setattr(run, "_in_ray", lambda: True)  # a study's verification task: the study's Serve, attached
    with run.started(chosen, log):
        pass
    monkeypatch.setattr(run, "_in_ray", lambda: False)  # servetune verify: a local Ray of its own, stopped after
    with run.started(chosen, log):
        pass
    assert made == [("engine", 2, None), ("left", None, None),
                    ("cluster", None, None), ("engine", 2, own_ray), ("left", None, None), ("stopped", None, None)]  # fmt: skip


def serve_study(tmp_path, replicas):
    """The fixture study, its pick measured through Serve at ``replicas`` replicas."""
    study = tmp_path / "study"
    shutil.copytree(FIXTURE, study)
    result_file = study / "trials" / FIXTURE_TRIAL / "result.json"
    result = json.loads(result_file.read_text())
    result["params"] = {**result["params"], "serve.num_replicas": replicas}
    result_file.write_text(json.dumps(result))
    return study


def test_verify_deploys_a_trial_through_serve_as_measured(tmp_path):
    from servetune.verify.choose import select

    selection = select(serve_study(tmp_path, 1), FIXTURE_TRIAL)
    assert selection.winner.spec.serve_replicas == 1  # verify.run.started deploys it through Serve, not a bare engine


def test_verify_refuses_serve_replicas_this_machine_cannot_hold_before_anything_starts(tmp_path, capsys):
    replicas = len(os.sched_getaffinity(0)) + 1  # one CPU core (TP 1) each on the CPU build
    study = serve_study(tmp_path, replicas)
    assert main(["verify", str(study), "--pick", FIXTURE_TRIAL]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"trial {FIXTURE_TRIAL}'s serve.num_replicas {replicas}: {replicas} replicas of 1 CPU core" in err[-1], err
    assert "this machine" in err[-1] and "--address" in err[-1] and not (study / "verify.json").exists()


class HalfwayCluster:
    """A cluster where the deployment comes up and reading its replicas then fails."""

    url = "http://127.0.0.1:1"

    def __init__(self):
        self.deployed, self.deleted, self.kept_ingress = [], [], []

    def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
        self.deployed.append(name)
        self.kept_ingress.append(keep_ingress)
        return 1.0

    def delete(self, name):
        self.deleted.append(name)

    def replica_engines(self, name, deployment_prefix="LLMServer"):
        return []

    def replica_pids(self, name):
        if self.deployed:
            raise RuntimeError("the GCS did not answer")
        return []

    def engine_replicas(self, name, live_only=True):
        return []


def test_a_trial_deployment_that_fails_after_deploying_is_deleted(tmp_path):
    from servetune.serve.trial import ServeEngine

    spec = serve_spec(tmp_path, 1)
    cluster = HalfwayCluster()
    with pytest.raises(RuntimeError, match="the GCS did not answer"):
        ServeEngine(spec, tmp_path, cluster).__enter__()
    name = f"servetune-t-{spec.trial_id}"
    assert cluster.deployed == [name] and cluster.deleted == [name, name]  # before (a killed run's), and after
    assert cluster.kept_ingress == [True]  # its ingress versioned by what it is built from (a rollout keeps it)


class ReplacingCluster(HalfwayCluster):
    """Replicas by actor id (alive or dead, each with its log): one left from an earlier deployment of the
    name, one that fails while deploying, and the one Serve replaces during the trial."""

    def __init__(self):
        super().__init__()
        self.actors = {"old": (False, "old: an earlier deployment\n")}

    def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
        self.actors |= {"r0": (False, "r0: failed while deploying, KV cache size: 1,000 tokens\n"),
                        "r1": (True, "r1: KV cache size: 2,000 tokens\n")}  # fmt: skip
        return super().deploy(name, config, timeout_s, route_prefix)

    def replica_engines(self, name, deployment_prefix="LLMServer"):
        return []

    def replica_pids(self, name):
        return []

    def engine_replicas(self, name, live_only=True):
        return sorted(i for i, (alive, _) in self.actors.items() if alive or not live_only)

    def replica_logs(self, name, leave_out=()):
        return "".join(text for i, (_, text) in sorted(self.actors.items()) if i not in leave_out)

    def replica_ids(self, name):
        return self.engine_replicas(name)

    def metrics_lag_s(self):
        return 2.5


def test_a_trials_engine_log_is_its_replicas_a_replaced_one_kept_and_failed_or_earlier_ones_left_out(
    tmp_path, monkeypatch
):
    from servetune.serve import trial as serve_trial
    from servetune.serve.trial import ServeEngine

    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    spec = serve_spec(tmp_path, 1)
    cluster = ReplacingCluster()
    engine = ServeEngine(spec, tmp_path, cluster).__enter__()
    log = (tmp_path / "engine.log").read_text()
    assert (
        log == "r1: KV cache size: 2,000 tokens\n"
    )  # read now for the start-up phases and the KV capacity: one engine
    assert engine.kv_capacity().engines == 1 and engine.kv_capacity().tokens == 2000
    cluster.actors |= {"r1": (False, cluster.actors["r1"][1]), "r2": (True, "r2: started by Serve mid-trial\n")}
    engine.__exit__(None, None, None)
    assert (tmp_path / "engine.log").read_text() == "r1: KV cache size: 2,000 tokens\nr2: started by Serve mid-trial\n"


def test_what_each_replica_served_leaves_out_an_earlier_deployment_of_the_name(tmp_path, monkeypatch):
    """A study verifying its trial deploys the trial's application name again: Ray's metrics agents still export the
    trial's gone replica's request counter, which is not this deployment's."""
    from servetune.serve import trial as serve_trial
    from servetune.serve.trial import ServeEngine

    class Counted(ReplacingCluster):
        def served_per_replica(self, name):
            return {"old": 25}  # before deploying: the trial's replica, gone

        def requests_per_replica(self, name):
            return {"old": 25, "r1": 7, "r2": 3}  # r2: Serve replaced r1 during the run, and it counts

    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    spec = serve_spec(tmp_path, 1)
    engine = ServeEngine(spec, tmp_path, Counted()).__enter__()
    assert engine.record()["requests_per_replica"] == {"r1": 7, "r2": 3}
    engine.__exit__(None, None, None)


def test_where_the_replicas_devices_are_is_told_to_the_ledger_while_deploying_and_again_once_serve_replaced_one(
    tmp_path, monkeypatch
):
    from servetune import device_ledger as serve_ledger
    from servetune.serve import trial as serve_trial
    from servetune.serve.trial import ServeEngine

    class Placing(ReplacingCluster):
        """Two TP1 replicas: one placed at the first status poll, both at the second; later Serve replaces the
        one on node a by one on node b."""

        def __init__(self):
            super().__init__()
            self.where = ({}, {})

        def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
            for where in (({"a": 1}, {"a": 1}), ({"a": 1, "b": 1}, {"a": 1, "b": 1})):
                self.where = where
                on_poll()
            return super().deploy(name, config, timeout_s, route_prefix)

        def replica_devices(self, name, each):
            assert each == 1
            return self.where

        def applications(self):
            return dict.fromkeys(self.deployed, "RUNNING")

        def requests_per_replica(self, name):
            return {}

    told = []
    monkeypatch.setattr(serve_ledger, "report_placement", lambda devices: told.append(dict(devices)))
    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    spec = serve_spec(tmp_path, 2)
    cluster = Placing()
    engine = ServeEngine(spec, tmp_path, cluster).__enter__()
    assert told == [{"a": 1, "b": 1}]  # once every replica was placed, not at the partial read
    assert engine.alive() and told == [{"a": 1, "b": 1}]  # nothing moved: nothing told again
    cluster.where = ({"b": 2}, {"b": 2})  # the replica on a died; Serve started it again on b
    assert engine.alive() and told == [{"a": 1, "b": 1}, {"b": 2}]
    assert engine.record()["device_nodes"] == {"b": 2}
    engine.__exit__(None, None, None)


@pytest.mark.parametrize(("kv_bytes", "waits"), [(2_000, False), (1 << 30, True)])
def test_a_trial_the_capacity_check_rejects_is_rejected_without_waiting_for_devices(
    tmp_path, tiny_model, monkeypatch, kv_bytes, waits
):
    """Trials through Serve take their devices from the study's ledger before they deploy; one that cannot hold a
    single request (a 2,000-byte KV cache) is INFEASIBLE at once, however long others hold the devices."""
    import ray
    from ray import tune

    from servetune import device_ledger as ledger
    from servetune.study import driver, mirror

    # the KV cache sized by kv_cache_memory_bytes, not VLLM_CPU_KVCACHE_SPACE
    path = write_space(
        tmp_path,
        BASE.replace("VLLM_CPU_KVCACHE_SPACE: 1, ", "")
        + f"params:\n  serve.num_replicas: [1]\n  kv_cache_memory_bytes: [{kv_bytes}]\n",
    )
    s = load_space(path)
    workload = s.resolved_workload(tmp_path)
    context = StudyContext(s, workload, tmp_path, str(tiny_model), resolve_levels(s, workload), ledger="the-study's")
    asked, reports = [], []

    class Held(Exception):
        pass

    def devices_held(name, holder, devices, each):  # every device held by other trials: a wait with no end
        asked.append((name, devices))
        raise Held

    monkeypatch.setattr(ledger, "devices_held", devices_held)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("R", (), {"get_node_id": lambda self: "node"})())
    monkeypatch.setattr(tune, "report", reports.append)
    monkeypatch.chdir(tmp_path)
    params = {"serve.num_replicas": 1, "kv_cache_memory_bytes": kv_bytes}
    if waits:
        with pytest.raises(Held):
            driver.trainable({"params": params}, context)
        assert asked == [("the-study's", 1)] and reports == []
        return
    driver.trainable({"params": params}, context)
    result = json.loads(reports[-1][mirror.RESULT_KEY])
    assert asked == [] and result["outcome"] == "INFEASIBLE" and result["reason"].startswith("capacity check: "), (
        result["reason"]
    )


def test_a_serve_trial_measures_through_the_proxy_picked_on_its_replicas_node_and_records_it(tmp_path, monkeypatch):
    """ServeEngine asks serve/proxies.py for the proxy of the nodes its replicas were placed on (read while they
    started), sends its load there, and keeps the choice for the trial's environment."""
    from servetune.serve import trial as serve_trial
    from servetune.serve.proxies import REPLICA_NODE, ProxyChoice
    from servetune.serve.trial import ServeEngine

    class Placed(ReplacingCluster):
        url = "http://10.0.0.1:8000"

        def deploy(self, name, config, timeout_s, route_prefix="/", on_poll=None, keep_ingress=False):
            started = super().deploy(name, config, timeout_s, route_prefix)
            on_poll()  # once it is up, as ServeCluster.deploy does: where the replicas went is read
            return started

        def replica_devices(self, name, each):
            return {"node-b": 1}, {"node-b": 1}

    asked = []

    def pick(replica_nodes, head_url, route):
        asked.append((dict(replica_nodes), head_url, route))
        return ProxyChoice("http://10.0.0.3:8000", "node-b", REPLICA_NODE, "1 replica(s) there")

    monkeypatch.setattr(serve_trial, "pick_proxy", pick)
    monkeypatch.setattr(serve_trial, "wait_gone", lambda pids, timeout_s: [])
    monkeypatch.setattr("servetune.device_ledger.report_placement", lambda devices: None)
    spec = serve_spec(tmp_path, 1)
    engine = ServeEngine(spec, tmp_path, Placed()).__enter__()
    route = f"/servetune-t-{spec.trial_id}"
    assert asked == [({"node-b": 1}, "http://10.0.0.1:8000", route)]
    assert engine.url == "http://10.0.0.3:8000" + route
    assert engine.proxy_record["serve_proxy"] == REPLICA_NODE and engine.proxy_record["serve_proxy_node_id"] == "node-b"


def test_a_trials_teardown_removes_the_shared_memory_its_engines_left(tmp_path):
    """vLLM's engine core and workers talk through ``multiprocessing.shared_memory`` segments in /dev/shm, which the
    engine of a replica that Serve stops never unlinks: the trial's teardown reads which ones its processes map while
    they run and removes them once Serve has stopped them (here a process that maps one, killed as Serve kills it)."""
    from servetune.serve.trial import ServeEngine

    script = (
        "import sys, time\n"
        "from multiprocessing import resource_tracker, shared_memory\n"
        "shm = shared_memory.SharedMemory(create=True, size=4096)\n"
        "resource_tracker.unregister(shm._name, 'shared_memory')  # vLLM's engine dies without the tracker's unlink\n"
        "print(shm.name, flush=True)\n"
        "time.sleep(60)\n"
    )
    engine_process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    segment = Path("/dev/shm") / "psm_not_made"
    try:
        segment = Path("/dev/shm") / engine_process.stdout.readline().strip().lstrip("/")
        assert segment.exists()

        class Stopping(HalfwayCluster):
            def delete(self, name):  # Serve stops the replica: its engine is killed, its segment stays
                super().delete(name)
                engine_process.kill()
                engine_process.wait()

        cluster = Stopping()
        engine = ServeEngine(serve_spec(tmp_path, 1), tmp_path, cluster)
        engine.pids = [engine_process.pid]
        engine.__exit__(None, None, None)
        assert cluster.deleted == [engine.name] and engine_process.returncode is not None
        assert not segment.exists()
    finally:
        engine_process.kill()
        engine_process.wait()
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()  # what the test made, whatever it found
