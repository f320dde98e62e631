"""An open loop's TTFT on the GPU twin, level by level, by how near its rate is to the configuration's capacity.

    PYTHONPATH=src .venv/bin/python bench/twin_open_wait.py [--space bench/data/gpu-twin-grid.yaml] [--seed 0]

Simulates every point of a Poisson space on the GPU twin (bench/twin_grid.py, the shipped factors, the run-to-run
spread) and predicts each measured level's mean TTFT with the shipped factors three times: without the wait for a
slot (the arrivals taken as evenly spaced, so :func:`servetune.estimate.queueing.slot_wait_s` is 0: the estimate
before it had that term), with the long run's wait (Poisson, the level's length not read), and with the wait of a
level of its measured requests started on an empty queue (what a trial's estimate now does). Prints the median
|error| and median signed error per band of the level's rate over the replica's capacity rate, levels the model
calls saturated left out.

``--noise-free`` instead runs levels of ``--requests`` Poisson arrivals on the twin without its run-to-run spread,
at set shares of three Llama-3.1-8B configurations' capacity (8, 32 and 64 slots, 1,000 in / 200 out), ``--seeds``
levels each, and prints the mean measured TTFT beside a simulated FIFO M/D/c queue's (the queue the model assumes:
the capacity's slots, each held the residence at the operating batch) and the long-run and the finite-level
estimates: the wait's own model against the twin's queue and against its own assumption, without the noise of the
run factor. Each takes under a minute of a core.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import statistics
from pathlib import Path

import numpy as np
import twin_grid  # bench/ (this script's directory is on sys.path)

from servetune.estimate import load_factors
from servetune.estimate.calibrate import predict
from servetune.estimate.queueing import capacity, open_loop, steady
from servetune.load.runner import Level
from servetune.testing.twin import Twin, TwinConfig
from servetune.trial.estimated import calibration_points
from servetune.trial.measure import LevelPlan

BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 1.0), (0.0, 1.0))
NO_BURSTS = 1e300  # a gamma shape so large the arrivals are evenly spaced: no wait for a slot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", type=Path, default=Path(__file__).parent / "data" / "gpu-twin-grid.yaml")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise-free", action="store_true", help="the twin's queue alone, no run factor")
    parser.add_argument("--requests", type=int, default=256, help="--noise-free: requests a level")
    parser.add_argument("--seeds", type=int, default=40, help="--noise-free: levels a share")
    args = parser.parse_args()
    if args.noise_free:
        noise_free(args.requests, args.seeds)
        return
    surface, _ = twin_grid.build(args.space, seed=args.seed)
    gpu = surface.space.hardware.gpu
    rows, saturated = [], 0
    for result in surface.results.values():
        if result.outcome != "COMPLETE":
            continue
        for point in calibration_points(result, gpu, None):
            if "ttft_ms" not in point.measured:
                continue
            eff = load_factors().for_class(point.gpu_class)
            with_wait, sat = predict(point, eff)
            if sat:
                saturated += 1
                continue
            without, _ = predict(dataclasses.replace(point, burstiness=NO_BURSTS), eff)
            long_run, _ = predict(dataclasses.replace(point, requests=None), eff)
            cap = capacity(point.replica, point.input_tokens, point.output_tokens)
            most = steady(point.replica, eff, cap, point.input_tokens, point.output_tokens)
            share = point.load / most.request_rate(point.output_tokens)
            measured = point.measured["ttft_ms"]
            rows.append((share, *(got["ttft_ms"] / measured - 1 for got in (without, long_run, with_wait))))
    print(f"{'rate / capacity':<16}{'levels':>7}  {'no wait |err|':>14} {'signed':>8}  {'long run |err|':>15} "
          f"{'signed':>8}  {'finite level |err|':>19} {'signed':>8}")  # fmt: skip
    for lo, hi in BANDS:
        band = [r for r in rows if lo <= r[0] < hi]
        if not band:
            continue
        columns = list(zip(*band, strict=True))[1:]
        cells = "  ".join(f"{_abs(e):>{w}} {_signed(e):>8}" for e, w in zip(columns, (14, 15, 19), strict=True))
        print(f"{lo:.2f}-{hi:.2f}{'':<7}{len(band):>7}  {cells}")
    print(f"levels the model calls saturated (left out): {saturated}")


NOISE_FREE_SHARES = (0.7, 0.85, 0.9, 0.95, 0.98, 0.995)


def noise_free(requests: int, seeds: int, lengths: tuple[int, int] = (1000, 200)) -> None:
    """Levels of ``requests`` Poisson arrivals on the twin with no run factor: measured mean TTFT against the
    long-run and the finite-level estimates, per configuration and share of its capacity."""
    isl, osl = lengths
    print(f"{'slots':>5} {'rate / capacity':>16} {'measured ms':>12} {'FIFO M/D/c ms':>14} {'long run ms':>12} "
          f"{'finite level ms':>16}")  # fmt: skip
    for slots in (8, 32, 64):
        engine = {"max_model_len": 8192, "max_num_seqs": slots, "max_num_batched_tokens": 8192}
        twin = Twin(TwinConfig(gpu="H100-SXM", model="meta-llama/Llama-3.1-8B-Instruct", engine_args=engine,
                               spread=0.0))  # fmt: skip
        rep, eff = twin.replica, twin.efficiency
        most = steady(rep, eff, capacity(rep, isl, osl), isl, osl).request_rate(osl)
        for share in NOISE_FREE_SHARES:
            level = Level("rate", share * most, "poisson")
            plan = LevelPlan.sized(level, requests, None, 0)
            means = []
            for seed in range(seeds):
                records = twin_grid.simulate_level(twin, level, plan, lengths, np.random.default_rng(seed))
                means.append(statistics.mean(r.chunk_times[0] - r.sent for r in records))
            whole = open_loop(rep, eff, level.value, isl, osl)
            long_run = whole.ttft_s or math.inf
            finite = open_loop(rep, eff, level.value, isl, osl, requests=requests).ttft_s or math.inf
            # the queue the model assumes, simulated: FIFO, the capacity's slots, each held the residence at the
            # operating batch, arrivals at in_flight / residence a second; TTFT is the engine's plus that wait
            service = steady(rep, eff, whole.in_flight, isl, osl)
            fifo = service.ttft_s + statistics.mean(
                fifo_level_wait(capacity(rep, isl, osl), whole.in_flight, service.residence_s(osl), requests, seed)
                for seed in range(seeds)
            )
            print(f"{slots:>5} {share:>16.3f} {statistics.mean(means) * 1e3:>12.0f} {fifo * 1e3:>14.0f} "
                  f"{long_run * 1e3:>12.0f} {finite * 1e3:>16.0f}")  # fmt: skip


def fifo_level_wait(slots: int, in_flight: float, service_s: float, requests: int, seed: int) -> float:
    """The mean wait for a slot of ``requests`` Poisson arrivals into an empty FIFO M/D/c queue (``slots`` servers
    each holding a request ``service_s`` seconds; ``in_flight`` / ``service_s`` arrivals a second)."""
    sends = np.cumsum(np.random.default_rng(seed).exponential(service_s / in_flight, size=requests))
    free = [0.0] * slots
    total = 0.0
    for sent in sends:
        start = max(float(sent), heapq.heappop(free))
        total += start - sent
        heapq.heappush(free, start + service_s)
    return total / requests


def _abs(errors: list[float]) -> str:
    return f"{statistics.median(abs(e) for e in errors):.1%}"


def _signed(errors: list[float]) -> str:
    return f"{statistics.median(errors):+.1%}"


if __name__ == "__main__":
    main()
