"""The prefetch's Ray tasks on a real local Ray (servetune/prefetch.py ``ray_runner``): one task per node that runs
trials, pinned to it, runs huggingface_hub against a hub on 127.0.0.1 and fills that node's cache."""

from __future__ import annotations

from servetune.config.space import SearchSpace
from servetune.prefetch import prefetch_point, prefetch_study
from tests.conftest import serve_fake
from tests.unit.test_prefetch import REPO, SECRET, FakeHub


def test_each_node_that_runs_trials_fetches_the_weights_in_a_ray_task_of_its_own(local_ray, tmp_path):
    import ray

    hub = FakeHub()
    cache = tmp_path / "cache"
    said: list[str] = []
    with serve_fake(hub) as url:
        space = SearchSpace.model_validate({
            "name": "s", "model": "org/m", "device": "cpu", "workload": "cpu-tiny",
            "env": {"HF_TOKEN": SECRET, "HF_ENDPOINT": url}, "engine_args": {"download_dir": str(cache)},
        })  # fmt: skip
        records = prefetch_study(space, {"org/m": "org/m"}, said.append)
        first = sorted(name for name, _ in hub.got)
        # verify / serve-check at --address: the point's engine through Serve, a task on each node that can host one
        (again,) = prefetch_point(
            "org/m", space.env, {"download_dir": str(cache)}, "cpu", said.append, through_ray=True
        )
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    (record,) = records
    assert record.node_id == node["NodeID"] and record.error is None, record
    expected = ["config.json", "model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json"]
    assert record.bytes == sum(len(REPO[n]) for n in expected)
    (snapshot,) = (cache / "models--org--m" / "snapshots").iterdir()
    assert sorted(p.name for p in snapshot.iterdir()) == expected
    # the driver read the index to plan; the node's task downloaded the four files once
    assert first == sorted([*expected, "model.safetensors.index.json"])
    assert "to 1 node(s)" in said[0] and "org/m on " in said[1] and SECRET not in " ".join(said)
    assert again.node_id == node["NodeID"] and again.error is None and again.bytes == record.bytes
    assert len(hub.got) == len(first) + 1  # the node's cache holds the weights: only the planning driver's index read
