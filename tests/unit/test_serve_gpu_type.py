"""A study's point started again on a cluster stays on the GPU type it was measured on: serve-check's and verify's
Serve deployments carry the trial's ``accelerator_type`` (as ``export --accelerator-type`` writes it), the weights are
fetched only on nodes of that type, and a cluster with none of it is refused in one line before anything is
deployed. Ray, Serve and the engines are replaced at their boundary; tests/integration/test_gpu_type_ray.py places
the bundles on a real Ray whose nodes declare two types."""

from __future__ import annotations

import dataclasses
import json
import types
from pathlib import Path
from typing import Any

import pytest

from servetune.cli import main
from servetune.errors import UserError
from servetune.results import LevelResult, WeightsPrefetch
from servetune.serve.check import Teardown, check_cluster_fits, run_check
from servetune.serve.plan import gpus_of_type, measured_gpu, needs, pin_gpu_type
from servetune.serve.study import read_picked
from tests.builders import level, study_info, trial, write_study
from tests.unit.test_serve_check import FakeCluster, ServedCluster, served_study  # noqa: F401  (a fixture)

HEAD = {"CPU": 0.0, "node:__internal_head__": 1.0}
H100 = {"CPU": 16.0, "GPU": 2.0, "accelerator_type:H100": 1.0}
A100 = {"CPU": 16.0, "GPU": 8.0, "accelerator_type:A100": 1.0}
L4 = {"CPU": 8.0, "GPU": 4.0, "accelerator_type:L4": 1.0}
BY_HAND = {"CPU": 8.0, "GPU": 4.0}  # ``ray start --num-gpus 4``: no type declared
NVML_H100 = "NVIDIA H100 80GB HBM3"  # what a trial's environment records of its GPUs


def test_a_point_is_pinned_to_the_type_it_was_measured_on_where_the_cluster_declares_types():
    assert pin_gpu_type("H100-SXM", [HEAD, H100, A100], "t1", "the cluster") == "H100"
    assert pin_gpu_type(NVML_H100, [HEAD, A100, H100], "t1", "the cluster") == "H100"  # the name NVML gave
    assert pin_gpu_type("A100-40GB", [H100, A100], "t1", "the cluster") == "A100"  # Ray does not tell 40/80 GB apart
    # Nothing to pin: nodes that declare no type cannot be told apart; no GPU known; one the catalogue has no type for.
    assert pin_gpu_type("H100-SXM", [HEAD, BY_HAND], "t1", "the cluster") is None
    assert pin_gpu_type(None, [H100], "t1", "the cluster") is None
    assert pin_gpu_type("custom", [H100], "t1", "the cluster") is None
    with pytest.raises(UserError) as refused:
        pin_gpu_type("H100-SXM", [HEAD, L4, A100], "3f2a", "the Ray cluster at auto")
    assert str(refused.value) == ("trial 3f2a was measured on H100-SXM GPUs (Ray accelerator_type H100); the Ray "
                                  "cluster at auto has GPUs of type A100, L4 only: nothing was deployed")  # fmt: skip


def test_the_gpu_measured_is_the_spaces_else_the_one_the_trial_recorded_and_none_on_the_cpu_build():
    assert measured_gpu("gpu", "H200", {"gpu_model": NVML_H100}) == "H200"
    assert measured_gpu("gpu", None, {"gpu_model": NVML_H100}) == NVML_H100
    assert measured_gpu("gpu", None, {}) is None
    assert measured_gpu("cpu", "H100-SXM", {"gpu_model": NVML_H100}) is None


def gpu_study(root: Path, gpu: str | None = "H100-SXM", environment: dict[str, str] | None = None) -> Path:
    """A one-trial GPU study through which serve-check deploys (its trial measured on ``gpu``, or on the GPU its
    environment recorded)."""
    t = trial("t1", {"max_num_seqs": 8}, [level(8, 400, 300)]).model_copy(update={"environment": environment or {}})
    write_study(root, study_info(), [t])
    hardware = f"hardware: {{gpu: {gpu}}}\n" if gpu else ""
    (root / "space.yaml").write_text(
        f"name: demo\nmodel: org/tiny-chat\ndevice: gpu\nworkload: chat\n{hardware}"
        "load: {levels: [8], requests_per_level: 16, startup_timeout_s: 60}\nslo: {ttft_ms: {p99: 2000}}\n"
    )  # fmt: skip
    return root


class RecordingCluster(FakeCluster):
    """FakeCluster that keeps every LLMConfig deployed."""

    def __init__(self) -> None:
        super().__init__()
        self.configs: list[dict[str, Any]] = []

    def deploy(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
        self.configs.append(config)
        return super().deploy(name, config, timeout_s, engine_version, keep_ingress)


def test_every_deployment_of_a_pinned_pick_carries_its_type_and_ray_serve_llm_asks_for_it_in_every_bundle(tmp_path):
    from ray.serve.llm import LLMConfig

    from servetune.serve.check import Ramp, Routing
    from servetune.serve.ramp import RampResult

    picked = read_picked(gpu_study(tmp_path / "s"), "t1")
    assert picked.gpu_type is None  # not pinned until the cluster is known
    pinned = picked.pinned([HEAD, A100, H100], "the cluster")
    assert pinned.gpu_type == "H100" and pinned.measured_gpu == "H100-SXM"
    cluster = RecordingCluster()
    deployment = {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}}

    def ramp_run(url, served):
        return RampResult(knee_concurrency=8, autoscaling_config=deployment["autoscaling_config"], max_ongoing_requests=10,
                          max_queued_requests=4, reasons={}, replicas_before=1, replicas_peak=2)  # fmt: skip

    routing = Routing(routers=["default", "prefix-aware"], replicas=2, workload="rag",
                      measure=lambda url, served, router: level(8, 700, 330))  # fmt: skip
    run_check(pinned, [1, 2], cluster, "app", lambda url, served, n: [level(8, 380 * n, 320)], Teardown(pids=set()),
              ramp=Ramp(deployment_config=deployment, run=ramp_run), routing=routing)  # fmt: skip
    # the replica counts, the ramp's autoscaling and each router: every one on the type measured
    assert len(cluster.configs) == 5
    assert [config.get("accelerator_type") for config in cluster.configs] == ["H100"] * 5
    engine = LLMConfig(**cluster.configs[0]).get_engine_config()  # Ray Serve LLM's own reading of what to ask Ray for
    assert engine.placement_bundles and all(b["accelerator_type:H100"] > 0 for b in engine.placement_bundles)
    # Unpinned (nodes that declare no type), nothing is asked of a type.
    cluster = RecordingCluster()
    run_check(picked.pinned([HEAD, BY_HAND], "the cluster"), [1], cluster, "app",
              lambda url, served, n: [level(8, 380, 320)], Teardown(pids=set()))  # fmt: skip
    assert "accelerator_type" not in cluster.configs[0]


def test_only_the_gpus_of_the_pinned_type_count_when_the_replicas_must_fit(tmp_path):
    picked = read_picked(gpu_study(tmp_path / "s"), "t1")
    need = needs(picked.point, {"engine_kwargs": {"tensor_parallel_size": 2}}, 2)  # 2 replicas of TP 2: 4 GPUs
    cluster = types.SimpleNamespace(available=lambda: {"CPU": 40.0, "GPU": 12.0})  # 2 on H100 nodes, 10 on others
    assert gpus_of_type([HEAD, H100, A100, dict(H100)], "H100") == 4.0
    check_cluster_fits(cluster, need, "the cluster")  # type: ignore[arg-type]  # any 4 of the 12 free
    with pytest.raises(UserError, match=r"need 4 GPUs; the cluster \(its H100 nodes\) has 2: nothing was deployed"):
        check_cluster_fits(cluster, need, "the cluster", ("H100", gpus_of_type([HEAD, H100, A100], "H100")))  # type: ignore[arg-type]


@pytest.fixture
def fetched(monkeypatch) -> list[dict[str, Any]]:
    """``prefetch_point`` replaced: each call recorded with the GPU type it fetches on, and what was deployed by then."""
    calls: list[dict[str, Any]] = []

    def prefetch_point(model, env, engine_args, device, say, through_ray, gpu_type=None, **kwargs):
        calls.append({"model": model, "through_ray": through_ray, "gpu_type": gpu_type,
                      "deployed": [list(c.deployed) for c in ServedCluster.opened],
                      "serving": [c.serving for c in ServedCluster.opened]})  # fmt: skip
        return [WeightsPrefetch(model=model, node_id="n", host="h", download_s=1.0, bytes=1)]

    monkeypatch.setattr("servetune.prefetch.prefetch_point", prefetch_point)
    return calls


@pytest.fixture
def gpu_served(served_study, monkeypatch, tmp_path):  # noqa: F811  (the fixture imported above)
    """A GPU study for the serve-check CLI on a :class:`ServedCluster` with free GPUs, levels measured instantly."""

    def run_levels(console, url, served, workload, prompts, plans, slo, args, holder, records):
        holder.levels.append(LevelResult(summary=level(8, 380, 320).summary))

    monkeypatch.setattr("servetune.cli.bench.run_levels", run_levels)
    monkeypatch.setattr(ServedCluster, "available", lambda self: {"CPU": 32.0, "GPU": 8.0})
    return gpu_study(tmp_path / "gpu")


def test_serve_check_pins_its_deployments_and_prefetch_to_the_measured_type(gpu_served, fetched, monkeypatch, capsys):
    configs: list[dict[str, Any]] = []
    deploy = ServedCluster.deploy

    def recording(self, name, config, timeout_s, engine_version=None, keep_ingress=False):
        configs.append(config)
        return deploy(self, name, config, timeout_s, engine_version, keep_ingress)

    monkeypatch.setattr(ServedCluster, "deploy", recording)
    monkeypatch.setattr(ServedCluster, "nodes", lambda self: [HEAD, A100, H100])
    assert main(["serve-check", str(gpu_served), "--pick", "t1", "--replicas", "1,2", "--address", "auto"]) == 0
    assert [c["accelerator_type"] for c in configs] == ["H100", "H100"]
    (call,) = fetched
    assert call["gpu_type"] == "H100" and call["through_ray"] is True and call["deployed"] == [[]]  # before deploying
    assert call["serving"] == [False] and ServedCluster.opened[0].serving  # and before Serve started, after it did
    doc = json.loads((gpu_served / "serve-check.json").read_text())
    assert doc["llm_config"]["accelerator_type"] == "H100"
    assert "replicas pinned to GPU type H100 (accelerator_type), as trial t1 was measured on H100-SXM" in (
        capsys.readouterr().err
    )


def test_serve_check_on_a_cluster_without_the_measured_type_is_one_line_and_deploys_nothing(
    gpu_served, fetched, monkeypatch, capsys
):  # fmt: skip
    monkeypatch.setattr(ServedCluster, "nodes", lambda self: [HEAD, L4, A100])
    deleted: list[str] = []  # an application of the name running, that --replace would delete: it is not
    monkeypatch.setattr(ServedCluster, "applications", lambda self: {"servetune-serve-check": "RUNNING"})
    monkeypatch.setattr(ServedCluster, "delete", lambda self, name: deleted.append(name))
    argv = ["serve-check", str(gpu_served), "--pick", "t1", "--replicas", "1", "--address", "auto", "--replace"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("servetune serve-check: error: trial t1 was measured on H100-SXM GPUs (Ray accelerator_type "
                       "H100); the Ray cluster at auto has GPUs of type A100, L4 only: nothing was deployed")  # fmt: skip
    (cluster,) = ServedCluster.opened
    assert cluster.deployed == [] and deleted == [] and fetched == []  # nothing deployed, replaced or fetched
    assert cluster.exited and not cluster.serving  # Ray let go, and no Serve started on it to be left behind
    assert not (gpu_served / "serve-check.json").exists()


@pytest.mark.parametrize("argv, nodes, running, refused", [
    (["--replicas", "4"], [HEAD, H100, A100], {},  # 4 GPUs, where the H100 nodes have 2
     "--replicas 4: 4 replicas of 1 GPU (TP x PP x PCP) need 4 GPUs; the Ray cluster at auto (its H100 nodes) has 2: "
     "nothing was deployed"),
    (["--replicas", "1"], [HEAD, H100], {"servetune-serve-check": "RUNNING"},  # someone's application of the name
     "a Serve application named servetune-serve-check is already running (RUNNING): pass --replace to replace it, or "
     "--app-name to deploy beside it"),
])  # fmt: skip
def test_every_refusal_once_ray_is_joined_comes_before_serve_starts_on_the_cluster(
    gpu_served, fetched, monkeypatch, capsys, argv, nodes, running, refused
):  # fmt: skip
    """Serve's controller outlives the driver on a cluster: a refusal after joining (the fit counted on the nodes of
    the pinned type, an application of the name) must not have started one. (The GPU type's refusal: above.)"""
    monkeypatch.setattr(ServedCluster, "nodes", lambda self: nodes)
    monkeypatch.setattr(ServedCluster, "applications", lambda self: dict(running))
    assert main(["serve-check", str(gpu_served), "--pick", "t1", "--address", "auto", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"servetune serve-check: error: {refused}"
    (cluster,) = ServedCluster.opened
    assert cluster.exited and not cluster.serving and cluster.deployed == [] and fetched == []


def test_serve_check_pins_to_the_gpu_the_trial_recorded_where_the_space_names_none(
    served_study, tmp_path, monkeypatch, fetched  # noqa: F811  (the fixture imported above)
):  # fmt: skip
    study = gpu_study(tmp_path / "detected", gpu=None, environment={"gpu_model": NVML_H100})
    monkeypatch.setattr("servetune.cli.bench.run_levels", lambda *a: a[-2].levels.append(level(8, 380, 320)))
    monkeypatch.setattr(ServedCluster, "available", lambda self: {"CPU": 32.0, "GPU": 8.0})
    monkeypatch.setattr(ServedCluster, "nodes", lambda self: [HEAD, H100, A100])
    assert main(["serve-check", str(study), "--pick", "t1", "--replicas", "1"]) == 0
    assert json.loads((study / "serve-check.json").read_text())["llm_config"]["accelerator_type"] == "H100"
    assert fetched[0]["gpu_type"] == "H100"


def test_each_model_is_fetched_once_per_place_the_nodes_of_a_gpu_type_being_a_place_of_their_own(fetched):
    import io

    from rich.console import Console

    from servetune.cli.prefetching import PointPrefetch

    prefetch = PointPrefetch(Console(file=io.StringIO()), spinner=False)
    for model, through_ray, gpu_type in [
        ("org/m", True, "H100"), ("org/m", True, "H100"),  # the runner-up of the same model and type: once
        ("org/m", True, "A100"),  # a candidate measured on another type: that type's nodes fetch it
        ("org/other", True, "H100"),  # a candidate of another model: fetched too
        ("org/m", False, None), ("org/m", False, "H100"),  # on this machine, whatever the type: once
    ]:  # fmt: skip
        prefetch(model, {}, {}, "gpu", through_ray, gpu_type)
    assert [(c["model"], c["through_ray"], c["gpu_type"]) for c in fetched] == [
        ("org/m", True, "H100"), ("org/m", True, "A100"), ("org/other", True, "H100"), ("org/m", False, None),
    ]  # fmt: skip
    assert len(prefetch.records) == 4


@dataclasses.dataclass(frozen=True)
class Spec:
    """What verify/run.py's ``started`` reads of a trial's spec."""

    model: str
    gpu: str | None
    serve_replicas: int | None = 1
    device: str = "gpu"
    gpu_type: str | None = None
    trial_id: str = "t"


def chosen(model: str, gpu: str | None, serve_replicas: int | None = 1, trial_id: str = "t") -> Any:
    return types.SimpleNamespace(spec=Spec(model, gpu, serve_replicas, trial_id=trial_id), trial_id=trial_id,
                                 result=types.SimpleNamespace(environment={}))  # fmt: skip


class Place:
    """A Ray cluster or an engine as ``started`` opens them, saying when."""

    def __init__(self, events: list[str], what: str, nodes: list[dict[str, float]] | None = None) -> None:
        self.events, self.what, self._nodes = events, what, nodes or []

    def nodes(self) -> list[dict[str, float]]:
        return self._nodes

    def __enter__(self) -> Place:
        self.events.append(f"{self.what} started")
        return self

    def __exit__(self, *exc: object) -> None:
        self.events.append(f"{self.what} stopped")


def test_verify_pins_each_deployment_and_fetches_what_starts_later_before_the_winner_starts(tmp_path, monkeypatch):
    import servetune.verify.run as verification

    events: list[str] = []
    cluster_nodes = [HEAD, H100, A100]
    monkeypatch.setattr(verification, "ServeCluster", lambda address, resources: Place(events, "ray", cluster_nodes))
    monkeypatch.setattr(verification, "ServeEngine",
                        lambda spec, folder, cluster: Place(events, f"serve {spec.model} on {spec.gpu_type}"))  # fmt: skip
    monkeypatch.setattr(verification, "trial_needs", lambda spec: types.SimpleNamespace(resources=lambda: {"CPU": 1}))
    monkeypatch.setattr(verification, "_in_ray", lambda: False)

    def prefetch(spec: Any, through_ray: bool) -> None:
        events.append(f"prefetch {spec.model} {f'on the {spec.gpu_type} nodes' if through_ray else 'here'}")

    log = tmp_path / "engine.log"
    winner = chosen("org/m", "H100-SXM", trial_id="w")
    later = [chosen("org/other", "A100-80GB", trial_id="c"), chosen("org/bare", "L4", serve_replicas=None)]
    with verification.started(winner, log, "auto", prefetch=prefetch, later=later):
        pass
    # The canary's candidate of another model, on its own type, fetched before the winner starts; a bare runner-up
    # runs on this machine, whatever its type.
    assert events == ["ray started", "prefetch org/m on the H100 nodes", "prefetch org/other on the A100 nodes",
                      "prefetch org/bare here", "serve org/m on H100 started", "serve org/m on H100 stopped",
                      "ray stopped"]  # fmt: skip
    # A cluster without the type of what starts later: refused before anything is fetched or deployed.
    events.clear()
    cluster_nodes = [HEAD, H100, L4]
    refused = (r"^trial c was measured on A100-80GB GPUs \(Ray accelerator_type A100\); the Ray cluster at auto has "
               r"GPUs of type H100, L4 only: nothing was deployed$")  # fmt: skip
    with pytest.raises(UserError, match=refused), verification.started(winner, log, "auto", None, prefetch, later[:1]):
        pass
    assert events == ["ray started", "ray stopped"]


def test_verify_checks_and_fetches_with_the_winner_the_runner_up_it_compares_or_the_canarys_candidate(monkeypatch):
    import servetune.verify.run as verification
    from servetune.verify.canary import CANARY
    from servetune.verify.choose import Chosen

    class Stop(Exception):
        pass

    given: list[list[Any]] = []

    def with_engine(chosen, log, timeouts, prompts, budget, progress, body, address=None, also=None, prefetch=None,
                    later=()):  # fmt: skip
        given.append(list(later))
        raise Stop

    def of(model: str, serve_replicas: int | None) -> Chosen:
        spec = RankedSpec(model, serve_replicas)
        return Chosen(point=None, result=types.SimpleNamespace(trial_id=model), spec=spec, level=None)  # type: ignore[arg-type]

    monkeypatch.setattr(verification, "with_engine", with_engine)
    monkeypatch.setattr(verification, "Timeouts", types.SimpleNamespace(from_slo=lambda slo, timeout: None))
    monkeypatch.setattr(verification, "trial_needs", lambda spec: types.SimpleNamespace(resources=lambda: {"CPU": 1}))
    winner, runner_up = of("org/w", 2), of("org/r", None)
    selection = types.SimpleNamespace(winner=winner, runner_up=runner_up, study_dir=Path("/nowhere"))
    for extra, compare, expected in [
        ((), True, [("org/r", None)]),  # the runner-up compared: as it ran (bare: on this machine)
        ((CANARY,), False, [("org/r", 1)]),  # the canary's candidate: through Serve, beside the winner
        ((), False, []),
    ]:
        with pytest.raises(Stop):
            verification.verify(selection, None, None, None, runner_up=compare, extra=extra)  # type: ignore[arg-type]
        assert [(c.spec.model, c.spec.serve_replicas) for c in given[-1]] == expected, (extra, compare)


@dataclasses.dataclass(frozen=True)
class RankedSpec:
    """What ``verify`` reads of the winner's and the runner-up's specs before it starts the winner."""

    model: str
    serve_replicas: int | None
    slo: Any = None
    request_timeout_s: float = 60.0
    startup_timeout_s: float = 60.0
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)


def test_a_rolling_update_moves_the_deployment_to_the_new_configuration_on_the_type_it_is_pinned_to(
    tmp_path, monkeypatch
):  # fmt: skip
    from servetune.serve import trial as serve_trial

    built: list[Any] = []
    monkeypatch.setattr(serve_trial, "trial_llm_config", lambda spec: built.append(spec) or {"model": spec.model})
    sent: list[dict[str, Any]] = []
    cluster = types.SimpleNamespace(engine_replicas=lambda name: ["a0"],
                                    redeploy=lambda name, config, route_prefix, keep_ingress: sent.append(config)
                                    if keep_ingress else None)  # fmt: skip
    winner = Spec("org/m", "H100-SXM", gpu_type="H100")
    engine = serve_trial.ServeEngine(types.SimpleNamespace(study="demo", trial_id="t1", gpu_type="H100"), tmp_path,  # type: ignore[arg-type]
                                     cluster)  # fmt: skip
    runner_up = Spec("org/m", "A100-80GB")  # as verify built it (unpinned), measured on another type
    assert engine.update(runner_up) == ["a0"]  # type: ignore[arg-type]
    assert [(s.model, s.gpu_type) for s in built] == [("org/m", "H100")] and sent == [{"model": "org/m"}]
    assert runner_up.gpu_type is None and winner.gpu_type == "H100"  # its own spec is left as it was
