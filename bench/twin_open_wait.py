"""An open loop's TTFT on the GPU twin, level by level, by how near its rate is to the configuration's capacity.

    PYTHONPATH=src .venv/bin/python bench/twin_open_wait.py [--space bench/data/gpu-twin-grid.yaml] [--seed 0]

Simulates every point of a Poisson space on the GPU twin (bench/twin_grid.py, the shipped factors, the run-to-run
spread) and predicts each measured level's mean TTFT with the shipped factors twice: without the wait for a slot
(the arrivals taken as evenly spaced, so :func:`servetune.estimate.queueing.slot_wait_s` is 0: the estimate before
it had that term) and with it (Poisson). Prints the median |error| and median signed error per band of the level's
rate over the replica's capacity rate, levels the model calls saturated left out. About a minute of a core.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import twin_grid  # bench/ (this script's directory is on sys.path)

from servetune.estimate import load_factors
from servetune.estimate.calibrate import predict
from servetune.estimate.queueing import capacity, steady
from servetune.trial.estimated import calibration_points

BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.9), (0.9, 0.95), (0.95, 1.0), (0.0, 1.0))
NO_BURSTS = 1e300  # a gamma shape so large the arrivals are evenly spaced: no wait for a slot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", type=Path, default=Path(__file__).parent / "data" / "gpu-twin-grid.yaml")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
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
            cap = capacity(point.replica, point.input_tokens, point.output_tokens)
            most = steady(point.replica, eff, cap, point.input_tokens, point.output_tokens)
            share = point.load / most.request_rate(point.output_tokens)
            measured = point.measured["ttft_ms"]
            rows.append((share, without["ttft_ms"] / measured - 1, with_wait["ttft_ms"] / measured - 1))
    print(
        f"{'rate / capacity':<16}{'levels':>7}  {'no wait |err|':>14} {'signed':>8}  {'with wait |err|':>16} {'signed':>8}"
    )
    for lo, hi in BANDS:
        band = [r for r in rows if lo <= r[0] < hi]
        if not band:
            continue
        old, new = [r[1] for r in band], [r[2] for r in band]
        print(f"{lo:.2f}-{hi:.2f}{'':<7}{len(band):>7}  {_abs(old):>14} {_signed(old):>8}  {_abs(new):>16} "
              f"{_signed(new):>8}")  # fmt: skip
    print(f"levels the model calls saturated (left out): {saturated}")


def _abs(errors: list[float]) -> str:
    return f"{statistics.median(abs(e) for e in errors):.1%}"


def _signed(errors: list[float]) -> str:
    return f"{statistics.median(errors):+.1%}"


if __name__ == "__main__":
    main()
