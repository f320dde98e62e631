"""A study on real vLLM (CPU build) across two Ray worker nodes, one of which is lost mid-trial.

Two worker nodes declare 2 CPUs each (this machine has 2 real cores: the declared ones are what
Ray places by); each trial reserves 2 cores (tensor parallel 2), so one trial runs per node.
Two trials start at once, one on each node. When the first engine answers on one node, that
node's raylet is killed: its trial is FAILED for its node, the other COMPLETEs on the node that is
left, the report is written, and no vLLM process is left. (A third trial waiting for a node and then
running on the one left, and --resume after the loss, are tested on the same kind of cluster with the
fake engine: tests/integration/test_multinode.py; a third TP=2 engine start here cost about a minute.)
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.e2e.needs import need
from tests.integration.test_multinode import results
from tests.processes import processes_mentioning
from tests.ray_heads import lose_a_node_mid_trial, ray_cluster, user_env

pytestmark = pytest.mark.e2e
need("vllm")

SPACE = """
name: nodes-e2e
model: tiny
device: cpu
workload: cpu-tiny
load: {{levels: [2], requests_per_level: 8, warmup_requests: 1, startup_timeout_s: 300, request_timeout_s: 120}}
slo: {{ttft_ms: {{p99: 20000}}}}
hardware: {{devices_per_node: 2}}
engine_args: {{enforce_eager: true, max_model_len: 512, dtype: float32, tensor_parallel_size: 2}}
env: {{VLLM_CPU_KVCACHE_SPACE: 1}}
price_per_device_hour: 0.05
params:  # two trials at once, one per node
  max_num_seqs: [2, 4]
search: {{algorithm: grid, baseline: false, max_concurrent: 2}}
"""


def test_a_cpu_tiny_study_over_two_nodes_survives_losing_one(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE.format())
    storage = tmp_path / "results"
    study_dir = storage / "nodes-e2e"
    began = time.monotonic()
    with ray_cluster(user_env(tmp_path / "home"), workers=[(2, 0), (2, 0)]) as cluster:
        argv = [sys.executable, "-m", "servetune", "run", str(tmp_path / "space.yaml"), "--address", cluster.address,
                "--storage", str(storage), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]  # fmt: skip
        # The first trial measuring (its requests being recorded on the node) loses its node. Before that, two
        # TP=2 engines start at once on two cores (the whole test took 235 s in CI): wait for it generously.
        lost_node = lose_a_node_mid_trial(cluster, argv, tmp_path, lambda d: (d / "requests.jsonl").exists(),
                                          find_s=480, finish_s=600)  # fmt: skip
        trial_id, output = lost_node.trial_id, lost_node.output
        assert lost_node.returncode == 0, output[-4000:]
        survivor = next(cluster.node_id_of(w) for w in cluster.workers if w is not lost_node.victim)
    by_id = results(study_dir)
    assert len(by_id) == 2, output[-3000:]
    lost = by_id[trial_id]
    assert lost["outcome"] == "FAILED" and lost["lost"] and lost["reason"].startswith("the trial's node died"), lost[
        "reason"
    ]
    (other,) = [r for t, r in by_id.items() if t != trial_id]
    assert other["outcome"] == "COMPLETE" and other["levels"], (other["outcome"], other["reason"])
    assert other["environment"]["ray_node_id"] == survivor, other["environment"]
    # the per-request records came back from the node that ran it
    rows = (study_dir / "trials" / other["trial_id"] / "requests.jsonl").read_text().splitlines()
    assert len(rows) >= 8 and json.loads(rows[0])["level"] == 0
    assert (study_dir / "report" / "summary.md").exists()
    deadline = time.monotonic() + 30
    while processes_mentioning("vllm.entrypoints.cli.main", str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_mentioning("vllm.entrypoints.cli.main", str(tmp_path)) == []
    assert processes_mentioning(str(study_dir), "vllm") == []
    print(f"e2e over two nodes: {time.monotonic() - began:.0f} s")
