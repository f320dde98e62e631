"""``servetune verify``: start a study's recommendation again and test whether it is ready to ship."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from servetune.cli.prefetching import add_no_prefetch

if TYPE_CHECKING:
    from rich.console import Console
    from rich.status import Status

    from servetune.verify.choose import Selection

DESCRIPTION = """\
Start the chosen configuration of a study again and run the stability stage of the tuning
checklist at its operating point: --headroom (default 0.8, as export) times the lower of the
trial's capacity at the SLO and its knee (where throughput stopped growing with load), in whole
clients for a closed loop; without a capacity search, the highest level that met the SLO:

  soak         steady load for --duration: P99 TTFT and TPOT per window, their jitter and drift,
               growth of KV-cache usage and of the engine's memory
  peak         1.25x the level          burst        gamma arrivals, CV 3, same mean rate (with
               admission bounds, the 503s they explain are set apart: the admitted must meet the SLO)
  mix          10% of requests at the workload's P99 input length: the short ones' TTFT P99
  long_output  requests up to the server's output limit
  disconnects  half the streams dropped after their first tokens: vLLM must release them
               within 2 s (/metrics: requests running, generated tokens)
  headroom     KV-cache usage, preemptions and OOM at the peak
  repeats      the level 5 times, bootstrap intervals on goodput and P99 TTFT; the runner-up's
               too, started after the winner's engine stopped: is the winner's lead real?

Opt-in, with --scenario NAME (repeatable):

  replica_lost through Serve with 2 or more replicas: one replica's vLLM engine killed mid-load,
               the load kept on until Serve replaced it and a while after; the failed requests
               and the error burst's span, the time until the replica count and the SLO were
               back, the other replicas' TTFT P99 meanwhile (checklist 15.20: the replacement)
  rolling_update through Serve: the deployment moved mid-load to the runner-up's configuration
               (else the same one as a new version) through Serve's update path; the requests
               failed and the worst and P99 TTFT while Serve rolled the replicas over, the time
               until none of the old ones was left, the SLO after it (checklist 15.23: rollback)
  canary       through Serve: the runner-up deployed as a second application beside the winner,
               taking --canary-share of the load (the client splits it and knows who served
               what); TTFT/TPOT P50/P99 and the error rate of each share with 95% bootstrap
               intervals over the requests; FAIL names the metric the candidate regressed
               beyond its interval and past the SLO (checklist 15.23; not part of the verdict)

A trial the study measured through Ray Serve (serve.num_replicas) is verified through Serve: the
same Serve LLM application at the same replica count, on a local Ray (or the cluster at --address),
loaded through Serve's OpenAI ingress; vLLM's gauges and counters come from the replicas through
Ray's metrics agents (late by up to 2.5 s on a local Ray: the disconnect allowance grows by that).
Serve starts with the first deployment, after the GPU-type checks: a refusal leaves none on the
cluster, and at --address a Serve verify started is shut down at the end once no application is left.

Requests time out (each its own error kind) at 10x the SLO's TTFT bound for the first token,
20x its TPOT bound between chunks, and the study's request_timeout_s in all.

Before each engine starts, a hub model's weights are fetched where it runs (this machine; through
Serve on the cluster at --address, one Ray task on each node that can host a replica), outside its
start-up clock; verify.json keeps each download ("prefetch") apart from "startup_s". --no-prefetch
leaves the download to the engine.

Writes verify.json in the study directory (or --json OUT): every scenario's numbers, passed and
reason, a "stability" object (cancellation_success_rate, p99_jitter, oom, error_rate_5xx),
"limited_by" (what limited the configuration here, from the soak's and the peak's own vLLM
metrics, by the study's diagnosis rules; soak, peak, burst and mix each have one too) beside
"limited_by_in_study", and "accepted". Logs the stability numbers (and verify.limited_by) on the
trial's MLflow run when the study was logged.
Exit status: 0 accepted, 1 rejected, 2 bad input (nothing started).
"""


#: Scenarios run only when asked for (verify/replica_lost.py, verify/rolling_update.py, verify/canary.py).
OPT_IN = ("replica_lost", "rolling_update", "canary")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="test a study's recommendation under soak, peak, bursts and disconnects",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="example: servetune verify servetune-results/cpu-tiny --duration 60")  # fmt: skip
    p.add_argument("study_dir", type=Path, metavar="STUDY_DIR", help="the study directory (servetune-results/<study>)")
    p.add_argument("--pick", default="best", metavar="best|N|TRIAL_ID",
                   help="best (the recommendation, default), a row of the cost vs P99 TTFT Pareto table, or a trial id")  # fmt: skip
    p.add_argument("--duration", type=float, metavar="S",
                   help="seconds of the soak (default: 600 on GPUs, 60 on the CPU stand-in, whose other scenarios shrink to match)")  # fmt: skip
    p.add_argument(
        "--json", type=Path, metavar="OUT", help="where to write the result (default: STUDY_DIR/verify.json)"
    )
    p.add_argument("--no-runner-up", action="store_true", help="do not start the runner-up to compare the repeats with")
    p.add_argument("--headroom", type=float, default=0.8, metavar="X",
                   help="run at X times the lower of the trial's capacity at the SLO and its knee (default 0.8, as export)")  # fmt: skip
    p.add_argument("--tracking-uri", metavar="URI",
                   help="MLflow store to log the stability numbers to (default: the one the study recorded, else "
                        "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here)")  # fmt: skip
    p.add_argument("--python", default=sys.executable, help="Python interpreter that has vLLM (default: this one)")
    p.add_argument("--address", metavar="ADDR",
                   help="Ray cluster to deploy a trial through Serve on (default: a local Ray, started and stopped here)")  # fmt: skip
    p.add_argument("--scenario", action="append", default=[], choices=OPT_IN, metavar="NAME",
                   help="also run an opt-in scenario (repeatable): replica_lost (a Serve deployment of >= 2 replicas), "
                        "rolling_update (a Serve deployment), canary (through Serve, the runner-up as the candidate)")  # fmt: skip
    p.add_argument("--canary-share", type=float, default=None, metavar="X",
                   help="with --scenario canary: the share of the load the candidate takes, between 0 and 1 (default 0.1)")  # fmt: skip
    add_no_prefetch(p)
    p.set_defaults(run=run)


class ConsoleProgress:
    """Steps as a spinner with the time they take, scenarios as one line each (``servetune bench``'s style)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.status: Status | None = None
        self.started = time.monotonic()

    def step(self, text: str, seconds: float | None = None) -> None:
        planned = f" (about {seconds:.0f} s)" if seconds else ""
        self.stop()
        self.status = self.console.status(f"{text}{planned}")
        self.status.start()

    def scenario(self, name: str, passed: bool, reason: str) -> None:
        self.stop()
        mark = "[green]PASS[/]" if passed else "[red]FAIL[/]"
        if name == "runner-up":
            mark = "[cyan]----[/]"
        self.console.print(f"{mark} {name}: {reason}", soft_wrap=True, highlight=False)

    def stop(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def opening_lines(selection: Selection, runner_up: bool) -> list[str]:
    """What verify is about to start (the trial, its operating point, the runner-up), what limited the trial in
    the study (report/diagnosis.py): what the scenarios may run into first, and the admission bounds its engine
    starts with."""
    from servetune.report.diagnosis import limited_by

    winner = selection.winner
    replicas = winner.spec.serve_replicas
    through = f" through Ray Serve ({replicas} replica{'s' if replicas != 1 else ''})" if replicas else ""
    other = f"; runner-up: trial {selection.runner_up.trial_id}" if selection.runner_up and runner_up else ""
    at = f"{winner.level}" + (f" ({winner.operating.why})" if winner.operating is not None else "")
    bounds = winner.admission
    admission = (", ".join(f"{k} {v}" for k, v in bounds.engine_args().items()) + " (as export --format vllm ships it)"
                 if bounds is not None and not isinstance(bounds, str) else f"none ({bounds or 'not derived'})")  # fmt: skip
    return [f"verifying trial {winner.trial_id} at {at}{through}{other}",
            f"in the study, what limited it: {limited_by(winner.result)}",
            f"admission bounds: {admission}"]  # fmt: skip


def summary_lines(doc: dict) -> list[str]:
    """What limited the configuration in this verification (verify/diagnosis.py: its own soak and peak), and each
    diagnosed scenario's line where it says something else; the study's line was said at the start."""
    from servetune.verify.diagnosis import DIAGNOSED

    line = doc.get("limited_by")
    if line is None:
        return []
    scenarios = doc.get("scenarios") or {}
    others = [f"  {name}: {said}" for name in DIAGNOSED
              if (said := (scenarios.get(name) or {}).get("limited_by")) is not None and said != line]  # fmt: skip
    return [f"in this verification, what limited it (soak and peak): {line}", *others]


def run(args: argparse.Namespace) -> int:
    from servetune.cli.display import console as make_console
    from servetune.cli.prefetching import PointPrefetch
    from servetune.engine.args import point_structured_problem, vllm_version
    from servetune.errors import UserError
    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.tracking.connection import study_tracking_uri
    from servetune.tracking.stability import log_stability
    from servetune.verify import canary
    from servetune.verify import document as recorded
    from servetune.verify import run as verification
    from servetune.verify.choose import select
    from servetune.verify.replica_lost import refusal
    from servetune.verify.rolling_update import refusal as update_refusal
    from servetune.verify.scenarios import Budget

    if args.duration is not None and args.duration <= 0:
        raise UserError(f"--duration must be positive, got {args.duration:g}")
    selection = select(
        args.study_dir, args.pick, args.python, args.address, args.headroom
    )  # bad input stops here, before anything starts
    if "replica_lost" in args.scenario and (why := refusal(selection.winner.spec.serve_replicas)):
        raise UserError(f"--scenario replica_lost: trial {selection.winner.trial_id}: {why}")
    if "rolling_update" in args.scenario and (why := update_refusal(selection.winner.spec.serve_replicas)):
        raise UserError(f"--scenario rolling_update: trial {selection.winner.trial_id}: {why}")
    if args.canary_share is not None and not 0 < args.canary_share < 1:
        raise UserError(f"--canary-share must be between 0 and 1 (exclusive), got {args.canary_share:g}")
    if args.canary_share is not None and canary.CANARY not in args.scenario:
        raise UserError("--canary-share is for --scenario canary, which was not asked for")
    if canary.CANARY in args.scenario and (
        why := canary.refusal(
            selection.winner.spec.serve_replicas, selection.runner_up.trial_id if selection.runner_up else None
        )
    ):
        raise UserError(f"--scenario canary: trial {selection.winner.trial_id}: {why}")
    if vllm_version(args.python) is None:
        raise UserError(
            f"vLLM is not installed for {args.python} (install servetune[cpu] or servetune[gpu], or pass --python)"
        )
    started = [selection.winner]
    if selection.runner_up is not None and (not args.no_runner_up or canary.CANARY in args.scenario):
        started.append(selection.runner_up)
    for chosen in started:  # as a study refuses it before its trials: an engine answering every structured request 500
        if problem := point_structured_problem(chosen.spec.engine_args, chosen.spec.workload.asks_structured,
                                               args.python):  # fmt: skip
            raise UserError(f"{args.study_dir}: trial {chosen.trial_id}: {problem}")
    budget = Budget.for_device(selection.info.device, args.duration)
    console = make_console(stderr=True)
    winner = selection.winner
    for line in opening_lines(selection, runner_up=not args.no_runner_up):
        console.print(line, soft_wrap=True, highlight=False)
    with console.status(f"loading the tokenizer of {winner.spec.tokenizer}"):
        prompts = PromptFactory(load_tokenizer(winner.spec.tokenizer))
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    progress = ConsoleProgress(console)
    prefetched = PointPrefetch(console, spinner=False)  # verify's spinner is on while an engine starts
    try:
        doc = verification.verify(
            selection,
            budget,
            prompts,
            progress,
            runner_up=not args.no_runner_up,
            address=args.address,
            extra=tuple(dict.fromkeys(args.scenario)),
            canary_share=args.canary_share,
            prefetch=None if args.no_prefetch else prefetched.spec,
        )
    finally:
        progress.stop()
    if prefetched.records:  # each engine's download, apart from its startup_s
        doc["prefetch"] = prefetched.dumped()
    for line in summary_lines(doc):
        console.print(line, soft_wrap=True, highlight=False)
    items = recorded.checklist(selection, doc)
    if items is not None:
        doc["checklist"] = items
    out = args.json or args.study_dir / verification.VERIFY_FILE
    if doc.get("stopped") and recorded.finished_document(out):  # a stopped one does not replace a verdict
        out = out.with_name(f"{out.stem}.stopped{out.suffix}")
    recorded.write_document(doc, out)
    console.print(f"wrote {out}", soft_wrap=True)
    if doc.get("stopped"):  # what finished is kept; a partial verification is no verdict, so MLflow is not told one
        print(f"servetune verify: stopped ({doc['stopped']}): {doc['reasons'][0]}; the scenarios that finished are in {out}",
              file=sys.stderr)  # fmt: skip
        return verification.stop_status(doc["stopped"])
    tracking_uri = study_tracking_uri(args.study_dir, args.tracking_uri)
    console.print(log_stability(tracking_uri, selection.info.name, winner.trial_id, doc["stability"], doc["accepted"], out,
                                doc.get("limited_by")), soft_wrap=True, highlight=False)  # fmt: skip
    verdict = "[green]ACCEPTED[/]" if doc["accepted"] else "[red]REJECTED[/]"
    console.print(f"{verdict}: " + "; ".join(doc["reasons"]), soft_wrap=True, highlight=False)
    if stopped := recorded.stopped_by(doc):  # during the runner-up's repeats: the verdict above stands
        print(f"servetune verify: stopped ({stopped}) during the runner-up's repeats: the winner's verdict stands, "
              "the comparison was not made", file=sys.stderr)  # fmt: skip
        return verification.stop_status(stopped)
    return 0 if doc["accepted"] else 1
