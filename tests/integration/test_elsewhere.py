"""A trial retried on another node (study/elsewhere.py) on a real local Ray: the placement group that avoids the node
it failed on, the trial run there as a Ray task, both attempts recorded; and no other node, the first failure kept.
The engine is a stand-in whose start fails as a GPU with an ECC error fails: no vLLM starts."""

from __future__ import annotations

import sys
from pathlib import Path

from servetune.config.space import SearchSpace
from servetune.errors import EngineStartError
from servetune.results import TrialResult
from servetune.study.elsewhere import run_elsewhere
from servetune.study.mirror import carried_files
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.failures import classify

ECC = "torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered"
OTHER_NODE = "f" * 56  # a node id no node of this Ray has


class EccEngine:
    """Every start fails with the node's fault."""

    def __call__(self, spec, trial_dir: Path) -> EccEngine:
        return self

    def __enter__(self) -> EccEngine:
        raise EngineStartError("vLLM exited with code 1 during startup", f"INFO loading\n{ECC}\n")

    def __exit__(self, *exc: object) -> None:
        pass


def context(tmp_path: Path, model: Path) -> StudyContext:
    space = SearchSpace.model_validate({
        "name": "s", "model": str(model), "device": "cpu", "workload": "cpu-tiny", "slo": {"ttft_ms": {"p99": 400}},
        "load": {"levels": [1], "requests_per_level": 4, "startup_timeout_s": 30},
    })  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, str(model), resolve_levels(space, workload))


def first_attempt(node_id: str) -> TrialResult:
    result = TrialResult(schema_version=6, trial_id="t", study="s", params={}, engine_args={}, env={}, model="m",
                         device="cpu", devices=1, price_per_device_hour=1.0, slo=[], outcome="FAILED", reason="r")  # fmt: skip
    result.failure = classify("vLLM exited with code 1 during startup", ECC).model_copy(update={"node_id": node_id})
    return result


def test_the_retry_runs_on_a_node_the_first_attempt_did_not_and_records_both(module_ray, tmp_path, tiny_model):
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the stand-in engine travels to the task
    here = ray.get_runtime_context().get_node_id()
    result, carried, _ = run_elsewhere(context(tmp_path, tiny_model), {}, [{"CPU": 1.0}], first_attempt(OTHER_NODE),
                                       carried_files, wait_s=60, engine=EccEngine())  # fmt: skip
    assert carried is not None  # it ran: its files came back (its engine log)
    assert [(f.cause, f.node_id) for f in result.retried] == [("gpu_fault", OTHER_NODE)]
    assert result.outcome == "FAILED" and result.failure.cause == "gpu_fault" and result.failure.node_id == here


def test_with_no_other_node_the_first_failure_stands_and_says_so(module_ray, tmp_path, tiny_model):
    import ray
    from ray.util import placement_group_table

    here = ray.get_runtime_context().get_node_id()
    first = first_attempt(here)
    result, carried, _ = run_elsewhere(
        context(tmp_path, tiny_model), {}, [{"CPU": 1.0}], first, carried_files, wait_s=3
    )
    assert carried is None and not result.retried and result.failure.node_id == here
    assert (
        result.failure.evidence.startswith(ECC)
        and "not retried: the cluster has no other node" in result.failure.evidence
    )
    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())  # none left waiting


def test_a_node_that_never_frees_the_devices_is_waited_for_a_bounded_time(
    module_ray, tmp_path, tiny_model, monkeypatch
):
    import ray

    here = ray.get_runtime_context().get_node_id()
    nodes = ray.nodes()
    monkeypatch.setattr(ray, "nodes", lambda: [*nodes, {"NodeID": OTHER_NODE, "Alive": True}])  # one that holds none
    result, carried, _ = run_elsewhere(context(tmp_path, tiny_model), {}, [{"CPU": 1.0}], first_attempt(here),
                                       carried_files, wait_s=3)  # fmt: skip
    assert carried is None and not result.retried
    assert f"not retried: no node but {here[:12]} freed the trial's devices within 3 s" in result.failure.evidence
