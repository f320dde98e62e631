"""``servetune run`` on the real vLLM CPU build: one configuration that serves, one that cannot start."""

import json
import shlex
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


PARSE_WITH_VLLM = """
import json, sys
try:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])
print(json.dumps({k: getattr(args, k) for k in ("model", "max_num_seqs", "max_num_batched_tokens", "block_size")}))
"""


def parsed_by_vllm(command: str) -> dict:
    """The exported ``vllm serve MODEL ...`` command as vLLM's own server parser reads it (exit 0 or the test fails)."""
    tokens = shlex.split(" ".join(line.rstrip("\\") for line in command.splitlines() if not line.startswith("#")))
    argv = tokens[tokens.index("serve") + 1 :]
    done = subprocess.run([sys.executable, "-c", PARSE_WITH_VLLM, "--model", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
    assert [lv.get("cache_note") for lv in ok["levels"]] == [None, None]  # each level began on an emptied cache
    resolved = ok["resolved_engine_args"]  # what vLLM chose for what the launch left to it
    assert resolved["max_num_seqs"] > 0 and resolved["max_num_batched_tokens"] > 0 and resolved["block_size"] == 128
    assert processes_mentioning(study_dir, "vllm") == []

    report = servetune("report", study_dir)
    assert report.returncode == 0, report.stderr[-2000:]
    summary = (study_dir / "report" / "summary.md").read_text()
    assert ok["trial_id"] in summary and "FAILED" in summary
    export = servetune("export", study_dir, "--format", "vllm")
    assert export.returncode == 0 and "VLLM_CPU_KVCACHE_SPACE=1" in export.stdout and "--block-size 128" in export.stdout
    picked = servetune("export", study_dir, "--pick", ok["trial_id"], "--format", "vllm")
    assert picked.returncode == 0, picked.stderr
    parsed = parsed_by_vllm(picked.stdout)  # pinned at what vLLM resolved, and accepted by vLLM's parser
    assert parsed["max_num_seqs"] == resolved["max_num_seqs"] and parsed["max_num_batched_tokens"] == resolved["max_num_batched_tokens"]
