"""What one trial needs of a single node, and ``max_concurrent: auto`` counted node by node (study/nodes.py)."""

import pytest

from servetune.config.space import SearchSpace
from servetune.study.nodes import placement_problem
from servetune.study.packing import resolve_max_concurrent
from servetune.trial.context import bundle, pinned_gpu_type

HEAD = {"CPU": 0.0, "node:__internal_head__": 1.0}
WORKER = {"CPU": 3.0, "GPU": 2.0}


@pytest.mark.parametrize(
    "bundle, nodes, expected",
    [
        ({"CPU": 1, "GPU": 2}, [HEAD, WORKER, WORKER], None),
        ({"CPU": 1, "GPU": 4}, [HEAD, WORKER, WORKER], "needs 4 GPUs on one node; the largest node has 2"),  # 4 in all, 2 a node
        ({"CPU": 4, "GPU": 1}, [HEAD, WORKER, WORKER], "needs 4 CPUs on one node; the largest node has 3"),
        ({"CPU": 3, "GPU": 2}, [{"CPU": 8.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 8.0}], "needs 3 CPUs, 2 GPUs on one node; no node has all of them"),
        ({"CPU": 1, "GPU": 8}, [HEAD], None),  # no node has GPUs yet: an autoscaler may add one
        ({"CPU": 1, "GPU": 8}, [], None),  # nodes unknown: not judged
        ({"CPU": 2}, [{"CPU": 2.0}, {"CPU": 2.0}], None),  # the CPU stand-in: cores
        ({"CPU": 4}, [{"CPU": 2.0}, {"CPU": 2.0}], "needs 4 CPUs on one node; the largest node has 2"),
    ],
)  # fmt: skip
def test_a_bundle_fits_inside_one_node_or_says_why_not(bundle, nodes, expected):
    assert placement_problem(bundle, nodes) == expected


def space(algorithm: str, sizes: list[int]) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "s", "model": "org/m", "workload": "chat", "device": "gpu", "hardware": {"devices_per_node": 8},
        "params": {"tensor_parallel_size": sizes}, "search": {"algorithm": algorithm},
    })  # fmt: skip


@pytest.mark.parametrize(
    "algorithm, sizes, nodes, expected",
    [
        ("tpe", [2], [3, 3], 2),         # two nodes of 3 GPUs run two 2-GPU trials, not three
        ("tpe", [2], [6], 3),
        ("grid", [2, 4], [3, 3], 5),     # twice the 2-GPU trials the nodes hold, plus one
        ("grid", [1, 2], [0, 2, 2], 9),  # a head without GPUs holds none
        ("tpe", [4], [2, 2], 1),         # none fits a node: one at a time (it is found INFEASIBLE)
        ("grid", [1], [0], 1),           # no GPUs in the cluster (yet): one
    ],
)  # fmt: skip
def test_auto_counts_trials_per_node(algorithm, sizes, nodes, expected):
    assert resolve_max_concurrent(space(algorithm, sizes), nodes) == expected


H100 = {"CPU": 3.0, "GPU": 2.0, "accelerator_type:H100": 1.0}
A100 = {"CPU": 8.0, "GPU": 8.0, "accelerator_type:A100": 1.0}


@pytest.mark.parametrize(
    "gpu, tp, nodes, expected",
    [
        ("H100-SXM", 2, [HEAD, H100, A100], None),
        ("H100-PCIe", 1, [HEAD, H100], None),  # Ray names both H100s "H100": the type pins, not the variant
        ("L40S", 1, [HEAD, H100, A100], "needs GPUs of type L40S; the cluster's nodes have A100, H100"),
        # 4 GPUs fit the A100 node, not an H100 one: the GPU count is judged on the nodes of the type
        ("H100-SXM", 4, [HEAD, H100, A100], "needs 4 GPUs on one H100 node; the largest H100 node has 2"),
        ("A100-80GB", 4, [HEAD, H100, A100], None),
        ("L40S", 1, [HEAD, WORKER, WORKER], None),  # nodes that declare no type (GPUs by hand): not pinned
    ],
)  # fmt: skip
def test_a_trial_is_pinned_to_its_gpu_type_where_the_cluster_declares_types(gpu, tp, nodes, expected):
    s = SearchSpace.model_validate({
        "name": "s", "model": "org/m", "workload": "chat", "device": "gpu", "hardware": {"devices_per_node": 8, "gpu": gpu},
        "params": {"tensor_parallel_size": [tp]},
    })  # fmt: skip
    params = {"tensor_parallel_size": tp}
    needed = bundle(s, params, pinned_gpu_type(s, nodes))
    assert placement_problem(needed, nodes) == expected
    pinned = [k for k in needed if k.startswith("accelerator_type:")]
    ray_type = {"H100-SXM": "H100", "H100-PCIe": "H100", "A100-80GB": "A100", "L40S": "L40S"}[gpu]
    assert pinned == ([] if nodes[1] is WORKER else [f"accelerator_type:{ray_type}"])
