"""The cluster as nodes: what one trial's bundle needs of a single node, and how many fit.

A trial's bundle (trial/context.py ``bundle``) must fit inside one node: Ray places a
placement-group bundle on one node or not at all, and a bundle no node can hold waits in Ray's
queue forever (Ray only warns). So the driver reads the nodes once (:func:`alive_nodes`) and
a trial that no node can hold is INFEASIBLE at once, with the reason in the user's words:
"needs 4 GPUs on one node; the largest node has 2". A cluster that has no node with the
resource at all (an autoscaler that starts GPU nodes on demand) is not judged: nothing here
knows which nodes it would start.

Pure apart from :func:`alive_nodes`, which asks Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from servetune.capacity.hardware import ACCELERATOR, gpu_types
from servetune.trial.context import bundle

if TYPE_CHECKING:
    from servetune.trial.context import StudyContext

#: The resources a bundle names, in the order a reason names the first one missing, with the user's word.
NOUNS = {"GPU": "GPUs", "CPU": "CPUs", "memory": "bytes of memory"}
#: Every Ray head node has this resource (1.0): a bundle of a sliver of it fits there whatever the
#: head's CPUs (the cluster files give the head none). It holds a trial that only records its outcome.
HEAD_SLIVER = {"node:__internal_head__": 0.001}


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of each live node of the connected Ray cluster."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def placement_problem(
    bundle: Mapping[str, float], nodes: Sequence[Mapping[str, float]], node: str = "node"
) -> str | None:
    """Why no node can hold ``bundle``, or None when one can (or when nothing can be judged). ``node``: what the
    reason calls one of ``nodes`` ("H100 node" once they are the nodes of the bundle's GPU type).

    Judged only for resources some node has: with no node declaring GPUs yet, an autoscaler may
    still add one.
    """
    wanted = {k: v for k, v in bundle.items() if v > 0}
    if not nodes or any(all(node.get(k, 0.0) >= v for k, v in wanted.items()) for node in nodes):
        return None
    kind = next((k for k in wanted if k.startswith(ACCELERATOR)), None)
    if kind is not None:  # pinned to a GPU type: only the nodes of that type count
        of_kind = [node for node in nodes if node.get(kind, 0.0) > 0]
        name = kind[len(ACCELERATOR) :]
        if not of_kind:
            return f"needs GPUs of type {name}; the cluster's nodes have {', '.join(gpu_types(nodes))}"
        return placement_problem({k: v for k, v in wanted.items() if k != kind}, of_kind, f"{name} node")
    if any(not any(node.get(k, 0.0) > 0 for node in nodes) for k in wanted):
        return None  # a resource no node has (yet): the autoscaler's call, not ours
    for key, amount in wanted.items():
        largest = max(node.get(key, 0.0) for node in nodes)
        if amount > largest:
            return f"needs {_amount(amount)} {NOUNS.get(key, key)} on one {node}; the largest {node} has {_amount(largest)}"
    needs = ", ".join(f"{_amount(v)} {NOUNS.get(k, k)}" for k, v in wanted.items())
    return f"needs {needs} on one {node}; no {node} has all of them"


def placement_problem_of(context: StudyContext, params: dict[str, Any]) -> str | None:
    """Why no node of the study's cluster can hold this trial's bundle (None: one can, or no nodes known)."""
    return placement_problem(bundle(context.space, params, context.gpu_type(params)), context.nodes)


def _amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
