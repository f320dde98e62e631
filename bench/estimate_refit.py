"""Does the online refit help? The next trial's error after k trials, shipped factors against refit ones.

    PYTHONPATH=src .venv/bin/python bench/estimate_refit.py [--after 5] [--orders 20] [--prior-points 5 [1 ...]]
        [--no-twin] [--twin-seeds 0 1 2] [--twin-spaces gpu-twin-grid] [--bootstrap 1000]

Replays each recorded CPU surface in ``bench/data`` (every grid trial with its measured levels) in
``--orders`` seeded random trial orders. After the first ``--after`` completed trials it refits the
CPU factors on their levels (:func:`servetune.estimate.refit.refit`, shrunk toward the shipped
factors) and predicts every later trial's levels: under a random order the next trial is any of them, so their
errors, pooled over the orders, are the next trial's error distribution without one trial's luck deciding the
median. Per metric it prints the pooled median |predicted/measured - 1| with the shipped and the refit factors,
refit/shipped with a 95% bootstrap interval (orders resampled whole: one order's errors share its refit), the
share of orders whose own pooled median is halved (the issue's target), and the earlier statistic (the median
over orders of the next trial's median, and the share of orders it was better in). The shipped CPU
factors were fitted on ``cpu-tiny-grid-r3.json`` itself, so that surface is their best case;
``cpu-tiny-grid.json`` is another host, where the shipped factors miss the most.

Then the same on GPU-twin surfaces (bench/twin_grid.py: every point of ``gpu-twin-closed.yaml``, a
closed loop, and ``gpu-twin-grid.yaml``, a Poisson ladder, Llama-3.1-8B on H100-SXM, simulated at the
twin's pace with the run-to-run spread). A twin paced by the shipped factors leaves the refit nothing to
correct (the ``shipped`` rows: the estimate's own error against its simulation, plus noise), so the twins
of :data:`TWINS` stand for H100s unlike the fit (``TwinConfig.factor_scale``: the shipped H100 factors
scaled per term), and the refit is of the H100 factors on the twin's trials (``trial/estimated.py
calibration_points``, as a study refits them), shrunk toward the shipped ones; ``truth`` is the error with the
twin's own factors, the floor a refit can reach. Without ``--no-twin`` this simulates 384 trials per twin seed (about
15-50 s of a core each surface).

``--prior-points`` takes several weights to compare: each surface is built once and replayed under each, its rows
labelled by the weight (``p5``, ``p1``); ``--twin-spaces`` runs one twin space (two processes can share the work).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from servetune.estimate import Efficiency, load_factors
from servetune.estimate.calibrate import CalibrationPoint
from servetune.estimate.calibrate_cpu import trial_points
from servetune.estimate.refit import DEFAULT_PRIOR_POINTS, refit, relative_errors

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
    parser.add_argument(
        "--prior-points",
        type=float,
        nargs="+",
        default=[DEFAULT_PRIOR_POINTS],
        help="the prior's weight in points, one row set each on the same surfaces (default 5)",
    )
    parser.add_argument("--no-twin", action="store_true", help="the CPU surfaces only (no GPU-twin simulation)")
    parser.add_argument("--twin-seeds", type=int, nargs="+", default=[0], help="twin simulation seeds (default 0)")
    parser.add_argument(
        "--twin-spaces",
        nargs="+",
        default=list(TWIN_SPACES),
        choices=TWIN_SPACES,
        help="the twin spaces to simulate (default both)",
    )
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the orders (default 1000)")
    args = parser.parse_args()
    priors = " / ".join(f"{w:g}" for w in args.prior_points)
    print(f"refit after {args.after} trials, {args.orders} orders, prior {priors} points: every level of every "
          f"later trial, |predicted/measured - 1|, pooled over the orders; 95% bootstrap interval of refit/shipped "
          f"over orders; share of orders whose own median is halved | the earlier statistic: median over orders of "
          f"the next trial's median, refit/shipped, share of orders better")  # fmt: skip
    print(f"{'surface':<36} {'metric':<17} {'shipped':>7} {'refit':>7} {'ratio':>5} {'95% interval':>12} "
          f"{'halved':>6} | {'next':>6} {'next':>6} {'ratio':>5} {'better':>6} | {'truth':>6}")  # fmt: skip
    shipped = load_factors().for_class("CPU")
    for path in sorted(SURFACES.glob("cpu-tiny-grid*.json")):
        trials = [t for t in json.loads(path.read_text(encoding="utf-8"))["trials"] if t.get("outcome") == "COMPLETE"]
        for prior_points in args.prior_points:
            replay(labelled(path.stem, prior_points, args), trials,
                   lambda t, held_out, stem=path.stem: trial_points(t, stem, held_out), shipped, args, prior_points)  # fmt: skip
    if args.no_twin:
        return
    import twin_grid  # bench/ (this script's directory is on sys.path)

    from servetune.testing.twin import TwinConfig
    from servetune.trial.estimated import calibration_points

    shipped = load_factors().for_class("H100")
    for seed in args.twin_seeds:
        for space in args.twin_spaces:
            for name, scale in TWINS.items():
                surface, _ = twin_grid.build(SURFACES / f"{space}.yaml", seed=seed, factor_scale=scale)
                gpu = surface.space.hardware.gpu
                trials = [r for r in surface.results.values() if r.outcome == "COMPLETE"]
                truth = TwinConfig(gpu=gpu, factor_scale=scale).efficiency(shipped)
                for prior_points in args.prior_points:
                    replay(labelled(f"{space} {name} s{seed}", prior_points, args), trials,
                           lambda t, _held_out, gpu=gpu: calibration_points(t, gpu, None), shipped, args, prior_points,
                           truth)  # fmt: skip


def labelled(surface: str, prior_points: float, args: argparse.Namespace) -> str:
    """The row label: the surface, and the prior's weight where several are compared."""
    return surface if len(args.prior_points) == 1 else f"{surface} p{prior_points:g}"


def replay(
    label: str,
    trials: Sequence[Any],
    points_of: Callable[[Any, bool], list[CalibrationPoint]],
    shipped: Efficiency,
    args: argparse.Namespace,
    prior_points: float,
    truth: Efficiency | None = None,
) -> dict[str, Pooled]:
    """Refit after ``args.after`` of ``trials`` in each seeded order, the shipped factors worth ``prior_points``;
    print shipped against refit per metric."""
    if len(trials) <= args.after:
        return {}
    pooled = {m: Pooled() for m in METRICS}
    for seed in range(args.orders):
        order = random.Random(seed).sample(list(trials), len(trials))
        seen = [p for t in order[: args.after] for p in points_of(t, False)]
        eff = refit(seen, shipped, prior_points=prior_points)
        for position, trial in enumerate(order[args.after :]):
            for point in points_of(trial, True):
                before, after = relative_errors(point, shipped), relative_errors(point, eff)
                for metric in METRICS:  # an unbounded TTFT (an open loop the factors saturate) is an infinite miss
                    if metric in point.measured and (metric in before or metric in after):
                        b, a = before.get(metric, math.inf), after.get(metric, math.inf)
                        pooled[metric].add(seed, position == 0, b, a)
                        if truth is not None and seed == 0:  # the same levels whatever the order
                            pooled[metric].truth.append(relative_errors(point, truth).get(metric, math.inf))
    for metric, p in pooled.items():
        if p.seeds:
            print(p.line(label, metric, args.bootstrap), flush=True)
    return pooled


class Pooled:
    """One metric's level errors on a surface, shipped and refit, by order (seed); ``next`` marks the next trial's."""

    def __init__(self) -> None:
        self.errors: dict[int, list[tuple[bool, float, float]]] = {}
        self.truth: list[float] = []  # the twin's own factors' errors on the first order's later trials

    @property
    def seeds(self) -> list[int]:
        return sorted(self.errors)

    def add(self, seed: int, is_next: bool, shipped: float, refitted: float) -> None:
        self.errors.setdefault(seed, []).append((is_next, shipped, refitted))

    def stats(self, resamples: int) -> dict[str, float]:
        """Pooled medians (every level of every trial after the refit, over all orders), their ratio with a bootstrap
        interval over orders (orders resampled whole: one order's errors share its refit), the share of orders whose
        own pooled median is halved, and the earlier statistic (median over orders of the next trial's median)."""
        arrays = {s: np.array([r[1:] for r in rows]) for s, rows in self.errors.items()}
        seeds = self.seeds

        def ratio(chosen: Sequence[int]) -> tuple[float, float, float]:
            both = np.concatenate([arrays[s] for s in chosen])
            b, a = np.median(both, axis=0)
            return float(b), float(a), float(a / b) if b else math.inf

        before, after, r = ratio(seeds)
        rng = np.random.default_rng(0)
        boot = np.sort([ratio(rng.choice(seeds, len(seeds)))[2] for _ in range(resamples)])
        per = [(statistics.median(x[1] for x in rows if x[0]), statistics.median(x[2] for x in rows if x[0]))
               for rows in self.errors.values() if any(x[0] for x in rows)]  # fmt: skip
        old_b, old_a = statistics.median(b for b, _ in per), statistics.median(a for _, a in per)
        return {
            "shipped": before, "refit": after, "ratio": r,
            "low": float(np.quantile(boot, 0.025)), "high": float(np.quantile(boot, 0.975)),
            "halved": sum(ratio([s])[2] <= 0.5 for s in seeds) / len(seeds), "orders": len(seeds),
            "old_shipped": old_b, "old_refit": old_a, "old_ratio": old_a / old_b if old_b else math.inf,
            "old_better": sum(a < b for b, a in per) / len(per),
            "truth": float(np.median(self.truth)) if self.truth else math.nan,
        }  # fmt: skip

    def line(self, label: str, metric: str, resamples: int) -> str:
        x = self.stats(resamples)
        truth = "-" if math.isnan(x["truth"]) else f"{x['truth']:.1%}"
        return (f"{label:<36} {metric:<17} {x['shipped']:>7.1%} {x['refit']:>7.1%} {x['ratio']:>5.2f} "
                f"[{x['low']:.2f}, {x['high']:.2f}] {x['halved']:>6.0%} | {x['old_shipped']:>6.1%} {x['old_refit']:>6.1%} "
                f"{x['old_ratio']:>5.2f} {x['old_better']:>5.0%} | {truth:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
