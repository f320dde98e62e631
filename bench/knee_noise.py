"""Run-to-run noise of the knee's throughput slope, and of P99 TTFT, on the recorded surfaces (no engines, seconds).

The knee (results.py ``find_knee``) compares the output-throughput gain between two loads x1 < x2,
``(t2 / t1 - 1) / (x2 / x1 - 1)``, with ``load.knee_fraction``; verify's overload scenario compares the admitted
requests' P99 TTFT with the SLO's bound. Neither had a noise measurement. The surfaces in ``bench/data`` ran every
level three times on the same engine (``load.repeats: 3``), so each level has three runs:

- per level, the **throughput noise**: half the spread of its runs' output throughput (with every client busy,
  as the knee reads it) relative to their median (results.py ``throughput_noise`` without its floor);
- per pair of consecutive loads of a trial, the **slope** of each run (run i at x1 against run i at x2) and half
  their spread: how far a single measurement's slope strays. It is set against the slope noise the levels'
  throughput noise predicts, ``(t2 / t1) x (n1 + n2) / (x2 / x1 - 1)`` (trial/capacity.py ``slope_noise``);
- how often the runs disagree on the knee decision (slope below the fraction or not);
- per level meeting the SLO, the **P99 TTFT noise**: half its runs' spread relative to their median.

    .venv/bin/python bench/knee_noise.py [bench/data/cpu-tiny-grid-r3.json bench/data/cpu-tiny-grid-r4.json] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

from servetune.results import KNEE_FRACTION, TrialResult, level_load

DATA = Path(__file__).parent / "data"
SURFACES = [DATA / "cpu-tiny-grid-r3.json", DATA / "cpu-tiny-grid-r4.json"]


def half_spread(values: list[float]) -> float:
    middle = statistics.median(values)
    return (max(values) - min(values)) / (2 * middle) if middle > 0 else 0.0


def busy(summary) -> float:
    return summary.busy_output_throughput if summary.busy_output_throughput is not None else summary.output_throughput


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "median": statistics.median(ordered), "p90": at(0.9), "max": ordered[-1]}


def measure(paths: list[Path], fraction: float = KNEE_FRACTION) -> dict:
    throughput_noise, ttft_noise, slope_spread, predicted, covered, flips = [], [], [], [], 0, 0
    pairs = 0
    for path in paths:
        for raw in json.loads(path.read_text())["trials"]:
            trial = TrialResult.model_validate(raw)
            levels = sorted((lv for lv in trial.levels if len(lv.runs) >= 2), key=level_load)
            for lv in levels:
                throughput_noise.append(half_spread([busy(r.summary) for r in lv.runs]))
                p99 = [r.summary.ttft_ms.p99 for r in lv.runs if r.summary.ttft_ms.p99 is not None]
                if lv.meets_slo and len(p99) >= 2:
                    ttft_noise.append(half_spread(p99))
            for a, b in itertools.pairwise(levels):
                x1, x2 = level_load(a), level_load(b)
                runs = min(len(a.runs), len(b.runs))
                slopes = [(busy(b.runs[i].summary) / busy(a.runs[i].summary) - 1) / (x2 / x1 - 1) for i in range(runs)]
                spread = (max(slopes) - min(slopes)) / 2
                t1, t2 = (
                    statistics.median(busy(r.summary) for r in a.runs),
                    statistics.median(busy(r.summary) for r in b.runs),
                )
                n1, n2 = half_spread([busy(r.summary) for r in a.runs]), half_spread([busy(r.summary) for r in b.runs])
                expected = (t2 / t1) * (n1 + n2) / (x2 / x1 - 1)
                slope_spread.append(spread)
                predicted.append(expected)
                covered += spread <= expected + 1e-12
                flips += len({s < fraction for s in slopes}) > 1
                pairs += 1
    return {
        "surfaces": [str(p) for p in paths],
        "throughput_noise": quantiles(throughput_noise),
        "slope_half_spread": quantiles(slope_spread),
        "slope_noise_predicted": quantiles(predicted),
        "pairs": pairs,
        "pairs_within_predicted": covered,
        "pairs_whose_runs_disagree_on_the_knee": flips,
        "ttft_p99_noise": quantiles(ttft_noise),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("surfaces", nargs="*", type=Path, default=SURFACES)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    out = measure(args.surfaces)
    for key in ("throughput_noise", "slope_half_spread", "slope_noise_predicted", "ttft_p99_noise"):
        q = out[key]
        print(f"{key:24s} n={q['n']:3d}  median {q['median']:.3f}  p90 {q['p90']:.3f}  max {q['max']:.3f}")
    print(f"pairs {out['pairs']}: observed slope spread within the predicted noise in {out['pairs_within_predicted']}, "
          f"runs disagreeing on the knee (slope < {KNEE_FRACTION}) in {out['pairs_whose_runs_disagree_on_the_knee']}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
