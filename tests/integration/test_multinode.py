"""A study across a real multi-node Ray cluster on this machine, with the fake engine for vLLM.

The cluster is a head (no GPU, no CPU for trials: the driver's node, as in cluster/) and two
worker nodes that each declare 2 GPUs, started as a user would (``ray start --head``, then
``ray start --address``), each with its own temp dir: the nodes' working directories are
their own, as on a cluster whose nodes share no disk (tests/ray_heads.py). ``servetune run``
joins it with ``--address``.

The module's tests share one cluster (a cluster start is half a minute of this host): the spread
test runs first, on the fresh cluster, and removes its trials' directories from the nodes; the
node-loss test, which kills a worker's raylet, runs last (pytest keeps the file's order).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from servetune.study.packing import Reservation, overlapping
from tests.processes import processes_mentioning
from tests.ray_heads import LocalCluster, lose_a_node_mid_trial, ray_cluster, trial_dirs_on, user_env

SPACE = """
name: nodes
model: {model}
device: gpu
workload: cpu-tiny
load: {{levels: [1, 2], requests_per_level: 6, warmup_requests: 1, startup_timeout_s: 60, min_throughput_gain: 0.0,
       capacity_levels: 0}}  # the ladder alone: these tests are about placement
slo: {{ttft_ms: {{p99: 1000}}}}
hardware: {{devices_per_node: 4, gpu: H100-SXM, cpus_per_trial: 1}}   # the space expects 4-GPU nodes; the cluster has 2
price_per_device_hour: 2.5
engine_args: {{max_model_len: 2048}}
params:
{params}
search: {{algorithm: grid, baseline: false}}
"""


def driver_state(stdout: str) -> dict:
    """The JSON line a driver below printed last. Ray can print a raylet's error to a driver's stdout after it
    (seen: "(raylet) Task ServeController.listen_for_change failed", with log_to_driver off), so that is skipped."""
    return json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))


def results(study_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in (study_dir / "trials").glob("*/result.json")}


def write_space(tmp_path: Path, model: Path, params: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(SPACE.format(model=model, params=params))
    return path


def run_argv(space: Path, cluster: LocalCluster, storage: Path, fake: Path, *extra: str) -> list[str]:
    """``servetune run`` joining the cluster, without doctor's checks: the cluster advertises GPUs this host has not."""
    return [sys.executable, "-m", "servetune", "run", str(space), "--address", cluster.address, "--storage", str(storage),
            "--python", str(fake), "--tracking-uri", f"sqlite:///{storage.parent / 'mlflow.db'}",
            "--no-checks", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A head and two worker nodes of 3 CPUs and 2 GPUs, for every test of the module (see above). The workers
    declare the GPU types Ray gives an H100 node and an A100 node, so a space's trials are pinned to their type
    (hardware.gpu: H100-SXM, or each trial's own with ``params: {gpu: [...]}``). Each worker has an address and a
    Serve proxy port of its own (127.0.0.2 and 127.0.0.3: ray_heads.ray_cluster ``own_addresses``)."""
    with ray_cluster(user_env(tmp_path_factory.mktemp("home")), own_addresses=True,
                     workers=[(3, 2, {"accelerator_type:H100": 1.0}), (3, 2, {"accelerator_type:A100": 1.0})]) as started:  # fmt: skip
        yield started


def trial_files_on(node_dir: Path) -> dict[str, set[str]]:
    """The files each trial wrote under the node's own temp dir, by trial id."""
    return {trial_id: {p.name for p in trial_dir.iterdir()} for trial_id, trial_dir in trial_dirs_on(node_dir).items()}


def test_trials_stay_inside_one_node_spread_over_both_and_come_back_to_the_driver(
    tmp_path, tiny_model, cluster, fake_python
):
    fake = fake_python
    # 1, 2 and 4 GPUs on each of two GPU types (the workers' H100 and A100): four trials that fit a node of their
    # type, two that none holds.
    space = write_space(tmp_path, tiny_model, "  gpu: [H100-SXM, A100-80GB]\n  tensor_parallel_size: [1, 2, 4]\n"
                                              "  env.SERVETUNE_FAKE_ITL_MS: [5]\n  env.SERVETUNE_FAKE_STARTUP_DELAY_S: [2]\n")  # fmt: skip
    space.write_text(space.read_text().replace("price_per_device_hour: 2.5\n", ""))  # each type at its listed price
    storage = tmp_path / "results"
    began = time.monotonic()
    done = subprocess.run(run_argv(space, cluster, storage, fake), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=cluster.head.env)  # fmt: skip
    wall_s = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    node_of_worker = {cluster.node_id_of(w): w for w in cluster.workers}
    on_node = {node_id: trial_files_on(w.temp_dir) for node_id, w in node_of_worker.items()}
    for worker in cluster.workers:  # gone from the nodes: what follows reads the driver's directory only
        for trial_dir in trial_dirs_on(worker.temp_dir).values():
            shutil.rmtree(trial_dir)
    study_dir = storage / "nodes"
    by_id = results(study_dir)
    assert len(by_id) == 6
    # Per node: two nodes of 2 GPUs hold four 1-GPU trials at once; grid search keeps twice that, plus one, in flight.
    assert "9 trial(s) at once (max_concurrent: auto)" in done.stderr, done.stderr
    unplaceable = [r for r in by_id.values() if r["devices"] == 4]
    assert len(unplaceable) == 2
    assert sorted(r["params"]["gpu"] for r in unplaceable) == ["A100-80GB", "H100-SXM"]
    for r in unplaceable:  # before anything started: no engine, no environment, no time
        ray_type = r["params"]["gpu"].split("-")[0]
        assert r["outcome"] == "INFEASIBLE", r
        assert r["reason"] == f"placement: needs 4 GPUs on one {ray_type} node; the largest {ray_type} node has 2"
        assert (
            r["startup_s"] is None
            and r["levels"] == []
            and not (study_dir / "trials" / r["trial_id"] / "engine.log").exists()
        )
    ran = [r for r in by_id.values() if r["devices"] < 4]
    assert sorted(r["devices"] for r in ran) == [1, 1, 2, 2]
    assert all(r["outcome"] == "COMPLETE" for r in ran), [r["reason"] for r in ran]
    # Each trial ran inside one worker node, with as many GPU ids as it reserved, among the node's two.
    nodes_used = {r["environment"]["ray_node_id"] for r in ran}
    assert nodes_used == set(node_of_worker), "the trials did not spread over both workers"
    # ... each on a node of its own GPU type, priced at that type's price, with a trial id of its own.
    node_of_type = {
        "H100-SXM": cluster.node_id_of(cluster.workers[0]),
        "A100-80GB": cluster.node_id_of(cluster.workers[1]),
    }
    from servetune.capacity.prices import load_price_table

    for r in ran:
        assert r["environment"]["ray_node_id"] == node_of_type[r["params"]["gpu"]], (r["params"], r["environment"])
        assert r["price"]["gpu"] == r["params"]["gpu"]
        assert r["price"]["usd_per_device_hour"] == load_price_table()[r["params"]["gpu"]].usd_per_device_hour
    for r in ran:
        gpus = r["environment"]["cuda_visible_devices"].split(",")
        assert len(set(gpus)) == r["devices"] and set(gpus) <= {"0", "1"}, r["environment"]
    # No GPU id shared by two trials that ran at the same time on one node.
    spans = [Reservation(_t(r["started_at"]), _t(r["finished_at"]), r["devices"], r["trial_id"]) for r in ran]
    for a, b in overlapping(spans):
        ra, rb = by_id[a.label], by_id[b.label]
        if ra["environment"]["ray_node_id"] == rb["environment"]["ray_node_id"]:
            shared = set(ra["environment"]["cuda_visible_devices"].split(",")) & set(
                rb["environment"]["cuda_visible_devices"].split(",")
            )
            assert not shared, (ra["trial_id"], rb["trial_id"], shared)
    # No shared disk: each trial wrote its files under its own node's temp dir, and only there ...
    for r in ran:
        local = on_node[r["environment"]["ray_node_id"]]
        assert {"result.json", "requests.jsonl", "engine.log"} <= local.get(r["trial_id"], set()), (
            r["trial_id"],
            local,
        )
        others = [ids for node_id, ids in on_node.items() if node_id != r["environment"]["ray_node_id"]]
        assert all(r["trial_id"] not in ids for ids in others)
    # ... and the driver's study directory holds what came back through Ray: result, records, engine log.
    for r in ran:
        trial_dir = study_dir / "trials" / r["trial_id"]
        rows = [json.loads(line) for line in (trial_dir / "requests.jsonl").read_text().splitlines()]
        assert {row["level"] for row in rows} == {0, 1} and len(rows) >= 12
        assert "Uvicorn" in (trial_dir / "engine.log").read_text() or (trial_dir / "engine.log").stat().st_size > 0
    assert (study_dir / "report" / "summary.md").exists()
    # The report's "Which GPU" table has a row per type measured: its best trial, of that type, at its listed price.
    summary = (study_dir / "report" / "summary.md").read_text()
    assert "## Which GPU" in summary, summary[-3000:]
    section = summary.split("## Which GPU", 1)[1].split("\n## ", 1)[0]
    gpu_rows = {cells[0]: cells for cells in ([c.strip() for c in line.strip().strip("|").split(" | ")]
                                              for line in section.splitlines()) if cells[0] in node_of_type}  # fmt: skip
    assert set(gpu_rows) == set(node_of_type), section
    for gpu, cells in gpu_rows.items():
        trial_id = cells[1].removeprefix("trial ")
        assert by_id[trial_id]["params"]["gpu"] == gpu, (gpu, cells)
        assert cells[6] == f"{load_price_table()[gpu].usd_per_device_hour:.2f}", (gpu, cells)
    assert processes_mentioning(fake) == []
    # The trials' directories on the nodes are gone: the report and the MLflow sync read the driver's directory only.
    fresh = tmp_path / "fresh.db"
    again = subprocess.run([sys.executable, "-m", "servetune", "report", str(study_dir), "--out", str(tmp_path / "again"),
                            "--log-to-mlflow", "--tracking-uri", f"sqlite:///{fresh}"],
                           capture_output=True, text=True, timeout=180, cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "summary.md").exists()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{fresh}")
    experiment = client.get_experiment_by_name("nodes")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.`servetune.role` != 'study'")
    assert {r.data.tags["servetune.trial_id"] for r in runs} == set(by_id)
    for run in runs:
        if by_id[run.data.tags["servetune.trial_id"]]["outcome"] == "COMPLETE":
            names = {a.path for a in client.list_artifacts(run.info.run_id)}
            assert {"requests.jsonl", "engine.log"} <= {Path(n).name for n in names} | _nested(
                client, run.info.run_id, names
            ), names
    print(f"study over 2 worker nodes: {wall_s:.0f} s")


def _nested(client, run_id: str, names: set[str]) -> set[str]:
    out = set()
    for name in names:
        out |= {Path(a.path).name for a in client.list_artifacts(run_id, name)}
    return out


def _t(stamp: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(stamp).timestamp()


LEDGER_DRIVER = """
import json, sys, time
import ray
from servetune.device_ledger import start_ledger

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
ledger = start_ledger("servetune-serve-devices-nodes-test", "gpu", 4, every_s=0.2)
take = lambda holder, devices, each: ray.get(ledger.take.remote(holder, devices, each))
back = lambda holder: ray.get(ledger.give_back.remote(holder))
take("x", 1, 1); take("tp2", 2, 2); take("y", 1, 1)  # x and y share one worker, tp2 has the other
back("tp2"); take("z", 1, 1); back("x")  # now one GPU is free on each worker
waiting = ledger.take.remote("late-tp2", 2, 2)  # 2 free in all, but no worker has 2
time.sleep(1.0)
waited = not ray.wait([waiting], timeout=0)[0]
back("y")
ray.get(waiting, timeout=30)
print(json.dumps({"waited": waited, **ray.get(ledger.state.remote())}))
"""


def test_the_serve_ledger_places_each_replica_inside_one_node_of_the_real_cluster(cluster):
    """Trials through Serve take their devices from the study's ledger (device_ledger.py), counted node by node
    from the real cluster's nodes: a TP2 replica waits while the 2 free GPUs are on different workers."""
    done = subprocess.run([sys.executable, "-c", LEDGER_DRIVER, cluster.address], capture_output=True, text=True,
                          env=cluster.head.env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    state = driver_state(done.stdout)
    workers = {node_id for node_id, gpus in state["nodes"].items() if gpus}
    assert len(workers) == 2 and sorted(state["nodes"].values()) == [0, 2, 2]  # the head lends none
    assert state["waited"], state
    placed = state["placed"]
    assert set(placed) == {"z", "late-tp2"} and set(placed["z"]) | set(placed["late-tp2"]) == workers
    assert list(placed["late-tp2"].values()) == [2]  # both its GPUs on one worker, the one y left


FETCH_DRIVER = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import ray
from servetune.config.space import SearchSpace
from servetune.trial.context import StudyContext, resolve_levels
from servetune.study.mirror import FETCH_KEY, FILES_KEY, ResultMirror, carried_files, final_report
from tests.builders import level, trial

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
root, worker = Path(sys.argv[2]), sys.argv[3]
node_dir = root / "node" / "abc123"  # the trial's directory on the worker
node_dir.mkdir(parents=True)
rows = "".join(json.dumps({"level": i % 2, "chunk_times": list(range(i % 97, i % 97 + 150))}) + "\\n" for i in range(3000))
(node_dir / "requests.jsonl").write_text(rows)
(node_dir / "engine.log").write_text("INFO started\\n")
inline, fetch = carried_files(node_dir, worker)  # as the trial calls it on its node
space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny"})
workload = space.resolved_workload(root)
context = StudyContext(space, workload, root / "driver", "m", resolve_levels(space, workload))
report = {**final_report(trial("abc123", {}, [level(1, 100, 50)]), context), FILES_KEY: json.dumps(inline),
          FETCH_KEY: json.dumps(fetch)}
size = len(json.dumps(report))
ResultMirror(context).on_trial_result(0, [], SimpleNamespace(trial_id="tune_0"), report)
kept = root / "driver" / "trials" / "abc123"
print(json.dumps({"inline": sorted(inline), "fetch": fetch, "report_bytes": size, "records": len(rows),
                  "same": (kept / "requests.jsonl").read_text() == rows, "log": (kept / "engine.log").read_text()}))
"""


def test_a_trials_large_records_come_back_from_its_node_as_a_file_not_through_tunes_results(cluster, tmp_path):
    """An offline-batch trial's per-request records run to hundreds of MB: past INLINE_LIMIT they stay out of the
    report, and the driver fetches them from the trial's node through Ray's object store (study/mirror.py)."""
    worker = cluster.node_id_of(cluster.workers[0])
    done = subprocess.run([sys.executable, "-c", FETCH_DRIVER, cluster.address, str(tmp_path), worker],
                          capture_output=True, text=True, env=cluster.head.env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    state = driver_state(done.stdout)
    assert state["inline"] == ["engine.log"] and state["fetch"]["node_id"] == worker
    assert list(state["fetch"]["files"]) == ["requests.jsonl"] and state["records"] > 1 << 20
    assert state["report_bytes"] < 100_000 and state["same"] and state["log"] == "INFO started\n"


def test_doctor_checks_every_node_and_fails_gpus_ray_advertises_that_nvml_cannot_see(cluster, tmp_path, tiny_model):
    """``servetune doctor`` on the local cluster: a task on each of its three nodes. The workers advertise 2 GPUs
    each and this host has none, so that check fails on both (what a node started with a wrong --num-gpus, or
    without its driver, would show); versions match the driver's on every node; the model is on every node. The
    space asks for L40S GPUs where the nodes are H100s: no trial could be placed, and doctor says so."""
    space = write_space(tmp_path, tiny_model, "  max_num_seqs: [4]\n")
    space.write_text(space.read_text().replace("gpu: H100-SXM", "gpu: L40S"))
    done = subprocess.run([sys.executable, "-m", "servetune", "doctor", str(space), "--address", cluster.address,
                           "--json", str(tmp_path / "doctor.json")], capture_output=True, text=True,
                          env=cluster.head.env, timeout=180)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    checks = json.loads((tmp_path / "doctor.json").read_text())
    workers = {cluster.node_id_of(w)[:12] for w in cluster.workers}
    gpus = [c for c in checks if c["name"] == "GPUs"]
    assert {c["node"] for c in gpus} == workers and all(c["status"] == "FAIL" for c in gpus), gpus
    assert all("Ray advertises 2 GPU(s), NVML sees none" in c["evidence"] for c in gpus)
    versions = [c for c in checks if c["name"] == "vllm version"]
    assert len(versions) == 3 and all(c["status"] == "PASS" for c in versions), versions  # head and both workers
    assert not [c for c in checks if c["name"] == "model"]  # the model folder is on every node
    (placement,) = [c for c in checks if c["name"] == "GPU type placement"]
    assert placement["status"] == "FAIL" and "L40S (Ray type L40S) is on no node" in placement["evidence"], placement
    assert "3 check(s) failed" in " ".join(done.stdout.split())
    # servetune run joining the cluster runs the same checks first, and starts no trial on a FAIL.
    argv = [a for a in run_argv(space, cluster, tmp_path / "results", tmp_path / "no-python") if a != "--no-checks"]
    refused = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=cluster.head.env, timeout=180)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "the cluster failed servetune doctor's checks (and 2 more): node" in refused.stderr
    assert "Ray advertises 2 GPU(s), NVML sees none" in refused.stderr
    assert not list((tmp_path / "results").glob("*/trials/*"))  # no trial ran


PLACED_DRIVER = """
import json, sys
import ray
from ray import serve
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from servetune.engine.server import free_port
from servetune.serve.cluster import ServeCluster
from servetune.device_ledger import devices_held, report_placement, start_ledger

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
ledger = start_ledger("servetune-serve-devices-placed-test", "gpu", 4, every_s=0.2)
workers = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]


@ray.remote(num_cpus=0)
class SomeoneElse:  # what the ledger does not know of: another job's actor holding GPUs
    def ready(self):
        return True


def someone_else(node, gpus):
    other = SomeoneElse.options(num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
    ray.get(other.ready.remote())
    return other


# A TP2 replica as Ray Serve LLM deploys one: a placement group of one bundle per rank, the actor in the first.
@serve.deployment(ray_actor_options={"num_cpus": 0}, placement_group_bundles=[{"GPU": 1}, {"GPU": 1}],
                  placement_group_strategy="PACK")
class LLMServerStandIn:
    def __call__(self, request):
        return "ok"


def deploy(app, holder):
    cluster, told = ServeCluster(sys.argv[1], {}), []
    poll = lambda: told.append(report_placement(cluster.replica_devices(app, 2)[1]))
    cluster.run_app(app, LLMServerStandIn.bind(), 120, route_prefix="/" + app, on_poll=poll)
    held = ray.get(ledger.state.remote())["placed"][holder]
    table = ray.util.placement_group_table().values()
    (group,) = [g for g in table if g["name"].startswith("SERVE_REPLICA::" + app + "#") and g["state"] == "CREATED"]
    bundles = sorted(group["bundles_to_node_id"].values())
    cluster.delete(app)
    return {"told": [t for t in told if t], "held": held, "bundles": bundles}


# Another job takes the planned worker's GPUs: Ray puts the replica on the other worker.
with devices_held("servetune-serve-devices-placed-test", "tp2", 2, 2):
    (planned,) = ray.get(ledger.state.remote())["placed"]["tp2"]
    others = [someone_else(planned, 2)]
    moved = dict(deploy("placed", "tp2"), planned=planned)
ray.kill(others.pop())
# Another job holds one GPU of each worker: PACK stretches the replica's two bundles over both.
with devices_held("servetune-serve-devices-placed-test", "tp2-stretched", 2, 2):
    planned = ray.get(ledger.state.remote())["placed"]["tp2-stretched"]
    others = [someone_else(node, 1) for node in workers]
    stretched = dict(deploy("stretched", "tp2-stretched"), planned=planned)
after = ray.get(ledger.state.remote())["placed"]
serve.shutdown()  # the module's cluster goes on without Serve's controller and proxy
for other in others:
    ray.kill(other)
print(json.dumps({"moved": moved, "stretched": stretched, "after": after}))
"""


def test_where_ray_placed_a_serve_replicas_devices_is_read_back_into_the_ledger_in_place_of_its_plan(cluster):
    """The ledger plans a replica on the fullest node that fits; Ray places it by what it sees. While the
    deployment starts, its placement group's bundles are read node by node from Ray and replace the plan
    (device_ledger.py placed_at): a replica Ray put on another node than planned (a job the ledger does not know
    of took the planned one's GPUs) is held there, and one that PACK stretched over both nodes (that job holds
    one GPU of each) is held on both, one device each."""
    done = subprocess.run([sys.executable, "-c", PLACED_DRIVER, cluster.address], capture_output=True, text=True,
                          env=cluster.head.env, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    state = driver_state(done.stdout)
    workers = {cluster.node_id_of(w) for w in cluster.workers}
    moved, stretched = state["moved"], state["stretched"]
    assert moved["planned"] in workers, state
    (other,) = workers - {moved["planned"]}
    assert moved["bundles"] == [other, other], state  # Ray put both bundles on the worker not planned
    assert moved["held"] == {other: 2} and moved["told"][-1] == {other: 2}, state
    assert sum(stretched["planned"].values()) == 2 and len(stretched["planned"]) == 1, state  # planned on one node
    assert sorted(stretched["bundles"]) == sorted(workers), state  # Ray put one bundle on each worker
    assert stretched["held"] == dict.fromkeys(workers, 1) and stretched["told"][-1] == stretched["held"], state
    assert state["after"] == {}, state  # given back on leaving


PROXY_DRIVER = """
import json, sys, urllib.request
import ray
from ray import serve
from servetune.engine.frontend import busiest
from servetune.engine.server import free_port
from servetune.serve.cluster import ServeCluster
from servetune.serve.frontend import read_front_end
from servetune.serve.proxies import pick_proxy

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
serve.start(http_options={"host": "0.0.0.0", "port": free_port()})  # as servetune run starts Serve on a cluster


@serve.deployment(ray_actor_options={"num_cpus": 0, "resources": {"accelerator_type:A100": 0.01}})
class LLMServerStandIn:  # its replica on the A100 worker; it answers with its node's id
    def __call__(self, request):
        return ray.get_runtime_context().get_node_id()


cluster = ServeCluster.attached()
cluster.run_app("proxied", LLMServerStandIn.bind(), 120, route_prefix="/proxied")
replicas, _ = cluster.replica_devices("proxied", 1)
choice = pick_proxy(replicas, cluster.url, "/proxied")
before = read_front_end("proxied", choice.node_id)  # as a Serve trial reads its front end around a level
for _ in range(5):
    with urllib.request.urlopen(choice.url + "/proxied", timeout=30) as resp:
        answered = resp.read().decode()
after = read_front_end("proxied", choice.node_id)
front_end = None if after is None else {"roles": {str(k): role for k, role in after.roles.items()},
                                        "clocked": sorted(map(str, after.clocks)), "busiest": busiest(before, after)}
cluster.delete("proxied")
serve.shutdown()  # the module's cluster goes on without Serve's controller and proxies
print(json.dumps({"replicas": replicas, "choice": choice.record(), "answered": answered, "head_url": cluster.url,
                  "front_end": front_end, "driver_node": ray.get_runtime_context().get_node_id()}))
"""


def test_a_serve_trials_client_sends_to_the_proxy_on_its_replicas_node(cluster):
    """Serve runs a proxy on each node holding a replica; a Serve trial's client picks the one on its replica's node
    (serve/proxies.py pick_proxy, as ServeEngine calls it), here the A100 worker at 127.0.0.3 on its own proxy port,
    and that node's proxy is the one that served the request (its log, in the node's own temp dir, says so). The
    front end's CPU is read on that node, where the proxy and the replica run."""
    done = subprocess.run([sys.executable, "-c", PROXY_DRIVER, cluster.address], capture_output=True, text=True,
                          env=cluster.head.env, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    state = driver_state(done.stdout)
    a100 = cluster.workers[1]
    node = cluster.node_id_of(a100)
    assert state["replicas"] == {node: 1}, state
    assert state["choice"] == {"serve_proxy_url": f"http://{a100.ip}:{a100.proxy_port}", "serve_proxy_node_id": node,
                               "serve_proxy": "replica's node", "serve_proxy_why": "1 replica(s) there"}, state  # fmt: skip
    assert a100.ip == "127.0.0.3" and state["head_url"] != state["choice"]["serve_proxy_url"]
    assert state["answered"] == node
    logs = [p.read_text() for p in a100.temp_dir.glob("session_2*/logs/serve/proxy_*.log")]
    assert any("GET /proxied 200" in text for text in logs), logs
    # The trial's front end (serve/frontend.py), the proxy it sent to and the replica, both on the A100 worker, not
    # the driver's node: read there by a task pinned to it, keyed by that node's pids, at its own clock.
    front_end = state["front_end"]
    assert front_end is not None and state["driver_node"] != node, state
    assert sorted(front_end["roles"].values()) == ["proxy", "replica"], front_end
    assert all(key.startswith(f"{node}:") for key in front_end["roles"]) and front_end["clocked"] == sorted(
        front_end["roles"]), front_end  # fmt: skip
    share, role = front_end["busiest"]
    assert share > 0 and role in ("proxy", "replica"), front_end


def test_a_node_lost_under_a_trial_fails_that_trial_and_the_study_goes_on(tmp_path, tiny_model, cluster, fake_python):
    """Runs last: it kills one of the module cluster's workers."""
    fake = fake_python
    # Three 2-GPU trials: one per node at a time, so the third waits and then runs on the node that is
    # left. Engines take 3 s to start after their imports, as vLLM takes its time: the node goes within a poll (0.2 s)
    # of the first engine's log appearing, before that engine logged a line (0.23 s after it, at a load of 12), so
    # its trial is still starting (the reason below says the node died while it ran). Each start is on the study's
    # path three times (both nodes' first, the survivor's second, --resume's), hence not the 6 s it was.
    space = write_space(tmp_path, tiny_model, "  tensor_parallel_size: [2]\n  env.SERVETUNE_FAKE_ITL_MS: [5, 6, 7]\n"
                                              "  env.SERVETUNE_FAKE_STARTUP_DELAY_S: [3]\n  env.SERVETUNE_FAKE_CHILD: [1]\n")  # fmt: skip
    # no GPU type: the trials run on either worker (the H100 one and the A100 one)
    space.write_text(space.read_text().replace("gpu: H100-SXM, ", ""))
    storage = tmp_path / "results"
    study_dir = storage / "nodes"
    argv = run_argv(space, cluster, storage, fake)
    before: dict = {}

    def look() -> None:
        before["engines"] = processes_mentioning(fake)
        before["finished"] = results(study_dir)  # none yet, or the other node's first

    # The first trial whose engine started (its log exists on the node) loses its node.
    lost_node = lose_a_node_mid_trial(cluster, argv, tmp_path, lambda d: (d / "engine.log").exists(),
                                      find_s=120, finish_s=300, before_kill=look)  # fmt: skip
    victim, trial_id, output = lost_node.victim, lost_node.trial_id, lost_node.output
    engines_before, finished_before = before["engines"], before["finished"]
    assert lost_node.returncode == 0, output[-4000:]
    by_id = results(study_dir)
    assert len(by_id) == 3, output[-3000:]
    lost = by_id[trial_id]
    assert lost["outcome"] == "FAILED" and lost["lost"], lost
    assert lost["reason"].startswith("the trial's node died while it ran"), lost["reason"]
    others = [r for t, r in by_id.items() if t != trial_id]
    assert all(r["outcome"] == "COMPLETE" for r in others), [r["reason"] for r in others]
    survivor = next(cluster.node_id_of(w) for w in cluster.workers if w is not victim)
    assert {r["environment"]["ray_node_id"] for r in others if r["trial_id"] not in finished_before} == {survivor}
    assert all(t in by_id and by_id[t] == r for t, r in finished_before.items())  # no finished result lost
    # Nothing of the lost trial's engine (a server and its child) is left, on any node.
    deadline = time.monotonic() + 30
    while set(processes_mentioning(fake)) & set(engines_before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning(fake) == []
    assert "FAILED" in output and (study_dir / "report" / "summary.md").exists()

    # --resume runs only what never finished: the lost trial, on the node that is left.
    stamps = {t: (study_dir / "trials" / t / "result.json").stat().st_mtime_ns for t in by_id if t != trial_id}
    resumed = subprocess.run(
        [*argv, "--resume"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=cluster.head.env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 trial(s) to run" in resumed.stderr, resumed.stderr
    final = results(study_dir)
    assert final[trial_id]["outcome"] == "COMPLETE" and not final[trial_id]["lost"]
    assert {t: (study_dir / "trials" / t / "result.json").stat().st_mtime_ns for t in stamps} == stamps
    assert processes_mentioning(fake) == []
    # MLflow holds one run per trial: the lost trial's FAILED run gave way to the run that completed it.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{storage.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("nodes").experiment_id], "tags.`servetune.role` = 'trial'")
    assert sorted(r.data.tags["servetune.trial_id"] for r in runs) == sorted(final)
    assert {r.data.tags["servetune.trial_id"]: r.data.tags["servetune.outcome"] for r in runs}[trial_id] == "COMPLETE"
