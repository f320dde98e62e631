"""What a verification records: the client timeouts it ran with (from the SLO), each engine launch, and the
document ``verify.json`` built from the scenarios (with section 16 stability and the numbers section 15 reads)."""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from servetune import __version__
from servetune.config.slo import Slo
from servetune.metrics import RequestRecord
from servetune.report.diagnosis import limited_by
from servetune.report.points import is_out_of_memory
from servetune.results import LevelResult
from servetune.trial.runner import write_atomic
from servetune.verify import scenarios as sc
from servetune.verify.canary import CANARY
from servetune.verify.choose import Chosen, Selection
from servetune.verify.diagnosis import diagnosis
from servetune.verify.overload import OVERLOAD
from servetune.verify.replica_lost import REPLICA_LOST
from servetune.verify.rolling_update import ROLLING_UPDATE

#: First-token timeout = this many times the SLO's TTFT bound (at least FIRST_TOKEN_MIN_S);
#: idle-stream timeout = this many times the TPOT bound (at least IDLE_MIN_S). A user waiting
#: ten times the promised latency has gone: the request counts as failed.
FIRST_TOKEN_FACTOR, FIRST_TOKEN_MIN_S = 10.0, 5.0
IDLE_FACTOR, IDLE_MIN_S = 20.0, 5.0


@dataclass(frozen=True)
class Timeouts:
    first_token_s: float
    idle_s: float
    total_s: float

    @classmethod
    def from_slo(cls, slo: Slo, total_s: float) -> Timeouts:
        ttft = min((b.limit for b in slo.bounds if b.metric == "ttft_ms"), default=None)
        tpot = min((b.limit for b in slo.bounds if b.metric in ("tpot_ms", "itl_ms")), default=None)
        first = (
            max(FIRST_TOKEN_MIN_S, FIRST_TOKEN_FACTOR * ttft / 1000.0) if ttft else max(FIRST_TOKEN_MIN_S, total_s / 4)
        )
        idle = max(IDLE_MIN_S, IDLE_FACTOR * tpot / 1000.0) if tpot else max(IDLE_MIN_S, total_s / 10)
        return cls(min(first, total_s), min(idle, total_s), total_s)


@dataclass
class EngineRun:
    """One engine launch: what it measured, or why it failed."""

    trial_id: str
    log_path: Path
    startup_s: float | None = None
    failure: str | None = None
    log_tail: str | None = None
    serve: dict[str, Any] | None = None  # through Serve: the application, its replicas and what each served
    # On the CPU build, the cores its ranks ran on (``cpu_binding``) and why it claimed none of its own where other
    # engines held them (``cpu_unclaimed``), as a trial records them (trial/runner.py ``cores_record``; through Serve,
    # its replicas', serve/claims.py ``replica_cores``).
    cores: dict[str, str] = field(default_factory=dict)
    stopped: str | None = None  # the verification was stopped while this engine ran ("SIGTERM", "interrupted")
    # The level each scenario measured (scenarios.py ``_measure``), as a trial records one: what diagnosis reads.
    levels: dict[str, LevelResult] = field(default_factory=dict)


def admission_record(chosen: Chosen) -> dict[str, Any]:
    """What verify.json says of the admission bounds the engine started with (export's), or why it had none."""
    bounds = chosen.admission
    if bounds is None or isinstance(bounds, str):
        return {"engine_args": {}, "reason": bounds or "none derived"}
    return {"engine_args": bounds.engine_args(), "reasons": dict(bounds.reasons)}


def stability(scenarios: dict[str, sc.ScenarioResult], records: list[RequestRecord], run: EngineRun) -> dict[str, Any]:
    """Section 16's stability field, measured: OOM, 5xx, cancellation success rate, P99 jitter. The 5xx rate leaves
    out the overload scenario's requests, whose 503s are the admission bound working (checklist 15.15), the
    replica_lost scenario's, whose errors are the fault it injected, and the rolling_update scenario's, judged on
    their own (checklist 15.23); and the burst's refusals its admission bounds explain (verify/admitted.py), each a
    503 the bound made on purpose, as the overload's are."""
    left_out = [scenarios[name].numbers for name in (OVERLOAD, REPLICA_LOST, ROLLING_UPDATE) if name in scenarios]
    bounded = int(scenarios["burst"].numbers.get("refused_explained", 0)) if "burst" in scenarios else 0
    sent = len(records) - sum(int(n.get("requests", 0)) for n in left_out) - bounded
    fives = (
        sum(r.error_kind == "http_5xx" for r in records) - sum(int(n.get("http_5xx", 0)) for n in left_out) - bounded
    )
    headroom = scenarios.get("headroom")
    oom = (
        bool(headroom and headroom.numbers.get("oom"))
        or is_out_of_memory(run.log_tail or "")
        or is_out_of_memory(run.failure or "")
    )
    errors: dict[str, int] = {}
    for r in records:
        if r.error_kind and r.error_kind != sc.DROPPED:
            errors[r.error_kind] = errors.get(r.error_kind, 0) + 1
    return {
        "cancellation_success_rate": scenarios["disconnects"].numbers.get("cancellation_success_rate") if "disconnects" in scenarios else None,
        "p99_jitter": scenarios["soak"].numbers.get("ttft_p99_jitter") if "soak" in scenarios else None,
        "oom": oom,
        "error_rate_5xx": fives / sent if sent else None,
        "requests": sent,
        "errors_by_kind": errors,
    }  # fmt: skip


def document(selection: Selection, budget: sc.Budget, timeouts: Timeouts, run: EngineRun,
             scenarios: dict[str, sc.ScenarioResult], records: list[RequestRecord]) -> dict[str, Any]:  # fmt: skip
    """verify.json: ``trial_id``, ``level``, ``scenarios`` (each with ``passed`` and ``reason``; the steady ones
    with ``limited_by``), ``stability``, ``limited_by`` (what limited the configuration in this verification, from
    its own soak and peak: verify/diagnosis.py) beside ``limited_by_in_study`` (the study's line for the trial,
    report/diagnosis.py), ``accepted`` and the ``reasons`` for the verdict."""
    # The canary judges the candidate beside the verified point, not the point itself: checklist 15.23, no veto.
    failed = [f"{name}: {s.reason}" for name, s in scenarios.items() if not s.passed and name != CANARY]
    if run.failure:
        failed.insert(0, f"engine: {run.failure}")
    if run.stopped:
        done = [name for name, s in scenarios.items() if not s.reason.startswith("not run:")]
        failed.insert(0, f"stopped ({run.stopped}) after {len(done)} of {len(sc.SCENARIOS)} scenarios: not a verdict")
    winner = selection.winner
    recorded = {
        name: scenarios[name].as_dict()
        for name in (*sc.SCENARIOS, OVERLOAD, CANARY, REPLICA_LOST, ROLLING_UPDATE)
        if name in scenarios
    }
    line, lines = diagnosis(winner.result, run.levels)  # what limited it here (verify/diagnosis.py)
    for name, said in lines.items():
        if name in recorded:
            recorded[name]["limited_by"] = said
    return {
        "servetune_version": __version__,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "study": selection.info.name,
        "trial_id": winner.trial_id,
        "level": dict(winner.point.level),
        **({"operating_point": winner.operating.as_dict()} if winner.operating is not None else {}),
        **({"admission": admission_record(winner)} if winner.admission is not None else {}),
        "params": dict(winner.result.params),
        "device": winner.result.device,
        "budget": asdict(budget),
        "timeouts": asdict(timeouts),
        "engine": {
            "startup_s": run.startup_s,
            "log": str(run.log_path),
            "failure": run.failure,
            "log_tail": run.log_tail,
            **({"serve": run.serve} if run.serve is not None else {}),
            **run.cores,
        },
        "scenarios": checklist_fields(recorded),
        "limited_by": line,
        "limited_by_in_study": limited_by(winner.result),
        "stability": stability(scenarios, records, run),
        "accepted": not failed,
        "reasons": failed or ["every scenario passed"],
        **({"stopped": run.stopped} if run.stopped else {}),
    }


def checklist_fields(scenarios: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Add to each scenario the numbers the acceptance checklist reads (``verify/checklist.py``'s
    docstring names them), derived from what the scenario measured."""
    soak = scenarios.get("soak")
    if soak is not None:
        windows = soak.get("windows") or []
        soak["p99_ttft_ms_windows"] = [w.get("ttft_ms_p99") for w in windows]
        if windows:
            soak["window_s"] = windows[0]["end_s"] - windows[0]["start_s"]
        if soak.get("rss_growth_mib") is not None:
            soak["memory_growth_gib"] = soak["rss_growth_mib"] / 1024
    mix = scenarios.get("mix")
    if mix is not None:
        mix["long_share"] = sc.LONG_SHARE
        mix["short_ttft_p99_ms"] = mix.get("short_ttft_ms_p99")
        mix["baseline_ttft_p99_ms"] = mix.get("soak_ttft_ms_p99")
    long_output = scenarios.get("long_output")
    if long_output is not None:
        produced = [n for n in long_output.get("output_tokens") or [] if n is not None]
        long_output["max_output_tokens"] = max(produced, default=None)
        long_output["limit_tokens"] = long_output.get("server_output_limit")
    drops = scenarios.get("disconnects")
    if drops is not None:
        seen = [r for r in drops.get("rounds") or [] if r.get("observed")]
        drops["dropped"] = sum(r.get("dropped", 0) for r in seen)
        times = [r.get("fell_back_s") for r in seen]
        drops["running_fell_back"] = bool(seen) and all(t is not None for t in times)
        drops["fallback_s"] = max((t for t in times if t is not None), default=None)
        late = [r.get("released_s") for r in seen if r.get("fell_back_s") is None]
        drops["released_late_s"] = max(late) if late and None not in late else None  # None: some never fell back
    headroom = scenarios.get("headroom")
    if headroom is not None:
        headroom["kv_usage_peak"] = headroom.get("kv_cache_usage_max")
    repeats = scenarios.get("repeats")
    if repeats is not None:
        lead = (repeats.get("runner_up") or {}).get("lead") or {}
        if "real" in lead:
            repeats["lead_is_real"] = lead["real"]
    return scenarios


def finite(value: Any) -> Any:
    """JSON has no NaN or infinity: such numbers become null (recursively)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def write_document(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(finite(doc), indent=2, default=str, allow_nan=False) + "\n")


def stopped_by(doc: dict[str, Any]) -> str | None:
    """What stopped the verification ``doc`` (a signal's name), in the winner's scenarios or the runner-up's repeats."""
    runner = ((doc.get("scenarios") or {}).get("repeats") or {}).get("runner_up") or {}
    return doc.get("stopped") or runner.get("stopped")


def finished_document(path: Path) -> bool:
    """Whether ``path`` holds a verification that ran to its verdict (not one that was stopped)."""
    from servetune.report.verification import read_json_file

    doc = read_json_file(path).content if path.is_file() else None
    return doc is not None and isinstance(doc.get("accepted"), bool) and not doc.get("stopped")


def checklist(selection: Selection, doc: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Section 15's acceptance list, evaluated with this verification's numbers."""
    from servetune.verify.checklist import evaluate

    items = evaluate(selection.study_dir, selection.winner.result, doc)
    return [{"id": i.id, "text": i.text, "status": i.status, "evidence": i.evidence} for i in items]
