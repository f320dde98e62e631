"""``export --format kubernetes|kserve``: the objects, checked against Kubernetes' published OpenAPI
schemas (kubernetes-validate's strict JSON schemas of Kubernetes 1.37).

KServe's and KEDA's CRD schemas ship in no PyPI package: the parts of them that are Kubernetes types
(the predictor's containers and volumes are a core/v1 PodSpec's) are checked against those schemas
here, the rest against the CRDs' schemas vendored under tests/data in test_export_autoscaler.py.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

from servetune.cli import main
from servetune.engine.args import load_argspecs
from servetune.report import ReportPoint, build_report, deploy, load_study
from servetune.report.export import autoscaling_for, pick_point, vllm_command
from tests.builders import CPU_TINY_KNEE, CPU_TINY_STUDY, gpu_knee

STUDY, BASELINE = CPU_TINY_STUDY, CPU_TINY_KNEE
K8S = "1.37.0"


def validate_k8s(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def validate_definition(obj: Any, definition: str) -> None:
    """``obj`` against one type of Kubernetes' strict definitions (e.g. ``io.k8s.api.core.v1.PodSpec``)."""
    defs = schema_contents(f"kubernetes-json-schema/v{K8S}-local-strict/_definitions.json", K8S)
    registry = Registry().with_resource(defs["$id"], Resource.from_contents(defs))
    schema = {"$schema": defs["$schema"], "$ref": f"{defs['$id']}#/$defs/{definition}"}
    jsonschema.Draft202012Validator(schema, registry=registry).validate(obj)


@pytest.fixture(scope="module")
def report():
    return build_report(load_study(STUDY))


@pytest.fixture(scope="module")
def gpu_point(report):
    """The study's knee as if measured on GPUs, with TP 2 x PP 2, a secret variable and an API key."""
    return gpu_knee(report, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, {"VLLM_LOGGING_LEVEL": "INFO"})


@pytest.fixture(scope="module")
def autoscaling(report, gpu_point):
    return autoscaling_for(report, gpu_point)


def test_every_kubernetes_object_is_valid_against_the_published_schema(gpu_point, autoscaling):
    for autoscaler in ("hpa", "keda"):
        docs = deploy.documents(deploy.kubernetes_yaml(gpu_point, autoscaling, autoscaler=autoscaler))
        kinds = [d["kind"] for d in docs]
        assert "Serve's bounded queue" not in deploy.kubernetes_yaml(gpu_point, autoscaling)  # no Serve-only reasons
        assert kinds == ["Deployment", "Service", "HorizontalPodAutoscaler" if autoscaler == "hpa" else "ScaledObject"]
        for doc in docs:
            if doc["apiVersion"].startswith("keda.sh/"):
                continue  # a CRD: checked in its own test
            validate_k8s(dict(doc))


def test_a_wrong_field_is_caught_by_the_schema_check(gpu_point, autoscaling):
    """The check above can fail: a misspelt field of the Deployment breaks the strict schema."""
    (doc, *_) = deploy.kubernetes_documents(gpu_point, autoscaling)
    doc["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(doc)


def test_the_container_runs_the_exported_vllm_command_with_gpus_shm_and_probes(gpu_point, autoscaling):
    deployment, service, _ = deploy.kubernetes_documents(gpu_point, autoscaling, image="registry.local/vllm:mine")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "registry.local/vllm:mine"
    # the same flags the vllm command prints, minus the credential (it comes from a Secret) and with the port
    command = "\n".join(line for line in vllm_command(gpu_point).splitlines() if not line.startswith("#"))
    tokens = shlex.split(command.replace("\\\n", " "))
    printed = tokens[tokens.index("serve") + 1 :]
    key = printed.index("--api-key")
    assert container["command"] + container["args"] == [
        "vllm",
        "serve",
        *printed[:key],
        *printed[key + 2 :],
        "--port",
        "8000",
    ]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}  # TP 2 x PP 2
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": 8000}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in service["spec"]["selector"].items())
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_every_flag_of_the_container_is_an_option_of_vllms_server(gpu_point):
    specs = load_argspecs()  # vLLM's own parser's table (cached per vLLM version)
    if specs is None:
        pytest.skip("vLLM is not installed")
    flags = {spec.flag for spec in specs.values()} | {"--no-" + spec.flag[2:] for spec in specs.values()}
    given = [token for token in deploy.container_args(gpu_point) if token.startswith("--")]
    assert "--tensor-parallel-size" in given and "--port" in given
    assert [flag for flag in given if flag not in flags] == []


def test_secrets_are_referenced_never_written(gpu_point, autoscaling):
    text = deploy.kubernetes_yaml(gpu_point, autoscaling)
    assert "hf_secret_value" not in text and "sk-live" not in text and "***" not in text
    (deployment, *_) = deploy.documents(text)
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    secret = f"{deployment['metadata']['name']}-secrets"
    for name in ("HF_TOKEN", "VLLM_API_KEY"):
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": secret, "key": name}}
    assert env["VLLM_LOGGING_LEVEL"] == {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}
    assert f"kubectl create secret generic {secret}" in text


def test_the_hpa_scales_on_in_flight_requests_at_the_derived_target(gpu_point, autoscaling):
    *_, hpa = deploy.kubernetes_documents(gpu_point, autoscaling)
    spec = hpa["spec"]
    assert (spec["minReplicas"], spec["maxReplicas"]) == (autoscaling.min_replicas, autoscaling.max_replicas)
    (metric,) = spec["metrics"]
    assert metric["pods"]["metric"]["name"] == deploy.IN_FLIGHT_METRIC
    assert metric["pods"]["target"]["averageValue"] == str(autoscaling.target_ongoing_requests)
    assert spec["behavior"]["scaleUp"]["stabilizationWindowSeconds"] == autoscaling.upscale_delay_s
    assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == autoscaling.downscale_delay_s
    assert spec["scaleTargetRef"]["name"] == hpa["metadata"]["name"]


def test_keda_queries_vllms_running_and_waiting_gauges_at_the_derived_target(gpu_point, autoscaling):
    *_, scaled = deploy.kubernetes_documents(gpu_point, autoscaling, autoscaler="keda", prometheus="http://prom:9090")
    spec = scaled["spec"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": scaled["metadata"]["name"]}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (autoscaling.min_replicas, autoscaling.max_replicas)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["serverAddress"] == "http://prom:9090"
    query = trigger["metadata"]["query"]
    assert "vllm:num_requests_running{" in query and "vllm:num_requests_waiting{" in query
    assert f'model_name="{deploy.served_model_name(gpu_point)}"' in query
    assert trigger["metadata"]["threshold"] == str(autoscaling.target_ongoing_requests)
    assert all(isinstance(v, str) for v in trigger["metadata"].values())  # the CRD: metadata is a map of strings
    # KEDA passes the behaviour through to the HPA it makes: a Kubernetes type
    validate_definition(
        spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"],
        "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior",
    )


def test_without_a_knee_the_replicas_stay_fixed_and_no_autoscaler_is_made(gpu_point):
    why = "trial x met the SLO at no load level, so it has no knee to scale on"
    text = deploy.kubernetes_yaml(gpu_point, why)
    assert [d["kind"] for d in deploy.documents(text)] == ["Deployment", "Service"]
    assert f"# Fixed replicas, no autoscaling derived: {why}" in text


def test_a_cpu_point_asks_for_no_gpu_and_says_the_image_must_be_a_cpu_one(report):
    point = pick_point(report, BASELINE)
    text = deploy.kubernetes_yaml(point, autoscaling_for(report, point))
    (deployment, *_) = deploy.documents(text)
    assert "nvidia.com/gpu" not in yaml.safe_dump(deployment)
    assert "vLLM's CPU build" in text
    validate_k8s(dict(deployment))


def test_kserve_predictor_is_the_same_container_as_a_valid_pod_spec(gpu_point, autoscaling):
    isvc = deploy.documents(deploy.kserve_yaml(gpu_point, autoscaling))[0]
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    validate_definition(isvc["metadata"], "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta")
    predictor = dict(isvc["spec"]["predictor"])
    (container,) = predictor["containers"]
    assert container["name"] == "kserve-container"
    (deployment, *_) = deploy.kubernetes_documents(gpu_point, autoscaling)
    assert container["args"] == deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    # KServe's predictor inlines a core/v1 PodSpec beside its own scaling fields (test_export_autoscaler checks
    # those against KServe's CRD)
    own = {k: predictor.pop(k) for k in ("minReplicas", "maxReplicas", "autoScaling")}
    assert (own["minReplicas"], own["maxReplicas"]) == (autoscaling.min_replicas, autoscaling.max_replicas)
    (metric,) = own["autoScaling"]["metrics"]  # the in-flight policy: one signal
    assert metric["external"]["target"]["value"] == str(autoscaling.target_ongoing_requests)
    validate_definition(predictor, "io.k8s.api.core.v1.PodSpec")


def test_a_local_model_is_mounted_from_its_claim_where_the_arguments_name_it(gpu_point, autoscaling):
    """The stored study ran on a local directory: the pod gets it at that path from the claim llm-d's export names
    (holding it as its directory), read-only, and the header says to create it; a hub id mounts nothing."""
    model = PurePosixPath(gpu_point.model)
    assert model.is_absolute()
    claim = f"{deploy.app_name(gpu_point)}-model"
    (deployment, *_) = deploy.kubernetes_documents(gpu_point, autoscaling)
    isvc = deploy.kserve_inference_service(gpu_point, autoscaling)
    for pod in (deployment["spec"]["template"]["spec"], isvc["spec"]["predictor"]):
        (container,) = pod["containers"]
        assert container["args"][0] == str(model)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert mount == {"name": "model", "mountPath": str(model), "subPath": model.name, "readOnly": True}
        assert {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}} in pod["volumes"]
    validate_k8s(dict(deployment))
    for text in (deploy.kubernetes_yaml(gpu_point, autoscaling), deploy.kserve_yaml(gpu_point, autoscaling)):
        assert f"PersistentVolumeClaim {claim} holding it as {model.name}/" in text
    hub = dataclasses.replace(gpu_point, model="Qwen/Qwen3-8B")
    (deployment, *_) = deploy.kubernetes_documents(hub, autoscaling)
    assert deployment["spec"]["template"]["spec"]["volumes"] == [deploy.SHM_VOLUME]
    assert "PersistentVolumeClaim" not in deploy.kubernetes_yaml(hub, autoscaling)
    relative = dataclasses.replace(gpu_point, model="./models/tiny")
    (deployment, *_) = deploy.kubernetes_documents(relative, autoscaling)
    assert deployment["spec"]["template"]["spec"]["volumes"] == [deploy.SHM_VOLUME]
    assert "the image must hold it there" in deploy.kubernetes_yaml(relative, autoscaling)


def test_names_are_dns_labels():
    point = ReportPoint(trial_id="Ab_12", model="/models/Qwen/Qwen3-8B_Instruct.v2/", engine_args={})
    name = deploy.app_name(point)
    assert name.startswith("vllm-qwen3-8b-instruct-v2-")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63


@pytest.mark.parametrize("fmt", ["kubernetes", "kserve"])
def test_the_command_prints_the_objects_of_the_stored_study(fmt, capsys):
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", fmt, "--image", "my/vllm-cpu:1"]) == 0
    docs = deploy.documents(capsys.readouterr().out)
    assert docs and all(d["metadata"]["annotations"]["servetune/trial"] == BASELINE for d in docs[:1])
    assert "my/vllm-cpu:1" in yaml.safe_dump(docs[0])
