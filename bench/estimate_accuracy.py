"""How well the performance estimate predicts public vLLM measurements (issue 40, items 1 and 2).

Refits the efficiency factors on the training rows of ``src/servetune/estimate/data/
vllm_public_perf.csv`` (849 points, 12 sources, A100/H100/H200; see ``calibration_README.md``
beside it) and prints the median and P90 of |predicted / measured - 1| for TPOT, TTFT and output
throughput, on the training and the held-out rows, per GPU class, below saturation (points the
model calls saturated are counted apart: a saturated open loop's TTFT is queueing that grows with
the run). The split is deterministic (SHA-256 of the CSV line = 0 mod 5 is held out). Targets from
the issue: held-out below saturation, median TPOT error <= 10 %, TTFT <= 15 %.

    PYTHONPATH=src .venv/bin/python bench/estimate_accuracy.py            # print the tables
    PYTHONPATH=src .venv/bin/python bench/estimate_accuracy.py --write    # and ship the factors
    PYTHONPATH=src .venv/bin/python bench/estimate_accuracy.py --by-source
    PYTHONPATH=src .venv/bin/python bench/estimate_accuracy.py --cpu [--write]  # the CPU stand-in
    PYTHONPATH=src .venv/bin/python bench/estimate_accuracy.py --cpu --per-load  # and its signed error per load

With ``--cpu`` it fits the CPU build's factors instead (issue 40, item 6) on the recorded surface
``bench/data/cpu-tiny-grid-r3.json`` and holds out ``cpu-tiny-grid-r4.json`` (the same AMD EPYC
host, another day, other request counts) and ``cpu-tiny-grid.json`` (an Intel host, bfloat16:
how far the factors carry to a host whose rates were not given).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from servetune.estimate import calibrate, calibrate_cpu
from servetune.estimate.factors import Factors, load_factors

ROOT = Path(__file__).resolve().parents[1]
FACTORS = ROOT / "src/servetune/estimate/data/factors.json"
SURFACES = ROOT / "bench/data"


def _cell(points: list[calibrate.CalibrationPoint], metric: str) -> str:
    err = calibrate.error_of(points, metric)
    return "-" if err is None else f"{100 * err.median:5.1f}% / {100 * err.p90:5.1f}% (n={err.points})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help=f"write the fitted factors to {FACTORS}")
    parser.add_argument("--by-source", action="store_true", help="also print the error per source")
    parser.add_argument("--cpu", action="store_true", help="fit and score the CPU build's factors instead")
    parser.add_argument(
        "--per-load", action="store_true", help="with --cpu, also the signed median error per surface and load"
    )
    args = parser.parse_args()
    if args.cpu:
        cpu(args.write, args.per_load)
        return

    text = calibrate.shipped_data()
    factors, points, skipped = calibrate.fit(text)
    print(f"data sha256 {factors.data_sha256[:16]}…  points {len(points)}  left out {dict(skipped)}")
    print(f"split: {factors.split}")
    print(f"default factors: {factors.default.model_dump()}")
    for cls, eff in factors.per_gpu_class.items():
        print(f"{cls:>5} factors:  {eff.model_dump()}")
    print()
    header = f"{'set':<9} {'GPU':<5} {'regime':<14} " + " ".join(f"{m + ' med / p90':<30}" for m in calibrate.METRICS)
    print(header)
    for held in (False, True):
        for cls in ["all", *sorted({p.gpu_class for p in points})]:
            for saturated in (False, True):
                sel = [
                    p
                    for p in points
                    if p.held_out == held and (cls == "all" or p.gpu_class == cls) and p.saturated == saturated
                ]
                if not sel:
                    continue
                name = "held-out" if held else "train"
                regime = "saturated" if saturated else "below sat."
                cells = " ".join(f"{_cell(sel, m):<30}" for m in calibrate.METRICS)
                print(f"{name:<9} {cls:<5} {regime:<14} {cells}")
    if args.by_source:
        print()
        for source in sorted({p.source_id for p in points}):
            sel = [p for p in points if p.source_id == source]
            cells = " ".join(f"{_cell(sel, m):<30}" for m in calibrate.METRICS)
            print(f"{source:<34} {cells}")
    if args.write:
        kept = {k: v for k, v in load_factors().per_gpu_class.items() if k == "CPU"}  # the CPU fit is --cpu's
        factors = factors.model_copy(update={"per_gpu_class": {**factors.per_gpu_class, **kept}})
        calibrate.write_factors(factors, FACTORS)
        print(f"\nwrote {FACTORS}")


def _signed(points: list[calibrate.CalibrationPoint], metric: str) -> str:
    errors = [
        p.predicted[metric] / p.measured[metric] - 1 for p in points if metric in p.measured and metric in p.predicted
    ]
    return "-" if not errors else f"{100 * statistics.median(errors):+6.1f}% (n={len(errors)})"


def cpu(write: bool, per_load: bool = False) -> None:
    train = calibrate_cpu.read_surface(SURFACES / "cpu-tiny-grid-r3.json", held_out=False)
    held = calibrate_cpu.read_surface(SURFACES / "cpu-tiny-grid-r4.json", held_out=True)
    other_host = calibrate_cpu.read_surface(SURFACES / "cpu-tiny-grid.json", held_out=True)
    eff = calibrate_cpu.fit_cpu(train)
    print(f"CPU factors (given rates {calibrate_cpu.RECORDED_HOST}): {eff.model_dump()}")
    scored = Factors(per_gpu_class={"CPU": eff})
    print(f"{'surface':<34} {'regime':<12} " + " ".join(f"{m + ' med / p90':<30}" for m in calibrate.METRICS))
    for name, points in (
        ("r3 (train, AMD)", train),
        ("r4 (held-out, AMD)", held),
        ("grid (held-out, Intel bf16)", other_host),
    ):
        calibrate.score(points, scored)
        for saturated in (False, True):
            sel = [p for p in points if p.saturated == saturated]
            regime = "saturated" if saturated else "below sat."
            print(f"{name:<34} {regime:<12} " + " ".join(f"{_cell(sel, m):<30}" for m in calibrate.METRICS))
    if per_load:
        print("\nsigned median of predicted / measured - 1, per closed-loop load (clients)")
        print(f"{'surface':<34} {'clients':<12} " + " ".join(f"{m:<30}" for m in calibrate.METRICS))
        for name, points in (("r3 (train)", train), ("r4 (held-out)", held), ("grid (held-out, Intel)", other_host)):
            for load in sorted({p.load for p in points}):
                sel = [p for p in points if p.load == load]
                print(f"{name:<34} {load:<12g} " + " ".join(f"{_signed(sel, m):<30}" for m in calibrate.METRICS))
    if write:
        shipped = load_factors()
        factors = shipped.model_copy(update={"per_gpu_class": {**shipped.per_gpu_class, "CPU": eff}})
        calibrate.write_factors(factors, FACTORS)
        print(f"\nwrote {FACTORS}")


if __name__ == "__main__":
    main()
