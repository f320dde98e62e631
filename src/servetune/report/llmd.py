"""A chosen operating point as the values file of llm-d's ModelService Helm chart
(github.com/llm-d-incubation/llm-d-modelservice, ``charts/llm-d-modelservice`` at chart version
:data:`CHART_VERSION`): ``helm install NAME llm-d-modelservice/llm-d-modelservice -f values.yaml``.

The chart makes the decode (and prefill) pods of one model; the rules, one values field at a time, as the
chart's templates (``_helpers.tpl``, ``decode-deployment.yaml``) use them:

- **decode.containers**: the container of the ``kubernetes`` export (:func:`servetune.report.deploy.container`:
  the same ``vllm serve`` arguments, environment with secrets by reference, probes on ``/health``, resources)
  with ``modelCommand: custom``, so the chart runs its ``command`` and ``args`` as they are rather than
  composing its own ``vllm serve`` line (which would add a second ``--port`` and ``--served-model-name``).
- **decode.parallelism** (``tensor``, ``data``, ``dataLocal``, ``workers``): the trial's TP and DP, all in one
  pod. The chart asks for tensor x dataLocal accelerators per pod (its ``resources`` overwrite the container's
  own); that is the engine's devices (:func:`servetune.config.space.engine_devices`) only without pipeline or
  context parallelism, which the chart has no field for: such a point is refused rather than given too few GPUs.
- **accelerator.type**: ``nvidia`` (``nvidia.com/gpu``), or ``cpu`` for a study on vLLM's CPU build (the chart
  then asks for no accelerator).
- **decode.replicas**: the chart makes no autoscaler, so the replicas are fixed: as many as the peak needs
  (``max_replicas`` of the derived autoscaling, ceil(peak / operating load per replica), as the ``kubernetes``
  export's autoscaler's upper bound); one without a derived autoscaling.
- **prefill**: not created (no prefill/decode disaggregation: the study measured whole engines), so no
  routing sidecar either (``routing.proxy.enabled: false``): vLLM listens on ``routing.servicePort`` itself.
- **modelArtifacts**: ``name`` is the served model name (what requests ask for; the InferencePool's
  ``llm-d.ai/model`` label is made from it). A hub id is ``hf://ID``, downloaded into an ``emptyDir`` of
  ``size`` (the checkpoint's size in servetune's model cache, with a fifth more room, else
  :data:`UNKNOWN_MODEL_SIZE`); a local directory is ``pvc://PVC/DIR`` with the claim mounted at the
  directory's parent, so the container's model argument names the same path in the pod.
"""

from __future__ import annotations

import math
import re
from pathlib import PurePosixPath
from typing import Any

import yaml

from servetune.errors import UserError
from servetune.report import deploy
from servetune.report.admission import AdmissionBounds
from servetune.report.autoscale import Autoscaling
from servetune.report.export import masked_engine_args
from servetune.report.pod_model import is_local_path, model_claim
from servetune.report.points import ReportPoint, level_label

#: The chart version these values are written for (its values.schema.json is vendored in tests/data/llm-d).
CHART_VERSION = "v0.3.8"
CHART_COMMIT = "732f65727c6c8a712cb82d75a41536965d8fb4b9"
CHART_REPO = "https://llm-d-incubation.github.io/llm-d-modelservice/"
#: The emptyDir a hub model is downloaded into when servetune's cache does not know the checkpoint's size.
UNKNOWN_MODEL_SIZE = "100Gi"
#: Room on top of the checkpoint's bytes for the download (tokenizer, config, partial files).
SIZE_MARGIN = 1.2
_GIB = 1024**3


def checkpoint_size(model: str) -> str | None:
    """The emptyDir size for a hub model: its checkpoint's stored bytes (servetune's model cache, no network)
    with :data:`SIZE_MARGIN`, in whole GiB; None where the cache does not know them."""
    from servetune.capacity.checkpoint import DTYPE_BYTES
    from servetune.capacity.source import cached_model

    found = cached_model(model)
    if found is None or not found.parameters or any(d not in DTYPE_BYTES for d in found.parameters):
        return None
    stored = sum(count * DTYPE_BYTES[dtype] for dtype, count in found.parameters.items())
    return f"{max(1, math.ceil(stored * SIZE_MARGIN / _GIB))}Gi"


def label_value(text: str) -> str:
    """A Kubernetes label value made from ``text``: at most 63 of [A-Za-z0-9._-], alphanumeric at both ends."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value) or "model"


def model_artifacts(point: ReportPoint) -> tuple[dict[str, Any], list[str]]:
    """``modelArtifacts`` and the header lines that say what the user must provide."""
    served = deploy.served_model_name(point)
    artifacts: dict[str, Any] = {
        "name": served,
        "labels": {"llm-d.ai/inferenceServing": "true", "llm-d.ai/model": label_value(served)},
    }
    if is_local_path(point.model):
        path = PurePosixPath(point.model.rstrip("/") or "/")
        if not path.is_absolute() or path.parent == path.parent.parent:
            raise UserError(
                f"export --format llm-d: trial {point.trial_id}'s model {point.model} is not an absolute directory "
                "below /: the chart mounts the model's claim at its parent; run the study on an absolute path "
                "(or a hub id), or use --format kubernetes"
            )
        claim = model_claim(deploy.app_name(point))
        artifacts |= {"uri": f"pvc://{claim}/{path.name}", "mountPath": str(path.parent)}
        return artifacts, [
            f"The model is a local directory: create the PersistentVolumeClaim {claim} holding it as {path.name}/ "
            f"(the chart mounts the claim at {path.parent}, so the pod sees {path})."
        ]
    size = checkpoint_size(point.model)
    artifacts |= {"uri": f"hf://{point.model}", "size": size or UNKNOWN_MODEL_SIZE}
    if size is None:
        return artifacts, [
            f"modelArtifacts.size {UNKNOWN_MODEL_SIZE} is a guess (servetune's cache does not know the checkpoint's "
            f"size; `servetune models add {point.model}` records it): set it above the checkpoint's size."
        ]
    return artifacts, []


def parallelism(point: ReportPoint) -> dict[str, int]:
    """``decode.parallelism`` as the chart names it: TP and DP, all DP ranks in the one pod. Refuses a point whose
    devices the chart would not ask for (pipeline or context parallelism)."""
    args = masked_engine_args(point)
    tensor = int(args.get("tensor_parallel_size") or 1)
    data = int(args.get("data_parallel_size") or 1)
    devices = deploy.gpus(point)
    if devices and devices != tensor * data:
        others = {k: v for k, v in args.items() if k.endswith("_parallel_size") and k not in
                  ("tensor_parallel_size", "data_parallel_size") and int(v or 1) > 1}  # fmt: skip
        raise UserError(
            f"export --format llm-d: trial {point.trial_id} takes {devices} GPUs per engine "
            f"({', '.join(f'{k} {v}' for k, v in others.items()) or 'beyond TP x DP'}), but llm-d-modelservice "
            f"{CHART_VERSION} gives a pod tensor x dataLocal = {tensor * data} and has no field for the rest; "
            "use --format kubernetes"
        )
    return {"tensor": tensor, "data": data, "dataLocal": data, "workers": 1}


def llmd_values(
    point: ReportPoint, autoscaling: Autoscaling | str, image: str = deploy.DEFAULT_IMAGE,
    admission: AdmissionBounds | str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The chart's values for ``point`` (see the module's rules)."""
    name = deploy.app_name(point)
    artifacts, _ = model_artifacts(point)
    container = deploy.container(point, image, f"{name}-secrets", admission=admission)
    container |= {"modelCommand": "custom", "mountModelVolume": True}
    return {
        "fullnameOverride": name,
        "multinode": False,
        "modelArtifacts": artifacts,
        "accelerator": {"type": "cpu" if point.device == "cpu" else "nvidia"},
        "routing": {"servicePort": deploy.PORT, "proxy": {"enabled": False}},
        "decode": {
            "create": True,
            "replicas": autoscaling.max_replicas if isinstance(autoscaling, Autoscaling) else 1,
            "autoscaling": {"enabled": False},
            "parallelism": parallelism(point),
            "containers": [container],
            "volumes": [deploy.SHM_VOLUME],
        },
        "prefill": {"create": False, "replicas": 0},
    }


def _header(point: ReportPoint, autoscaling: Autoscaling | str, notes: list[str],
            admission: AdmissionBounds | str | None = None) -> str:  # fmt: skip
    name = deploy.app_name(point)
    lines = [
        f"Values of llm-d's ModelService Helm chart (llm-d-incubation/llm-d-modelservice, chart {CHART_VERSION}, "
        f"commit {CHART_COMMIT[:12]}),",
        f"for servetune trial {point.trial_id}, measured at {level_label(point.level)}. Deploy:",
        f"  helm repo add llm-d-modelservice {CHART_REPO}",
        f"  helm install {name} llm-d-modelservice/llm-d-modelservice --version {CHART_VERSION} -f this.yaml",
        f"Decode pods only (Deployment {name}-decode): no prefill/decode disaggregation, no routing sidecar;",
        f"vLLM serves on port {deploy.PORT} for the InferencePool selecting the modelArtifacts labels.",
    ]
    lines += notes
    lines += deploy.pod_notes(point, name, admission)
    if isinstance(autoscaling, str):
        lines.append(f"Fixed at 1 replica, no autoscaling derived: {autoscaling}")
    else:
        lines += [
            f"The chart makes no autoscaler: decode.replicas is fixed at what the peak needs, {autoscaling.reasons['max_replicas']}",
            f"  operating load: {autoscaling.reasons['knee']}",
            "  (servetune export --format kubernetes writes an autoscaler on the derived signals)",
        ]  # fmt: skip
    return "".join(f"# {line}\n" for line in lines)


def llmd_yaml(point: ReportPoint, autoscaling: Autoscaling | str, image: str = deploy.DEFAULT_IMAGE,
              admission: AdmissionBounds | str | None = None) -> str:  # fmt: skip
    values = llmd_values(point, autoscaling, image, admission)
    notes = model_artifacts(point)[1]
    return _header(point, autoscaling, notes, admission) + yaml.dump(values, Dumper=_Dumper, sort_keys=False)


class _Dumper(yaml.SafeDumper):
    """Writes every mapping out in full (no ``&id001`` anchors), as the other deployment files are."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
