"""Does the online refit help? The next trial's error after k trials, shipped factors against refit ones.

    PYTHONPATH=src .venv/bin/python bench/estimate_refit.py [--after 5] [--orders 20] [--prior-points 5]

Replays each recorded CPU surface in ``bench/data`` (every grid trial with its measured levels) in
``--orders`` seeded random trial orders. After the first ``--after`` completed trials it refits the
CPU factors on their levels (:func:`servetune.estimate.refit.refit`, shrunk toward the shipped
factors) and predicts the next trial's levels; it prints the median |predicted/measured - 1| per
metric over those next trials, with the shipped factors and with the refit ones. The shipped CPU
factors were fitted on ``cpu-tiny-grid-r3.json`` itself, so that surface is their best case;
``cpu-tiny-grid.json`` is another host, where the shipped factors miss the most.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from servetune.estimate import load_factors
from servetune.estimate.calibrate_cpu import trial_points
from servetune.estimate.refit import refit, relative_errors

SURFACES = Path(__file__).resolve().parent / "data"
METRICS = ("ttft_ms", "tpot_ms", "output_throughput")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--after", type=int, default=5, help="completed trials before the refit (default 5)")
    parser.add_argument("--orders", type=int, default=20, help="seeded random trial orders per surface (default 20)")
    parser.add_argument("--prior-points", type=float, default=5.0, help="the prior's weight in points (default 5)")
    args = parser.parse_args()
    shipped = load_factors().for_class("CPU")
    print(f"next trial's median |error| after {args.after} trials, {args.orders} orders, prior {args.prior_points}")
    print(f"{'surface':<22} {'metric':<18} {'shipped':>8} {'refit':>8} {'better in':>10}")
    for path in sorted(SURFACES.glob("cpu-tiny-grid*.json")):
        trials = [t for t in json.loads(path.read_text(encoding="utf-8"))["trials"] if t.get("outcome") == "COMPLETE"]
        if len(trials) <= args.after:
            continue
        errors: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in METRICS}
        wins = dict.fromkeys(METRICS, 0)
        for seed in range(args.orders):
            order = random.Random(seed).sample(trials, len(trials))
            seen = [p for t in order[: args.after] for p in trial_points(t, path.stem, held_out=False)]
            eff = refit(seen, shipped, prior_points=args.prior_points)
            nxt = trial_points(order[args.after], path.stem, held_out=True)
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
                print(f"{path.stem:<22} {metric:<18} {b:>7.1%} {a:>7.1%} {wins[metric]:>4}/{len(before)}")


if __name__ == "__main__":
    main()
