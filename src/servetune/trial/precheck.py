"""What a trial learns before any engine starts: the memory ledger's verdict on its configuration (the capacity
check, which makes a trial INFEASIBLE in seconds), the vLLM it runs (whose memory profile the ledger uses), and
its price by the GPU type it got. The runner (trial/runner.py) asks these first; the study asks ``fits`` to skip
a trial that cannot start."""

from __future__ import annotations

import functools
import sys

from servetune.engine.args import vllm_version
from servetune.errors import UserError
from servetune.results import CapacityReport, TrialResult
from servetune.trial.spec import TrialSpec


def capacity_check(spec: TrialSpec, seen: dict[str, str] | None = None) -> CapacityReport | None:
    """The memory ledger's verdict; for what the ledger cannot size (a model whose config cannot be read here:
    offline and not cached, gated, no hub; an unmodelled KV cache dtype or quantization) a report that is "not
    planned: REASON" and lets the trial start. On the CPU build without a KV space, only what it refuses (a
    quantized KV cache on a CPU without AVX-512 or AMX, capacity/cpubuild.py), else None; None too on a GPU that is
    neither named nor seen yet (a dry run of a space without ``hardware.gpu``).

    ``seen``: the trial's environment record, with the GPU it got as NVML names it (``gpu_model``,
    ``gpu_memory_gib``). Without ``hardware.gpu`` in the space the check sizes the GPU from that; with it, the
    space's GPU is used and a GPU of another kind is said in ``environment["hardware_note"]``. A MIG slice
    (``gpu_mig``) is sized by its own memory either way, unless the space gives ``hardware.gpu_memory_gib``."""
    from servetune.capacity import NotPlanned, gpu_hardware, load_model_arch, plan_capacity, resolve_hardware
    from servetune.capacity.cpubuild import cpu_kv_cache_problem, quantized_kv_cache
    from servetune.capacity.draft import check_draft, load_draft
    from servetune.capacity.hardware import find_gpu
    from servetune.capacity.profile import profile_for_version

    kv_dtype = str(spec.engine_args.get("kv_cache_dtype") or "auto")
    kv_space = spec.env.get("VLLM_CPU_KVCACHE_SPACE") or "kv_cache_memory_bytes" in spec.engine_args
    # Without a KV space the CPU build sizes its KV cache from host memory: nothing to predict, only what it refuses.
    if spec.device == "cpu" and not kv_space and not quantized_kv_cache(kv_dtype):
        return None
    got = (seen or {}).get("gpu_model") if spec.device == "gpu" else None
    sliced = (seen or {}).get("gpu_mig") if got else None  # a MIG slice: the space's GPU would size the whole board
    try:
        arch = load_model_arch(spec.model)
    except (UserError, ValueError) as exc:  # vLLM may still load it (a cache or a hub this host has not)
        return CapacityReport(fits=True, planned=False, reason=f"not planned: {exc}")
    try:
        if got and spec.gpu_memory_gib is None and (spec.gpu is None or sliced):  # the GPU the trial got, per NVML
            hardware = gpu_hardware(got, int(float((seen or {})["gpu_memory_gib"]) * 2**30))
        else:
            hardware = resolve_hardware(spec.device, spec.gpu, spec.gpu_memory_gib)
    except (UserError, ValueError, KeyError):
        return None
    if got and spec.gpu is not None and seen is not None:
        try:
            same = find_gpu(got).name == hardware.name
        except UserError:
            same = False
        if not same or sliced:
            part, size = (f" MIG {sliced}", f" ({hardware.memory_gib:.1f} GiB)") if sliced else ("", "")
            seen["hardware_note"] = f"the space says {spec.gpu}; the trial got {got}{part}: its capacity check sized {hardware.name}{size}"  # fmt: skip
    try:
        profile = profile_for_version(trial_vllm_version(spec, seen), "the trial's vLLM version")
    except UserError as exc:
        return CapacityReport(fits=False, reason=str(exc))
    if spec.device == "cpu" and not kv_space:
        if (refused := cpu_kv_cache_problem(arch, kv_dtype, hardware, profile)) is None:
            return None
        return CapacityReport(fits=False, reason=f"vLLM refuses this configuration: {refused}", profile=profile.name)
    try:
        draft = load_draft(spec.engine_args)  # speculative decoding's draft checkpoint, where it has one
    except UserError as exc:  # unknown offline: vLLM may still fetch it, so no verdict
        return CapacityReport(fits=True, planned=False, reason=f"not planned: {exc}")
    try:
        check_draft(arch, draft, spec.engine_args)  # a draft model of another vocabulary: vLLM refuses it
        plan = plan_capacity(arch, spec.engine_args, hardware, env=spec.env, profile=profile, draft=draft)
    except NotPlanned as exc:  # no verdict: the trial starts, and records what vLLM itself reports
        return CapacityReport(fits=True, planned=False, reason=f"not planned: {exc}")
    except UserError as exc:
        return CapacityReport(fits=False, reason=str(exc))
    return CapacityReport(
        fits=plan.fits, reason=plan.reason, kv_cache_tokens=plan.kv_cache_tokens, kv_cache_gib=plan.kv_cache_gib,
        max_concurrency=plan.max_concurrency, advice=list(plan.advice), profile=profile.name,
    )  # fmt: skip


@functools.lru_cache(maxsize=8)
def _installed_vllm(python: str) -> str | None:
    return vllm_version(python)


def trial_vllm_version(spec: TrialSpec, seen: dict[str, str] | None = None) -> str | None:
    """The vLLM the trial runs: its environment record's (``seen["vllm"]``, what the trial's node has), else the one
    installed beside ``spec.python`` (the driver's view, before the trial runs: on a joined cluster servetune
    doctor's checks fail a node whose vLLM differs from the driver's, so it is the cluster's too); None where
    neither has vLLM."""
    recorded = (seen or {}).get("vllm")
    if recorded and recorded != "not installed":
        return recorded
    return _installed_vllm(spec.python or sys.executable)


def price_trial(result: TrialResult, spec: TrialSpec) -> None:
    """Price the trial by the GPU type it ran on (as NVML names it, else the space's ``hardware.gpu``)."""
    if spec.pricing is None:
        return
    got = result.environment.get("gpu_model", "")
    gpu = got if got and not got.startswith("no NVIDIA GPU") else spec.gpu
    result.price = spec.pricing.resolve(gpu if spec.device == "gpu" else None)
    result.price_per_device_hour = result.price.usd_per_device_hour


def fits(spec: TrialSpec) -> bool:
    """Whether the trial passes its capacity check (or has none): what ``run_trial`` checks first."""
    capacity = capacity_check(spec)
    return capacity is None or capacity.fits
