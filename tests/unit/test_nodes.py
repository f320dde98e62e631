"""What one trial needs of a single node, and ``max_concurrent: auto`` counted node by node (study/nodes.py)."""

import pytest

from servetune.config.space import SearchSpace
from servetune.study.nodes import placement_problem
from servetune.study.packing import resolve_max_concurrent

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
