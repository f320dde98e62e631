"""The ``servetune`` command line: one module per sub-command.

Each sub-command module exposes ``add_parser(subparsers)`` and ``run(args) -> int``.
:class:`~servetune.errors.UserError` becomes one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
import threading

from servetune import __version__
from servetune.errors import UserError

# Sub-commands, in the order ``--help`` lists them.
COMMANDS = (
    "init",
    "doctor",
    "run",
    "bench",
    "plan",
    "estimate",
    "models",
    "workload",
    "report",
    "export",
    "verify",
    "serve-check",
    "recheck",
)


def command_of(argv: list[str] | None) -> str | None:
    """The sub-command ``argv`` names (its first word not an option), when it is one of :data:`COMMANDS`."""
    words = sys.argv[1:] if argv is None else argv
    first = next((word for word in words if not word.startswith("-")), None)
    return first if first in COMMANDS else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser: every sub-command, or ``only`` that one. Each sub-command's module is imported to add its
    parser, and some import Ray Tune, scipy or MLflow: ``servetune plan`` need not pay for ``run``'s (about 1.6 s of
    a core's time in every call, here)."""
    parser = argparse.ArgumentParser(
        prog="servetune",
        description=(
            "Find the best way to serve an LLM with vLLM: measure configurations under a "
            "realistic load, search over them, and report cost against P99 latency."
        ),
    )
    parser.add_argument("--version", action="version", version=f"servetune {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (only,) if only else COMMANDS:
        importlib.import_module(f"servetune.cli.{name.replace('-', '_')}").add_parser(subparsers)
    return parser


def _reader_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (``poll`` reports an error on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no file descriptor (a caller's StringIO), or no poll here
        return False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(command_of(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    previous = signal.getsignal(signal.SIGTERM)  # commands set their own; a caller in-process gets its back
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader gone (`servetune plan --json | head`) shows here, where it is answered
        return code
    except BrokenPipeError:
        if not _reader_gone():  # another pipe broke (a child's, a connection's): not ours to silence
            raise
        # Stop quietly, as a Unix tool stopped by SIGPIPE does (status 141), and point stdout at /dev/null so that
        # Python's own flush at exit finds no closed pipe to complain of.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except UserError as exc:
        print(f"servetune {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"servetune {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
