"""A trial whose start failed for its node's fault, started once more on another node.

A GPU with an uncorrectable ECC error, a driver that no longer matches its library, NCCL failing on the node's
fabric, a full disk (trial/failures.py: ``retry_elsewhere``) fail the same way on the same node whatever the
configuration, and Tune would place the trial there again. So the trial's own process asks Ray for a placement group
of the trial's bundle on any node but the ones it failed on (Ray's ``ray.io/node-id`` label, negated), waits a
bounded time for it, and runs the trial there as a Ray task with that group's devices. The result recorded is the
second attempt's, with the first attempt's failure (and node) in ``retried``; where no other node frees such a bundle
in time, the first failure stands, and says so.

The retry's levels reach Tune in the trial's final report, not one at a time (the task cannot report to Tune).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from servetune.results import TrialResult
from servetune.trial.context import StudyContext
from servetune.trial.failures import after_attempt

#: Ray's label on every node: its id (ray/util/placement_group.py NODE_ID_LABEL_KEY).
NODE_ID_LABEL = "ray.io/node-id"
#: How long the retry waits for another node to free the trial's bundle before the first failure stands.
ELSEWHERE_WAIT_S = 600.0


def excluding(nodes: list[str], bundles: int) -> list[dict[str, str]]:
    """Ray's per-bundle label selector for any node but ``nodes`` (``!id`` for one, ``!in(a, b)`` for several)."""
    value = f"!{nodes[0]}" if len(nodes) == 1 else f"!in({', '.join(nodes)})"
    return [{NODE_ID_LABEL: value} for _ in range(bundles)]


#: The trial's files to carry back from its directory on a node (study/mirror.py ``carried_files``).
Carry = Callable[[Path, str | None], tuple[dict[str, str], dict[str, Any]]]


def _run_there(
    context: StudyContext, params: dict[str, Any], carry: Carry, before: Callable[[], object], engine: Any = None
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """In the Ray task, on the other node: the trial, written under this node's temporary directory."""
    import ray

    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.trial.runner import run_trial, vllm_engine

    before()
    here = dataclasses.replace(context, study_dir=Path(tempfile.mkdtemp(prefix="servetune-elsewhere-")))
    gpu_ids = [str(g) for g in ray.get_gpu_ids()] if context.space.device == "gpu" else None
    spec = here.spec_for(params, gpu_ids, node_id=ray.get_runtime_context().get_node_id())
    result = run_trial(spec, lambda metrics: None, lambda: PromptFactory(load_tokenizer(spec.tokenizer)),
                       engine=engine or vllm_engine)  # fmt: skip
    inline, fetch = carry(spec.trial_dir, spec.node_id)
    return result.model_dump_json(), inline, fetch


def run_elsewhere(
    context: StudyContext,
    params: dict[str, Any],
    bundles: list[dict[str, float]],
    first: TrialResult,
    carry: Carry,
    before: Callable[[], object] = lambda: None,
    wait_s: float = ELSEWHERE_WAIT_S,
    engine: Any = None,
) -> tuple[TrialResult, dict[str, str] | None, dict[str, Any]]:
    """The trial once more on a node other than the one ``first`` failed on: its result recording both attempts and
    the files to carry (None: no other node held the bundle within ``wait_s``, and ``first`` stands with a note).
    ``carry`` picks the files there; ``before`` runs first in the task (the trial's priority); ``engine``: the
    trial runner's engine factory (None: vLLM)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    assert first.failure is not None and first.failure.node_id is not None
    others = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["NodeID"] != first.failure.node_id]
    if not others:  # a cluster of one node: nothing to wait for
        return _stands(first, "the cluster has no other node"), None, {}
    group = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=excluding([first.failure.node_id], len(bundles)))  # fmt: skip
    try:
        ready, _ = ray.wait([group.ready()], timeout=wait_s)
        if not ready:
            note = f"no node but {first.failure.node_id[:12]} freed the trial's devices within {wait_s:g} s"
            return _stands(first, note), None, {}
        held = bundles[0]
        task = ray.remote(_run_there).options(
            num_cpus=held.get("CPU", 0), num_gpus=held.get("GPU", 0), max_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        )  # fmt: skip
        text, inline, fetch = ray.get(task.remote(context, params, carry, before, engine))
    finally:
        remove_placement_group(group)
    return after_attempt(first, TrialResult.model_validate_json(text)), inline, fetch


def _stands(first: TrialResult, why: str) -> TrialResult:
    """The first attempt's result, its failure saying why it was not retried elsewhere."""
    assert first.failure is not None
    failure = first.failure.model_copy(update={"evidence": f"{first.failure.evidence[-200:]} (not retried: {why})"})
    return first.model_copy(update={"failure": failure})
