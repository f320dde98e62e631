"""A study's point started again on a mixed GPU cluster stays on the type it was measured on (serve-check, verify):
a real multi-node Ray on this machine whose two worker nodes declare the GPU types Ray gives an H100 node and an
A100 node (tests/ray_heads.py, as test_multinode.py starts it), no vLLM. The pin is read from the live nodes, a
type the cluster lacks is refused naming the types it has, the weights are fetched (from a hub on 127.0.0.1) only on
the node of the pinned type, and the placement groups Ray Serve LLM asks for from the deployed ``LLMConfig`` land
only on nodes of its type. ``servetune serve-check`` refused there (a type the cluster lacks, too few GPUs of the type)
leaves no Serve on the cluster, and the Serve and application of someone else as they were."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.builders import level, study_info, trial, write_study
from tests.conftest import serve_fake
from tests.ray_heads import LocalCluster, last_json, ray_cluster, user_env
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
    out = last_json(done.stdout)
    h100, a100 = (cluster.node_id_of(worker) for worker in cluster.workers)
    assert out["pinned"] == "H100"
    assert out["refused"] == ("trial t2 was measured on L4 GPUs (Ray accelerator_type L4); the cluster has GPUs of "
                              "type A100, H100 only: nothing was deployed")  # fmt: skip
    # fetched on the H100 node alone: not on the A100 node, nor on the head (no GPU)
    ((node, error, size),) = out["fetched"]
    assert node == h100 and error is None and size > 0, out["fetched"]
    # each replica's GPUs on one node of its type
    assert out["placed"] == {"H100": [h100], "A100": [a100]}


# What a driver sees of Serve on the cluster: the Serve actors alive (controller, proxies, replicas) and the
# applications. One driver does what comes before the look where a step asks (each driver process costs an import of
# Ray and a connection): "twice" joins and leaves twice first as verify does for the runner-up (leaving disconnects
# the driver; it joins again), "theirs" starts someone else's Serve with an application of theirs first; "shutdown"
# then shuts Serve down (the test's own, at the end).
SERVE_LEFT = r"""
import json, sys
import ray
from ray import serve
from ray.util.state import list_actors
from servetune.engine.server import free_port
from servetune.serve.cluster import ServeCluster

address, step = sys.argv[1], sys.argv[2:]
if step == ["twice"]:
    for _ in range(2):
        with ServeCluster(address, {}) as cluster:
            print("nodes", len(cluster.nodes()), flush=True)
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
if step == ["theirs"]:

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Theirs:
        def __call__(self, request) -> str:
            return "theirs"

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    serve.run(Theirs.bind(), name="theirs", route_prefix="/theirs")
try:
    # address named: left to find one, the state API refuses on a host with another Ray (a second test process's)
    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
    actors = sorted(a.class_name for a in alive if a.class_name.startswith(("Serve", "Proxy")))
    print(json.dumps({"actors": actors,
                      "apps": {name: str(app.status) for name, app in serve.status().applications.items()}}))
finally:
    if step == ["shutdown"]:
        serve.shutdown()
"""


def measured_on(root, model, gpu: str):
    """A one-trial study (t1, TP 1) measured on ``gpu``, of the tiny model (serve-check loads its tokenizer)."""
    t = trial("t1", {"max_num_seqs": 8}, [level(8, 400, 300)]).model_copy(update={"model": model})
    write_study(root, study_info(model=model), [t])
    (root / "space.yaml").write_text(
        f"name: demo\nmodel: {model}\ndevice: gpu\nworkload: chat\nhardware: {{gpu: {gpu}}}\n"
        "load: {levels: [8], requests_per_level: 16, startup_timeout_s: 60}\nslo: {ttft_ms: {p99: 2000}}\n"
    )  # fmt: skip
    return root


def test_a_serve_check_refused_on_a_joined_cluster_leaves_no_serve_there_and_someone_elses_as_it_was(
    cluster, tmp_path, tiny_model
):  # fmt: skip
    def driver(script: str, *argv: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-c", script, cluster.address, *argv], capture_output=True, text=True,
                              env=cluster.head.env, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return done

    def serve_check(study, *argv: str) -> str:
        done = subprocess.run([sys.executable, "-m", "servetune", "serve-check", str(study), "--pick", "t1",
                               "--address", cluster.address, "--no-prefetch", *argv], capture_output=True, text=True,
                              env=cluster.head.env, cwd=tmp_path, timeout=300)  # fmt: skip
        assert done.returncode == 2, done.stderr[-3000:]
        return done.stderr.strip().splitlines()[-1]

    def left(step: str | None = None) -> tuple[dict, list[str]]:
        done = driver(SERVE_LEFT, *([step] if step else []))
        return last_json(done.stdout), [line for line in done.stdout.splitlines() if line.startswith("nodes")]

    l4 = measured_on(tmp_path / "l4", str(tiny_model), "L4")
    h100 = measured_on(tmp_path / "h100", str(tiny_model), "H100-SXM")
    # No Serve on the cluster: each refusal once joined leaves none (nor does a driver joining and leaving twice).
    assert serve_check(l4, "--replicas", "1") == (
        "servetune serve-check: error: trial t1 was measured on L4 GPUs (Ray accelerator_type L4); the Ray cluster at "
        f"{cluster.address} has GPUs of type A100, H100 only: nothing was deployed"
    )
    assert serve_check(h100, "--replicas", "3") == (  # the H100 node has 2 GPUs
        "servetune serve-check: error: --replicas 3: 3 replicas of 1 GPU (TP x PP x PCP) need 3 GPUs; the Ray cluster at "
        f"{cluster.address} (its H100 nodes) has 2: nothing was deployed"
    )
    nothing, joined = left("twice")
    assert nothing == {"actors": [], "apps": {}}, nothing
    assert joined == ["nodes 3"] * 2
    # Someone's Serve and application: refused, even with --replace of an application of that name, both as they were.
    before, _ = left("theirs")
    assert list(before["apps"]) == ["theirs"] and before["apps"]["theirs"].endswith("RUNNING"), before
    assert "ServeController" in before["actors"], before
    try:
        serve_check(l4, "--replicas", "1", "--app-name", "theirs", "--replace")
        serve_check(h100, "--replicas", "3")
    finally:
        after, _ = left("shutdown")  # what is left, then the test's Serve shut down
    assert after == before
