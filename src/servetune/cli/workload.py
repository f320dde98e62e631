"""``servetune workload from-log``: a workload made from a log of real requests."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from servetune.errors import UserError

#: Levels written for a fitted open loop: the log's own rate times these.
RATE_FACTORS = (0.5, 1.0, 2.0, 4.0)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("workload", help="make workloads from request logs",
                              description="Make workloads from real traffic.")  # fmt: skip
    sub = p.add_subparsers(dest="workload_command", metavar="ACTION", required=True)
    log = sub.add_parser(
        "from-log",
        help="a workload measured from a request log (JSONL, one request a line)",
        description=(
            "Read a request log (JSONL: a time, input and output token counts or texts, an optional "
            "session id per line; docs/commands/workload.md lists the keys read) and write a workload: the "
            "logged lengths as empirical distributions, the arrival process fitted from the times (Poisson, "
            "or gamma with the measured coefficient of variation), the shared prefix when the prompts are "
            "there, and conversations when sessions are. Prints what it found."
        ),
        epilog="example: servetune workload from-log traffic.jsonl --out trials/workloads/mine.yaml",
    )
    log.add_argument("log", type=Path, metavar="LOG", help="the request log (JSONL)")
    log.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the workload to write (YAML); the lengths go beside it in <stem>.lengths.jsonl",
    )
    log.add_argument("--name", help="the workload's name (default: the --out file's stem)")
    log.add_argument(
        "--tokenizer",
        help="a model directory or hub id whose tokenizer counts texts (needed when the log has texts without counts)",
    )
    log.add_argument(
        "--trace",
        action="store_true",
        help="replay the log's times (arrival: {process: trace}) instead of the fitted process",
    )
    log.set_defaults(run=run_from_log)


def run_from_log(args: argparse.Namespace) -> int:
    from servetune.traffic.fit import profile
    from servetune.traffic.log import read_log

    out: Path = args.out
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory")
    if out.suffix not in (".yaml", ".yml"):
        raise UserError(f"--out {out}: a workload is a .yaml file")
    requests = read_log(args.log)
    count = None
    if args.tokenizer:
        from servetune.load.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
        count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    traffic = profile(requests, count, source=str(args.log))
    name = args.name or out.stem
    stem = out.name.rsplit(".", 1)[0]
    names = {"lengths": f"{stem}.lengths.jsonl", "turns": f"{stem}.turns.jsonl", "sessions": f"{stem}.sessions.jsonl"}
    rows = list(zip(traffic.input_tokens, traffic.output_tokens, traffic.first_turn, strict=True))
    files = {out.with_name(names["lengths"]): _lengths(rows, first=True)}
    if traffic.sessions is not None:
        files[out.with_name(names["sessions"])] = _jsonl({"turns": t} for t in traffic.sessions.turns)
        if not all(traffic.first_turn):
            files[out.with_name(names["turns"])] = _lengths(rows, first=False)
    trace_file = trace_path(args.log, out) if args.trace else None
    files[out] = workload_yaml(traffic, name, args.log, names, trace_file, requests)
    write_all(files)
    print(summary(traffic, args.log, requests))
    written = ", ".join(str(p) for p in files)
    print(f"wrote {written}")
    return 0


def trace_path(log: Path, out: Path) -> str:
    """The log as the workload names it: relative to the workload's directory where the two share
    a parent below the root (they move together), else absolute."""
    log, home = log.resolve(), out.parent.resolve()
    if os.path.commonpath([log, home]) == log.anchor:
        return str(log)
    return os.path.relpath(log, home)


def _lengths(rows: list[tuple[int, int, bool]], first: bool) -> str:
    """The lengths of the first turns (and requests on their own), or of the later turns."""
    return _jsonl({"input_tokens": i, "output_tokens": o} for i, o, is_first in rows if is_first == first)


def _jsonl(rows) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def write_all(files: dict[Path, str]) -> None:
    """Write every file or none: each to a temporary name beside it, then renamed (the last one last)."""
    temps: list[tuple[Path, Path]] = []
    try:
        for path, text in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            tmp.write_text(text)
            temps.append((tmp, path))
        for tmp, path in temps:
            tmp.replace(path)
    except OSError as exc:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
        target = exc.filename or next(iter(files))
        raise UserError(f"--out: cannot write {target} ({exc.strerror or exc})") from None


def _sig(value: float) -> str:
    return f"{value:.3g}"


def workload_yaml(traffic, name: str, log: Path, names: dict[str, str], trace_file: str | None, requests) -> str:
    arrival = traffic.arrival
    per = "conversations" if traffic.sessions is not None else "requests"
    lengths_name = names["lengths"]
    firsts = ", conversations' first turns" if traffic.sessions is not None else ""
    lines = [
        f"# Made by `servetune workload from-log {log.name}`: {traffic.requests} requests over {arrival.span_s:.0f} s.",
        f"# Lengths are the logged ones ({lengths_name}{firsts}); arrivals are {per}.",
        f"name: {json.dumps(name)}",
        f"description: {json.dumps(f'from {log.name}: {traffic.requests} requests, {arrival.rate:.3g} {per}/s, CV {arrival.cv:.2f}')}",
        "seed: 0",
        "api: completions",
        f"input_tokens: {{dist: empirical, file: {json.dumps(lengths_name)}, field: input_tokens}}",
        f"output_tokens: {{dist: empirical, file: {json.dumps(lengths_name)}, field: output_tokens}}",
    ]
    if traffic.prefix is not None:
        prefix = traffic.prefix
        how = "estimated from characters" if prefix.estimated else "counted"
        lines.append(
            f"# {prefix.fraction:.0%} of first prompts share their first {len(prefix.text)} characters ({prefix.tokens} tokens, {how})."
        )
        lines.append(f"shared_prefix: {{tokens: {prefix.tokens}, fraction: {prefix.fraction:.3g}}}")
    else:
        lines.append(f"# shared prefix: {traffic.prefix_note}")
    sessions = traffic.sessions
    if sessions is not None:
        lines.append(f"# {len(sessions.turns)} conversations, {np.mean(sessions.turns):.2f} turns on average; "
                     + ("later turns' logged inputs carried the conversation: their lengths here are the new messages."
                        if sessions.carries_history else "later turns' logged inputs did not carry the conversation."))  # fmt: skip
        lines.append("sessions:")
        lines.append(f"  turns: {{dist: empirical, file: {json.dumps(names['sessions'])}, field: turns}}")
        if not all(traffic.first_turn):  # later turns' own lengths
            what = "new message" if sessions.carries_history else "input"
            lines.append(
                f"  input_tokens: {{dist: empirical, file: {json.dumps(names['turns'])}, field: input_tokens}}   # later turns' {what}"
            )
            lines.append(
                f"  output_tokens: {{dist: empirical, file: {json.dumps(names['turns'])}, field: output_tokens}}"
            )
        lines.append(f"  think_time_s: {think_time(sessions.think_times_s)}")
        if sessions.think_includes_response:
            lines.append("  # the log has no durations: think times include each answer's time")
        if sessions.carries_history:
            counted = [
                r.input_tokens + r.output_tokens
                for r in requests
                if r.input_tokens is not None and r.output_tokens is not None
            ]
            longest = max(counted) if len(counted) == len(requests) else None  # texts counted by --tokenizer: left out
            if longest:
                lines.append(f"  max_context_tokens: {longest}   # the longest logged prompt and answer")
    if trace_file is not None:
        lines.append(
            f"# replays the log's times; levels are speed-ups (2: twice the recorded pace). Fitted: {arrival.process}, CV {arrival.cv:.2f}."
        )
        lines.append(f"arrival: {{process: trace, file: {json.dumps(trace_file)}, levels: [1, 2, 4]}}")
    else:
        levels = ", ".join(_sig(arrival.rate * f) for f in RATE_FACTORS)
        lines.append(f"# measured: {arrival.rate:.4g} {per}/s, gaps' coefficient of variation {arrival.cv:.3f}; "
                     f"levels are the measured rate x {', '.join(f'{f:g}' for f in RATE_FACTORS)}")  # fmt: skip
        if arrival.process == "poisson":
            lines.append(f"arrival: {{process: poisson, levels: [{levels}]}}")
        else:
            lines.append(
                f"arrival: {{process: gamma, burstiness: {arrival.burstiness:.4g}, levels: [{levels}]}}   # burstiness = 1/CV^2"
            )
    return "\n".join(lines) + "\n"


def think_time(seconds: list[float]) -> str:
    """A lognormal fitted to the positive think times (median, and sigma of their logarithms)."""
    positive = np.asarray([s for s in seconds if s > 0], dtype=float)
    if len(positive) < 2:
        return f"{{dist: fixed, value: {float(np.median(seconds)) if seconds else 0.0:.3g}}}"
    logs = np.log(positive)
    sigma = max(float(logs.std(ddof=1)), 0.01)
    return f"{{dist: lognormal, median: {float(np.exp(np.median(logs))):.4g}, sigma: {sigma:.3g}, max: {float(positive.max()):.4g}}}"


def _spread(values: list[int]) -> str:
    a = np.asarray(values)
    return f"median {np.median(a):g}, p90 {np.percentile(a, 90):.0f}, max {a.max()}"


def summary(traffic, log: Path, requests) -> str:
    arrival = traffic.arrival
    lines = [f"{log}: {traffic.requests} requests over {arrival.span_s:.1f} s"]
    per = "conversations" if traffic.sessions is not None else "requests"
    fitted = "Poisson" if arrival.process == "poisson" else f"gamma, burstiness {arrival.burstiness:.3g}"
    lines.append(f"  arrivals: {arrival.rate:.4g} {per}/s, gaps' coefficient of variation {arrival.cv:.2f} -> {fitted}")
    firsts = [i for i, first in zip(traffic.input_tokens, traffic.first_turn, strict=True) if first]
    later = [i for i, first in zip(traffic.input_tokens, traffic.first_turn, strict=True) if not first]
    if later:
        lines.append(f"  input tokens: first turns {_spread(firsts)}")
        what = "new message" if traffic.sessions.carries_history else "input"
        lines.append(f"                later turns' {what} {_spread(later)}")
    else:
        lines.append(f"  input tokens: {_spread(traffic.input_tokens)}")
    lines.append(f"  output tokens: {_spread(traffic.output_tokens)}")
    if traffic.prefix is not None:
        p = traffic.prefix
        lines.append(
            f"  shared prefix: {p.tokens} tokens{' (estimated)' if p.estimated else ''} on {p.fraction:.0%} of first prompts"
        )
    else:
        lines.append(f"  shared prefix: {traffic.prefix_note}")
    if traffic.sessions is not None:
        s = traffic.sessions
        think = np.median(s.think_times_s) if s.think_times_s else 0.0
        lines.append(
            f"  conversations: {len(s.turns)}, {np.mean(s.turns):.2f} turns on average (max {max(s.turns)}), think time median {think:.3g} s"
        )
    else:
        lines.append("  conversations: none (no session ids)")
    return "\n".join(lines)
