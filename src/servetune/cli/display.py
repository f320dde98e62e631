"""Rich tables shared by the commands."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from servetune.config.slo import Slo
from servetune.results import LevelResult
from servetune.summary import asks_note, itl_note


def console(stderr: bool = False) -> Console:
    """A console that does not cut tables to 80 columns when output goes to a file or pipe."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 200)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def level_table(results: list[LevelResult], slo: Slo, title: str = "") -> Table:
    table = Table(title=title or None, title_justify="left")
    for col in (
        "level",
        "ok/failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2EL p99",
        "in sync",
    ):
        table.add_column(col, justify="right")
    if slo:
        table.add_column("goodput", justify="right")
        table.add_column("SLO")
    for r in results:
        s = r.summary
        level = ", ".join(f"{k} {v:g}" for k, v in s.level.items())
        row = [
            level, f"{s.completed}/{s.failed}", _fmt(s.request_throughput, 2), _fmt(s.output_throughput),
            _fmt(s.ttft_ms.p50), _fmt(s.ttft_ms.p99), _fmt(s.tpot_ms.p50), _fmt(s.tpot_ms.p99),
            _fmt(s.itl_ms.p99), _fmt(s.e2el_ms.p99), "-" if r.send_sync_share is None else f"{r.send_sync_share:.0%}",
        ]  # fmt: skip
        if slo:
            row += [
                _fmt(s.goodput, 2),
                "[green]met[/]" if r.meets_slo else "[red]broken[/]: " + "; ".join(r.slo_violations),
            ]
        table.add_row(*row)
    table.caption = "latencies in ms; in sync: requests sent within 10 ms of another"
    if slo:  # LevelSummary.goodput_window
        table.caption += "; goodput: a closed loop's with every client busy (its final drain left out)"
    notes = [f"{', '.join(f'{k} {v:g}' for k, v in r.summary.level.items())}: {note}"
             for r in results
             for note in (r.stopped_early, r.cache_note, itl_note(r.itl_burst_share), asks_note(r.summary)) if note]  # fmt: skip
    if notes:
        table.caption += "\n" + "\n".join(notes)
    return table
