"""Whose fault a failed trial was (trial/failures.py), read from log lines as vLLM, Python and the hub write them."""

from __future__ import annotations

import errno
import os
import socket
from importlib.util import find_spec
from pathlib import Path

import pytest

from servetune.results import Failure, TrialResult
from servetune.trial.failures import after_attempt, classify, retries_elsewhere

# vLLM 0.32's start-up check (vllm/v1/worker/utils.py), formatted as it formats it.
FREE_MEMORY = (
    "ValueError: Free memory on device cuda:0 ({free:.2f}/139.80 GiB) on startup is less than desired GPU memory "
    "utilization (0.9, 125.82 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes."
)


def vllm_source(relative: str) -> str:
    spec = find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text()


def test_a_port_another_process_bound_is_the_clusters_and_worth_a_retry():
    with socket.socket() as held, socket.socket() as late:
        held.bind(("127.0.0.1", 0))
        with pytest.raises(OSError) as raised:
            late.bind(held.getsockname())
    assert raised.value.errno == errno.EADDRINUSE
    log = f"INFO 12-05 00:01:02 [api_server.py:1] vLLM API server version 0.32.0\nOSError: {raised.value}"
    failure = classify("vLLM exited with code 1 during startup (OSError: ...)", log)
    assert (failure.kind, failure.cause) == ("infrastructure", "port_in_use") and failure.retry_after_s is not None
    assert str(raised.value) in failure.evidence


def test_a_device_held_by_another_process_is_the_clusters_but_asking_for_too_much_is_the_configurations():
    busy = classify("vLLM exited with code 1 during startup", FREE_MEMORY.format(free=60.0))
    assert (busy.kind, busy.cause) == ("infrastructure", "device_busy") and busy.retry_after_s is not None
    # Only a CUDA context's worth in use: nothing else holds the GPU, the utilization asked is more than it has.
    greedy = classify("vLLM exited with code 1 during startup", FREE_MEMORY.format(free=139.2))
    assert (greedy.kind, greedy.cause) == ("configuration", "device_memory_short") and greedy.retry_after_s is None


def test_host_memory_on_the_cpu_build_is_the_configurations():
    line = (
        "ValueError: Available memory on node 0 (3.10/23.43 GiB) on startup is less than desired CPU memory "
        "utilization (0.92, 21.55 GiB)."
    )
    assert classify("vLLM exited with code 1 during startup", line).kind == "configuration"


def test_the_hubs_rate_limit_waits_and_retries():
    failure = classify("vLLM exited with code 1 during startup", "HfHubHTTPError: 429 Too Many Requests for url: x")
    assert (failure.kind, failure.cause) == ("infrastructure", "hub_rate_limit") and failure.retry_after_s >= 30


def test_a_start_up_timeout_while_a_hub_model_downloads_is_the_clusters_but_not_once_weights_loaded():
    reason = "vLLM did not become healthy within 600 s"
    downloading = "INFO [gpu_model_runner.py:1] Starting to load model meta-llama/Llama-3.1-8B-Instruct..."
    assert classify(reason, downloading, hub_model=True).cause == "weights_download"
    assert classify(reason, downloading, hub_model=False).kind == "configuration"  # a local folder downloads nothing
    loaded = f"{downloading}\nINFO [default_loader.py:1] Loading weights took 41.20 seconds"
    assert classify(reason, loaded, hub_model=True).kind == "configuration"  # slow after loading: its own start


def test_anything_else_stays_the_configurations_with_the_reason_as_evidence():
    failure = classify("vLLM exited with code 1 during startup (ValueError: block_size must be a multiple of 16)")
    assert (failure.kind, failure.cause) == ("configuration", "engine") and "block_size" in failure.evidence
    oom = classify("the engine died during concurrency 32", "torch.OutOfMemoryError: CUDA out of memory.")
    assert (oom.kind, oom.cause) == ("configuration", "out_of_memory")


def test_the_last_telling_line_of_the_log_decides():
    log = "OSError: [Errno 98] Address already in use\nINFO retrying\ntorch.OutOfMemoryError: CUDA out of memory."
    assert classify("vLLM exited with code 1 during startup", log).cause == "out_of_memory"


@pytest.mark.parametrize(
    ("relative", "fragment"),
    [
        ("v1/worker/utils.py", '"is less than desired GPU memory utilization "'),
        ("v1/worker/utils.py", 'f"Free memory on device {init_snapshot.device_} "'),
        ("v1/worker/utils.py", 'f"{format_gib(init_snapshot.total_memory)} GiB) on startup "'),
        ("v1/worker/cpu_worker.py", 'f"Available memory on node {cpu_core.numa_node} "'),
        ("model_executor/model_loader/default_loader.py", '"Loading weights took %.2f seconds"'),
        ("model_executor/model_loader/weight_utils.py", '"Time spent downloading weights for %s: %.6f seconds"'),
        ("v1/worker/gpu_model_runner.py", "Starting to load model"),
        ("v1/core/kv_cache_utils.py", '"No available memory for the cache blocks. "'),
    ],
)
def test_the_signatures_are_the_installed_vllms_own_messages(relative, fragment):
    """The log lines read above are written by these statements of the installed vLLM: a release that rewords
    one fails here, not silently in a study."""
    assert fragment in vllm_source(relative)


def test_an_infrastructure_failure_runs_again_and_a_configurations_does_not():
    base = {"trial_id": "t", "study": "s", "params": {}, "engine_args": {}, "env": {}, "model": "m", "device": "gpu", "devices": 1,
            "price_per_device_hour": 1.0, "slo": [], "outcome": "FAILED"}  # fmt: skip
    infra = Failure(kind="infrastructure", cause="device_busy", evidence="...")
    assert TrialResult(**base, failure=infra).runs_again
    assert not TrialResult(**base, failure=infra.model_copy(update={"kind": "configuration"})).runs_again
    assert TrialResult(**base, lost=True).runs_again and not TrialResult(**base).runs_again
    # Read back by an older reader's rules: an unknown field is ignored, a missing one takes its default.
    assert TrialResult.model_validate_json(TrialResult(**base, failure=infra).model_dump_json()).failure == infra


def test_the_report_says_a_cluster_failure_is_not_the_configurations():
    from servetune.report.points import outline

    base = {"trial_id": "t", "study": "s", "params": {}, "engine_args": {}, "env": {}, "model": "m", "device": "gpu",
            "devices": 1, "price_per_device_hour": 1.0, "slo": [], "outcome": "FAILED", "reason": "engine start: x"}  # fmt: skip
    infra = Failure(kind="infrastructure", cause="hub_auth", evidence="GatedRepoError: 401 Client Error.")
    assert outline(TrialResult(**base, failure=infra)).reason == (
        "not the configuration's (hub_auth; runs again on --resume): engine start: x"
    )
    own = infra.model_copy(update={"kind": "configuration", "cause": "engine"})
    assert outline(TrialResult(**base, failure=own)).reason == "engine start: x"


# The node's faults: started again there they fail again, whatever the configuration (trial/failures.py).
ECC_LINE = "torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered"  # a real engine log's line


def nccl_line(error: str) -> str:
    """vLLM's NCCL wrapper's error, formatted as it formats it (checked in its source below)."""
    return f"RuntimeError: NCCL error: {error}"


def test_vllms_nccl_wrapper_raises_the_line_the_signature_reads():
    source = vllm_source("distributed/device_communicators/pynccl_wrapper.py")
    assert 'raise RuntimeError(f"NCCL error: {error_str}")' in source


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        (ECC_LINE, "gpu_fault"),
        ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", "gpu_fault"),
        ("RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version", "gpu_fault"),
        (nccl_line("unhandled system error (run with NCCL_DEBUG=INFO for details)"), "nccl_fault"),
        (nccl_line("remote process exited or there was a network error"), "nccl_fault"),
        (f"OSError: {OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/tmp/x.safetensors')}", "disk_full"),
    ],
)
def test_a_fault_of_the_node_is_retried_on_another_node_not_this_one(line, cause):
    failure = classify("vLLM exited with code 1 during startup", f"INFO loading\n{line}\nINFO shutting down")
    assert (failure.kind, failure.cause) == ("infrastructure", cause)
    assert failure.retry_elsewhere and failure.retry_after_s is None  # not again on this node
    assert line in failure.evidence


@pytest.mark.parametrize(
    "line",
    [
        "RuntimeError: CUDA error: an illegal memory access was encountered",  # a kernel of the configuration's
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
        nccl_line("invalid usage (run with NCCL_DEBUG=WARN for details)"),
    ],
)
def test_the_configurations_own_failures_are_not_retried_anywhere(line):
    failure = classify("vLLM exited with code 1 during startup", line)
    assert failure.kind == "configuration" and not failure.retry_elsewhere and failure.retry_after_s is None


def failed(failure: Failure | None, retried: list[Failure] | None = None) -> TrialResult:
    result = TrialResult(schema_version=6, trial_id="t", study="s", params={}, engine_args={}, env={}, model="m",
                         device="gpu", devices=1, price_per_device_hour=1.0, slo=[], outcome="FAILED", reason="r")  # fmt: skip
    result.failure, result.retried = failure, list(retried or [])
    return result


def test_the_retry_elsewhere_is_decided_once_and_only_for_the_nodes_fault():
    node_fault = classify("x", ECC_LINE).model_copy(update={"node_id": "a" * 56})
    assert retries_elsewhere(failed(node_fault))
    assert not retries_elsewhere(failed(node_fault, [node_fault]))  # it ran elsewhere once already
    assert not retries_elsewhere(failed(classify("x", "torch.OutOfMemoryError: CUDA out of memory.")))
    port = classify("x", "OSError: [Errno 98] error while attempting to bind on address: address already in use")
    assert port.kind == "infrastructure" and not retries_elsewhere(failed(port))  # retried on its own node
    complete = failed(None)
    complete.outcome = "COMPLETE"
    assert not retries_elsewhere(complete)


def test_both_attempts_are_recorded_in_the_order_they_ran():
    port = classify("x", "OSError: [Errno 98] address already in use").model_copy(update={"node_id": "a" * 56})
    ecc = classify("x", ECC_LINE).model_copy(update={"node_id": "a" * 56})
    first = failed(ecc, [port])  # node a: a port collision retried there, then the GPU's fault
    second = failed(None)
    second.outcome = "COMPLETE"
    merged = after_attempt(first, second)
    assert merged.outcome == "COMPLETE" and [f.cause for f in merged.retried] == ["port_in_use", "gpu_fault"]
    assert merged.retried[-1].node_id == "a" * 56 and merged.retried[-1].evidence == ECC_LINE
    again = after_attempt(first, failed(ecc.model_copy(update={"node_id": "b" * 56})))
    assert [f.node_id[0] for f in again.retried] == ["a", "a"] and again.failure.node_id[0] == "b"
    assert not retries_elsewhere(again)  # the second node's fault is recorded, not retried a third time
