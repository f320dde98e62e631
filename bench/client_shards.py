"""The chunk rate of servetune's load client split across N processes (``load.client_processes``, load/shard.py).

Starts the fake OpenAI server (``servetune.testing.fake_openai``) in its own process, answering at once
(``--ttft-ms 0 --itl-ms 0``, ``--output-tokens`` chunks a request), and reads it with a closed loop of
``--concurrency`` streams split across each of ``--processes`` client processes (one process runs through the same
shard path, so every row pays the same start-up). Prints the chunks/s received over the level's wall time, the
client CPU per chunk summed over the shards, the busiest shard's CPU share, and the failed requests.

The fake server is one Python process too: where it, not the client, is the limit (the client's CPU shares stay
low), more client processes cannot raise the rate. On a host with fewer cores than the fake and the shards
need, the rows measure the host's scheduler as much as the client. Numbers only; no verdict.

    .venv/bin/python bench/client_shards.py [--processes 1 2] [--concurrency 32] [--num-requests 200]
        [--output-tokens 256] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

from client_rate import fake_server, specs

from servetune.load.runner import Level
from servetune.load.shard import ClientSettings, run_sharded


async def one_level(url: str, processes: int, concurrency: int, n: int, output_tokens: int) -> dict:
    origin: list[float] = []
    run = await run_sharded(
        ClientSettings(url, "fake"), specs(n, output_tokens), Level("concurrency", concurrency), processes,
        stagger=False, on_start=origin.append,
    )  # fmt: skip
    wall = time.perf_counter() - origin[0]
    chunks = sum(len(r.chunk_times) for r in run.records)
    shares = [p.cpu_share or 0.0 for p in run.shard_paces]
    cpu = sum(share * wall for share in shares)  # each shard's CPU share is of the level's wall time
    return {
        "processes": len(run.shard_paces),
        "concurrency": concurrency,
        "requests": n,
        "failed": sum(not r.ok for r in run.records),
        "chunks": chunks,
        "wall_s": wall,
        "chunks_per_s": chunks / wall,
        "cpu_us_per_chunk": cpu / chunks * 1e6 if chunks else None,
        "max_shard_cpu_share": max(shares),
        "client_bound": run.client_bound,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, the process counts alternating in each")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the fake server
    rows = []
    with fake_server("--ttft-ms", "0", "--itl-ms", "0") as url:
        asyncio.run(one_level(url, 1, 4, 20, args.output_tokens))  # warm: the fake's first connections
        print(
            f"chunk rate (fake at --ttft-ms 0 --itl-ms 0, {args.concurrency} streams, {args.output_tokens} chunks each)"
        )
        print(
            f"{'round':>6} {'processes':>10} {'chunks/s':>10} {'CPU us/chunk':>13} {'max shard CPU':>14} {'failed':>7}"
        )
        for round_ in range(args.repeats):
            order = args.processes if round_ % 2 == 0 else args.processes[::-1]
            for processes in order:
                row = asyncio.run(one_level(url, processes, args.concurrency, args.num_requests, args.output_tokens))
                row["round"] = round_ + 1
                rows.append(row)
                print(f"{round_ + 1:>6} {row['processes']:>10} {row['chunks_per_s']:>10.0f} "
                      f"{row['cpu_us_per_chunk']:>13.1f} {row['max_shard_cpu_share']:>14.2f} {row['failed']:>7}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
