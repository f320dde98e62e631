"""``servetune run`` on the real vLLM CPU build: one configuration that serves, one that cannot start."""

import json
import subprocess
import sys

import pytest

from tests.processes import processes_mentioning

pytestmark = pytest.mark.e2e
pytest.importorskip("vllm", reason="the e2e tests need vLLM (the CPU build: pip install servetune[cpu])")

SPACE = """
name: e2e
model: tiny
device: cpu
workload: cpu-tiny
load: {{levels: [2, 8], requests_per_level: 24, startup_timeout_s: 300}}
slo: {{ttft_ms: {{p99: 5000}}}}
hardware: {{devices_per_node: 2}}
engine_args: {{enforce_eager: true, max_model_len: 1024}}
env: {{VLLM_CPU_KVCACHE_SPACE: 1}}
params:
  block_size: [128, 7]     # 7 is not a block size vLLM accepts: the engine fails at startup
search: {{algorithm: grid, baseline: false}}
"""


def servetune(*argv, cwd=None):
    return subprocess.run([sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True, timeout=900, cwd=cwd)




def test_study_report_and_export_on_real_vllm(tmp_path):
    (tmp_path / "space.yaml").write_text(SPACE.format())
    done = servetune("run", tmp_path / "space.yaml", "--storage", tmp_path / "results", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    study_dir = tmp_path / "results" / "e2e"
    results = {json.loads(p.read_text())["params"]["block_size"]: json.loads(p.read_text()) for p in study_dir.glob("trials/*/result.json")}
    ok, bad = results[128], results[7]
    assert ok["outcome"] == "COMPLETE" and len(ok["levels"]) == 2
    assert ok["kv_capacity"]["tokens"] == 524288 and ok["kv_prediction_error"] == 0.0  # the ledger, exactly
    assert ok["environment"]["vllm"].startswith("vllm") and ok["environment"]["device"] == "cpu"
    assert ok["levels"][1]["telemetry"]["host_cpu_percent_mean"] > 0
    assert ok["levels"][1]["summary"]["output_throughput"] > ok["levels"][0]["summary"]["output_throughput"]
    assert bad["outcome"] == "FAILED" and bad["reason"].startswith("engine start: vLLM exited") and bad["log_tail"]
    assert processes_mentioning(study_dir, "vllm") == []

    report = servetune("report", study_dir)
    assert report.returncode == 0, report.stderr[-2000:]
    summary = (study_dir / "report" / "summary.md").read_text()
    assert ok["trial_id"] in summary and "FAILED" in summary
    export = servetune("export", study_dir, "--format", "vllm")
    assert export.returncode == 0 and "VLLM_CPU_KVCACHE_SPACE=1" in export.stdout and "--block-size 128" in export.stdout
