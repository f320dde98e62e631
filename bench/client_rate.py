"""What one load-client process costs per streamed chunk, and the TTFT it adds.

Starts the fake OpenAI server (``servetune.testing.fake_openai``) in its own process and drives it
with servetune's own client (``StreamingClient`` under ``run_level``) from this process:

1. **Chunk rate**: the fake answers at once (``--ttft-ms 0 --itl-ms 0``), ``--output-tokens``
   chunks a request, at each of ``--concurrency`` streams in flight. Prints the chunks/s received
   (wall), the client's CPU seconds per chunk (``time.process_time`` of this process over the level,
   so imports and start-up are not counted), its CPU share of the wall time, and the chunk rate that
   CPU cost allows one process at a full core (``chunks / CPU-s``).
2. **Client-added TTFT**: the fake answers after ``--ttft-ms`` with ``--paced-itl-ms`` between chunks;
   at each concurrency, the measured TTFT minus the fake's TTFT, P50 and P99. This is an upper
   bound on what the client adds: it also holds the fake's own event-loop delay and the loopback.
3. **Open loops** against the same paced fake at ``--rates`` req/s (Poisson): the P99 of the send lag
   (how late requests went out against their schedule) and the ``client_bound`` verdict of
   ``servetune.load.pace`` on the level.

On a shared host both processes compete for cores with whatever else runs: the numbers are a floor.

    .venv/bin/python bench/client_rate.py [--concurrency 1 8 32 64] [--output-tokens 256]
        [--num-requests 200] [--ttft-ms 20] [--paced-itl-ms 2] [--rates 50 200 800] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time

import numpy as np

from servetune.load.client import StreamingClient
from servetune.load.pace import client_bound, client_pace
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level
from servetune.testing.process import fake_server_process


def specs(n: int, output_tokens: int) -> list[RequestSpec]:
    return [RequestSpec(i, "hello " * 8, 8, output_tokens, "bench") for i in range(n)]


async def one_level(url: str, concurrency: int, n: int, output_tokens: int, rate: float | None = None) -> dict:
    """``concurrency`` streams in a closed loop, or with ``rate`` an open (Poisson) loop at that many req/s."""
    level = Level("concurrency", concurrency) if rate is None else Level("rate", rate, "poisson")
    async with StreamingClient(url, "fake") as client:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        records = await run_level(client, specs(n, output_tokens), level, num_requests=n, stagger=False)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    pace = client_pace(records, cpu, wall)
    chunks = sum(len(r.chunk_times) for r in records)
    ttft = np.array([r.ttft_s for r in records if r.ttft_s is not None]) * 1e3
    return {
        "concurrency": concurrency,
        "requests": n,
        "failed": sum(not r.ok for r in records),
        "chunks": chunks,
        "wall_s": wall,
        "cpu_s": cpu,
        "chunks_per_s": chunks / wall,
        "cpu_us_per_chunk": cpu / chunks * 1e6 if chunks else None,
        "cpu_share": cpu / wall,
        "chunks_per_cpu_s": chunks / cpu if cpu > 0 else None,
        "ttft_ms_p50": float(np.percentile(ttft, 50)) if ttft.size else None,
        "ttft_ms_p99": float(np.percentile(ttft, 99)) if ttft.size else None,
        "send_lag_ms_p50": pace.send_lag_ms_p50,
        "send_lag_ms_p99": pace.send_lag_ms_p99,
        "client_bound": client_bound(pace),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--paced-itl-ms", type=float, default=2.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[50.0, 200.0, 800.0], help="open loops, req/s")
    parser.add_argument("--json", help="write the rows as JSON here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the fake server
    rows: dict[str, list[dict]] = {"rate": [], "ttft": [], "open": []}
    with fake_server_process("--ttft-ms", "0", "--itl-ms", "0") as url:
        asyncio.run(one_level(url, 4, 20, args.output_tokens))  # warm: connections, caches
        print("chunk rate (fake at --ttft-ms 0 --itl-ms 0)")
        print(
            f"{'streams':>8} {'chunks/s':>10} {'CPU us/chunk':>13} {'CPU share':>10} {'chunks/CPU-s':>13} {'failed':>7}"
        )
        for c in args.concurrency:
            row = asyncio.run(one_level(url, c, args.num_requests, args.output_tokens))
            rows["rate"].append(row)
            print(f"{c:>8} {row['chunks_per_s']:>10.0f} {row['cpu_us_per_chunk']:>13.1f} "
                  f"{row['cpu_share']:>10.2f} {row['chunks_per_cpu_s']:>13.0f} {row['failed']:>7}")  # fmt: skip
    with fake_server_process("--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.paced_itl_ms)) as url:
        asyncio.run(one_level(url, 4, 20, 16))
        print(f"\nclient-added TTFT (fake at --ttft-ms {args.ttft_ms:g} --itl-ms {args.paced_itl_ms:g}; upper bound)")
        print(f"{'streams':>8} {'chunks/s':>10} {'CPU share':>10} {'added P50 ms':>13} {'added P99 ms':>13}")
        for c in args.concurrency:
            row = asyncio.run(one_level(url, c, args.num_requests, args.output_tokens))
            row["added_ttft_ms_p50"] = row["ttft_ms_p50"] - args.ttft_ms
            row["added_ttft_ms_p99"] = row["ttft_ms_p99"] - args.ttft_ms
            rows["ttft"].append(row)
            print(f"{c:>8} {row['chunks_per_s']:>10.0f} {row['cpu_share']:>10.2f} "
                  f"{row['added_ttft_ms_p50']:>13.2f} {row['added_ttft_ms_p99']:>13.2f}")  # fmt: skip
        print(f"\nopen loops (same fake; {args.num_requests} requests of {args.output_tokens // 8} tokens)")
        print(f"{'req/s':>8} {'chunks/s':>10} {'CPU share':>10} {'lag P50 ms':>11} {'lag P99 ms':>11}  client_bound")
        for rate in args.rates:
            row = asyncio.run(one_level(url, 0, args.num_requests, args.output_tokens // 8, rate=rate))
            rows["open"].append(row)
            print(f"{rate:>8g} {row['chunks_per_s']:>10.0f} {row['cpu_share']:>10.2f} "
                  f"{row['send_lag_ms_p50']:>11.2f} {row['send_lag_ms_p99']:>11.2f}  {row['client_bound'] or '-'}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
