"""servetune's CLI called in-process: what it leaves of the caller's process."""


def test_main_gives_an_in_process_caller_its_sigterm_handler_back(monkeypatch):
    """Commands set their own SIGTERM handler for the process they run in; called in-process (a test, a
    notebook), the caller's handler is back once the command returns."""
    import argparse
    import signal

    from servetune import cli

    parser = argparse.ArgumentParser()
    command = parser.add_subparsers(dest="command").add_parser("x")
    command.set_defaults(run=lambda args: 0 if signal.signal(signal.SIGTERM, signal.SIG_IGN) is not None else 1)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)

    def callers(signum, frame):
        raise AssertionError("not called")

    before = signal.signal(signal.SIGTERM, callers)
    try:
        assert cli.main(["x"]) == 0 and signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)
