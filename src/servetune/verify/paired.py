"""Two configurations of a study measured round by round, interleaved, so that the host's drift is in both.

A study measures its trials minutes apart, and a shared host drifts over minutes: the speculative-decoding study, run
twice ten minutes apart on two shared cores, measured its baseline at 10.4 then 22.4 req/s of goodput, and the gain
of k=4 at 8 clients at +79% then -32%, each "beyond the noise" of the level's repeats, which are measured within a
run. ``servetune recheck --paired`` measures the picked configuration (A) and another (B) at one load, the shipped
level's, for R rounds, A then B in one round and B then A in the next, and judges B against A from the rounds'
paired differences (:func:`servetune.verify.stats.paired_difference`): a host that slows down for a while slows
both sides of a round, and that cancels in the round's difference.

How the engines run (:func:`measure_pairs`):

- **Side by side** (both on vLLM's CPU build): both engines start once and stay up through every round, only one
  under load at a time. Each claims cores of its own (engine/cores.py), so the one measured keeps the same cores
  in every round whatever the other holds; a start-up takes a minute on two cores and its own time varies, so
  starting both once keeps the rounds seconds apart and leaves start-up out of the comparison. The idle engine
  holds its memory and sleeps.
- **One after the other** (GPUs): each round starts A, measures it and stops it, then B (the order alternating).
  Two engines on one GPU would each take their ``gpu_memory_utilization`` share of the same memory.

The verdict is taken on goodput (requests per second meeting every per-request SLO): ``A better``, ``B better``
or ``tie within the paired noise``. Where goodput was 0 on both sides in all rounds but at most one (neither met the
SLO), it is taken on output throughput, and the reason says so. Every compared metric is judged the same way and
shown beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel

from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT
from servetune.results import MIN_MARGIN, LevelResult
from servetune.trial.measure import LevelPlan, check_alive, measure_rung
from servetune.trial.runner import Engine, EngineFactory, TrialSpec, vllm_engine
from servetune.verify.recheck import COMPARED
from servetune.verify.stats import paired_difference

PairedVerdict = Literal["A better", "B better", "tie within the paired noise", "REFUSED"]
#: Exit status per verdict (2 is servetune's bad input: nothing started); the recheck's 3 for an engine that failed.
PAIRED_EXIT_STATUS: dict[str, int] = {"A better": 0, "B better": 1, "REFUSED": 3, "tie within the paired noise": 5}
DEFAULT_ROUNDS = 3
PAIRED_DIR = "paired"  # under the recheck's trials directory: each side's engine log and request records
Mode = Literal["side by side", "one after the other"]


class PairedRound(BaseModel):
    """One round: both configurations at the same load, one after the other."""

    round: int
    first: Literal["A", "B"]
    a: dict[str, float]  # the compared metrics of A's run
    b: dict[str, float]
    a_meets_slo: bool
    b_meets_slo: bool


class PairedMetric(BaseModel):
    """One metric of B against A over the rounds (:class:`servetune.verify.stats.PairedDifference`)."""

    metric: str
    better: Literal["max", "min"]
    a_median: float | None
    b_median: float | None
    change: float  # the median over rounds of (B - A) / mean(A, B)
    ratio: float | None  # the median over rounds of B / A (None where a side measured 0)
    noise: float  # half the interquartile range of the rounds' differences, at least the floor (stats.paired_noise)
    low: float | None  # 95% interval of the rounds' mean difference (stats.mean_interval)
    high: float | None
    b_ahead: int  # rounds in which B was the better side
    rounds: int
    verdict: str  # "A better" | "B better" | "tie"


class Paired(BaseModel):
    """``recheck-paired-<version>.json``: two configurations measured round by round, and which is better."""

    study: str
    vllm: str | None
    a_trial_id: str  # the pick
    b_trial_id: str  # --against
    level: dict[str, float]  # the load both were measured at: the shipped level's
    mode: Mode
    rounds_asked: int
    rounds: list[PairedRound]
    metrics: list[PairedMetric]
    decided_on: str | None  # the metric the verdict is taken on
    verdict: PairedVerdict
    reason: str
    failure: str | None = None  # an engine refused, did not start, or died
    result_dir: str | None = None
    created: str | None = None

    @property
    def exit_status(self) -> int:
        return PAIRED_EXIT_STATUS[self.verdict]


def mode_of(a: TrialSpec, b: TrialSpec) -> Mode:
    """Side by side where both run on vLLM's CPU build (cores of their own each), else one after the other."""
    return "side by side" if a.device == "cpu" and b.device == "cpu" else "one after the other"


def judge(
    rounds: Sequence[PairedRound], floor: float = MIN_MARGIN
) -> tuple[list[PairedMetric], str | None, PairedVerdict, str]:
    """Every compared metric of B against A, the metric the verdict is taken on, the verdict and its reason.

    Pure: the rounds' numbers in, the judgement out (no I/O)."""
    metrics = []
    for name, better in COMPARED:
        pairs = [(r.a[name], r.b[name]) for r in rounds if name in r.a and name in r.b]
        diff = paired_difference([a for a, _ in pairs], [b for _, b in pairs], better == "max", floor)
        if diff is None:
            continue
        metrics.append(PairedMetric(metric=name, better=better, a_median=_median([a for a, _ in pairs]),
                                    b_median=_median([b for _, b in pairs]), change=diff.change, ratio=diff.ratio,
                                    noise=diff.noise, low=diff.low, high=diff.high, b_ahead=diff.b_ahead,
                                    rounds=diff.rounds, verdict=diff.verdict))  # fmt: skip
    by_name = {m.metric: m for m in metrics}
    decided = by_name.get(GOODPUT) or by_name.get(OUTPUT_THROUGHPUT)
    if decided is None:
        return metrics, None, "tie within the paired noise", "fewer than two rounds measured both sides"
    missing = " (goodput 0 on both sides, or not measured, in all rounds but at most one)"
    fallback = "" if decided.metric == GOODPUT else missing
    numbers = (f"{decided.metric}{fallback}: A {decided.a_median:.4g}, B {decided.b_median:.4g}; B against A "
               f"{decided.change:+.1%} (median of {decided.rounds} rounds' paired differences, interval "
               f"[{_pct(decided.low)}, {_pct(decided.high)}], paired noise ±{decided.noise:.1%}; B ahead in "
               f"{decided.b_ahead} of {decided.rounds})")  # fmt: skip
    verdict: PairedVerdict = "tie within the paired noise"
    if decided.verdict == "A better":
        verdict = "A better"
    elif decided.verdict == "B better":
        verdict = "B better"
    return metrics, decided.metric, verdict, numbers


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _pct(value: float | None) -> str:
    return "?" if value is None else f"{value:+.1%}"


def compared(level: LevelResult) -> dict[str, float]:
    flat = level.summary.flat()
    return {name: float(v) for name, _ in COMPARED if (v := flat.get(name)) is not None}


def measure_pairs(a: TrialSpec, b: TrialSpec, level: Level, rounds: int, out_dir: Path,
                  prompts: Mapping[str, PromptFactory], engine: EngineFactory = vllm_engine,
                  on_round: Callable[[PairedRound], None] | None = None,
                  names: Mapping[str, str] | None = None) -> list[PairedRound]:  # fmt: skip
    """``rounds`` rounds of A and B at ``level`` (A first in even rounds), each side's engine log and request
    records in ``out_dir/<A|B>-<name>/`` (``names`` by side: the recorded trials' ids; else each spec's);
    ``prompts`` by side. Round ``i`` draws the same prompts for both sides. Raises EngineStartError or
    EngineDiedError as the trial runner's engines do."""
    specs = {"A": a, "B": b}
    dirs = {side: out_dir / f"{side}-{(names or {}).get(side, spec.trial_id)}" for side, spec in specs.items()}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    together = mode_of(a, b) == "side by side"
    out: list[PairedRound] = []
    with contextlib.ExitStack() as stack:
        records = {side: stack.enter_context((path / "requests.jsonl").open("w")) for side, path in dirs.items()}
        servers: dict[str, Engine] = {}
        if together:  # both up through every round; A starts first, claiming its cores first
            servers = {side: stack.enter_context(engine(spec, dirs[side])) for side, spec in specs.items()}
        for index in range(rounds):
            order = ("A", "B") if index % 2 == 0 else ("B", "A")
            measured: dict[str, LevelResult] = {}
            for side in order:
                if together:
                    measured[side] = _measure(specs[side], servers[side], level, index, prompts[side], records[side])
                    continue
                with engine(specs[side], dirs[side]) as server:
                    measured[side] = _measure(specs[side], server, level, index, prompts[side], records[side])
            done = PairedRound(round=index, first=order[0], a=compared(measured["A"]), b=compared(measured["B"]),
                               a_meets_slo=measured["A"].meets_slo, b_meets_slo=measured["B"].meets_slo)  # fmt: skip
            out.append(done)
            if on_round is not None:
                on_round(done)
    return out


def _measure(spec: TrialSpec, server: Engine, level: Level, index: int, prompts: PromptFactory,
             records: IO[str]) -> LevelResult:  # fmt: skip
    """One run of ``level`` on ``server`` with ``spec``'s client settings, requests and SLO; prompt stream
    ``index + 1`` (the same for both sides of a round)."""

    def record(row: dict) -> None:
        records.write(json.dumps({"round": index, **row}) + "\n")

    async def run() -> LevelResult:
        async with StreamingClient(
            server.url, spec.engine_args.get("served_model_name") or spec.model, api=spec.workload.api,
            timeout_s=spec.request_timeout_s, ignore_eos=spec.workload.ignore_eos,
            temperature=spec.workload.temperature,
        ) as client:  # fmt: skip
            plan = LevelPlan.sized(level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
            return await measure_rung(
                client, server.url, spec.workload, prompts, plan, index, repeats=1, slo=spec.slo,
                record=record, engine=server,
                client_processes=spec.client_processes, client_cpus=spec.client_cpus,
            )  # fmt: skip

    result = asyncio.run(run())
    check_alive(server, level, result.summary.failed)
    return result
