"""Calibrate the estimate for vLLM's CPU build (the stand-in) on recorded CPU surfaces.

A surface is a study's ``bench/data/*.json`` (every trial of a grid with its measured levels, as
``bench/search_efficiency.py`` replays them). Each trial x level becomes a closed-loop
:class:`~servetune.estimate.calibrate.CalibrationPoint` of servetune's tiny model, with the KV
capacity from the memory ledger (``VLLM_CPU_KVCACHE_SPACE``) and the measured mean TTFT, mean
TPOT and output throughput. The recording hosts' rates were not measured, so they are given:
``RECORDED_HOST`` (two AVX2 cores' nominal float32 FMA rate and a VM's share of memory bandwidth);
the fitted efficiencies and overheads absorb the difference. On the tiny model the step overheads
dominate: the roofline terms are fractions of a millisecond.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np

from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.estimate.calibrate import BOUNDS, SOFT_L1_SCALE, CalibrationPoint, _residuals, fit_efficiency
from servetune.estimate.factors import Efficiency
from servetune.estimate.model import replica_from_plan
from servetune.estimate.specs import DeviceRates, cpu_rates
from servetune.models.tiny import TINY_CONFIG

# Two AVX2 cores at ~2.5 GHz: 2 FMA units x 8 float32 lanes x 2 FLOP = 32 FLOP/cycle/core.
RECORDED_HOST = cpu_rates(gflops=160.0, memory_gbps=20.0, cores=2)
# Where the host-cores fit starts: 1.5 to 4 ms of CPU a token, 1,333 to 500 tok/s on two cores, about where the
# recorded levels streamed (a bound that binds nowhere has no gradient to fit from: it starts where it is felt).
HOST_CPU_MS_STARTS = (1.5, 2.0, 3.0, 4.0)
# Which rate a recorded closed-loop level's output throughput is read as (read_output_throughput says how).
Throughput = Literal["level", "busy", "little"]
THROUGHPUTS: tuple[Throughput, ...] = ("level", "busy", "little")
# On a CPU the fractions of peak a tiny model reaches are far below a GPU's, so the floor is lower.
CPU_BOUNDS = ((1e-4, 1e-4, 0.0, 0.0, 0.0), BOUNDS[1])


def read_output_throughput(summary: Mapping[str, Any], throughput: Throughput = "level") -> float | None:
    """A recorded closed-loop level's output tok/s, read as ``throughput``:

    - ``level``: the level's ``output_throughput``, its tokens over its whole measured window, which holds the
      last requests' drain with ever fewer clients busy (a share that grows with the clients per request);
    - ``busy``: the level's ``busy_output_throughput`` (summary.busy_output_throughput: while every client had a
      request in flight), as recorded; None where the level has none (recorded without it, or too short: fewer
      requests finished in the window than there are clients);
    - ``little``: the steady rate by Little's law, clients x mean output tokens / mean E2E latency (every client
      always in flight: a client's gap between requests is left out, the drain's shorter latencies are in). It
      reads high where a level holds about one request a client and requests queue for the engine's slots: the
      first wave's queue is shorter than a steady loop's.
    """
    if throughput == "level":
        return float(summary["output_throughput"])
    if throughput == "busy":
        busy = summary.get("busy_output_throughput")
        return None if busy is None else float(busy)
    e2e_ms, done = (summary.get("e2el_ms") or {}).get("mean"), summary.get("completed")
    if not e2e_ms or not done:
        return None
    return float(summary["level"]["concurrency"]) * summary["total_output_tokens"] / done / (e2e_ms / 1000.0)


def read_surface(
    path: Path, held_out: bool, rates: DeviceRates = RECORDED_HOST, throughput: Throughput = "level"
) -> list[CalibrationPoint]:
    """The completed trials' levels of one recorded surface as calibration points."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    points: list[CalibrationPoint] = []
    for trial in doc["trials"]:
        points.extend(trial_points(trial, path.stem, held_out, rates, first_row=len(points), throughput=throughput))
    return points


def trial_points(
    trial: Mapping[str, Any],
    source_id: str,
    held_out: bool,
    rates: DeviceRates = RECORDED_HOST,
    first_row: int = 0,
    throughput: Throughput = "level",
) -> list[CalibrationPoint]:
    """One recorded trial's (a ``result.json`` as a dict) closed-loop levels as calibration points; none unless
    COMPLETE. Each level's output throughput is read as ``throughput`` (read_output_throughput); a level
    without that rate keeps its TPOT and TTFT."""
    if trial.get("outcome") != "COMPLETE":
        return []
    arch = arch_from_hf_config(TINY_CONFIG, name="tiny")
    args, env = trial["engine_args"], trial.get("env") or {}
    plan = plan_capacity(arch, args, resolve_hardware("cpu"), env=env)
    replica = replica_from_plan(arch, plan, args, rates)
    points: list[CalibrationPoint] = []
    for level in trial["levels"]:
        s = level["summary"]
        if "concurrency" not in s["level"] or not s.get("completed"):
            continue
        measured = {
            "tpot_ms": s["tpot_ms"]["mean"],
            "ttft_ms": s["ttft_ms"]["mean"],
            "output_throughput": read_output_throughput(s, throughput),
        }
        points.append(
            CalibrationPoint(
                row=first_row + len(points),
                source_id=source_id,
                gpu_class="CPU",
                model="tiny",
                replica=replica,
                regime="closed",
                input_tokens=max(1, round(s["total_input_tokens"] / s["completed"])),
                output_tokens=max(2, round(s["total_output_tokens"] / s["completed"])),
                load=float(s["level"]["concurrency"]),
                measured={k: v for k, v in measured.items() if v and v > 0},
                held_out=held_out,
            )
        )
    return points


def halves(points: Iterable[CalibrationPoint]) -> list[CalibrationPoint]:
    """One surface's points split in two for the held-out test (issue 40: fit on half of each surface, predict the
    other half): every other point in the surface's order (trial, load, run) is held out, so both halves hold
    every configuration and every load."""
    return [dataclasses.replace(p, held_out=bool(i % 2)) for i, p in enumerate(points)]


def fit_cpu(train: Iterable[CalibrationPoint], host_cores: bool = True) -> Efficiency:
    """The CPU build's factors, fitted from a neutral start; ``host_cores``: with the cores' bound
    (``host_cpu_ms_per_token``, queueing.host_bound_tpot_s), else without it, as before it was there."""
    points = list(train)
    start = Efficiency(
        decode_bandwidth=0.1, prefill_flops=0.01, step_overhead_ms=5.0, sequence_overhead_ms=0.1, closed_loop_waves=0.5
    )
    without = fit_efficiency(points, start=start, bounds=CPU_BOUNDS, extra=[("closed_loop_waves", 0.0, 1.0)])
    if not host_cores:
        return without
    # A bound that binds at no point has no gradient: the fit starts it where it binds at some of the training
    # points (HOST_CPU_MS_STARTS) and keeps the best fit, the fit without it among them.
    extra = [("closed_loop_waves", 0.0, 1.0), ("host_cpu_ms_per_token", 0.0, 10.0)]
    fits = [without] + [
        fit_efficiency(
            points, start=start.model_copy(update={"host_cpu_ms_per_token": ms}), bounds=CPU_BOUNDS, extra=extra
        )
        for ms in HOST_CPU_MS_STARTS
    ]
    return min(fits, key=lambda eff: fit_cost(points, eff))


def fit_cost(points: list[CalibrationPoint], eff: Efficiency) -> float:
    """The fit's own objective at ``eff``: the soft-L1 loss fit_efficiency minimises, summed."""
    counts = Counter(p.source_id for p in points)
    r = _residuals(points, eff, {source: n**-0.25 for source, n in counts.items()}) / SOFT_L1_SCALE
    return float(np.sum(2.0 * (np.sqrt(1.0 + r**2) - 1.0)))
