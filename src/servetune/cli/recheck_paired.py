"""``servetune recheck --paired``: the picked configuration against another, measured round by round, interleaved
(verify/paired.py), so that the host's drift between them is in both sides of every round."""

from __future__ import annotations

import argparse
import datetime as dt
import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from servetune.verify.paired import Paired, PairedRound


def check_flags(args: argparse.Namespace) -> None:
    """The flags that go with ``--paired`` and those that do not: one line, before anything starts."""
    from servetune.errors import UserError

    if not args.paired:
        for flag, value in (("--against", args.against), ("--rounds", args.rounds)):
            if value is not None:
                raise UserError(f"{flag} goes with --paired (a paired comparison of two configurations)")
        return
    if args.runner_up:
        raise UserError("--runner-up re-checks two configurations one after the other; with --paired, name the "
                        "other as --against runner-up")  # fmt: skip
    if args.repeats is not None:
        raise UserError("--repeats goes without --paired: a paired comparison repeats as --rounds")
    if args.rounds is not None and args.rounds < 2:
        raise UserError(f"--rounds must be at least 2 (a spread needs two rounds), got {args.rounds}")


def run_paired(args: argparse.Namespace) -> int:
    from servetune.cli.display import console as make_console
    from servetune.cli.prefetching import PointPrefetch
    from servetune.engine.args import load_argspecs, point_structured_problem, vllm_version
    from servetune.errors import EngineDiedError, EngineStartError, UserError
    from servetune.load.requests import PromptFactory
    from servetune.load.tokenizer import load_tokenizer
    from servetune.tracking.connection import recorded_tracking_uri
    from servetune.tracking.recheck import log_paired
    from servetune.verify.choose import point_level, select
    from servetune.verify.paired import DEFAULT_ROUNDS, PAIRED_DIR, Paired, judge, measure_pairs, mode_of
    from servetune.verify.recheck import PAIRED_RUN_DOC, new_run_dir, refusal, version_slug

    pick = "best" if args.pick == "shipped" else args.pick
    against = args.against or "runner-up"
    selection = select(args.study_dir, pick, args.python, admission=False, against=against)
    a, b = selection.winner, selection.runner_up
    if b is None:
        raise UserError(f"--against runner-up: the study has no other candidate meeting the SLO than trial "
                        f"{a.trial_id}; name one with --against N|TRIAL_ID")  # fmt: skip
    for one in (a, b):
        if one.spec.serve_replicas is not None:
            raise UserError(f"trial {one.trial_id} was measured through Ray Serve: recheck measures bare engines only")
    version = vllm_version(args.python)
    if version is None:
        raise UserError(f"vLLM is not installed for {args.python} (install servetune[cpu] or servetune[gpu], or pass --python)")  # fmt: skip
    for one in (a, b):
        if problem := point_structured_problem(one.spec.engine_args, one.spec.workload.asks_structured, args.python):
            raise UserError(f"{args.study_dir}: trial {one.trial_id}: {problem}")
    rounds = args.rounds or DEFAULT_ROUNDS
    level = point_level(a.point, a.spec.levels, selection.workload)  # the shipped level's load, for both
    console = make_console(stderr=True)
    with console.status(f"reading {version}'s argument table"):
        table = load_argspecs(args.python)
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    mode = mode_of(a.spec, b.spec)
    doc = Paired(study=a.result.study, vllm=version, a_trial_id=a.trial_id, b_trial_id=b.trial_id,
                 level=level.as_dict(), mode=mode, rounds_asked=rounds, rounds=[], metrics=[], decided_on=None,
                 verdict="REFUSED", reason="")  # fmt: skip
    refused = [f"trial {one.trial_id}: {why}" for one in (a, b) if (why := refusal(one.spec.engine_args, table))]
    run_dir = new_run_dir(args.study_dir, version)  # its own: a later paired run loses nothing (a REFUSED one too)
    if refused:  # nothing starts
        doc.failure = doc.reason = f"vLLM {version} refuses " + "; ".join(refused)
    else:
        if not args.no_prefetch:
            prefetched = PointPrefetch(console)
            for one in (a, b):
                prefetched.spec(one.spec, through_ray=False)
        factories: dict[str, PromptFactory] = {}
        for one in (a, b):  # one per tokenizer: the same prompts for both sides of a round
            if one.spec.tokenizer not in factories:
                factories[one.spec.tokenizer] = PromptFactory(load_tokenizer(one.spec.tokenizer))
        prompts = {"A": factories[a.spec.tokenizer], "B": factories[b.spec.tokenizer]}
        out_dir = run_dir / PAIRED_DIR
        doc.result_dir = str(out_dir)
        console.print(f"A: trial {a.trial_id} (the pick), B: trial {b.trial_id}; {rounds} rounds at {level}, {mode}",
                      soft_wrap=True, highlight=False)  # fmt: skip
        with console.status(f"measuring A and B, {rounds} rounds ({mode})"):
            try:
                doc.rounds = measure_pairs(a.spec, b.spec, level, rounds, out_dir, prompts,
                                           on_round=lambda r: _say(console, round_line(r)),
                                           names={"A": a.trial_id, "B": b.trial_id})  # fmt: skip
            except (EngineStartError, EngineDiedError) as exc:
                doc.failure = doc.reason = str(exc.args[0]).splitlines()[0]
        if doc.failure is None:
            doc.metrics, doc.decided_on, doc.verdict, doc.reason = judge(doc.rounds)
    doc.created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    for line in table_lines(doc):
        _say(console, line)
    out = args.json or args.study_dir / f"recheck-paired-{version_slug(version)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc.model_dump_json(indent=2) + "\n")
    # a copy in the run's folder (beside its records where it measured): the study's file is the latest paired run's
    (run_dir / PAIRED_RUN_DOC).write_text(doc.model_dump_json(indent=2) + "\n")
    _say(console, f"wrote {out}")
    uri = args.tracking_uri or recorded_tracking_uri(args.study_dir)
    if uri is not None:
        _say(console, log_paired(uri, doc.model_dump(mode="json"), out))
    return doc.exit_status


def _say(console: Console, line: str) -> None:
    console.print(line, soft_wrap=True, highlight=False, markup=False)


def round_line(r: PairedRound) -> str:
    from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT

    parts = [f"round {r.round + 1} ({r.first} first):"]
    for name in (GOODPUT, OUTPUT_THROUGHPUT):
        if name in r.a and name in r.b:
            ratio = f"{r.b[name] / r.a[name]:.3f}" if r.a[name] > 0 else "-"
            parts.append(f"{name} A {r.a[name]:.4g}, B {r.b[name]:.4g} (B/A {ratio});")
    parts.append(f"SLO A {'met' if r.a_meets_slo else 'broken'}, B {'met' if r.b_meets_slo else 'broken'}")
    return " ".join(parts)


def table_lines(doc: Paired) -> list[str]:
    """The comparison as lines: per metric, the medians, B against A, its interval and noise; then the verdict."""
    load = ", ".join(f"{k} {v:g}" for k, v in doc.level.items())
    lines = [f"A trial {doc.a_trial_id} against B trial {doc.b_trial_id} at {load} on {doc.vllm}: "
             f"{len(doc.rounds)} rounds, {doc.mode}"]  # fmt: skip
    if doc.metrics:
        lines.append(f"  {'metric':<18} {'A':>10} {'B':>10} {'B vs A':>8} {'interval':>17} {'noise':>7} "
                     f"{'B ahead':>8}  verdict")  # fmt: skip
    for m in doc.metrics:
        interval = "-" if m.low is None or m.high is None else f"[{m.low:+.1%}, {m.high:+.1%}]"
        mark = " (decides)" if m.metric == doc.decided_on else ""
        lines.append(f"  {m.metric:<18} {_num(m.a_median):>10} {_num(m.b_median):>10} {m.change:>+8.1%} "
                     f"{interval:>17} {m.noise:>6.1%} {f'{m.b_ahead}/{m.rounds}':>8}  {m.verdict}{mark}")  # fmt: skip
    if doc.metrics:
        lines.append("  (B vs A: the median over rounds of (B - A) / mean(A, B), for latencies too: negative is "
                     "lower; interval: 95% of its mean over rounds, the wider of bootstrap and Student's t)")  # fmt: skip
    lines.append(f"{doc.verdict}: {doc.reason}")
    return lines


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
