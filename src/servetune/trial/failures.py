"""Whose fault a failed trial was: the configuration's, or the cluster's around it.

A trial that fails because of what it asked vLLM to do (out of memory, an argument vLLM refuses, a
crash under load) is data: the searcher learns to avoid it and ``--resume`` keeps it. A trial that
fails because of its surroundings says nothing about its configuration: its port taken between the
choice and the bind, its GPU held by another process, the model hub refusing the token or rate-
limiting, weights still downloading when the start-up clock ran out. Those are retried where a retry
can help, kept from the searcher, recorded with their cause, and run again on ``--resume``.

The verdict reads the engine's log by signature: the messages below are vLLM 0.32's, Python's and
``huggingface_hub``'s own (tests/unit/test_failures.py checks them against the installed sources).
A failure that matches nothing is the configuration's, as every failure was before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from servetune.results import Failure, FailureKind, TrialResult

#: How many times a trial starts its engine again after a failure a retry can help with.
INFRA_RETRIES = 2


@dataclass(frozen=True)
class Signature:
    cause: str
    kind: FailureKind
    pattern: re.Pattern[str]
    retry_after_s: float | None = None
    retry_elsewhere: bool = False  # the node's fault: not again there, once on another node
    # Where a line matches, whether it decides (False: look on; e.g. the free-memory check is the
    # configuration's when nothing else holds the device).
    applies: Callable[[re.Match[str]], bool] = lambda match: True


def _held_by_another(match: re.Match[str]) -> bool:
    """vLLM's free-memory check failed: another process holds the device when more than a CUDA context's worth
    (about 1.5 GiB, or 5% of a small device) is in use at start-up; otherwise the utilization asked for is more
    than the device has, which is the configuration's doing."""
    if match[2] != "device":  # the CPU build's host memory: always partly in use, so no sign of another holder
        return False
    free, total = float(match["free"]), float(match["total"])
    return total - free > max(1.5, 0.05 * total)


# Python's OSError when the API server binds a port something took since servetune chose it.
PORT_IN_USE = re.compile(r"\[Errno (98|48)\] .*address already in use|EADDRINUSE", re.IGNORECASE)
# vllm/v1/worker/utils.py (GPU) and cpu_worker.py: less free memory at start-up than the utilization asks for.
DEVICE_MEMORY = re.compile(
    r"(Free|Available) memory on (device|node) \S+ \((?P<free>[\d.]+)/(?P<total>[\d.]+) GiB\) on startup "
    r"is less than desired"
)
# huggingface_hub: a gated or private model without an accepted token. A retry fails the same way.
HUB_AUTH = re.compile(
    r"Cannot access gated repo|GatedRepoError|401 Client Error|Invalid username or password"
    r"|is restricted and you are not in the authorized list"
)
HUB_RATE_LIMIT = re.compile(r"429 Too Many Requests|429 Client Error")  # huggingface_hub: the hub's rate limit
OUT_OF_MEMORY = re.compile(r"CUDA out of memory|OutOfMemoryError|No available memory for the cache blocks")

# The node's own faults, the same whatever the configuration; started again there, they fail again.
# torch raises a CUDA runtime error as "CUDA error: " + cudaGetErrorString (c10/cuda/CUDAException.cpp); the
# strings are the CUDA runtime's for its hardware and driver errors (cudaErrorECCUncorrectable,
# cudaErrorNvlinkUncorrectable, cudaErrorDevicesUnavailable, cudaErrorNoDevice, cudaErrorInsufficientDriver), as a
# real engine log shows them: "torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered". An illegal
# memory access or a device-side assert is left out: a kernel of the configuration's can cause those.
CUDA_NODE = re.compile(
    r"CUDA error: (uncorrectable ECC error encountered|uncorrectable NVLink error detected"
    r"|CUDA-capable device\(s\) is/are busy or unavailable|no CUDA-capable device is detected"
    r"|CUDA driver version is insufficient for CUDA runtime version)"
    r"|Driver/library version mismatch"  # NVML (and nvidia-smi) after a driver upgrade without a reboot
)
# vLLM's NCCL wrapper raises "NCCL error: " + ncclGetErrorString (vllm/distributed/device_communicators/
# pynccl_wrapper.py NCCL_CHECK); NCCL's strings for a system, CUDA or network fault (ncclSystemError,
# ncclUnhandledCudaError, ncclRemoteError). torch's NCCL watchdog: "Watchdog caught collective operation timeout".
NCCL_NODE = re.compile(
    r"NCCL error: (unhandled system error|unhandled cuda error|remote process exited or there was a network error)"
    r"|Watchdog caught collective operation timeout"
)
DISK_FULL = re.compile(r"\[Errno 28\] No space left on device")  # Python's OSError for ENOSPC (Linux strerror)
# servetune's own: Serve's controller did not take a trial's application within the hand-off's bound
# (serve/builder.py NOT_TAKEN): a slow or stuck Serve, whatever the configuration; started again a little later.
SERVE_HANDOFF = re.compile(r"Serve did not take the application")

SIGNATURES: tuple[Signature, ...] = (
    Signature("gpu_fault", "infrastructure", CUDA_NODE, retry_elsewhere=True),
    Signature("nccl_fault", "infrastructure", NCCL_NODE, retry_elsewhere=True),
    Signature("disk_full", "infrastructure", DISK_FULL, retry_elsewhere=True),
    Signature("serve_handoff", "infrastructure", SERVE_HANDOFF, retry_after_s=10.0),
    Signature("port_in_use", "infrastructure", PORT_IN_USE, retry_after_s=1.0),
    Signature("device_busy", "infrastructure", DEVICE_MEMORY, retry_after_s=20.0, applies=_held_by_another),
    Signature("device_memory_short", "configuration", DEVICE_MEMORY),  # nothing else holds it: asked too much
    Signature("hub_auth", "infrastructure", HUB_AUTH),
    Signature("hub_rate_limit", "infrastructure", HUB_RATE_LIMIT, retry_after_s=60.0),
    Signature("out_of_memory", "configuration", OUT_OF_MEMORY),  # named for the record
)

#: vLLM logs this once a model's weights are in memory; a start-up timeout before it (and before the
#: download's own "Time spent downloading weights") on a hub model is the download's, not the engine's.
WEIGHTS_LOADED = re.compile(r"Loading weights took|Time spent downloading weights|Model loading took")
LOADING_STARTED = re.compile(r"Starting to load model")
TIMED_OUT = re.compile(r"did not become healthy within")


def classify(reason: str, log_tail: str = "", *, hub_model: bool = False) -> Failure:
    """The failure's kind and cause, read from the engine's log (its last lines first) and the trial's reason.

    ``hub_model``: the model is a hub id (not a local path), so its weights may be downloading at start-up.
    """
    lines = [line.strip() for line in [*log_tail.splitlines()[::-1], reason] if line.strip()]
    for line in lines:
        for signature in SIGNATURES:
            match = signature.pattern.search(line)
            if match and signature.applies(match):
                return Failure(kind=signature.kind, cause=signature.cause, evidence=line[-300:],
                               retry_after_s=signature.retry_after_s, retry_elsewhere=signature.retry_elsewhere)  # fmt: skip
    if hub_model and TIMED_OUT.search(reason) and not WEIGHTS_LOADED.search(log_tail):
        started = next((line for line in lines if LOADING_STARTED.search(line)), None)
        if started is not None or not log_tail.strip():
            return Failure(kind="infrastructure", cause="weights_download", evidence=reason[-300:], retry_after_s=1.0)
    return Failure(kind="configuration", cause="engine", evidence=reason[-300:])


def retries_elsewhere(result: TrialResult) -> bool:
    """Whether the trial is started once more on another node: it failed for its node's fault (a GPU, driver, NCCL or
    disk fault), and no attempt of it has run elsewhere yet. A configuration's failure never is."""
    failure = result.failure
    if result.outcome != "FAILED" or failure is None or failure.kind != "infrastructure" or not failure.retry_elsewhere:
        return False
    return not any(earlier.retry_elsewhere for earlier in result.retried)


def after_attempt(first: TrialResult, second: TrialResult) -> TrialResult:
    """The second attempt's result, recording the first: the first's failure (with the node it failed on) and what it
    retried itself come before the second's own ``retried``, in the order they happened."""
    assert first.failure is not None
    return second.model_copy(update={"retried": [*first.retried, first.failure, *second.retried]})
