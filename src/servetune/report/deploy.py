"""A chosen operating point as Kubernetes objects: a Deployment with its Service and autoscaler
(an ``autoscaling/v2`` HorizontalPodAutoscaler or a KEDA ``ScaledObject``), or a KServe
``InferenceService``.

The container runs ``vllm serve`` with the arguments :func:`servetune.report.export.vllm_command`
prints (the same :func:`engine_argv` of the same pinned, resolved engine arguments, and the same admission
bounds, report/admission.py), so the pod serves what the trial measured. The rules, one object at a time:

- **GPUs**: ``nvidia.com/gpu`` = TP x PP x DP (one vLLM server holds all its ranks; DP is 1 unless
  the trial ran data parallelism inside one server). A CPU study's point asks for no GPU.
- **/dev/shm**: an ``emptyDir`` with ``medium: Memory`` (PyTorch's and NCCL's shared memory; the
  container runtime's 64 MiB default breaks tensor parallelism).
- **probes**: vLLM's ``/health`` answers 200 once the engine is up. A startup probe gives the
  model up to 30 minutes to load; then readiness (out of the Service while unhealthy) and liveness
  (restarted when the engine died) probe it every 10 s.
- **environment**: the study's, except secrets (:mod:`servetune.secrets`' rule), which come from a
  Secret (``secretKeyRef``), never as values; so do the engine's credentials (``api_key`` as
  ``VLLM_API_KEY``, ``hf_token`` as ``HF_TOKEN``), which vLLM reads from the environment.
- **autoscaling**: on the signals and thresholds Serve's autoscaling derivation computes
  (:mod:`servetune.report.autoscale`, the signals from :func:`servetune.report.autoscale_policy.scaling_signals`):
  with the predictive policy, requests in flight per replica (``vllm:num_requests_running`` +
  ``vllm:num_requests_waiting``) at the operating load's target, requests waiting (the queue wait that
  predicts a TTFT breach) per replica, and the fullest engine's ``vllm:kv_cache_usage_perc`` against the
  limit above which it preempts; with the in-flight policy only the first. The autoscaler runs the most
  replicas any signal asks for, as Serve's policy does; scale-up and scale-down windows are its delays;
  each threshold's origin (capacity, knee, headroom, trial, study) is an annotation of the object. The
  HPA reads per-pod custom metrics that a Prometheus adapter serves (the rules are printed as comments);
  KEDA queries Prometheus itself; KServe (raw deployment mode) hands the same queries to KEDA. Without a
  knee the replicas stay fixed at one and no autoscaler is made.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

import yaml

from servetune.config.space import engine_devices
from servetune.engine.args import engine_argv
from servetune.engine.metrics import GAUGES
from servetune.report.admission import AdmissionBounds, comment_lines
from servetune.report.autoscale import Autoscaling
from servetune.report.autoscale_policy import ScalingSignal
from servetune.report.export import masked_engine_args
from servetune.report.pod_model import model_notes, model_volume
from servetune.report.points import ReportPoint, level_label
from servetune.secrets import SECRET_ENGINE_ARGS, is_secret_env

#: The vLLM OpenAI server image of the vLLM release servetune is tested with (pyproject's [gpu] extra).
DEFAULT_IMAGE = "vllm/vllm-openai:v0.32.0"
#: Where the container's server listens (vLLM's default port).
PORT = 8000
#: The environment variables vLLM reads the engine's credentials from.
SECRET_ARG_ENV = {"api_key": "VLLM_API_KEY", "hf_token": "HF_TOKEN"}
#: The per-pod metric the HPA scales on, as the Prometheus adapter rule below names it.
IN_FLIGHT_METRIC = "vllm_requests_in_flight"
#: Where KEDA finds Prometheus unless told (the Prometheus Operator's service in ``monitoring``).
DEFAULT_PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"

Autoscaler = Literal["hpa", "keda"]
#: The derived settings a Kubernetes autoscaler uses (Serve's queue caps have none here: a pod's vLLM bounds its own queue).
K8S_REASONS = ("knee", "min_replicas", "max_replicas", "upscale_delay_s", "downscale_delay_s")


def app_name(point: ReportPoint) -> str:
    """A DNS-1123 name for the objects: ``vllm-`` and the served model's last path part, then the trial."""
    base = first_served_name(masked_engine_args(point).get("served_model_name"), point.model)
    base = base.rstrip("/").rsplit("/", 1)[-1].lower()
    base = re.sub(r"[^a-z0-9-]+", "-", base).strip("-")[:30].strip("-") or "model"
    trial = re.sub(r"[^a-z0-9]+", "", point.trial_id.lower())[:12]
    return "-".join(part for part in ("vllm", base, trial) if part)


def served_model_name(point: ReportPoint) -> str:
    """The name vLLM labels its metrics with (``model_name``): the first served name, else the model."""
    served = point.engine_args.get("served_model_name") or point.resolved_engine_args.get("served_model_name")
    return first_served_name(served, point.model)


def first_served_name(served: object, model: str) -> str:
    """The first of ``served_model_name``'s names (vLLM takes one or a list), else the model."""
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return str(served or model)


def gpus(point: ReportPoint) -> int:
    """The GPUs one server holds: TP x PP x PCP x DP (0 on the CPU build)."""
    if point.device == "cpu":
        return 0
    return engine_devices(
        {**point.resolved_engine_args, **{k: v for k, v in point.engine_args.items() if v is not None}}
    )


def container_env(point: ReportPoint, secret_name: str) -> list[dict[str, Any]]:
    """The study's environment as a container's ``env``: secrets by reference to ``secret_name``."""
    env: list[dict[str, Any]] = []
    for name, value in point.env.items():
        if is_secret_env(name):
            env.append(secret_ref(name, secret_name))
        else:
            env.append({"name": name, "value": str(value)})
    for arg, name in SECRET_ARG_ENV.items():
        if masked_engine_args(point).get(arg) is not None and all(e["name"] != name for e in env):
            env.append(secret_ref(name, secret_name))
    return env


def secret_ref(name: str, secret_name: str) -> dict[str, Any]:
    """An ``env`` entry that takes ``name`` from the Secret ``secret_name`` (its key of the same name)."""
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": name}}}


def container_args(point: ReportPoint, admission: AdmissionBounds | str | None = None) -> list[str]:
    """``vllm serve``'s arguments: the model, the trial's flags as export prints them (with the admission bounds, when
    derived: a pod's own queue is the only one in front of its engine), the port. Credentials are left out (they come
    from the environment, :func:`container_env`)."""
    args = {k: v for k, v in masked_engine_args(point).items() if k not in SECRET_ENGINE_ARGS}
    if isinstance(admission, AdmissionBounds):
        args.update(admission.engine_args())
    return [point.model, *engine_argv(args), "--port", str(PORT)]


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": PORT}, "periodSeconds": period_s, "failureThreshold": failures}


def container(point: ReportPoint, image: str, secret_name: str, name: str = "vllm",
              admission: AdmissionBounds | str | None = None) -> dict[str, Any]:  # fmt: skip
    """The vLLM server container (a ``core/v1`` Container)."""
    resources: dict[str, Any] = {}
    if gpus(point):
        count = str(gpus(point))
        resources = {"limits": {"nvidia.com/gpu": count}, "requests": {"nvidia.com/gpu": count}}
    spec: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": ["vllm", "serve"],
        "args": container_args(point, admission),
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        "env": container_env(point, secret_name),
        "resources": resources,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        "startupProbe": _probe("/health", 10, 180),  # up to 30 minutes to load the model
        "readinessProbe": _probe("/health", 10, 3),
        "livenessProbe": _probe("/health", 10, 3),
    }
    if not spec["env"]:
        del spec["env"]
    return spec


SHM_VOLUME = {"name": "dshm", "emptyDir": {"medium": "Memory"}}


def pod_volumes(point: ReportPoint, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's volumes: ``/dev/shm``, and for a local model its claim (report/pod_model.py), whose mount is added
    to ``spec``, the vLLM container."""
    found = model_volume(point.model, app_name(point))
    if found is None:
        return [SHM_VOLUME]
    volume, mount = found
    spec["volumeMounts"] = [*spec["volumeMounts"], mount]
    return [SHM_VOLUME, volume]


def deployment(point: ReportPoint, image: str, replicas: int = 1,
               admission: AdmissionBounds | str | None = None) -> dict[str, Any]:  # fmt: skip
    name = app_name(point)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "servetune"}
    vllm = container(point, image, f"{name}-secrets", admission=admission)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, "annotations": {"servetune/trial": point.trial_id}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [vllm], "volumes": pod_volumes(point, vllm)},
            },
        },
    }


def service(point: ReportPoint) -> dict[str, Any]:
    name = app_name(point)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": name}},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def pod_selector(point: ReportPoint, deployment: str | None = None) -> str:
    """PromQL's label selector for the engines of ``deployment`` (default: :func:`deployment`'s): vLLM's own
    ``model_name`` label and the ``pod`` label Prometheus' Kubernetes discovery adds (a Deployment's pods are
    ``NAME-<template hash>-<suffix>``), so another Deployment serving the same model (a canary, an old
    version) is not counted."""
    name = deployment or app_name(point)
    return f'{{model_name="{served_model_name(point)}",pod=~"{name}-[a-z0-9]+-[a-z0-9]+"}}'


def signal_query(
    point: ReportPoint, signal: ScalingSignal, deployment: str | None = None, *, as_total: bool = False
) -> str:
    """PromQL of ``signal`` over vLLM's gauges: a per-replica signal summed over the engines (KEDA divides it
    by the replicas), a share its fullest engine's (max). ``as_total``: a share times the pods reporting it,
    so that a per-replica target (KServe's, which sets no metric type) asks for ceil(pods x max / limit)."""
    sel = pod_selector(point, deployment)
    agg = "sum" if signal.per_replica else "max"
    query = " + ".join(f"{agg}({GAUGES[g][0]}{sel})" for g in signal.gauges)
    if as_total and not signal.per_replica:
        (gauge,) = signal.gauges
        query = f"{query} * count(count by (pod) ({GAUGES[gauge][0]}{sel}))"
    return query


#: The per-pod metric name the HPA reads for each signal (served by the prometheus-adapter rules printed beside).
HPA_METRICS = {"in flight": IN_FLIGHT_METRIC, "queue wait": "vllm_requests_waiting", "KV usage": "vllm_kv_cache_usage"}
#: The annotation that states a signal's threshold and where it came from.
SIGNAL_ANNOTATIONS = {"in flight": "in-flight", "queue wait": "queue-wait", "KV usage": "kv-usage"}


def _threshold(value: float) -> str:
    return f"{value:g}"


def autoscaler_annotations(autoscaling: Autoscaling) -> dict[str, str]:
    """Each threshold's origin on the autoscaler object: the operating load (capacity, knee, headroom), the
    trial and study it was measured in, and each signal's threshold with its reason."""
    annotations = {"servetune/operating-load": autoscaling.reasons["knee"]}
    if autoscaling.study:
        annotations["servetune/study"] = autoscaling.study
    annotations["servetune/policy"] = autoscaling.policy
    for signal in autoscaling.scaling_signals():
        annotations[f"servetune/threshold-{SIGNAL_ANNOTATIONS[signal.name]}"] = autoscaling.signal_reason(signal)
    return annotations


def _behavior(autoscaling: Autoscaling) -> dict[str, Any]:
    return {
        "scaleUp": {"stabilizationWindowSeconds": int(autoscaling.upscale_delay_s)},
        "scaleDown": {"stabilizationWindowSeconds": int(autoscaling.downscale_delay_s)},
    }


def hpa(point: ReportPoint, autoscaling: Autoscaling) -> dict[str, Any]:
    """An ``autoscaling/v2`` HPA with one per-pod metric per signal (served by a Prometheus adapter), each at
    its derived per-pod average; the HPA runs the most replicas any metric asks for, as Serve's policy does.
    A per-pod metric is averaged over the pods, so the HPA's KV usage is the mean engine's, not the fullest's
    (KEDA's trigger takes the fullest)."""
    name = app_name(point)
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": HPA_METRICS[signal.name]},
                "target": {"type": "AverageValue", "averageValue": _threshold(signal.threshold)},
            },
        }
        for signal in autoscaling.scaling_signals()
    ]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {
            "name": name,
            "annotations": {"servetune/trial": point.trial_id, **autoscaler_annotations(autoscaling)},
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": autoscaling.min_replicas,
            "maxReplicas": autoscaling.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(autoscaling),
        },
    }


def keda_scaled_object(point: ReportPoint, autoscaling: Autoscaling, prometheus: str) -> dict[str, Any]:
    """A KEDA ``ScaledObject`` with a Prometheus trigger per signal: a per-replica signal's total against its
    per-replica threshold (``AverageValue``: ceil(total / threshold) replicas), KV usage's fullest engine against
    its limit (``Value``: ceil(replicas x usage / limit)). KEDA's HPA runs the most replicas any trigger asks
    for: the rule of Serve's predictive policy (:func:`servetune.report.autoscale_policy.predictive_replicas`)."""
    name = app_name(point)
    triggers = [
        {
            "type": "prometheus",
            "name": SIGNAL_ANNOTATIONS[signal.name],
            "metricType": "AverageValue" if signal.per_replica else "Value",
            "metadata": {
                "serverAddress": prometheus,
                "query": signal_query(point, signal),
                "threshold": _threshold(signal.threshold),
            },
        }
        for signal in autoscaling.scaling_signals()
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {
            "name": name,
            "annotations": {"servetune/trial": point.trial_id, **autoscaler_annotations(autoscaling)},
        },
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicaCount": autoscaling.min_replicas,
            "maxReplicaCount": autoscaling.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": int(autoscaling.downscale_delay_s),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(autoscaling)}},
            "triggers": triggers,
        },
    }


def kubernetes_documents(
    point: ReportPoint, autoscaling: Autoscaling | str, image: str = DEFAULT_IMAGE, autoscaler: Autoscaler = "hpa",
    prometheus: str = DEFAULT_PROMETHEUS, admission: AdmissionBounds | str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Deployment, Service and (with a derived autoscaling) the HPA or the KEDA ScaledObject."""
    docs = [deployment(point, image, admission=admission), service(point)]
    if isinstance(autoscaling, Autoscaling):
        docs.append(
            hpa(point, autoscaling) if autoscaler == "hpa" else keda_scaled_object(point, autoscaling, prometheus)
        )
    return docs


#: KServe's Deployment for the predictor (raw deployment mode): the InferenceService's name and this.
KSERVE_PREDICTOR_SUFFIX = "-predictor"


def kserve_inference_service(
    point: ReportPoint, autoscaling: Autoscaling | str, image: str = DEFAULT_IMAGE,
    prometheus: str = DEFAULT_PROMETHEUS, admission: AdmissionBounds | str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A KServe ``InferenceService`` (``serving.kserve.io/v1beta1``) whose predictor is the same vLLM container.
    With a derived autoscaling it runs as a plain Deployment (raw deployment mode) scaled by KEDA on the same
    signals and thresholds as the ``kubernetes`` export: one ``External`` Prometheus metric per signal
    (``autoScaling.metrics``), each a total against its per-replica threshold (KServe gives KEDA no metric
    type, so KV usage is queried as the fullest engine's times the pods)."""
    name = app_name(point)
    vllm = container(point, image, f"{name}-secrets", name="kserve-container", admission=admission)
    predictor: dict[str, Any] = {"containers": [vllm], "volumes": pod_volumes(point, vllm)}
    annotations = {"servetune/trial": point.trial_id}
    if isinstance(autoscaling, Autoscaling):
        deployment = name + KSERVE_PREDICTOR_SUFFIX
        metrics = [
            {
                "type": "External",
                "external": {
                    "metric": {
                        "backend": "prometheus", "serverAddress": prometheus,
                        "query": signal_query(point, signal, deployment, as_total=True),
                    },
                    "target": {"type": "Value", "value": _threshold(signal.threshold)},
                },
            }
            for signal in autoscaling.scaling_signals()
        ]  # fmt: skip
        predictor.update({
            "minReplicas": autoscaling.min_replicas, "maxReplicas": autoscaling.max_replicas,
            "autoScaling": {"metrics": metrics, "behavior": _behavior(autoscaling)},
        })  # fmt: skip
        annotations |= {
            "serving.kserve.io/deploymentMode": "RawDeployment",
            "serving.kserve.io/autoscalerClass": "keda",
        }
        annotations |= autoscaler_annotations(autoscaling)
    else:
        predictor.update({"minReplicas": 1, "maxReplicas": 1})
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {"name": name, "annotations": annotations},
        "spec": {"predictor": predictor},
    }


def _header(point: ReportPoint, autoscaling: Autoscaling | str, what: str,
            admission: AdmissionBounds | str | None = None) -> str:  # fmt: skip
    name = app_name(point)
    lines = [
        f"{what} (servetune trial {point.trial_id}, measured at {level_label(point.level)}).",
        "Deploy: kubectl apply -f this.yaml",
    ]
    lines += pod_notes(point, name, admission) + model_notes(point.model, name)
    if isinstance(autoscaling, str):
        lines.append(f"Fixed replicas, no autoscaling derived: {autoscaling}")
    else:
        lines.append(
            "Autoscaling derived from the study's measurements (checklist sections 10 and 11), as for Ray Serve:"
        )
        lines += [f"  {key}: {autoscaling.reasons[key]}" for key in K8S_REASONS if key in autoscaling.reasons]
        lines.append(f"It scales ({autoscaling.policy} policy) on the most replicas any of these signals asks for:")
        lines += [
            f"  {signal.name} ({'per replica' if signal.per_replica else 'the fullest engine'}): "
            f"{autoscaling.signal_reason(signal)}"
            for signal in autoscaling.scaling_signals()
        ]
    return "".join(f"# {line}\n" for line in lines)


def adapter_rule(point: ReportPoint, autoscaling: Autoscaling) -> str:
    """The prometheus-adapter rules that serve the HPA's per-pod metrics (:data:`HPA_METRICS`), one per signal."""
    lines = [
        "The HPA reads per-pod metrics from the custom metrics API; prometheus-adapter rules that serve them:",
    ]
    for signal in autoscaling.scaling_signals():
        first = GAUGES[signal.gauges[0]][0]
        agg = "sum" if signal.per_replica else "max"
        query = " + ".join(f"{agg} by (<<.GroupBy>>) ({GAUGES[g][0]}{{<<.LabelMatchers>>}})" for g in signal.gauges)
        lines += [
            f'  - seriesQuery: \'{first}{{namespace!="",pod!=""}}\'',
            "    resources: {overrides: {namespace: {resource: namespace}, pod: {resource: pod}}}",
            f"    name: {{matches: '^{first}$', as: '{HPA_METRICS[signal.name]}'}}",
            f"    metricsQuery: '{query}'",
        ]
    return "".join(f"# {line}\n" for line in lines)


class _Dumper(yaml.SafeDumper):
    """Writes every mapping out in full (no ``&id001`` anchors): what a reader of the manifest expects."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def kubernetes_yaml(
    point: ReportPoint, autoscaling: Autoscaling | str, image: str = DEFAULT_IMAGE, autoscaler: Autoscaler = "hpa",
    prometheus: str = DEFAULT_PROMETHEUS, admission: AdmissionBounds | str | None = None,
) -> str:  # fmt: skip
    header = _header(point, autoscaling, "Kubernetes Deployment, Service and autoscaler", admission)
    if isinstance(autoscaling, Autoscaling) and autoscaler == "hpa":
        header += adapter_rule(point, autoscaling)
    docs = kubernetes_documents(point, autoscaling, image, autoscaler, prometheus, admission)
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def kserve_yaml(
    point: ReportPoint, autoscaling: Autoscaling | str, image: str = DEFAULT_IMAGE,
    prometheus: str = DEFAULT_PROMETHEUS, admission: AdmissionBounds | str | None = None,
) -> str:  # fmt: skip
    header = _header(point, autoscaling, "KServe InferenceService", admission)
    service = kserve_inference_service(point, autoscaling, image, prometheus, admission)
    return header + yaml.dump(service, Dumper=_Dumper, sort_keys=False)


def documents(text: str) -> list[Mapping[str, Any]]:
    """The YAML documents of an exported file (for tests and tools)."""
    return [d for d in yaml.safe_load_all(text) if d]


def pod_notes(point: ReportPoint, name: str, admission: AdmissionBounds | str | None = None) -> list[str]:
    """The header lines every pod-based export (kubernetes, kserve, llm-d) gives: the Secret to create for the
    variables the pod reads by reference, the image to use for a study on vLLM's CPU build, and the admission
    bounds its ``vllm serve`` sets (or why none), as ``export --format vllm`` says them."""
    lines = comment_lines(admission)
    secrets = [e["name"] for e in container_env(point, "") if "valueFrom" in e]
    if secrets:
        lines.append(f"Secrets by reference, never by value: kubectl create secret generic {name}-secrets "
                     + " ".join(f"--from-literal={s}=..." for s in secrets))  # fmt: skip
    if point.device == "cpu":
        lines.append("The study ran on vLLM's CPU build: use a CPU image of vLLM (the default image is the GPU one).")
    return lines
