"""One load level run across several client processes (``load.client_processes``), its records merged.

One Python process reads streams on one event loop, one core at most (load/pace.py). Past the chunk rate that
allows (bench/README.md, "The load client's cost per chunk": 5.5-7.8 µs of client CPU a chunk), a level is split
across N shard processes, each with its own event loop and HTTP session, started as ``python -m
servetune.load.shard`` in a session of its own:

- the split is by request index, fixed before the level starts: request ``i`` goes to shard ``i % N`` in an open
  loop; in a closed loop of ``C`` clients to shard ``(i % C) % N``, so a shard holds the requests of its clients;
- an open loop's one schedule is drawn here (:func:`open_schedule`, the gaps ``run_level`` would draw with the
  same seed) and each shard sends its share at its times, so the merged schedule is the unsharded one;
- a closed loop's clients are split (:func:`split_evenly`; the shares add up to the level's concurrency), and so
  is an open loop's cap on requests in flight;
- every shard runs :func:`servetune.load.runner.run_level` on the level's one clock: times in records count from
  the same origin (``time.perf_counter`` is the system's monotonic clock, one for every process);
- each record comes back as its request finishes, with its level-wide index (the warm-up is the first
  ``warmup_requests`` indices, as unsharded), so progress and the early break (``stop``) work as they do in one
  process: once ``stop()`` says so, every shard is told to send no more;
- each shard measures its own CPU share and send lags; the level is client-bound when any shard was
  (:func:`servetune.load.pace.shards_bound`);
- each shard records its own event loop's stalls (:class:`servetune.load.pace.LoopStalls`) and reports their spans
  on the level's one clock; the level's stalls are all shards' (``ShardedRun.stall_spans``): the longest of any, and
  the seconds in which any shard stalled (the union of the spans: a stall of the whole host, which stops every shard
  at once, counts once);
- a shard that dies fails the level (:class:`ClientShardError`), and every shard's process group is killed
  whatever ends the level, so nothing is left behind.

Conversations (workloads with ``sessions``) are not split: a conversation's turns must stay on one client.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import BinaryIO, Literal

import numpy as np

from servetune.load.client import StreamingClient
from servetune.load.pace import ClientPace, LoopStalls, StallSpan, client_pace, shards_bound
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, arrival_gaps, run_level
from servetune.metrics import RequestRecord
from servetune.shipped import child_env

#: How long a shard process may take to start (an interpreter importing numpy and aiohttp on a busy host).
START_TIMEOUT_S = 120.0
#: The level's clock origin lies this far after the last shard said it is ready, so every shard waits for it.
START_MARGIN_S = 0.05
#: The rate one client process is rated for, in streamed chunks a second, for ``client_processes: auto``: the
#: bench's 5.5-7.8 µs of CPU a chunk allow 130,000-180,000 at a full core; a client kept near half a core adds
#: little to TTFT, and the busy host measured up to 10-12 µs a chunk (bench/README.md), so 60,000.
RATED_CHUNKS_PER_S = 60_000.0

_HEADER = struct.Struct("!I")


class ClientShardError(RuntimeError):
    """A shard of a level's load client failed: the level measured nothing that can be trusted."""


@dataclass(frozen=True)
class ClientSettings:
    """What a shard needs to open the same client as the level's (:class:`StreamingClient`'s arguments)."""

    base_url: str
    model: str
    api: str = "completions"
    timeout_s: float = 600.0
    first_token_timeout_s: float | None = None
    idle_timeout_s: float | None = None
    ignore_eos: bool = True
    temperature: float = 0.0
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, client: StreamingClient) -> ClientSettings:
        return cls(
            client.base_url, client.model, client.api, client.timeout_s, client.first_token_timeout_s,
            client.idle_timeout_s, client.ignore_eos, client.temperature, tuple(client.headers.items()),
        )  # fmt: skip

    def open(self) -> StreamingClient:
        return StreamingClient(
            self.base_url, self.model, api=self.api, timeout_s=self.timeout_s,
            first_token_timeout_s=self.first_token_timeout_s, idle_timeout_s=self.idle_timeout_s,
            ignore_eos=self.ignore_eos, temperature=self.temperature, headers=dict(self.headers),
        )  # fmt: skip


@dataclass(frozen=True)
class ShardPlan:
    """One shard's part of a level: its requests (in level order), their level-wide indices, and its level."""

    shard: int
    level: Level
    specs: tuple[RequestSpec, ...]
    indices: tuple[int, ...]
    schedule: tuple[float, ...] | None  # an open loop's send times, seconds from the level's origin
    seed: int
    duration_s: float | None
    stagger: bool


@dataclass(frozen=True)
class ShardedRun:
    """A level's merged records (level order) and how the client kept up: over all shards, and per shard, with each
    shard's event-loop stalls (:class:`~servetune.load.pace.LoopStalls`' spans)."""

    records: list[RequestRecord]
    pace: ClientPace
    shard_paces: tuple[ClientPace, ...]
    shard_stalls: tuple[tuple[StallSpan, ...], ...] = ()

    @property
    def client_bound(self) -> str | None:
        return shards_bound(self.shard_paces)

    @property
    def stall_spans(self) -> list[StallSpan]:
        """Every shard's stalls, on the level's one clock (read by ``pace.longest_stall_s`` and ``pace.stalled_s``)."""
        return [span for spans in self.shard_stalls for span in spans]


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` split in ``parts`` shares differing by one at most, larger first; they add up to ``total``."""
    return [total // parts + (k < total % parts) for k in range(parts)]


def open_schedule(level: Level, count: int, seed: int) -> list[float]:
    """An open loop's send times for ``count`` requests, seconds from the first: the gaps ``run_level`` draws."""
    gaps = arrival_gaps(level, np.random.default_rng(seed))
    return [0.0, *itertools.accumulate(itertools.islice(gaps, max(count - 1, 0)))]


def shard_count(level: Level, requests: int, processes: int) -> int:
    """How many shards a level gets of ``processes``: no more than its requests, clients or cap in flight."""
    most = requests
    if level.kind == "concurrency":
        most = min(most, max(1, int(level.value)))
    elif level.max_concurrency:
        most = min(most, level.max_concurrency)
    return max(1, min(processes, most))


def plan_shards(level: Level, specs: Sequence[RequestSpec], shards: int, *, seed: int, duration_s: float | None = None,
                stagger: bool = True) -> list[ShardPlan]:  # fmt: skip
    """Split a level's requests across ``shards`` (see the module's docstring for the rule)."""
    if any(spec.session is not None for spec in specs):
        raise ValueError("a level with conversations (workload.sessions) runs in one client process")
    count = len(specs)
    if level.kind == "concurrency":
        clients = max(1, int(level.value))
        owner = [(i % clients) % shards for i in range(count)]
        levels = [replace(level, value=float(c)) for c in split_evenly(clients, shards)]
        schedule = None
    else:
        owner = [i % shards for i in range(count)]
        caps = split_evenly(level.max_concurrency, shards) if level.max_concurrency else [None] * shards
        levels = [replace(level, max_concurrency=cap) for cap in caps]
        schedule = open_schedule(level, count, seed)
    plans = []
    for k in range(shards):
        mine = tuple(i for i in range(count) if owner[i] == k)
        times = None if schedule is None else tuple(schedule[i] for i in mine)
        plans.append(ShardPlan(k, levels[k], tuple(specs[i] for i in mine), mine, times, seed + k, duration_s, stagger))
    return plans


async def run_sharded(
    client: ClientSettings,
    specs: Sequence[RequestSpec],
    level: Level,
    processes: int,
    *,
    duration_s: float | None = None,
    warmup_requests: int = 0,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
    stop: Callable[[], bool] | None = None,
    stagger: bool = True,
    on_start: Callable[[float], None] | None = None,
    python: Sequence[str] = (sys.executable,),
) -> ShardedRun:
    """Run one level's ``specs`` (its warm-up first) across ``processes`` client processes; see the module's docstring.

    Raises :class:`ClientShardError` when a shard dies or fails; no shard process outlives the call.
    """
    shards = shard_count(level, len(specs), processes)
    plans = plan_shards(level, specs, shards, seed=seed, duration_s=duration_s, stagger=stagger)
    procs: list[asyncio.subprocess.Process] = []
    records: list[RequestRecord] = []
    measured: dict[int, tuple[float, float]] = {}  # shard -> its CPU seconds and wall seconds over the level
    stalls: dict[int, tuple[StallSpan, ...]] = {}  # shard -> its event loop's stalls over the level
    stopped = False

    def tell_all(message: object) -> None:
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.write(_frame(message))

    async def read(k: int) -> object:
        reader = procs[k].stdout
        assert reader is not None
        try:
            (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            return pickle.loads(await reader.readexactly(size))
        except asyncio.IncompleteReadError:
            code = await procs[k].wait()
            raise ClientShardError(
                f"load client shard {k + 1} of {shards} died (exit code {code}) during {level}: the level is void"
            ) from None

    async def follow(k: int) -> None:
        nonlocal stopped
        plan = plans[k]
        while True:
            message = await read(k)
            match message:
                case ("record", RequestRecord() as record):
                    record.index = plan.indices[record.index]
                    record.warmup = record.index < warmup_requests
                    records.append(record)
                    if on_done is not None:
                        on_done(record)
                    if not stopped and stop is not None and stop():
                        stopped = True
                        tell_all(("stop",))
                case ("done", float() as cpu_s, float() as wall_s, tuple() as spans):
                    measured[k], stalls[k] = (cpu_s, wall_s), spans
                    return
                case ("error", str() as text):
                    raise ClientShardError(f"load client shard {k + 1} of {shards} failed during {level}: {text}")
                case _:
                    raise ClientShardError(f"load client shard {k + 1} of {shards} sent {message!r}")

    try:
        for plan in plans:
            proc = await asyncio.create_subprocess_exec(
                *python, "-m", "servetune.load.shard", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                start_new_session=True, env=child_env(),  # this servetune, in a trial's own directory too
            )  # fmt: skip
            procs.append(proc)
            assert proc.stdin is not None
            proc.stdin.write(_frame((plan, client)))
        async with asyncio.timeout(START_TIMEOUT_S):
            for k in range(shards):
                if (message := await read(k)) != ("ready",):
                    raise ClientShardError(f"load client shard {k + 1} of {shards} did not start: {message!r}")
        t0 = time.perf_counter() + START_MARGIN_S
        if on_start is not None:
            on_start(t0)
        tell_all(("go", t0))
        await asyncio.gather(*(follow(k) for k in range(shards)))
    finally:
        for proc in procs:
            if proc.returncode is None:
                if proc.stdin is not None:
                    proc.stdin.close()
                with contextlib.suppress(TimeoutError):  # it ends on its stdin's end
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 2.0)
            if proc.returncode is None or proc.returncode < 0:
                # the whole group: whatever a shard started goes with it
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    records.sort(key=lambda r: r.index)
    owner = {i: plan.shard for plan in plans for i in plan.indices}
    shard_paces = tuple(
        client_pace([r for r in records if owner[r.index] == plan.shard], *measured[plan.shard]) for plan in plans
    )
    merged = client_pace(records, None, None)
    shares = [p.cpu_share for p in shard_paces if p.cpu_share is not None]
    pace = ClientPace(max(shares, default=None), merged.send_lag_ms_p50, merged.send_lag_ms_p99)
    return ShardedRun(records, pace, shard_paces, tuple(stalls[plan.shard] for plan in plans))


def auto_client_processes(level: Level, output_tokens: float, cpus: int, rated: float = RATED_CHUNKS_PER_S,
                          tokens_per_stream_s: float = 100.0) -> int:  # fmt: skip
    """``client_processes: auto`` for one level: its expected chunk rate over what one process is rated for, at
    most the CPUs the trial reserves (one core each; at least 1).

    An open loop's expected rate is its request rate times the mean output tokens (one chunk a token, as vLLM
    streams); a closed loop's, its clients times ``tokens_per_stream_s`` (a stream's decode rate on a GPU; 100
    tokens/s is a fast one, so the estimate errs toward more processes).
    """
    expected = level.value * (output_tokens if level.kind == "rate" else tokens_per_stream_s)
    return max(1, min(cpus, math.ceil(expected / rated)))


def _frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _read_frame(source: BinaryIO) -> object:
    header = source.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    return pickle.loads(source.read(size))


async def _shard(plan: ShardPlan, client: ClientSettings, t0: float, stop: threading.Event, out: BinaryIO) -> None:
    def send(record: RequestRecord) -> None:
        out.write(_frame(("record", record)))
        out.flush()

    async with client.open() as session:
        if (delay := t0 - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        cpu_at = time.process_time()  # this shard's CPU over the level (load/pace.py)
        async with LoopStalls() as stalls:  # this shard's own stalls, which the level's verdict tells from the server's
            await run_level(
                session, plan.specs, plan.level, num_requests=len(plan.specs), duration_s=plan.duration_s,
                seed=plan.seed, on_done=send, stop=stop.is_set, stagger=plan.stagger, t0=t0, schedule=plan.schedule,
            )  # fmt: skip
        cpu_s, wall_s = time.process_time() - cpu_at, time.perf_counter() - t0
    out.write(_frame(("done", float(cpu_s), float(wall_s), tuple(stalls.spans))))
    out.flush()


def main() -> Literal[0, 1]:
    """A shard process: reads its plan and the level's origin from stdin, writes its records to stdout."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the records
    source = sys.stdin.buffer
    given = _read_frame(source)
    assert isinstance(given, tuple)
    plan, client = given
    out.write(_frame(("ready",)))
    out.flush()
    message = _read_frame(source)
    assert isinstance(message, tuple) and message[0] == "go"
    stop = threading.Event()

    def listen() -> None:  # "stop" from the level; the end of stdin: the level is gone, so is this shard
        try:
            while _read_frame(source) == ("stop",):
                stop.set()
        except (EOFError, OSError, pickle.UnpicklingError):
            pass
        os._exit(0 if done.is_set() else 3)

    done = threading.Event()
    threading.Thread(target=listen, daemon=True).start()
    try:
        asyncio.run(_shard(plan, client, float(message[1]), stop, out))
    except Exception:
        out.write(_frame(("error", traceback.format_exc(limit=4).strip().splitlines()[-1])))
        out.flush()
        return 1
    finally:
        done.set()
        out.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: the thread blocked reading stdin would stall the interpreter's shutdown
