"""``servetune report``: Pareto fronts and a recommendation from a study directory (no GPU, no Ray)."""

from __future__ import annotations

import argparse
from pathlib import Path

DESCRIPTION = """\
Read a study directory (study.json and trials/*/result.json), gather every operating point
(trial x load level), and write:

  report.html          interactive Pareto fronts (plotly.js inline: opens offline)
  pareto-<front>.png   the same fronts as PNG figures
  summary.md           outcomes, failure reasons, Pareto tables, the recommendation

Where trials ran on GPU types (params: {gpu: [...]}, or hardware.gpu), a "Which GPU" section gives each
type's best configuration, its capacity at the SLO, cost per million tokens, energy per token and, with
--target-rps, the replicas and the fleet's price per hour; it recommends one type. Catalogue GPUs the
study did not measure are added as estimated rows (servetune estimate's model, calibrated on the measured
type), marked with their expected error.

Both files carry a Verification section: the verdict of `servetune verify STUDY_DIR`, its
stability numbers, scenarios and acceptance checklist (verify.json), or how to run it.

Fronts: cost per million output tokens vs P99 TTFT, vs P99 TPOT, vs P99 end-to-end latency;
output tokens/s per device vs tokens/s per user (both higher is better). Points whose trial
failed or that break an SLO are drawn apart and never on a front.

The recommendation is the cheapest operating point meeting every SLO, stepped back to the
next one when its memory margin is thin: the next-higher max_num_seqs,
gpu_memory_utilization or max_num_batched_tokens ran out of memory, the KV cache peaked at
90 % or more, or the server preempted requests (tuning checklist, section 15). A tuned
configuration must also cost less than vLLM's defaults (the baseline trial) by more than the
two measurements' noise together (10 % each for a level run once; the repeats' spread with
load.repeats), or the defaults are recommended.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="Pareto fronts (HTML, PNG, Markdown) and a recommendation from a study directory",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: servetune report servetune-results/chat-latency --price-per-gpu-hour 2.5",
    )
    p.add_argument("study_dir", type=Path, metavar="STUDY_DIR", help="the study directory (servetune-results/<study>)")
    p.add_argument("--out", type=Path, metavar="DIR", help="where to write the report (default: STUDY_DIR/report)")
    p.add_argument(
        "--price-per-gpu-hour", type=float, metavar="X",
        help="recompute costs with this price per device-hour in USD (default: each trial's recorded price)",
    )  # fmt: skip
    p.add_argument(
        "--target-rps", type=float, metavar="N",
        help="the load to serve, in requests per second: the 'which GPU' section counts each type's replicas for it",
    )  # fmt: skip
    p.add_argument(
        "--skip-unreadable", action="store_true",
        help="list an invalid result.json as 'not read' instead of stopping with an error",
    )  # fmt: skip
    p.add_argument(
        "--log-to-mlflow", action="store_true",
        help="also log the study to MLflow (trials not there yet, their records, this report): what a study could not upload",
    )  # fmt: skip
    p.add_argument(
        "--tracking-uri", metavar="URI",
        help="MLflow server or store for --log-to-mlflow (implies it; default: the one the study recorded, else "
             "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)",
    )  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.report.write import recommendation_lines, verification_line, write_report

    report, files = write_report(
        args.study_dir, args.out, args.price_per_gpu_hour, args.skip_unreadable, target_rps=args.target_rps
    )
    out = files[0].parent
    counts = ", ".join(f"{n} {name}" for name, n in report.outcome_counts().items() if n)
    print(f"study {report.info.name}: {counts or 'no trials yet'}; {len(report.points)} operating points")
    for path in files:
        print(f"wrote {path}")
    for line in recommendation_lines(report, args.study_dir):
        print(line)
    if report.recommendation.point is not None:
        print(verification_line(report))
    if report.which_gpu is not None:
        print(f"which GPU: {report.which_gpu.why}")
    if args.log_to_mlflow or args.tracking_uri:
        from servetune.tracking import sync_study
        from servetune.tracking.connection import study_tracking_uri

        synced = sync_study(args.study_dir, study_tracking_uri(args.study_dir, args.tracking_uri), report_dir=out)
        print(synced.summary())
        return 0 if synced.ok else 1
    return 0
