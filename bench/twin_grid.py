"""A GPU-twin surface: every point of a GPU space's grid answered at the GPU twin's pace, for search_efficiency.py.

For each grid point of ``SPACE`` (a GPU space: a catalogue model on a catalogue GPU), the twin
(testing/twin.py, what ``SERVETUNE_FAKE_TWIN`` paces the fake engine by) stands for its configuration,
with one seeded run factor per point drawn from the measured run-to-run spread. The trial's own capacity
search (trial/capacity.py ``CapacitySearch``: the ladder, its stops, the bisection and the knee) is driven
level by level; each level's requests are simulated on the level's clock against the twin's pace, a closed
loop of C clients or Poisson arrivals at the rate, and summarized and judged against the SLO by servetune's
own code (``summary.summarize``, ``Slo.violations``). A point the capacity check rejects is INFEASIBLE.
The result is a surface file that ``search_efficiency.py replay`` reads as it reads a recorded grid.

What the simulation leaves out, against the fake engine run for real through Ray: every request has the
workload's mean lengths; a request keeps the ITL of the batch it was admitted into (the fake re-reads it per
token); and the load client's own overhead (a few ms of TTFT, bench/README.md "The GPU twin") is absent. A
trial's ``duration_s`` is the start-up budget's expected seconds (capacity/startup.py) plus its levels' time.
The pruning replay then judges the estimate against the twin, which is the estimate plus its noise: it shows
the rule's bookkeeping on a GPU-shaped space, not the estimate's error on real GPUs.

    PYTHONPATH=src .venv/bin/python bench/twin_grid.py bench/data/gpu-twin-grid.yaml --out /tmp/twin-grid.json [--seed 0]
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from pathlib import Path

import numpy as np

from servetune.config.workload import mean_lengths
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.metrics import RequestRecord
from servetune.results import LevelResult, TrialResult
from servetune.space_file import load_space
from servetune.study.surface import Surface, score
from servetune.summary import summarize
from servetune.testing.twin import Twin, TwinConfig
from servetune.trial.capacity import CapacitySearch
from servetune.trial.context import StudyContext, resolve_levels, startup_budget_for
from servetune.trial.measure import LevelPlan
from servetune.trial.runner import TrialSpec, capacity_check, new_result


def simulate_level(twin: Twin, level: Level, plan: LevelPlan, lengths: tuple[int, int], rng) -> list[RequestRecord]:
    """The requests of one level on the twin: sends in time order, each paced by the twin at the requests in flight
    then (itself included); a closed loop's client sends again when its answer ends, an open loop at Poisson times."""
    count = plan.warmup_requests + (plan.num_requests or max(int((plan.duration_s or 0) * level.value), 1))
    isl, osl = lengths
    ends: list[float] = []  # of the requests sent so far
    records = []
    if level.kind == "concurrency":
        clients = [0.0] * max(int(level.value), 1)
        heapq.heapify(clients)
        sends = None
    else:
        sends = np.cumsum(rng.exponential(1.0 / level.value, size=count))
    for index in range(count):
        sent = heapq.heappop(clients) if sends is None else float(sends[index])
        in_flight = 1 + sum(1 for end in ends if end > sent)
        pace = twin.pace(in_flight, isl, osl)
        first = sent + pace.ttft_s
        chunks = [first + k * pace.itl_s for k in range(osl)]
        ends.append(chunks[-1])
        if sends is None:
            heapq.heappush(clients, chunks[-1])
        records.append(RequestRecord(index=index, sent=sent, input_tokens=isl, max_tokens=osl,
                                     warmup=index < plan.warmup_requests, chunk_times=chunks, end=chunks[-1],
                                     prompt_tokens=isl, output_tokens=osl, ok=True))  # fmt: skip
    return records


def twin_trial(
    spec: TrialSpec,
    gpu: str,
    lengths: tuple[int, int],
    seed: int,
    startup_s: float,
    factor_scale: dict[str, float] | None = None,
) -> TrialResult:
    """One grid point's trial at the twin's pace (see the module); ``factor_scale``: TwinConfig's."""
    cap = capacity_check(spec)
    if cap is not None and not cap.fits:
        result = new_result(spec, "INFEASIBLE", cap.reason)
        result.duration_s = 0.0
        return result
    twin = Twin(TwinConfig(gpu=gpu, model=spec.model, engine_args=spec.engine_args, seed=seed,
                           factor_scale=factor_scale or {}))  # fmt: skip
    rng = np.random.default_rng(seed)
    search = CapacitySearch(spec.levels, spec.slo, tolerance=spec.capacity_tolerance, budget=spec.capacity_levels,
                            stop_on_slo_break=spec.stop_on_slo_break, min_gain=spec.min_throughput_gain,
                            knee_fraction=spec.knee_fraction)  # fmt: skip
    steps = search.steps()
    result = new_result(spec, "COMPLETE")
    level = next(steps)
    measured = 0.0
    while True:
        plan = LevelPlan.sized(level, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
        records = simulate_level(twin, level, plan, lengths, rng)
        summary = summarize(records, level.as_dict(), spec.slo.request_bounds_ms() or None)
        level_result = LevelResult(summary=summary, slo_violations=spec.slo.violations(summary))
        result.levels.append(level_result)
        measured += max(r.end or 0.0 for r in records)
        try:
            level = steps.send(level_result)
        except StopIteration as stop:
            result.stopped_because = stop.value
            result.capacity_at_slo = search.capacity
            break
    result.startup_s = startup_s
    result.duration_s = startup_s + measured
    return result


def build(space_path: Path, seed: int, factor_scale: dict[str, float] | None = None) -> tuple[Surface, float]:
    space = load_space(space_path)
    if space.device != "gpu" or space.hardware.gpu is None:
        raise UserError(f"{space_path}: device: a GPU twin needs device: gpu and hardware.gpu")
    workload = space.resolved_workload(space_path.parent)
    context = StudyContext(space, workload, Path("/nonexistent"), space.model, resolve_levels(space, workload))
    lengths = mean_lengths(workload)
    kept, _ = space.grid()
    began = time.perf_counter()
    results = []
    for index, params in enumerate(kept):
        spec = context.spec_for(params)
        startup = startup_budget_for(space, params, spec.model).expected_s or 0.0
        results.append(twin_trial(spec, space.gpu_for(params) or space.hardware.gpu, lengths, seed * 10_000 + index,
                                  startup, factor_scale))  # fmt: skip
    made_by = {
        "command": " ".join(["bench/twin_grid.py", *sys.argv[1:]]), "study": space.name, "space_file": str(space_path),
        "trials": len(results), "meet_slo": sum(score(r) > 0 for r in results), "twin_seed": seed,
        **({"factor_scale": factor_scale} if factor_scale else {}),
        "trial_seconds": round(sum(r.duration_s or 0 for r in results)),
        "note": "simulated at the GPU twin's pace (bench/twin_grid.py), not measured",
    }  # fmt: skip
    return Surface.from_results(space, results, made_by), time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("space", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="seeds every point's run factor and arrivals")
    args = parser.parse_args(argv)
    try:
        surface, took = build(args.space, args.seed)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    surface.dump(args.out, args.space.read_text())
    outcomes: dict[str, int] = {}
    for r in surface.results.values():
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    print(f"{args.out}: {len(surface.results)} grid points {outcomes}, {surface.made_by['meet_slo']} meet the SLO, "
          f"best goodput {surface.best_score:.2f} req/s; {took:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
