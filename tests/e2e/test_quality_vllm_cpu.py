"""Quality as a constraint on the real vLLM CPU build: float32 against bfloat16 on the tiny model.

The reference (float32, max_num_seqs 4) runs first. A second float32 trial (max_num_seqs 16)
must agree with it exactly; the bfloat16 trial diverges for real (its greedy tokens and its
log-probabilities of the reference's tokens differ), breaks a bound tighter than that divergence,
and is kept out of the recommendation.
"""

import json
import subprocess
import sys

import pytest

from tests.processes import processes_mentioning

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="the e2e tests need vLLM (the CPU build: pip install servetune[cpu])")

SPACE = """
name: quality
model: tiny
device: cpu
workload: cpu-tiny
load: {levels: [2], requests_per_level: 16, startup_timeout_s: 300}
slo: {ttft_ms: {p99: 5000}}
hardware: {devices_per_node: 2}
engine_args: {enforce_eager: true, max_model_len: 512}
env: {VLLM_CPU_KVCACHE_SPACE: 1}
params:
  dtype: [float32, bfloat16]
  max_num_seqs: [4, 16]
constraints:
  - dtype == 'float32' or max_num_seqs == 4
search: {algorithm: grid, baseline: false}
quality:
  suites: [agreement, arithmetic, recall]
  prompts: 16
  reference: {dtype: float32, max_num_seqs: 4}
  max_drop: {agreement: 0.01}
"""


def servetune(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True, timeout=900, cwd=cwd)


def test_lower_precision_is_measured_against_the_reference_and_kept_out(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE)
    done = servetune("run", tmp_path / "space.yaml", "--storage", tmp_path / "results", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study_dir = tmp_path / "results" / "quality"
    results = {}
    for path in study_dir.glob("trials/*/result.json"):
        result = json.loads(path.read_text())
        results[(result["params"]["dtype"], result["params"]["max_num_seqs"])] = result
    assert sorted(results) == [("bfloat16", 4), ("float32", 4), ("float32", 16)]
    ref, same, bf16 = results[("float32", 4)], results[("float32", 16)], results[("bfloat16", 4)]
    assert all(r["outcome"] == "COMPLETE" for r in results.values())
    assert ref["quality"]["reference_trial"] == ref["trial_id"] and ref["started_at"] <= same["started_at"]

    # The same numerics agree exactly, whatever the batch size.
    q = same["quality"]
    assert q["reference_trial"] == ref["trial_id"] and q["passed"] is True
    assert q["agreement"] == 1.0 and q["exact_match"] == 1.0 and abs(q["nll_delta"]) < 1e-6
    assert q["suites"] == ref["quality"]["suites"]

    # bfloat16 diverges for real: fewer matching tokens and another likelihood of the reference's.
    q = bf16["quality"]
    assert 0 < q["agreement"] < 1.0 and q["exact_match"] < 1.0 and abs(q["nll_delta"]) > 1e-5
    assert q["passed"] is False and q["failures"][0].startswith("agreement dropped")
    rows = [json.loads(line) for line in (study_dir / "trials" / bf16["trial_id"] / "quality.jsonl").read_text().splitlines()]
    assert {row["suite"] for row in rows} == {"agreement", "arithmetic", "recall"}
    assert any(row["suite"] == "agreement" and row["agreement"] < 1 for row in rows)
    recall = [row for row in rows if row["suite"] == "recall"]
    assert len(recall) == 9 and max(len(row["prompt"]) for row in recall) > 400  # up to 9/10 of max_model_len
    reference = json.loads((study_dir / "quality" / "reference.json").read_text())
    assert reference["trial_id"] == ref["trial_id"] and len(reference["continuations"]) == 16

    # The report shows the quality table and never recommends the failing trial.
    report = (study_dir / "report" / "summary.md").read_text()
    assert "### Quality" in report and "FAIL: agreement dropped" in report
    recommended = report.split("## Recommendation", 1)[1].split("\n\n", 2)[1]
    assert bf16["trial_id"] not in recommended and "quality probe" in report
    assert processes_mentioning(study_dir, "vllm") == []

    # MLflow has the scores and the record's quality field.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("quality").experiment_id], "tags.`servetune.role` = 'trial'")
    by_trial = {run.data.tags["servetune.trial_id"]: run for run in runs}
    assert by_trial[bf16["trial_id"]].data.metrics["quality/agreement"] < 1.0
    assert by_trial[bf16["trial_id"]].data.tags["quality"].startswith("FAIL")
    assert by_trial[same["trial_id"]].data.metrics["quality/passed"] == 1.0
