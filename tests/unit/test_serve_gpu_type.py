"""A study's point started again on a cluster stays on the GPU type it was measured on: serve-check's and verify's
Serve deployments carry the trial's ``accelerator_type`` (as ``export --accelerator-type`` writes it), the weights are
fetched only on nodes of that type, and a cluster with none of it is refused in one line before anything is
deployed. Ray, Serve and the engines are replaced at their boundary; tests/integration/test_gpu_type_ray.py places
the bundles on a real Ray whose nodes declare two types."""

from __future__ import annotations

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

    def deploy(self, name, config, timeout_s, engine_version=None):
        self.configs.append(config)
        return super().deploy(name, config, timeout_s, engine_version)


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
                      "deployed": [list(c.deployed) for c in ServedCluster.opened]})  # fmt: skip
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

    def recording(self, name, config, timeout_s, engine_version=None):
        configs.append(config)
        return deploy(self, name, config, timeout_s, engine_version)

    monkeypatch.setattr(ServedCluster, "deploy", recording)
    monkeypatch.setattr(ServedCluster, "nodes", lambda self: [HEAD, A100, H100])
    assert main(["serve-check", str(gpu_served), "--pick", "t1", "--replicas", "1,2", "--address", "auto"]) == 0
    assert [c["accelerator_type"] for c in configs] == ["H100", "H100"]
    (call,) = fetched
    assert call["gpu_type"] == "H100" and call["through_ray"] is True and call["deployed"] == [[]]  # before deploying
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
    assert cluster.exited
    assert not (gpu_served / "serve-check.json").exists()


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
