"""Does the online refit help? The next trial's error after k trials, shipped factors against refit ones.

    PYTHONPATH=src .venv/bin/python bench/estimate_refit.py [--after 5] [--orders 20] [--prior-points 5] [--no-twin]

Replays each recorded CPU surface in ``bench/data`` (every grid trial with its measured levels) in
``--orders`` seeded random trial orders. After the first ``--after`` completed trials it refits the
CPU factors on their levels (:func:`servetune.estimate.refit.refit`, shrunk toward the shipped
factors) and predicts the next trial's levels; it prints the median |predicted/measured - 1| per
metric over those next trials, with the shipped factors and with the refit ones. The shipped CPU
factors were fitted on ``cpu-tiny-grid-r3.json`` itself, so that surface is their best case;
``cpu-tiny-grid.json`` is another host, where the shipped factors miss the most.

Then the same on GPU-twin surfaces (bench/twin_grid.py: every point of ``gpu-twin-closed.yaml``, a
closed loop, and ``gpu-twin-grid.yaml``, a Poisson ladder, Llama-3.1-8B on H100-SXM, simulated at the
twin's pace with the run-to-run spread). A twin paced by the shipped factors leaves the refit nothing to
correct (the ``shipped`` rows: the estimate's own error against its simulation, plus noise), so the twins
of :data:`TWINS` stand for H100s unlike the fit (``TwinConfig.factor_scale``: the shipped H100 factors
scaled per term), and the refit is of the H100 factors on the twin's trials (``trial/estimated.py
calibration_points``, as a study refits them), shrunk toward the shipped ones. Without ``--no-twin`` this
simulates 192 trials (about 40 s of a core each surface).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from servetune.estimate import Efficiency, load_factors
from servetune.estimate.calibrate import CalibrationPoint
from servetune.estimate.calibrate_cpu import trial_points
from servetune.estimate.refit import refit, relative_errors

SURFACES = Path(__file__).resolve().parent / "data"
METRICS = ("ttft_ms", "tpot_ms", "output_throughput")
#: GPU twins unlike the fit: the shipped H100 factors scaled per term (TwinConfig.factor_scale).
TWINS: dict[str, dict[str, float]] = {
    "shipped": {},
    "slow-memory": {"decode_bandwidth": 0.7, "step_overhead_ms": 2.0},
    "fast-compute": {"prefill_flops": 1.5, "sequence_overhead_ms": 0.5},
}
TWIN_SPACES = ("gpu-twin-closed", "gpu-twin-grid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--after", type=int, default=5, help="completed trials before the refit (default 5)")
    parser.add_argument("--orders", type=int, default=20, help="seeded random trial orders per surface (default 20)")
    parser.add_argument("--prior-points", type=float, default=5.0, help="the prior's weight in points (default 5)")
    parser.add_argument("--no-twin", action="store_true", help="the CPU surfaces only (no GPU-twin simulation)")
    args = parser.parse_args()
    print(f"next trial's median |error| after {args.after} trials, {args.orders} orders, prior {args.prior_points}")
    print(f"{'surface':<34} {'metric':<18} {'shipped':>8} {'refit':>8} {'better in':>10} {'refit/shipped':>14}")
    shipped = load_factors().for_class("CPU")
    for path in sorted(SURFACES.glob("cpu-tiny-grid*.json")):
        trials = [t for t in json.loads(path.read_text(encoding="utf-8"))["trials"] if t.get("outcome") == "COMPLETE"]
        replay(path.stem, trials, lambda t, held_out, stem=path.stem: trial_points(t, stem, held_out), shipped, args)
    if args.no_twin:
        return
    import twin_grid  # bench/ (this script's directory is on sys.path)

    from servetune.trial.estimated import calibration_points

    shipped = load_factors().for_class("H100")
    for space in TWIN_SPACES:
        for name, scale in TWINS.items():
            surface, _ = twin_grid.build(SURFACES / f"{space}.yaml", seed=0, factor_scale=scale)
            gpu = surface.space.hardware.gpu
            trials = [r for r in surface.results.values() if r.outcome == "COMPLETE"]
            replay(f"{space} {name}", trials, lambda t, _held_out, gpu=gpu: calibration_points(t, gpu, None),
                   shipped, args)  # fmt: skip


def replay(
    label: str,
    trials: Sequence[Any],
    points_of: Callable[[Any, bool], list[CalibrationPoint]],
    shipped: Efficiency,
    args: argparse.Namespace,
) -> None:
    """The next trial's median error after ``args.after`` of ``trials`` in each seeded order, shipped and refit."""
    if len(trials) <= args.after:
        return
    errors: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METRICS}
    wins = dict.fromkeys(METRICS, 0)
    for seed in range(args.orders):
        order = random.Random(seed).sample(list(trials), len(trials))
        seen = [p for t in order[: args.after] for p in points_of(t, False)]
        eff = refit(seen, shipped, prior_points=args.prior_points)
        nxt = points_of(order[args.after], True)
        for metric in METRICS:
            before = [e[metric] for p in nxt if metric in (e := relative_errors(p, shipped))]
            after = [e[metric] for p in nxt if metric in (e := relative_errors(p, eff))]
            if before and after:
                errors[metric][0].append(statistics.median(before))
                errors[metric][1].append(statistics.median(after))
                wins[metric] += statistics.median(after) < statistics.median(before)
    for metric, (before, after) in errors.items():
        if before:
            b, a = statistics.median(before), statistics.median(after)
            print(f"{label:<34} {metric:<18} {b:>7.1%} {a:>7.1%} {wins[metric]:>4}/{len(before):<5} {a / b:>13.2f}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
