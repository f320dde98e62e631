"""``servetune bench --client-processes N|auto``: the flag read, and a level that cannot be split refused before any
engine starts (the split itself: tests/integration/test_bench_cli.py against the fake server)."""

import pytest

from servetune.cli import main
from servetune.cli.bench import parse_client_processes
from servetune.errors import UserError


def test_a_number_or_auto_is_read():
    assert parse_client_processes("3") == 3 and parse_client_processes("1") == 1
    assert parse_client_processes("auto") == "auto"
    for bad in ("0", "-2", "1.5", "two", ""):
        with pytest.raises(UserError, match="--client-processes must be a whole number"):
            parse_client_processes(bad)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--client-processes", "0"],
            "--client-processes must be a whole number of processes (at least 1) or auto, got '0'",
        ),
        (["--client-processes", "many"], "got 'many'"),
        (["--client-processes", "2", "--duration", "5"], "--client-processes: 2 cannot split a level bounded by time"),
        (["--client-processes", "2", "--workload", "agent"], "--client-processes: 2 cannot split conversations"),
    ],
)
def test_bad_values_are_one_line_and_nonzero_before_anything_starts(tmp_path, capsys, argv, needle):
    # The model folder does not exist: the flag is judged first, so its error is the one given.
    code = main(["bench", "--model", str(tmp_path / "none"), "--concurrency", "4", *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_auto_where_a_level_cannot_be_split_runs_it_on_one_process(tmp_path, capsys):
    # "auto" gives 1 for a level bounded by time alone: not refused, so the next check (the model) is the error.
    code = main(["bench", "--model", str(tmp_path / "none"), "--client-processes", "auto", "--duration", "5"])
    err = capsys.readouterr().err
    assert code == 2 and "no such directory" in err, err
