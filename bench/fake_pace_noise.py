"""How far the fake engine's achieved pace strays from the pace it was set to, alone and on a busy host.

The integration tests set fake engines (``servetune.testing.fake_openai``) to a time a token and then compare what
the client measured: one configuration faster than another, a release before or after an allowance, a stream that
outlasts a watch. On CI three pytest processes share two cores, so the fake's sleeps end late and the client reads
its chunks late. This script drives the fake with servetune's own client (``run_level``, a closed loop of
``--concurrency`` streams, as the tests do) at each pace of ``--paces`` ms a token, with ``--busy`` other Python
processes beside it (0: a quiet host; 2: the tier's two other pytest workers), each spinning on a core
(``--neighbour spin``) or running the unit tier (``--neighbour pytest``: interpreter starts, imports, subprocesses,
garbage collections, as the tier's other workers do), and the fake either in a
thread of the client's process (``thread``: ``tests/conftest.py::serve_fake``, most tests) or in a process of its
own (``process``: ``fake_server_process``, the engine-lifecycle and CLI tests).

Per request it reads the achieved time a token after the first (TPOT: (end - first chunk) / (tokens - 1)) as a
ratio to the set pace, and each gap between two chunks as a ratio; per level, the mean TPOT ratio (what goodput
and throughput comparisons rest on); and the TTFT beyond the set TTFT, in ms. Prints one row per condition:

    ratio P50 / P95 / P99 / max of the requests' TPOT, the worst level's mean, the gaps' P99, TTFT excess P50 / P99

A test comparing a pace ``k`` times another's has a margin of ``k / worst ratio``: above 1, the slower one cannot
read faster. Run it under the heavy lock (it times), with ``uptime`` beside it:

    flock /tmp/servetune-heavy.lock .venv/bin/python bench/fake_pace_noise.py [--paces 2 5 10] [--busy 0 2]
        [--neighbour spin|pytest]
        [--modes thread process] [--concurrency 4] [--requests 96] [--tokens 32] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level
from servetune.metrics import RequestRecord
from servetune.testing.fake_openai import FakeOpenAI, serve_in_thread
from servetune.testing.process import fake_server_process

TTFT_MS = 10.0


def fake_in_thread(itl_ms: float) -> contextlib.AbstractContextManager[str]:
    """The fake on a loop in a thread of this process (as the tests' ``serve_fake``); yields its URL."""
    return serve_in_thread(FakeOpenAI(ttft_ms=TTFT_MS, itl_ms=itl_ms))


@contextmanager
def neighbours(count: int, kind: str) -> Iterator[None]:
    """``count`` Python processes beside the block: each spinning on a core (``spin``), or running the unit tier over
    and over (``pytest``, its output thrown away); each killed by its own process group."""
    spin = [sys.executable, "-c", "while True: pass"]
    tier = ["bash", "-c", f"while true; do {sys.executable} -m pytest tests/unit -q -n 0 -p no:cacheprovider; done"]
    procs = [
        subprocess.Popen(spin if kind == "spin" else tier, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(count)
    ]  # fmt: skip
    try:
        yield
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one_level(url: str, concurrency: int, requests: int, tokens: int) -> list[RequestRecord]:
    specs = [RequestSpec(i, "a b c", 3, tokens, "bench") for i in range(requests)]
    async with StreamingClient(url, "fake", timeout_s=120) as client:
        records = await run_level(
            client, specs, Level("concurrency", concurrency), num_requests=requests, stagger=False
        )
    return [r for r in records if r.ok and not r.warmup]


def condition(mode: str, busy: int, itl_ms: float, args: argparse.Namespace) -> dict:
    tpot: list[float] = []
    gaps: list[float] = []
    ttft: list[float] = []
    level_means: list[float] = []
    stall_ms = 0.0
    level_excess_s = 0.0
    serving = fake_in_thread(itl_ms) if mode == "thread" else (
        fake_server_process("--ttft-ms", str(TTFT_MS), "--itl-ms", str(itl_ms)))  # fmt: skip
    waves = -(-args.requests // args.concurrency)
    ideal_s = waves * (TTFT_MS + (args.tokens - 1) * itl_ms) / 1e3
    with serving as url, neighbours(busy, args.neighbour):
        for _ in range(args.rounds):
            records = asyncio.run(one_level(url, args.concurrency, args.requests, args.tokens))
            ends = [r.end for r in records if r.end is not None]
            level_excess_s = max(level_excess_s, max(ends) - min(r.sent for r in records) - ideal_s)
            ratios = [
                (r.end - r.chunk_times[0]) / (len(r.chunk_times) - 1) / (itl_ms / 1e3)
                for r in records
                if r.end is not None and len(r.chunk_times) > 1
            ]
            tpot += ratios
            level_means.append(float(np.mean(ratios)))
            level_gaps = [float(g) for r in records for g in np.diff(r.chunk_times)]
            gaps += [g / (itl_ms / 1e3) for g in level_gaps]
            stall_ms = max(stall_ms, (max(level_gaps) - itl_ms / 1e3) * 1e3)
            ttft += [(r.chunk_times[0] - r.sent) * 1e3 - TTFT_MS for r in records if r.chunk_times]
    p50, p95, p99 = np.percentile(tpot, [50, 95, 99])
    t50, t99 = np.percentile(ttft, [50, 99])
    return {
        "mode": mode, "busy": busy, "itl_ms": itl_ms, "requests": len(tpot),
        "tpot_ratio_p50": p50, "tpot_ratio_p95": p95, "tpot_ratio_p99": p99, "tpot_ratio_max": max(tpot),
        "worst_level_mean_ratio": max(level_means), "gap_ratio_p99": float(np.percentile(gaps, 99)),
        "ttft_excess_ms_p50": t50, "ttft_excess_ms_p99": t99, "ttft_excess_ms_max": max(ttft),
        "stall_ms_max": stall_ms, "level_excess_s_max": level_excess_s,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paces", type=float, nargs="+", default=[2.0, 5.0, 10.0], help="ms a token")
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="processes beside the fake")
    parser.add_argument("--neighbour", choices=["spin", "pytest"], default="spin", help="what each of them runs")
    parser.add_argument("--modes", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--requests", type=int, default=96, help="a level's requests")
    parser.add_argument("--tokens", type=int, default=32, help="each request's output tokens")
    parser.add_argument("--rounds", type=int, default=3, help="levels per condition")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; {os.cpu_count()} CPUs; neighbours: {args.neighbour}",
        flush=True,
    )
    header = ("mode     busy  ms/tok   n    TPOT ratio P50   P95    P99    max   worst level   gap P99"
              "   TTFT+ms P50    P99    max   stall ms   level+ s")  # fmt: skip
    print(header, flush=True)
    rows = []
    for mode in args.modes:
        for busy in args.busy:
            for pace in args.paces:
                row = condition(mode, busy, pace, args)
                rows.append(row)
                print(f"{mode:8} {busy:4} {pace:7.1f} {row['requests']:4}        {row['tpot_ratio_p50']:6.2f} "
                      f"{row['tpot_ratio_p95']:6.2f} {row['tpot_ratio_p99']:6.2f} {row['tpot_ratio_max']:6.2f}"
                      f"   {row['worst_level_mean_ratio']:6.2f}     {row['gap_ratio_p99']:7.2f}"
                      f"   {row['ttft_excess_ms_p50']:9.1f} {row['ttft_excess_ms_p99']:6.1f}"
                      f" {row['ttft_excess_ms_max']:6.1f}   {row['stall_ms_max']:8.1f}   {row['level_excess_s_max']:8.2f}",
                      flush=True)  # fmt: skip
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
