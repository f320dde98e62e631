"""Does the online refit help? The next trial's error after k trials, shipped factors against refit ones.

    PYTHONPATH=src .venv/bin/python bench/estimate_refit.py [--after 5] [--orders 20] [--prior-points 5 [1 ...]]
        [--no-twin] [--twin-seeds 0 1 2] [--twin-spaces gpu-twin-grid] [--twins fast-compute] [--bootstrap 1000]

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

Where the floor is well above zero, half the shipped error may be out of reach whatever the factors. So each row
also gives two floors, ``truth`` (the twin's own factors) and ``best`` (the same refit on every trial of the
surface: what the refit reaches with all the data, on any surface), on the same levels as the other columns, and
against each the share of the reachable improvement, (shipped - refit) / (shipped - floor)
(:func:`reachable_share`), with a 95% bootstrap interval over the orders; share >= 0.5 is the issue's halving
applied to the error above the floor, and '-' marks a floor the shipped error is not above beyond its interval.

``--prior-points`` takes several weights to compare: each surface is built once and replayed under each, its rows
labelled by the weight (``p5``, ``p1``); ``--twin-spaces`` runs one twin space and ``--twins`` some of the twins (two
processes can share the work).
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
    parser.add_argument(
        "--twins", nargs="+", default=list(TWINS), choices=TWINS, help="the twins to simulate (default all three)"
    )
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the orders (default 1000)")
    args = parser.parse_args()
    priors = " / ".join(f"{w:g}" for w in args.prior_points)
    print(f"refit after {args.after} trials, {args.orders} orders, prior {priors} points: every level of every "
          f"later trial, |predicted/measured - 1|, pooled over the orders; 95% bootstrap interval of refit/shipped "
          f"over orders; share of orders whose own median is halved | the earlier statistic: median over orders of "
          f"the next trial's median, refit/shipped, share of orders better | floors: the twin's own factors (truth) "
          f"and the refit on every trial of the surface (best), each with the share of the reachable improvement, "
          f"(shipped - refit) / (shipped - floor), and its 95% interval ('-': shipped not above the floor)")  # fmt: skip
    print(f"{'surface':<36} {'metric':<17} {'shipped':>7} {'refit':>7} {'ratio':>5} {'95% interval':>12} "
          f"{'halved':>6} | {'next':>6} {'next':>6} {'ratio':>5} {'better':>6} | {'truth':>6} {'share':>19} | "
          f"{'best':>6} {'share':>19}")  # fmt: skip
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
            for name in args.twins:
                scale = TWINS[name]
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
    print shipped against refit per metric, with the floors: the twin's own factors (``truth``) and the refit on
    every trial of the surface (``best``)."""
    if len(trials) <= args.after:
        return {}
    best = refit([p for t in trials for p in points_of(t, False)], shipped, prior_points=prior_points)
    # each level's error with the factors that do not depend on the order, once per trial
    fixed = [[(point, relative_errors(point, shipped), relative_errors(point, best),
               relative_errors(point, truth) if truth is not None else {}) for point in points_of(t, True)]
             for t in trials]  # fmt: skip
    pooled = {m: Pooled(truth is not None) for m in METRICS}
    for seed in range(args.orders):
        order = random.Random(seed).sample(range(len(trials)), len(trials))
        seen = [p for i in order[: args.after] for p in points_of(trials[i], False)]
        eff = refit(seen, shipped, prior_points=prior_points)
        for position, i in enumerate(order[args.after :]):
            for point, before, oracle, own in fixed[i]:
                after = relative_errors(point, eff)
                for metric in METRICS:  # an unbounded TTFT (an open loop the factors saturate) is an infinite miss
                    if metric in point.measured and (metric in before or metric in after):
                        errors = [before.get(metric, math.inf), after.get(metric, math.inf),
                                  oracle.get(metric, math.inf)] + ([own.get(metric, math.inf)] if truth else [])  # fmt: skip
                        pooled[metric].add(seed, position == 0, errors)
    for metric, p in pooled.items():
        if p.seeds:
            print(p.line(label, metric, args.bootstrap), flush=True)
    return pooled


def bootstrap_medians(by_order: Sequence[np.ndarray], resamples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The pooled median of each column of ``by_order`` (one array of level errors a row per order: shipped, refit,
    then the floors), and the same over ``resamples`` resamples of the orders, drawn whole (one order's errors share
    its refit): (medians, resampled medians, one row each)."""
    boot = np.random.default_rng(seed)
    medians = np.median(np.concatenate(by_order), axis=0)
    resampled = [np.median(np.concatenate([by_order[k] for k in boot.integers(len(by_order), size=len(by_order))]), axis=0)
                 for _ in range(resamples)]  # fmt: skip
    return medians, np.array(resampled).reshape(resamples, len(medians))


def reachable_share(shipped: float | np.ndarray, refitted: float | np.ndarray, floor: float | np.ndarray) -> Any:
    """The share of the reachable improvement the refit gets, (shipped - refit) / (shipped - floor): 1 where it
    reaches the floor, 0 where it stays at the shipped error, above 1 past the floor (the fit bent around the model's
    own error), negative where it made things worse. The issue's target, refit <= shipped / 2, is share >= 0.5 with a
    floor of 0; against a floor, the refit halves the error it can remove."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (np.asarray(shipped) - refitted) / (np.asarray(shipped) - floor)


def judged_share(medians: np.ndarray, resampled: np.ndarray, floor: int) -> tuple[float, float, float] | None:
    """:func:`reachable_share` against column ``floor`` of :func:`bootstrap_medians`' output, with its 95% interval;
    None where the shipped error is not above the floor beyond its own interval (nothing reachable to share)."""
    gap = resampled[:, 0] - resampled[:, floor]
    if not np.isfinite(medians[floor]) or np.quantile(gap, 0.025) <= 0:
        return None
    share = reachable_share(resampled[:, 0], resampled[:, 1], resampled[:, floor])
    low, high = np.quantile(share, [0.025, 0.975])
    return float(reachable_share(medians[0], medians[1], medians[floor])), float(low), float(high)


class Pooled:
    """One metric's level errors on a surface by order (seed): shipped, refit, the refit on the whole surface
    (``best``) and, on a twin, the twin's own factors (``truth``); ``next`` marks the next trial's levels."""

    def __init__(self, has_truth: bool = False) -> None:
        self.has_truth = has_truth
        self.errors: dict[int, list[tuple[bool, list[float]]]] = {}

    @property
    def seeds(self) -> list[int]:
        return sorted(self.errors)

    def add(self, seed: int, is_next: bool, errors: list[float]) -> None:
        self.errors.setdefault(seed, []).append((is_next, errors))

    def stats(self, resamples: int) -> dict[str, Any]:
        """Pooled medians (every level of every trial after the refit, over all orders), their ratio with a bootstrap
        interval over orders, the share of orders whose own pooled median is halved, the share of the reachable
        improvement against each floor with its interval, and the earlier statistic (median over orders of the
        next trial's median)."""
        seeds = self.seeds
        arrays = [np.array([e for _, e in self.errors[s]]) for s in seeds]
        medians, resampled = bootstrap_medians(arrays, resamples)
        before, after = float(medians[0]), float(medians[1])
        ratios = resampled[:, 1] / resampled[:, 0]
        per = [(statistics.median(e[0] for n, e in rows if n), statistics.median(e[1] for n, e in rows if n))
               for rows in self.errors.values() if any(n for n, _ in rows)]  # fmt: skip
        old_b, old_a = statistics.median(b for b, _ in per), statistics.median(a for _, a in per)
        halved = sum(np.median(a[:, 1]) <= 0.5 * np.median(a[:, 0]) for a in arrays) / len(arrays)
        return {
            "shipped": before, "refit": after, "ratio": after / before if before else math.inf,
            "low": float(np.quantile(ratios, 0.025)), "high": float(np.quantile(ratios, 0.975)),
            "halved": float(halved), "orders": len(seeds),
            "old_shipped": old_b, "old_refit": old_a, "old_ratio": old_a / old_b if old_b else math.inf,
            "old_better": sum(a < b for b, a in per) / len(per),
            "best": float(medians[2]), "best_share": judged_share(medians, resampled, 2),
            "truth": float(medians[3]) if self.has_truth else math.nan,
            "truth_share": judged_share(medians, resampled, 3) if self.has_truth else None,
        }  # fmt: skip

    def line(self, label: str, metric: str, resamples: int) -> str:
        x = self.stats(resamples)
        truth = "-" if math.isnan(x["truth"]) else f"{x['truth']:.1%}"
        return (f"{label:<36} {metric:<17} {x['shipped']:>7.1%} {x['refit']:>7.1%} {x['ratio']:>5.2f} "
                f"[{x['low']:.2f}, {x['high']:.2f}] {x['halved']:>6.0%} | {x['old_shipped']:>6.1%} {x['old_refit']:>6.1%} "
                f"{x['old_ratio']:>5.2f} {x['old_better']:>5.0%} | {truth:>6} {shared(x['truth_share'])} | "
                f"{x['best']:>6.1%} {shared(x['best_share'])}")  # fmt: skip


def shared(share: tuple[float, float, float] | None) -> str:
    """A share of the reachable improvement with its interval, or '-' where nothing is reachable."""
    return f"{'-':>19}" if share is None else f"{share[0]:>5.2f} [{share[1]:.2f}, {share[2]:.2f}]"


if __name__ == "__main__":
    main()
