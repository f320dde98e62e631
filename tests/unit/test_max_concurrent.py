"""``search.max_concurrent: auto``: as many trials as the cluster's GPUs run; one on CPU."""

import pytest

from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.study.packing import resolve_max_concurrent, trial_sizes


def space(algorithm="grid", device="gpu", max_concurrent=None, **params) -> SearchSpace:
    search = {"algorithm": algorithm} | ({} if max_concurrent is None else {"max_concurrent": max_concurrent})
    return SearchSpace.model_validate({
        "name": "s", "model": "org/m", "workload": "chat", "device": device, "hardware": {"devices_per_node": 8},
        "params": params or {"max_num_seqs": [64, 256]}, "search": search,
    })  # fmt: skip


def test_auto_is_the_default_and_a_number_is_kept():
    assert space().search.max_concurrent == "auto"
    assert resolve_max_concurrent(space(max_concurrent=3), cluster_devices=16) == 3


def test_the_sizes_a_space_s_trials_reserve():
    assert trial_sizes(space(tensor_parallel_size=[1, 2, 4], data_parallel_size=[1, 2])) == [1, 2, 4, 8]
    assert trial_sizes(space(tensor_parallel_size={"low": 2, "high": 4, "step": 2})) == [2, 4]
    assert trial_sizes(space()) == [1]


@pytest.mark.parametrize(
    "algorithm, params, gpus, expected",
    [
        ("grid", {"tensor_parallel_size": [1, 2, 4]}, 8, 17),   # 8 one-GPU trials fill it, twice, plus one
        ("grid", {"tensor_parallel_size": [2, 4]}, 8, 9),
        ("random", {"tensor_parallel_size": [4]}, 16, 9),
        ("tpe", {"tensor_parallel_size": [1, 2, 4]}, 8, 8),     # Bayesian: what can run at once, no more
        ("gp", {"tensor_parallel_size": [2, 4]}, 8, 4),
        ("tpe", {"tensor_parallel_size": [8]}, 4, 1),           # even where none fits now: one at a time
        ("tpe", {"tensor_parallel_size": [1]}, 0, 1),           # no GPUs in the cluster (yet)
    ],
)  # fmt: skip
def test_auto_fills_the_cluster_s_gpus(algorithm, params, gpus, expected):
    assert resolve_max_concurrent(space(algorithm, **params), cluster_devices=gpus) == expected


def test_auto_on_cpu_runs_one_trial_at_a_time():
    assert resolve_max_concurrent(space("grid", device="cpu"), cluster_devices=64) == 1


def test_a_bad_value_names_the_field(tmp_path):
    from servetune.config.loading import load_yaml_model

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nmodel: org/m\nworkload: chat\nsearch: {max_concurrent: lots}\n")
    with pytest.raises(UserError, match=r"s.yaml: search.max_concurrent"):
        load_yaml_model(path, SearchSpace)


def test_auto_keeps_the_grid_order_on_cpu_and_packs_on_gpu():
    from servetune.study.driver import proposals

    params = {"data_parallel_size": [2, 1], "max_num_seqs": [8, 32]}
    on_cpu = proposals(space("grid", device="cpu", **params), None)
    assert [p.get("data_parallel_size") for p in on_cpu] == [None, 2, 2, 1, 1]  # the baseline, then the grid's order
    on_gpu = proposals(space("grid", device="gpu", **params), None)
    assert [p.get("data_parallel_size") for p in on_gpu] == [None, 1, 1, 2, 2]  # smallest first
    assert [
        p.get("data_parallel_size") for p in proposals(space("grid", device="cpu", max_concurrent=2, **params), None)
    ] == [None, 1, 1, 2, 2]
