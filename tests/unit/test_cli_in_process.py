"""servetune's CLI called in-process: what it leaves of the caller's process."""

import subprocess
import sys

import pytest


def test_main_gives_an_in_process_caller_its_sigterm_handler_back(monkeypatch):
    """Commands set their own SIGTERM handler for the process they run in; called in-process (a test, a
    notebook), the caller's handler is back once the command returns."""
    import argparse
    import signal

    from servetune import cli

    parser = argparse.ArgumentParser()
    command = parser.add_subparsers(dest="command").add_parser("x")
    command.set_defaults(run=lambda args: 0 if signal.signal(signal.SIGTERM, signal.SIG_IGN) is not None else 1)
    monkeypatch.setattr(cli, "build_parser", lambda only=None: parser)

    def callers(signum, frame):
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, callers)
    try:
        assert cli.main(["x"]) == 0 and signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_command_imports_its_own_module_only():
    """``servetune plan`` builds only its own parser: run's and estimate's modules (the trial runner, Ray Tune's trainable, scipy) are not imported, so a plan
    answers in about a second; with no command named, every command is there for ``--help``."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from servetune import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(sys.argv[1:])\n"
        "print(sorted(m for m in ('servetune.cli.run', 'servetune.cli.plan', 'servetune.trial.runner') if m in sys.modules))\n"
    )

    def imported(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
        return done.stdout.strip().splitlines()[-1]

    assert imported("plan", "--help") == "['servetune.cli.plan']"
    assert imported("--help") == "['servetune.cli.plan', 'servetune.cli.run', 'servetune.trial.runner']"


def test_run_parses_its_arguments_without_the_trial_stack_or_scipy():
    """``servetune run``'s own module, which every ``run`` (and ``run --help``) loads before anything else, imports
    neither the trial runner (through ``cli.estimate``, once) nor scipy's optimizer (only a fit of the estimate needs
    it), nor torch."""
    import subprocess
    import sys

    heavy = ("servetune.trial.runner", "servetune.cli.estimate", "scipy.optimize", "torch", "tensorboardX")
    code = (
        "import sys, contextlib, io\n"
        "from servetune import cli\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    cli.main(['run', '--help'])\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stderr[-2000:]


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """``servetune plan --json | head``: the pipe's reader closes before the plan is written. The command stops
    with a Unix tool's SIGPIPE status and no traceback, where it used to end in a BrokenPipeError's."""
    argv = [sys.executable, "-m", "servetune", "plan", "--model", "meta-llama/Llama-3.1-8B-Instruct"]
    proc = subprocess.Popen([*argv, "--gpu", "H100-SXM", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before a byte is written
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr


def test_a_broken_pipe_that_is_not_stdouts_is_not_silenced(monkeypatch):
    """A command whose own connection or child's pipe broke fails as before: only a gone reader of stdout is a
    quiet stop."""
    import argparse

    from servetune import cli

    def broken(args):
        raise BrokenPipeError("a child's pipe")

    parser = argparse.ArgumentParser()
    parser.add_subparsers(dest="command").add_parser("x").set_defaults(run=broken)
    monkeypatch.setattr(cli, "build_parser", lambda only=None: parser)
    with pytest.raises(BrokenPipeError):
        cli.main(["x"])
