"""Where a pod finds the model that a point's ``vllm serve`` arguments name (the ``kubernetes``, ``kserve`` and
``llm-d`` exports).

A hub id is downloaded by vLLM in the pod (``HF_TOKEN`` from the Secret). A local directory, a study run on
``/models/tiny``, must be in the pod at the same path: one PersistentVolumeClaim, ``<app>-model`` (:func:`model_claim`),
holds it as its directory (``tiny/``). llm-d's chart mounts that claim at the directory's parent
(``modelArtifacts.uri: pvc://<claim>/tiny``, report/llmd.py); the Deployment and the InferenceService mount the
claim's directory at the path itself (``subPath``), read-only (:func:`model_volume`), so one claim serves all three.
A relative path is left to the image (the header says so).
"""

from __future__ import annotations

import os
from pathlib import PurePosixPath
from typing import Any

#: The pod volume that holds a local model.
MODEL_VOLUME = "model"


def is_local_path(model: str) -> bool:
    """Whether ``model`` names a directory (absolute, relative or existing here) rather than a hub id."""
    return model.startswith(("/", ".", "~")) or os.path.isdir(model)


def model_claim(app: str) -> str:
    """The PersistentVolumeClaim that holds a local model, for the application ``app`` (deploy.app_name)."""
    return f"{app}-model"[:63]


def mounted_path(model: str) -> PurePosixPath | None:
    """The local model's directory where a claim can hold it: absolute and below / (None: a hub id, or not)."""
    if not is_local_path(model):
        return None
    path = PurePosixPath(model.rstrip("/") or "/")
    return path if path.is_absolute() and path != path.parent else None


def model_volume(model: str, app: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """For a local model: the pod's volume (the claim, read-only) and the container's mount of the claim's directory
    at the path the arguments name. None for a hub id or a relative path."""
    path = mounted_path(model)
    if path is None:
        return None
    volume = {"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": model_claim(app), "readOnly": True}}
    mount = {"name": MODEL_VOLUME, "mountPath": str(path), "subPath": path.name, "readOnly": True}
    return volume, mount


def model_notes(model: str, app: str) -> list[str]:
    """The header line saying what a local model needs (none for a hub id)."""
    if not is_local_path(model):
        return []
    path = mounted_path(model)
    if path is None:
        return [f"The model is the relative directory {model}: the image must hold it there (or run the study on an "
                "absolute path, which the export mounts from a PersistentVolumeClaim)."]  # fmt: skip
    return [f"The model is a local directory: create the PersistentVolumeClaim {model_claim(app)} holding it as "
            f"{path.name}/ (mounted read-only at {path}, where the arguments name it)."]  # fmt: skip
