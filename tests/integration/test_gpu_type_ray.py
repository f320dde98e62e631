"""A study's point started again on a mixed GPU cluster stays on the type it was measured on (serve-check, verify):
a real multi-node Ray on this machine whose two worker nodes declare the GPU types Ray gives an H100 node and an
A100 node (tests/ray_heads.py, as test_multinode.py starts it), no vLLM. The pin is read from the live nodes, a
type the cluster lacks is refused naming the types it has, the weights are fetched (from a hub on 127.0.0.1) only on
the node of the pinned type, and the placement groups Ray Serve LLM asks for from the deployed ``LLMConfig`` land
only on nodes of its type."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.conftest import serve_fake
from tests.ray_heads import LocalCluster, ray_cluster, user_env
from tests.unit.test_prefetch import FakeHub

# A driver of its own on the cluster (this process keeps no Ray connection for the tests after it).
DRIVER = r"""
import json, sys
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from servetune.errors import UserError
from servetune.prefetch import prefetch_point
from servetune.serve.cluster import ServeCluster
from servetune.serve.plan import pin_gpu_type

address, hub, cache, asks = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
nodes = ServeCluster(address, {}).nodes()  # as serve-check and verify read them once joined
out = {"pinned": pin_gpu_type("H100-SXM", nodes, "t1", "the cluster")}
try:
    pin_gpu_type("L4", nodes, "t2", "the cluster")
except UserError as exc:
    out["refused"] = str(exc)
records = prefetch_point("org/m", {"HF_ENDPOINT": hub}, {"download_dir": cache}, "gpu", lambda line: None,
                         through_ray=True, gpu_type=out["pinned"])
out["fetched"] = [[r.node_id, r.error, r.bytes] for r in records]
out["placed"] = {}
for gpu_type, (bundles, strategy) in asks.items():
    group = placement_group(bundles, strategy=strategy)
    ray.get(group.ready(), timeout=60)
    out["placed"][gpu_type] = sorted(set(placement_group_table(group)["bundles_to_node_id"].values()))
    remove_placement_group(group)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A head and two worker nodes of 2 CPUs and 2 GPUs each, one of Ray's type H100, the other A100."""
    with ray_cluster(user_env(tmp_path_factory.mktemp("home")),
                     workers=[(2, 2, {"accelerator_type:H100": 1.0}), (2, 2, {"accelerator_type:A100": 1.0})]) as started:  # fmt: skip
        yield started


def test_a_point_is_pinned_fetched_and_placed_only_on_nodes_of_its_measured_gpu_type(cluster, tmp_path):
    from ray.serve.llm import LLMConfig

    from servetune.report.points import ReportPoint
    from servetune.serve.plan import llm_config

    point = ReportPoint(trial_id="t1", level={"concurrency": 8.0}, engine_args={"tensor_parallel_size": 2},
                        model="/models/m", device="gpu")  # fmt: skip
    asks = {}
    for gpu_type in ("H100", "A100"):  # what Ray Serve LLM asks Ray for, a replica of TP 2 pinned to each type
        engine = LLMConfig(**llm_config(point, 1, env={}, accelerator_type=gpu_type)).get_engine_config()
        asks[gpu_type] = [engine.placement_bundles, engine.placement_strategy]
    hub, cache = FakeHub(), tmp_path / "cache"
    with serve_fake(hub) as url:
        done = subprocess.run([sys.executable, "-c", DRIVER, cluster.address, url, str(cache), json.dumps(asks)],
                              capture_output=True, text=True, env=cluster.head.env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    h100, a100 = (cluster.node_id_of(worker) for worker in cluster.workers)
    assert out["pinned"] == "H100"
    assert out["refused"] == ("trial t2 was measured on L4 GPUs (Ray accelerator_type L4); the cluster has GPUs of "
                              "type A100, H100 only: nothing was deployed")  # fmt: skip
    # fetched on the H100 node alone: not on the A100 node, nor on the head (no GPU)
    ((node, error, size),) = out["fetched"]
    assert node == h100 and error is None and size > 0, out["fetched"]
    # each replica's GPUs on one node of its type
    assert out["placed"] == {"H100": [h100], "A100": [a100]}
