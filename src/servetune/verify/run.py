"""Run verification: the winner's engine through every scenario, the runner-up's through the
repeats, then the document ``verify.json`` holds.

An engine that does not start, or dies during a scenario, fails the configuration: the scenario
says so with the engine log's tail, the ones after it are not run, and the process group is
always stopped (``VllmServer`` is a context manager). Nothing here raises for a failure of the
configuration; only bad input (``choose.py``) does. A verification stopped by SIGTERM or Ctrl-C while an
engine runs stops the engine and returns what finished (``stopped`` in the document: no verdict).

A trial the study measured through Ray Serve (``serve.num_replicas``) is verified through Serve too: the
same application and replica count (``serve.trial.ServeEngine``), loaded through Serve's OpenAI ingress,
its replicas' vLLM metrics read through Ray's metrics agents and their prefix caches reset through Serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import signal
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from servetune.engine.cores import ClientCores, client_cores_here, client_record, pinned_to
from servetune.engine.server import VllmServer
from servetune.errors import EngineStartError
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.metrics import RequestRecord
from servetune.results import ENGINE_LOG
from servetune.serve.cluster import ServeCluster
from servetune.serve.trial import ServeEngine, pinned_spec, trial_needs
from servetune.trial.runner import TrialSpec, cores_record, vllm_engine
from servetune.verify import scenarios as sc
from servetune.verify.admitted import bounds_of
from servetune.verify.canary import CANARY, DEFAULT_SHARE, Deploy, canary
from servetune.verify.choose import Chosen, Selection
from servetune.verify.disconnects import disconnects
from servetune.verify.document import EngineRun, Timeouts, document
from servetune.verify.overload import OVERLOAD, overload
from servetune.verify.replica_lost import REPLICA_LOST, replica_lost
from servetune.verify.rolling_update import ROLLING_UPDATE, SAME_CONFIGURATION, new_configuration, rolling_update
from servetune.verify.stats import lead

VERIFY_FILE = "verify.json"
VERIFY_DIR = "verify"  # engine logs, per trial, beside the study's trials
T = TypeVar("T")


class Progress(Protocol):
    """How verify tells what it does: a step begins (with its planned seconds), a scenario ends."""

    def step(self, text: str, seconds: float | None = None) -> None: ...

    def scenario(self, name: str, passed: bool, reason: str) -> None: ...


def max_model_len(url: str, fallback: int) -> int:
    """The server's context length, from ``/v1/models`` (vLLM reports ``max_model_len``)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
            data = json.load(resp).get("data", [])
        return int(data[0]["max_model_len"]) if data and data[0].get("max_model_len") else fallback
    except (OSError, ValueError, KeyError):
        return fallback


def _configured_len(chosen: Chosen) -> int:
    args = {**chosen.spec.engine_args, **chosen.result.resolved_engine_args}
    value = args.get("max_model_len")
    return int(value) if isinstance(value, (int, float)) and value > 0 else 2048


#: Fetches a point's weights where its engine will run, before it starts (servetune/prefetch.py): called with the
#: trial's spec and whether the engine runs on the nodes of a Ray cluster (``--address``) rather than this machine.
Prefetch = Callable[[TrialSpec, bool], object]


@contextlib.contextmanager
def started(chosen: Chosen, log_path: Path, address: str | None = None, also: Mapping[str, float] | None = None,
            prefetch: Prefetch | None = None, later: Sequence[Chosen] = ()) -> Iterator[VllmServer | ServeEngine]:  # fmt: skip
    """The chosen configuration, running as the study measured it: one vLLM server, or a trial through Ray
    Serve (``serve.num_replicas``) as that Serve application on a local Ray (or the one at ``address``), whose
    replicas' vLLM log is kept at ``log_path``, pinned to the GPU type its trial was measured on (:func:`pinned`).
    Leaving stops it, and a Ray it started. ``also``: Ray resources a local Ray declares beside the trial's (the
    canary's candidate, deployed on it later). ``prefetch``: run before the engine starts, outside its start-up clock
    (on a study's own Ray the study prefetched: not run). ``later``: the configurations the verification starts after
    this one (the runner-up, the canary's candidate): refused now where the cluster has none of their GPU type, before
    anything is deployed, and fetched now, so the canary's candidate deployed beside this one does not download inside
    its start-up whatever its model."""
    spec = chosen.spec
    assert log_path.name == ENGINE_LOG  # where a trial's engine, bare or through Serve, keeps its log
    if spec.serve_replicas is None:
        if prefetch is not None:
            prefetch(spec, False)
        with vllm_engine(
            spec, log_path.parent
        ) as server:  # as the trial started it (its cores claimed on the CPU build)
            yield server
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if address is None and _in_ray():  # a study's verification (study/verify_top.py): on the study's Ray and Serve
        with ServeEngine(spec, log_path.parent) as engine:
            yield engine
        return
    resources = trial_needs(spec).resources()
    for key, value in (also or {}).items():
        resources[key] = resources.get(key, 0.0) + value
    with ServeCluster(address, resources) as cluster:  # Ray only: Serve starts with the deployment, past the refusals
        spec = pinned(chosen, cluster, address)
        others = [pinned(c, cluster, address) if c.spec.serve_replicas is not None else c.spec for c in later]
        if prefetch is not None:  # a local Ray runs on this machine: fetched here, else on the cluster's nodes
            for each in (spec, *others):  # a bare one runs on this machine
                prefetch(each, address is not None and each.serve_replicas is not None)
        with ServeEngine(spec, log_path.parent, cluster) as engine:
            yield engine


def pinned(chosen: Chosen, cluster: ServeCluster, address: str | None) -> TrialSpec:
    """``chosen``'s spec with its replicas pinned to the GPU type its trial was measured on, where the cluster's nodes
    declare types (serve/trial.py ``pinned_spec``: refused in one line where none is of that type)."""
    where = f"the Ray cluster at {address}" if address else "the local Ray"
    return pinned_spec(chosen.spec, chosen.result.environment, cluster.nodes(), where)


def _in_ray() -> bool:
    """Whether this process already belongs to a Ray cluster (a study's task), with Serve on it."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def served_len(server: VllmServer | ServeEngine, chosen: Chosen) -> int:
    """The running engine's context length: vLLM's ``/v1/models``; through Serve (whose models list has none)
    the one its replicas' log reports (the KV cache line's tokens per request), else the configured one."""
    if isinstance(server, ServeEngine):
        capacity = server.kv_capacity()
        return (
            capacity.at_tokens_per_request if capacity and capacity.at_tokens_per_request else _configured_len(chosen)
        )
    return max_model_len(server.url, _configured_len(chosen))


def verdict_noise(chosen: Chosen) -> float | None:
    """How much a repeat could differ at the trial's capacity, as its capacity search measured it (None: no search)."""
    capacity = chosen.operating.capacity if chosen.operating is not None else None
    return capacity.verdict_noise if capacity is not None else None


def measured_rate(chosen: Chosen) -> float | None:
    """Requests per second at the level verify runs: the operating point's, interpolated between the levels the
    study measured (else, without one, the picked level's)."""
    if chosen.operating is not None:
        return chosen.operating.request_rate
    return chosen.result.levels[chosen.point.level_index].summary.request_throughput


def capacity_rate(chosen: Chosen) -> float | None:
    """Requests per second the study measured at the trial's capacity (what the overload scenario multiplies)."""
    return chosen.operating.capacity_rate if chosen.operating is not None else None


def with_engine(chosen: Chosen, log_path: Path, timeouts: Timeouts, prompts: PromptFactory, budget: sc.Budget,
                progress: Progress, body: Callable[[sc.Target], Awaitable[T]], address: str | None = None,
                also: Mapping[str, float] | None = None, prefetch: Prefetch | None = None,
                later: Sequence[Chosen] = ()) -> tuple[EngineRun, T | None, list[RequestRecord]]:  # fmt: skip
    """Start the chosen configuration (:func:`started`, after ``prefetch``; ``later``: as there), run ``body``
    against it, always stop it."""
    spec = chosen.spec
    run = EngineRun(chosen.trial_id, log_path)
    records: list[RequestRecord] = []
    through = (
        f" through Ray Serve, {spec.serve_replicas} replica{'s' if spec.serve_replicas != 1 else ''}"
        if spec.serve_replicas
        else ""
    )
    progress.step(f"starting vLLM for trial {chosen.trial_id}{through} (log: {log_path})")
    try:
        with started(chosen, log_path, address, also, prefetch, later) as server:
            run.startup_s = server.startup_s
            pin = client_pin(server)
            run.cores = {**cores_record(server), **client_record(pin)}
            served = spec.engine_args.get("served_model_name") or spec.model

            async def main() -> T:
                with _cancelled_on(signal.SIGTERM, run), _cancelled_on(signal.SIGINT, run, "interrupted"):
                    return await measure()

            async def measure() -> T:
                async with StreamingClient(
                    server.url, served, api=spec.workload.api, timeout_s=timeouts.total_s,
                    first_token_timeout_s=timeouts.first_token_s, idle_timeout_s=timeouts.idle_s,
                    ignore_eos=spec.workload.ignore_eos, temperature=spec.workload.temperature,
                ) as client:  # fmt: skip
                    target = sc.Target(
                        client=client, url=server.url, workload=spec.workload, prompts=prompts, slo=spec.slo,
                        level=chosen.level, budget=budget, max_model_len=served_len(server, chosen),
                        measured_rate=measured_rate(chosen), capacity_rate=capacity_rate(chosen),
                        verdict_noise=verdict_noise(chosen),
                        engine=server, pid=server.process.pid if server.process else None, records=records,
                        metrics=getattr(server, "server_metrics", None),
                        reset_cache=server.reset_prefix_cache if isinstance(server, ServeEngine) else None,
                        admission=bounds_of(spec.engine_args),
                        levels=run.levels,
                    )  # fmt: skip
                    return await body(target)

            try:
                with pinned_to(pin.cores):  # the load client on cores apart from the engine's (client_pin)
                    value = asyncio.run(main())
            except (asyncio.CancelledError, SystemExit, KeyboardInterrupt) as exc:  # stopped: the engine is stopped
                run.stopped = run.stopped or stop_name(
                    exc
                )  # on the way out; what finished is kept (verify's `partial`)
                return run, None, records
            if isinstance(server, ServeEngine):
                with contextlib.suppress(Exception):  # what each replica served: a record, never a failure
                    run.serve = server.record()
            if not server.alive():
                run.failure = f"the engine died ({server.failure_reason()})"
                run.log_tail = server.log_tail()
            return run, value, records
    except EngineStartError as exc:
        run.failure, run.log_tail = f"engine start: {exc.args[0]}", exc.log_tail
        return run, None, records


def client_pin(server: VllmServer | ServeEngine) -> ClientCores:
    """Where verify's load client runs while it measures ``server``: beside a bare engine on vLLM's CPU build, on the
    cores its OpenMP ranks are not bound to (engine/cores.py ``client_cores``), so that the client's sends and reads
    do not wait for the engine's spinning worker on one core (bench/README.md, "Verify's overload on real vLLM,
    traced"); left where it is on a GPU engine and through Serve (whose replicas run where Serve placed them)."""
    if isinstance(server, ServeEngine):
        return ClientCores([], "through Ray Serve: the replicas run where Serve placed them")
    if getattr(server, "cpu_ranks", None) is None:
        return ClientCores([], "a GPU engine: its ranks are bound to no cores")
    return client_cores_here(server.cpu_binding)


@contextlib.contextmanager
def _cancelled_on(sig: signal.Signals, run: EngineRun, name: str | None = None) -> Iterator[None]:
    """While the measuring coroutine runs, ``sig`` cancels it (recorded in ``run.stopped`` as ``name``, else the
    signal's name): the scenarios unwind at their awaits and close their connections, where an exception raised from
    a signal handler would land anywhere in the event loop. Ctrl-C is handled here too, not by ``asyncio.run``'s own
    handler: that one turns the cancellation into KeyboardInterrupt only if it propagates, and a cancellation that
    lands while a level's requests are ending can be absorbed below (a flake census saw Ctrl-C's verification run to
    its end and exit 0); ``run.stopped`` and :func:`_winner`'s check between scenarios do not depend on it.
    Outside the main thread there is nothing to catch."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    before = signal.getsignal(sig)

    def stop() -> None:
        run.stopped = name or sig.name
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(sig, stop)
        installed = True
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (a study's Ray task)
        installed = False
    try:
        yield
    finally:
        if installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, before)  # the command's own handler again, for the teardown (remove_... leaves SIG_DFL)


def stop_status(stopped: str) -> int:
    """The exit status of a command whose verification was stopped (``verify.json``'s ``stopped``)."""
    if stopped == "interrupted":
        return 130
    with contextlib.suppress(KeyError):
        return 128 + signal.Signals[stopped].value
    number = stopped.removeprefix("exit ")
    return int(number) if number.isdigit() else 1


def stop_name(exc: BaseException) -> str:
    """What stopped a verification: ``interrupted`` (Ctrl-C), a signal's name (the commands exit 128 + its number on
    SIGTERM), or ``exit N``; :func:`stop_status` reads it back."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
    if code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128).name
    return f"exit {code}"


async def _winner(
    t: sc.Target,
    progress: Progress,
    out: dict[str, sc.ScenarioResult] | None = None,
    extra: tuple[str, ...] = (),
    replicas: int | None = None,
    replace_timeout_s: float | None = None,
    update: tuple[TrialSpec | None, str] = (None, SAME_CONFIGURATION),
    canary_run: Callable[[sc.Target], Awaitable[sc.ScenarioResult]] | None = None,
) -> dict[str, sc.ScenarioResult]:
    """Every scenario in order, each kept in ``out`` as it finishes (what a stopped verification keeps); after an
    engine death the rest are not run. ``extra``: the opt-in ones asked for (``replica_lost``: it costs the
    deployment a replica; ``rolling_update``, last: it moves the deployment to ``update``'s configuration), on a
    Serve deployment of ``replicas`` whose replacement may take ``replace_timeout_s``; ``canary_run``: the canary
    scenario, asked for (before replica_lost)."""
    out = {} if out is None else out
    b = t.budget
    soak_p99: float | None = None
    peak_state: tuple[Any, Any] | None = None
    plan: list[tuple[str, float | None]] = [
        ("soak", b.soak_s), ("peak", b.scenario_s), ("burst", b.scenario_s), ("mix", b.scenario_s),
        ("long_output", None), ("disconnects", None), ("headroom", None), ("repeats", b.repeats * b.repeat_s),
        *([(OVERLOAD, 2 * b.scenario_s)] if t.admission_bound else []),
        *([(CANARY, None)] if canary_run is not None else []),
        *([(REPLICA_LOST, 2.5 * b.scenario_s)] if REPLICA_LOST in extra else []),
        *([(ROLLING_UPDATE, 2.5 * b.scenario_s)] if ROLLING_UPDATE in extra else []),
    ]  # fmt: skip
    for name, seconds in plan:
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # stopped, and the cancellation absorbed in the last scenario
            raise asyncio.CancelledError
        if t.engine is not None and not t.engine.alive():
            out[name] = sc.not_run(name, "the engine died in an earlier scenario")
            continue
        progress.step(f"{name}", seconds)
        if name == "soak":
            result = await sc.soak(t)
            soak_p99 = result.numbers.get("ttft_ms_p99")
        elif name == "peak":
            result, peak_result, trace = await sc.peak(t)
            peak_state = (peak_result, trace)
        elif name == "burst":
            result = await sc.burst(t)
        elif name == "mix":
            result = await sc.mix(t, soak_p99)
        elif name == "long_output":
            result = await sc.long_output(t)
        elif name == "disconnects":
            result = await disconnects(t)
        elif name == "headroom":
            if peak_state is None:
                result = sc.not_run(name, "the peak did not run")
            else:
                log_text = t.engine.log_text() if isinstance(t.engine, (VllmServer, ServeEngine)) else ""
                result = sc.headroom(peak_state[0], peak_state[1], t.engine, log_text)
        elif name == OVERLOAD:
            result = await overload(t)
        elif name == REPLICA_LOST:
            result = await replica_lost(t, replicas or 0, replace_timeout_s)
        elif name == CANARY and canary_run is not None:
            result = await canary_run(t)
        elif name == ROLLING_UPDATE:
            result = await rolling_update(t, *update, update_timeout_s=replace_timeout_s)
        else:
            result, runs = await sc.repeats(t)
            result.numbers["_runs"] = runs
        if name in t.errors:
            result.numbers["error_samples"] = t.errors[name]
        if t.engine is not None and not t.engine.alive():
            result.passed = False
            result.reason = f"the engine died during {name} ({t.engine.failure_reason()}); " + result.reason
            result.numbers["log_tail"] = t.engine.log_tail()
        out[name] = result
        progress.scenario(name, result.passed, result.reason)
    return out


def goodput_per_device(values: list[float], devices: int) -> list[float]:
    return [v / max(devices, 1) for v in values]


def as_candidate(chosen: Chosen) -> Chosen:
    """The canary's candidate: ``chosen`` through Serve, at its study's replica count (one where it ran bare)."""
    return dataclasses.replace(
        chosen, spec=dataclasses.replace(chosen.spec, serve_replicas=chosen.spec.serve_replicas or 1)
    )


def canary_candidate(chosen: Chosen, log_dir: Path) -> tuple[Deploy, dict[str, float]]:
    """The canary's candidate as a Serve application (:func:`as_candidate`), whose replicas' log is kept in
    ``log_dir``; and the Ray resources it takes beside the incumbent's."""
    spec = as_candidate(chosen).spec
    model = str(spec.engine_args.get("served_model_name") or spec.model)

    def open_candidate(incumbent: object) -> ServeEngine:  # on the cluster the incumbent's application runs on
        log_dir.mkdir(parents=True, exist_ok=True)  # where its replicas' log is kept (started() does it for a trial)
        cluster = getattr(incumbent, "cluster", None)
        if cluster is None:  # a study's own Ray: its spec is pinned already
            return ServeEngine(spec, log_dir, None)
        # pinned to its own GPU type, as measured (started() refused a cluster without it, before the incumbent)
        return ServeEngine(
            pinned_spec(spec, chosen.result.environment, cluster.nodes(), "the cluster"), log_dir, cluster
        )

    return Deploy(chosen.trial_id, model, open_candidate), trial_needs(spec).resources()


def verify(selection: Selection, budget: sc.Budget, prompts: PromptFactory, progress: Progress,
           runner_up: bool = True, address: str | None = None, extra: tuple[str, ...] = (),
           canary_share: float | None = None, prefetch: Prefetch | None = None) -> dict[str, Any]:  # fmt: skip
    """Run everything and return verify.json's content (see :func:`document`); trials through Serve are
    deployed on a local Ray, or on the cluster at ``address``. ``extra``: opt-in scenarios (``replica_lost``,
    ``rolling_update``: to the runner-up's configuration unless ``runner_up`` is False; ``canary``: the runner-up
    deployed beside the winner, taking ``canary_share`` of the load). ``prefetch``: before each engine starts."""
    winner = selection.winner
    update = (new_configuration(winner.spec, selection.runner_up.spec if runner_up and selection.runner_up else None)
              if ROLLING_UPDATE in extra else (None, SAME_CONFIGURATION))  # fmt: skip
    verify_dir = selection.study_dir / VERIFY_DIR
    timeouts = Timeouts.from_slo(winner.spec.slo, winner.spec.request_timeout_s)
    partial: dict[str, sc.ScenarioResult] = {}
    canary_run: Callable[[sc.Target], Awaitable[sc.ScenarioResult]] | None = None
    also: dict[str, float] | None = None
    if CANARY in extra and selection.runner_up is not None:
        deploy, also = canary_candidate(selection.runner_up, verify_dir / selection.runner_up.trial_id / CANARY)
        share = canary_share if canary_share is not None else DEFAULT_SHARE
        canary_run = functools.partial(canary, deploy=deploy, share=share, incumbent_id=winner.trial_id)

    later: list[Chosen] = []  # what starts after the winner: checked and fetched with it
    if selection.runner_up is not None and (runner_up or CANARY in extra):
        later = [as_candidate(selection.runner_up) if CANARY in extra else selection.runner_up]
    run, results, records = with_engine(
        winner, verify_dir / winner.trial_id / "engine.log", timeouts, prompts, budget, progress,
        lambda t: _winner(t, progress, partial, extra, winner.spec.serve_replicas, winner.spec.startup_timeout_s,
                          update, canary_run),
        address, also, prefetch, later,
    )  # fmt: skip
    scenarios = results or {}
    if run.stopped:  # what finished stands; the scenario it stopped in, and the rest, did not run
        scenarios = dict(partial)
        if "repeats" in scenarios:
            scenarios["repeats"].numbers.pop("_runs", None)
        left = [name for name in sc.SCENARIOS if name not in scenarios]
        for i, name in enumerate(left):
            scenarios[name] = sc.not_run(
                name, f"the verification was stopped ({run.stopped}){' during it' if i == 0 else ''}"
            )
        return document(selection, budget, timeouts, run, scenarios, records)
    if run.failure and not scenarios:
        for name in sc.SCENARIOS:
            scenarios[name] = sc.ScenarioResult(name, False, f"not run: {run.failure}")
    runs = scenarios["repeats"].numbers.pop("_runs", []) if "repeats" in scenarios else []
    runner: dict[str, Any] | None = None
    if runner_up and selection.runner_up is not None and runs:
        other = selection.runner_up
        other_timeouts = Timeouts.from_slo(other.spec.slo, other.spec.request_timeout_s)
        other_run, other_runs, _ = with_engine(
            other, verify_dir / other.trial_id / "engine.log", other_timeouts, prompts, budget, progress,
            lambda t: sc.repeat_runs(t, sc.STREAMS["repeats"]), address, prefetch=prefetch,
        )  # fmt: skip
        runner = {"trial_id": other.trial_id, "level": dict(other.point.level), "startup_s": other_run.startup_s}
        if other_runs:
            runner.update(sc.repeats_numbers(other_runs))
            mine = goodput_per_device([sc.served_per_s(r) for r in runs], winner.result.devices)
            theirs = goodput_per_device([sc.served_per_s(r) for r in other_runs], other.result.devices)
            verdict = lead(mine, theirs, "goodput per device (req/s)")
            runner["lead"] = {"verdict": verdict.verdict, "real": verdict.real, "reason": verdict.reason}
            progress.scenario(
                "runner-up", True, f"trial {other.trial_id}: the winner's lead is {verdict.verdict}: {verdict.reason}"
            )
        if other_run.failure:
            runner.update(failure=other_run.failure, log_tail=other_run.log_tail)
        if other_run.stopped:  # the winner's scenarios all ran: their verdict stands, the comparison is not made
            runner["stopped"] = other_run.stopped
    if "repeats" in scenarios:
        scenarios["repeats"].numbers["runner_up"] = runner
    return document(selection, budget, timeouts, run, scenarios, records)
