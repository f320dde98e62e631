"""``servetune recheck``: measure a study's shipped configuration again on the vLLM installed now, and compare."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from servetune.cli.prefetching import add_no_prefetch

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from rich.console import Console

    from servetune.engine.args import ArgSpec
    from servetune.quality.probe import QualityPlan
    from servetune.verify.choose import Chosen
    from servetune.verify.recheck import Recheck

DESCRIPTION = """\
After a vLLM upgrade, measure the configuration a study recommended (the one shipped) again on the vLLM
installed now (or the one beside --python), through the same trial runner, at the same load ladder, request
count, workload and SLO, with the same capacity search, and compare with what the study recorded:

  per metric and load   output_throughput, goodput, ttft_ms_p99, tpot_ms_p99 before and after, and whether the
                        change stands beyond the run-to-run noise (the verdict is taken at the shipped level's load;
                        the other loads are shown beside it); a repeated level's median over its repeats. The
                        margin: half the spread of the metric over
                        each level's repeats relative to their median (load.repeats, or --repeats here), the
                        recorded and the new level's added, at least 5%; 10% where neither level was repeated.
  SLO and capacity      the SLO verdict at the shipped level and the load carried at the SLO, before and after
  quality               where the study has a quality probe, the same probe against the answers its reference
                        gave when the study ran (STUDY_DIR/quality/reference.json), with the same bounds
  vLLM and arguments    both vLLM versions; the configuration's flags in both versions' argument tables (removed,
                        renamed, another kind, a value no longer a choice; the old table where servetune's cache
                        still holds it) and every engine argument vLLM resolved to another value (/server_info)

Verdict and exit status:
  0 PASS              within noise or better, no engine argument moved
  1 REGRESSED         a metric worse beyond its noise at the shipped level, the SLO there broken, the quality probe
                      failed, or capacity lower by more than the capacity search's tolerance
  2                   bad input (nothing started)
  3 REFUSED           the new vLLM refuses the configuration (an unknown flag, a value not a choice) or its
                      engine does not start or dies
  4 CHANGED-DEFAULTS  within noise or better, but engine arguments resolved to other values or flags moved
With --runner-up the worse of the two verdicts decides the exit status.

Paired (--paired): the pick (A) against another configuration (B, --against: the runner-up, a row of the Pareto
table or a trial id) at the shipped level's load, for --rounds rounds (default 3), A then B in one round and B then A
in the next, so that the host's drift over the minutes is in both sides of every round. Both engines stay up, one
under load at a time, where both run on vLLM's CPU build (each on cores of its own); on GPUs each round starts and
stops them one after the other. Judged on goodput from the rounds' paired differences ((B - A) / mean(A, B) per
round): the median beyond the paired noise (half the interquartile range of the rounds' differences, at least 5%:
it does not grow with the rounds, so more rounds can settle a tie) and a 95% interval of their mean (the wider of
a bootstrap and Student's t) on the same side of 0. Exit status of a paired recheck:
  0 A better          the pick is better beyond the paired noise
  1 B better          the other configuration is better beyond the paired noise
  2                   bad input (nothing started)
  3 REFUSED           vLLM refuses either configuration, or an engine does not start or dies
  5 tie               tie within the paired noise
Writes STUDY_DIR/recheck-paired-<vLLM version>.json (or --json OUT: the latest run's), each side's engine log and
requests in STUDY_DIR/recheck/<vLLM version>/<run>/paired/ (<run>: the run's UTC time), and a copy of every run's
result, a REFUSED one's too, in STUDY_DIR/recheck/<vLLM version>/<run>/recheck-paired.json: the report reads them
all, settles a tie on the latest on the study's vLLM and names the earlier ones.

Before the engine starts, a hub model's weights are fetched on this machine, outside its start-up clock (the
result's "prefetch"; --no-prefetch leaves the download to the engine).

Writes STUDY_DIR/recheck-<vLLM version>.json (or --json OUT: the latest run's); each run's re-measured trials
and a copy of its result (recheck.json) are kept in a folder of their own, STUDY_DIR/recheck/<vLLM version>/<run>/
(<run>: the run's UTC time, 20261207T110500Z), a REFUSED run's too (its recheck.json alone), so a later recheck
on the same vLLM loses nothing. Where the study recorded an MLflow store (or --tracking-uri names one), the
recheck is logged there as a run of the study's experiment tagged servetune.role=recheck.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("recheck", help="measure a study's shipped configuration again after a vLLM upgrade",
                              description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog="example: servetune recheck servetune-results/cpu-tiny --runner-up")  # fmt: skip
    p.add_argument("study_dir", type=Path, metavar="STUDY_DIR", help="the study directory (servetune-results/<study>)")
    p.add_argument("--pick", default="best", metavar="best|N|TRIAL_ID",
                   help="best or shipped (the recommendation, default), a row of the cost vs P99 TTFT Pareto table, or a trial id")  # fmt: skip
    p.add_argument("--runner-up", action="store_true", help="re-check the runner-up (the best other candidate) too")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="runs of each level (default: the study's load.repeats); more runs, a tighter noise margin")  # fmt: skip
    p.add_argument("--paired", action="store_true",
                   help="measure the pick against another configuration round by round, interleaved (see above)")  # fmt: skip
    p.add_argument("--against", metavar="runner-up|N|TRIAL_ID",
                   help="with --paired: the other configuration (default: runner-up, the best other candidate)")  # fmt: skip
    p.add_argument("--rounds", type=int, metavar="R", help="with --paired: rounds of A and B (default 3, at least 2)")
    p.add_argument("--json", type=Path, metavar="OUT",
                   help="where to write the result (default: STUDY_DIR/recheck-<vLLM version>.json)")  # fmt: skip
    p.add_argument("--tracking-uri", metavar="URI",
                   help="MLflow store to log the recheck to (default: the one the study recorded; none: not logged)")  # fmt: skip
    p.add_argument("--python", "--vllm-python", dest="python", default=sys.executable, metavar="PATH",
                   help="Python interpreter that has the vLLM to re-check on (default: this one)")  # fmt: skip
    add_no_prefetch(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.cli.recheck_paired import check_flags, run_paired

    check_flags(args)
    if args.paired:
        return run_paired(args)
    from servetune.cli.display import console as make_console
    from servetune.engine.args import cached_argspecs, load_argspecs, point_structured_problem, vllm_version
    from servetune.errors import UserError
    from servetune.tracking.connection import recorded_tracking_uri
    from servetune.tracking.recheck import log_recheck
    from servetune.verify.choose import select
    from servetune.verify.recheck import RUN_DOC, new_run_dir, quality_plan, recheck_file

    if args.repeats is not None and args.repeats < 1:
        raise UserError(f"--repeats must be at least 1, got {args.repeats}")
    pick = "best" if args.pick == "shipped" else args.pick
    # Launched as its trial was, without the admission bounds verify adds, so its ladder is measured again as it was
    # first measured. Bad input stops here, before anything starts.
    selection = select(args.study_dir, pick, args.python, admission=False)
    chosen = [selection.winner]
    if args.runner_up:
        if selection.runner_up is None:
            raise UserError(f"--runner-up: the study has no other candidate meeting the SLO than trial {selection.winner.trial_id}")  # fmt: skip
        chosen.append(selection.runner_up)
    quality = quality_plan(
        args.study_dir, selection.space, selection.info.space_file
    )  # a missing suite: before any start
    for one in chosen:
        if one.spec.serve_replicas is not None:
            raise UserError(f"trial {one.trial_id} was measured through Ray Serve: recheck measures bare engines only")
    version = vllm_version(args.python)
    if version is None:
        raise UserError(f"vLLM is not installed for {args.python} (install servetune[cpu] or servetune[gpu], or pass --python)")  # fmt: skip
    for one in chosen:  # as a study refuses it before its trials: an engine answering every structured request 500
        if problem := point_structured_problem(one.spec.engine_args, one.spec.workload.asks_structured, args.python):
            raise UserError(f"{args.study_dir}: trial {one.trial_id}: {problem}")
    console = make_console(stderr=True)
    with console.status(f"reading {version}'s argument table"):
        new_table = load_argspecs(args.python)
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    made: list[Path] = []  # this run's own folder, made when the first trial is measured, else with its result

    def run_dir() -> Path:
        if not made:
            made.append(new_run_dir(args.study_dir, version))
        return made[0]

    docs = []
    for one in chosen:
        before = one.result.environment.get("vllm")
        old_table = cached_argspecs(before) if before and before != version else new_table
        docs.append(_recheck(one, args, version, before, old_table, new_table, quality, console, run_dir))
    doc = docs[0].model_copy(update={"runner_up": docs[1] if len(docs) > 1 else None})
    out = args.json or recheck_file(args.study_dir, version)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc.model_dump_json(indent=2) + "\n")
    # Every run's result kept in its own folder, beside its trials where it measured any (one REFUSED before anything
    # started has a folder too): a later recheck on this vLLM replaces recheck-<version>.json only.
    (run_dir() / RUN_DOC).write_text(doc.model_dump_json(indent=2) + "\n")
    console.print(f"wrote {out}", soft_wrap=True, highlight=False)
    uri = args.tracking_uri or recorded_tracking_uri(args.study_dir)
    if uri is not None:
        console.print(log_recheck(uri, doc.model_dump(mode="json"), out), soft_wrap=True, highlight=False)
    return doc.exit_status


def _recheck(one: Chosen, args: argparse.Namespace, version: str, before: str | None,
             old_table: Mapping[str, ArgSpec] | None, new_table: Mapping[str, ArgSpec] | None,
             quality: QualityPlan | None, console: Console, run_dir: Callable[[], Path]) -> Recheck:  # fmt: skip
    from servetune.cli.prefetching import PointPrefetch
    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.verify.recheck import compare, refusal, remeasure

    after = None
    refused = refusal(one.spec.engine_args, new_table)  # what would be launched: refused, nothing starts
    prefetched = PointPrefetch(console)
    if refused is None and not args.no_prefetch:  # the weights on this machine, outside the engine's start-up
        prefetched.spec(one.spec, through_ray=False)
    if refused is None:
        with console.status(f"measuring trial {one.trial_id} again on {version} (its whole ladder)"):
            after = remeasure(one.spec, run_dir(), lambda: PromptFactory(load_tokenizer(one.spec.tokenizer)),
                              repeats=args.repeats, quality=quality)  # fmt: skip
    doc = compare(one.result, after, one.point.level, old_table=old_table, new_table=new_table,
                  vllm_before=before, vllm_after=version, refused=refused)  # fmt: skip
    doc.prefetch = prefetched.records
    if after is not None:
        doc.result_dir = str(run_dir() / after.trial_id)
    doc.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for line in summary(doc):
        console.print(line, soft_wrap=True, highlight=False)
    return doc


def summary(doc: Recheck) -> list[str]:
    """What the recheck found, as lines: versions, per metric and load, SLO, capacity, arguments, verdict."""
    from servetune.engine.cores import cores_words
    from servetune.results import MARGIN
    from servetune.verify.recheck import describe

    lines = [f"trial {doc.trial_id} at {', '.join(f'{k} {v:g}' for k, v in doc.level.items())}: "
             f"vLLM {doc.vllm_before or '?'} -> {doc.vllm_after or '?'}"]  # fmt: skip
    for c in doc.changes:
        mark = "worse" if c.worse else "better" if c.beyond_noise else "within noise"
        mark += "" if c.shipped else " (not the shipped level)"
        load = ", ".join(f"{k} {v:g}" for k, v in c.level.items())
        lines.append(f"  {c.metric:<18} {load:<16} {c.before:>10.4g} -> {c.after:<10.4g} {c.change:+7.1%}  "
                     f"(noise {c.margin:.0%}, {c.margin_from}): {mark}")  # fmt: skip
    lines.append(f"  SLO at the shipped level: {_met(doc.slo_before)} -> {_met(doc.slo_after)}; capacity at the SLO: "
                 f"{_num(doc.capacity_before)} -> {_num(doc.capacity_after)}")  # fmt: skip
    if doc.quality_before is not None or doc.quality_after is not None:
        lines.append(f"  quality probe: {_passed(doc.quality_before)} -> {_passed(doc.quality_after)}")
    if doc.host_note is not None:
        lines.append(f"  {doc.host_note}")
    # the CPU build: the cores the re-measured engine ran on, as a trial records them
    if doc.cpu_binding or doc.cpu_unclaimed:
        lines.append("  re-measured engine" + cores_words(doc.cpu_binding, doc.cpu_unclaimed))
    lines += [f"  argument: {describe(a)}" for a in doc.arguments]
    if doc.resolved_note is not None:
        lines.append(f"  resolved engine arguments not compared: {doc.resolved_note}")
    if any(c.margin_from == "default" for c in doc.changes):
        lines.append(f"  (levels measured once: the noise margin is the {MARGIN:.0%} default, tighter than a P99 latency "
                     "spreads between runs on a shared host; --repeats 3 measures the noise)")  # fmt: skip
    lines.append(f"  ({doc.argument_table})")
    lines.append(f"{doc.verdict}: " + "; ".join(doc.reasons))
    return lines


def _met(value: bool | None) -> str:
    return "not measured" if value is None else "met" if value else "broken"


def _passed(value: bool | None) -> str:
    return "not run" if value is None else "passed" if value else "failed"


def _num(value: float | None) -> str:
    return "none" if value is None else f"{value:g}"
