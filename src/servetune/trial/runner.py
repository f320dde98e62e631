"""One trial: capacity check -> engine start -> load ladder and capacity search -> teardown -> result.json.

The outcome is a state: COMPLETE, INFEASIBLE (the capacity check rejected it, in seconds,
with no engine started) or FAILED (with the reason and the engine's log tail). A failed trial
is data: whatever levels finished are kept. Nothing here knows about Ray or MLflow: the study
passes a ``report`` callback (Tune's), the GPU ids Ray assigned, and optionally a ``stop_rule``
the ladder and the capacity search ask after each level (the study's early stopping by dominance).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from servetune.capacity.compare import measured_kv_tokens
from servetune.engine.resolved import fetch_resolved
from servetune.engine.server import VllmServer
from servetune.engine.startup import startup_phases
from servetune.environment import collect_environment
from servetune.errors import EngineDiedError, EngineStartError
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.models.names import is_hub_id
from servetune.quality.lm_eval import results_file
from servetune.quality.lossless import method_of
from servetune.quality.probe import run_probe
from servetune.results import (
    ENGINE_LOG,
    LM_EVAL_RESULTS_FILE,
    QUALITY_FILE,
    REQUESTS_FILE,
    RESULT_FILE,
    SCHEMA_VERSION,
    KvCapacityReport,
    LevelResult,
    TrialResult,
    best_level,
    find_knee,
    read_result,
)
from servetune.secrets import redact_engine_args, redact_env, redact_params
from servetune.telemetry import GpuId, TelemetrySampler, visible_gpus
from servetune.trial.capacity import CapacitySearch
from servetune.trial.estimated import estimate_levels
from servetune.trial.failures import INFRA_RETRIES, classify
from servetune.trial.measure import Engine as MeasuredEngine
from servetune.trial.measure import LevelPlan, check_alive, measure_rung
from servetune.trial.precheck import capacity_check, fits, price_trial, trial_vllm_version
from servetune.trial.spec import TrialSpec

# The spec and the checks before the engine starts have their own modules; importable from here as before.
__all__ = ["TrialSpec", "capacity_check", "fits", "price_trial", "trial_vllm_version"]

Report = Callable[[dict[str, Any]], None]
#: Asked before each further level with the trial so far and the levels it may still measure (the
#: rest of the ladder and what the capacity search could add): a reason to stop climbing (it becomes
#: ``stopped_because``), or None to go on.
StopRule = Callable[[TrialResult, Sequence[Level]], str | None]  # study/early_stop.py makes one


def load_result(trial_dir: Path) -> TrialResult | None:
    """The trial's finished result, None when it has none (``results.read_result``: one reader, one policy)."""
    return read_result(trial_dir)


def write_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, content: bytes) -> None:
    """``path`` holds ``content`` whole or is as it was: written beside it, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(content)
    tmp.replace(path)


def new_result(spec: TrialSpec, outcome: str, reason: str | None = None) -> TrialResult:
    """A trial's result before anything was measured: its configuration and an outcome."""
    return TrialResult(
        schema_version=SCHEMA_VERSION, trial_id=spec.trial_id, study=spec.study,
        params=redact_params(spec.params),
        engine_args=redact_engine_args(spec.engine_args),
        env=redact_env(spec.env), model=spec.model, device=spec.device, devices=spec.devices,
        price_per_device_hour=spec.price_per_device_hour, slo=[str(b) for b in spec.slo.bounds],
        outcome=outcome, reason=reason, started_at=_now(),
    )  # fmt: skip


def placement_record(spec: TrialSpec) -> dict[str, str]:
    """Where the trial ran: its Ray node, the devices it was given (``CUDA_VISIBLE_DEVICES``) and,
    when servetune chose them, the node's compile cache and Triton cache."""
    record = {"ray_node_id": spec.node_id} if spec.node_id else {}
    if "CUDA_VISIBLE_DEVICES" in spec.extra_env:
        record["cuda_visible_devices"] = spec.extra_env["CUDA_VISIBLE_DEVICES"]
    if "VLLM_CACHE_ROOT" in spec.extra_env:  # node-local, the home being on a network filesystem
        record["vllm_cache_root"] = spec.extra_env["VLLM_CACHE_ROOT"]
    if "TRITON_CACHE_DIR" in spec.extra_env:  # the kernels the node's trials share
        record["triton_cache_dir"] = spec.extra_env["TRITON_CACHE_DIR"]
    if "TORCHINDUCTOR_COMPILE_THREADS" in spec.extra_env:  # torch.compile's pool, sized to the trial's CPUs
        record["compile_threads"] = spec.extra_env["TORCHINDUCTOR_COMPILE_THREADS"]
    return record


class Engine(MeasuredEngine, Protocol):
    """The server a trial measures, as the trial uses it: a context manager that starts it (raising
    ``EngineStartError``) and stops it, with its address, its start-up time, the KV capacity it
    reported, and its process (the telemetry sampler follows its memory)."""

    @property
    def url(self) -> str: ...

    startup_s: float | None
    process: Any

    def kv_capacity(self) -> Any: ...

    def __enter__(self) -> Engine: ...

    def __exit__(self, *exc: object) -> None: ...


EngineFactory = Callable[[TrialSpec, Path], Engine]


def vllm_engine(spec: TrialSpec, trial_dir: Path) -> VllmServer:
    """The real engine: vLLM's OpenAI server in its own process group, logging to ``engine.log`` (with what measuring
    the workload needs of it: ``Workload.measured_engine_args``)."""
    return VllmServer(spec.model, spec.workload.measured_engine_args(spec.engine_args), {**spec.env, **spec.extra_env},
                      log_path=trial_dir / ENGINE_LOG,
                      startup_timeout_s=spec.startup_timeout_s, startup_expected=spec.startup_expected,
                      cpu_ranks=cpu_ranks(spec),
                      python=spec.python or sys.executable)  # fmt: skip


SERVE_TELEMETRY_NOTE = (
    "through Serve the replicas' GPUs are in Serve's placement groups, not the trial's bundle: "
    "no GPU telemetry recorded (the load client's node's GPUs are other trials')"
)


def trial_gpus(spec: TrialSpec) -> list[GpuId]:
    """The GPUs whose telemetry is the trial's: those its bundle holds, as ``CUDA_VISIBLE_DEVICES`` names them (indices
    or UUIDs). None through Serve, whose bundle is a CPU for the load client: every GPU of its node would be sampled."""
    if spec.device != "gpu" or spec.serve_replicas is not None:
        return []
    return visible_gpus(spec.extra_env)


def cpu_ranks(spec: TrialSpec) -> int | None:
    """On the CPU build, the cores a bare engine of ``spec`` binds, a rank each (its devices); None on GPUs."""
    return spec.devices if spec.device == "cpu" else None


def run_trial(spec: TrialSpec, report: Report, prompts: Callable[[], PromptFactory], stop_rule: StopRule | None = None,
              engine: EngineFactory = vllm_engine) -> TrialResult:  # fmt: skip
    """Run one trial to its outcome; never raises for a failure of the configuration.

    ``prompts`` makes the prompt factory (loading the tokenizer) once the trial passed its
    capacity check, so an infeasible trial is rejected in seconds. ``engine`` makes the server
    to measure (vLLM unless a test gives another).
    """
    trial_dir = spec.trial_dir
    trial_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = new_result(spec, "FAILED")
    try:
        gpus = trial_gpus(spec)
        result.environment = collect_environment(spec.device, gpus, spec.python or sys.executable, cores=spec.devices)
        if spec.device == "gpu" and spec.serve_replicas is not None:
            result.environment["telemetry_note"] = SERVE_TELEMETRY_NOTE
        result.environment.update(placement_record(spec))
        result.capacity = capacity_check(spec, result.environment)
        price_trial(result, spec)
        if result.capacity is not None and not result.capacity.fits:
            result.outcome, result.reason = "INFEASIBLE", f"capacity check: {result.capacity.reason}"
            return result
        _start_and_measure(engine, spec, result, report, prompts(), trial_dir, stop_rule)
    except EngineStartError as exc:  # its failure classified where the retry was decided (_start_and_measure)
        result.outcome, result.reason, result.log_tail = "FAILED", f"engine start: {exc.args[0]}", exc.log_tail
    except EngineDiedError as exc:  # under load or the probe: the configuration's own
        result.outcome, result.reason, result.log_tail = "FAILED", exc.args[0], exc.log_tail
        result.failure = classify(exc.args[0], exc.log_tail or "")
    except Exception as exc:  # a failed trial is data; the study goes on
        result.outcome, result.reason = "FAILED", f"{type(exc).__name__}: {exc}"
        result.failure = classify(result.reason)
    finally:
        if result.failure is not None and result.failure.node_id is None and spec.node_id:
            result.failure = result.failure.model_copy(update={"node_id": spec.node_id})
        result.finished_at = _now()
        result.duration_s = time.monotonic() - started
        result.best_level_index = best_level(result)
        estimate_levels(result, spec.gpu, spec.gpu_memory_gib, spec.estimate_efficiency, spec.workload)
        write_atomic(trial_dir / RESULT_FILE, result.model_dump_json(indent=2) + "\n")
    return result


def _start_and_measure(engine: EngineFactory, spec: TrialSpec, result: TrialResult, report: Report,
                       prompts: PromptFactory, trial_dir: Path, stop_rule: StopRule | None) -> None:  # fmt: skip
    """:func:`_measure` on a fresh engine, started again (a new port, the same cores) after a start-up failure that
    was not the configuration's and that a retry can help with (trial/failures.py), at most ``INFRA_RETRIES``
    times. Each retried start's log is kept beside the trial's (``engine.attempt-N.log``) and its failure in
    ``result.retried``; the start that is not retried leaves its failure in ``result.failure``."""
    for attempt in range(INFRA_RETRIES + 1):
        try:
            _measure(engine(spec, trial_dir), spec, result, report, prompts, trial_dir, stop_rule)
            return
        except EngineStartError as exc:
            failure = classify(exc.args[0], exc.log_tail or "", hub_model=is_hub_id(spec.model))
            if failure.kind != "infrastructure" or failure.retry_after_s is None or attempt == INFRA_RETRIES:
                result.failure = failure
                raise
            result.retried.append(failure.model_copy(update={"node_id": spec.node_id}))
            log = trial_dir / ENGINE_LOG
            if log.exists():
                log.replace(trial_dir / f"engine.attempt-{attempt + 1}.log")
            time.sleep(failure.retry_after_s)


def cores_record(server: object) -> dict[str, str]:
    """On the CPU build, the cores the engine's ranks ran on (``cpu_binding``, engine/cores.py), and, where it
    claimed none of its own (other engines on the host held them), why (``cpu_unclaimed``)."""
    record = {
        "cpu_binding": getattr(server, "cpu_binding", None),
        "cpu_unclaimed": getattr(server, "cpu_unclaimed", None),
    }
    return {key: value for key, value in record.items() if value}


def _measure(server: Engine, spec: TrialSpec, result: TrialResult, report: Report, prompts: PromptFactory,
             trial_dir: Path, stop_rule: StopRule | None = None) -> None:  # fmt: skip
    with server:
        result.startup_s = server.startup_s
        result.environment.update(cores_record(server))
        # A Serve trial's proxy: the one its client sends to, and why (serve/proxies.py).
        result.environment.update(getattr(server, "proxy_record", None) or {})
        result.startup_phases = startup_phases(_read(trial_dir / ENGINE_LOG), server.startup_s)
        result.resolved_engine_args = fetch_resolved(server.url)
        kv = server.kv_capacity()
        if kv is not None:
            result.kv_capacity = KvCapacityReport(**vars(kv))
            if result.capacity is not None and result.capacity.kv_cache_tokens:
                result.kv_capacity.planned_tokens = result.capacity.kv_cache_tokens
                measured = measured_kv_tokens(kv.tokens, kv.max_concurrency, kv.at_tokens_per_request)
                result.kv_prediction_error = (result.capacity.kv_cache_tokens - measured) / measured
        if spec.quality is not None:  # before the ladder: the probe needs the engine, not the load
            model = spec.engine_args.get("served_model_name") or spec.model
            result.quality, rows = asyncio.run(run_probe(server.url, model, spec.quality, prompts.count, spec.trial_id,
                                                         spec.params, timeout_s=spec.request_timeout_s, tokenizer=spec.tokenizer,
                                                         out_dir=trial_dir / "lm_eval",
                                                         speculation=method_of(spec.engine_args.get("speculative_config"))))  # fmt: skip
            write_atomic(trial_dir / QUALITY_FILE, "".join(json.dumps(row) + "\n" for row in rows))
            lm_eval_results = results_file(trial_dir / "lm_eval") if spec.quality.lm_eval is not None else None
            if lm_eval_results is not None:  # under a fixed name, carried back to the driver with quality.jsonl
                write_atomic(trial_dir / LM_EVAL_RESULTS_FILE, lm_eval_results.read_text())
            if not server.alive():
                raise EngineDiedError(
                    f"the engine died during the quality probe ({server.failure_reason()})", server.log_tail()
                )
        records_path = trial_dir / REQUESTS_FILE
        with records_path.open("w") as records_file:
            result.stopped_because = asyncio.run(_climb(spec, server, result, report, prompts, records_file, stop_rule))
        record = getattr(server, "record", None)  # through Serve: what each replica served
        if callable(record):
            result.serve = record()
        if not server.alive():
            raise EngineDiedError(f"the engine died during the ladder ({server.failure_reason()})", server.log_tail())
    result.outcome = "COMPLETE"


async def _climb(spec, server, result, report, prompts, records_file, stop_rule=None) -> str | None:
    """The ladder and the capacity search on the running engine; records ``result.capacity_at_slo``."""
    gpus = trial_gpus(spec)
    rule = (lambda level, ahead: stop_rule(result, ahead)) if stop_rule is not None else None
    search = CapacitySearch(spec.levels, spec.slo, tolerance=spec.capacity_tolerance, budget=spec.capacity_levels,
                            stop_on_slo_break=spec.stop_on_slo_break, min_gain=spec.min_throughput_gain,
                            stop_rule=rule, knee_fraction=spec.knee_fraction)  # fmt: skip
    steps = search.steps()
    async with StreamingClient(
        server.url, spec.engine_args.get("served_model_name") or spec.model, api=spec.workload.api,
        timeout_s=spec.request_timeout_s, ignore_eos=spec.workload.ignore_eos, temperature=spec.workload.temperature,
    ) as client:  # fmt: skip
        level = next(steps)
        while True:
            plan = LevelPlan.sized(level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
            level_result = await measure_rung(
                client, server.url, spec.workload, prompts, plan, len(result.levels), repeats=spec.repeats, slo=spec.slo,
                record=lambda row: records_file.write(json.dumps(row) + "\n"), engine=server,
                telemetry=lambda: TelemetrySampler(gpus, server.process.pid if server.process is not None else None),
                client_processes=spec.client_processes, client_cpus=spec.client_cpus,
            )  # fmt: skip
            result.levels.append(level_result)  # kept even when the engine died during it
            check_alive(server, level, level_result.summary.failed)
            report(level_report(result, level_result))
            try:
                level = steps.send(level_result)
            except StopIteration as stop:
                result.capacity_at_slo = search.capacity
                result.knee = search.knee or find_knee(result.levels, spec.knee_fraction, search.found().unit)
                return stop.value


def level_report(result: TrialResult, level: LevelResult) -> dict[str, Any]:
    """What a trial reports to Tune after each level (flat metrics and where it stands)."""
    point = result.operating_points()[-1]
    report = {
        **point.metrics,
        "level_index": point.level_index,
        "meets_slo": level.meets_slo,
        "servetune_trial_id": result.trial_id,
    }
    if result.quality is not None:
        report["quality_passed"] = bool(result.quality.passed)
    return report


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
