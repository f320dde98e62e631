"""servetune's load client against vLLM's own benchmark client, on the same server and requests.

Starts one vLLM server (the CPU build and the tiny model by default), makes one list of
requests from a workload, and runs both clients on it one after the other (alternating, for
``--repeats`` rounds), each in its own process. Prints both sets of metrics side by side and the
client CPU seconds each spent driving the load (measured inside the client process around the
load phase only, so interpreter start-up, imports and tokenizer loading are not counted).

Each round prints TTFT P10/P50/P99, throughput, client CPU and how synchronized the client's
sends were (the share of requests sent within 10 ms of another, ``servetune.summary.send_sync_share``).

``--pin ENGINE:CLIENT`` runs the engine on one set of cores and both clients on another (taskset
core lists, e.g. ``--pin 0:1``): the engine's processes under ``taskset`` with vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` set to its cores, each client process under ``taskset`` with the
client's, so a client cannot take CPU from the engine. The affinity in force is read back and
printed.

Both clients' per-request records are also read by one definition (servetune's ``summarize``: vLLM's
``start_times``, ``ttfts``, ``itls`` and ``latencies`` made into servetune's records, :func:`vllm_records`), so the
throughputs compare on the same window whatever each client's own bookkeeping: ``window`` (every completed
request's output tokens over the first send -> the last end, vLLM's definition), ``busy`` (tokens arriving while
every client had a request in flight, over that window: no ramp-up, no drain), how long the start took until
every client was busy (``ramp``), the drain after the last send, the client's own pace (``refill``: the median
time from an answer's end to the next send while every client is busy) and, for vLLM's client, how much longer its
own duration was than the records' window (``extra``: its clock starts before the first send and stops after
``gather``).

Targets: output throughput within 3% of vLLM's client for the client that starts as vLLM's does (every client
at once, ``--lockstep``), and TTFT P50 within 5%; less client CPU per streamed token.

    .venv/bin/python bench/loadgen_vs_vllm.py [--concurrency 16] [--num-requests 400] [--repeats 2]
        [--input-tokens 256 --output-tokens 128] [--lockstep] [--vllm-body] [--pin 0:1] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace


def parse_cores(text: str) -> list[int]:
    """A taskset core list (``0``, ``0,2``, ``0-3``) as sorted core numbers."""
    cores: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()) or (dash and int(last) < int(first)):
            raise argparse.ArgumentTypeError(f"not a core list: {text!r} (e.g. 0, 0,2 or 0-3)")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


def parse_pin(text: str) -> tuple[list[int], list[int]]:
    """``--pin ENGINE:CLIENT``: the engine's cores and the clients' cores, which must not overlap."""
    engine, sep, client = text.partition(":")
    if not sep or not engine or not client:
        raise argparse.ArgumentTypeError(f"--pin wants ENGINE:CLIENT core lists (e.g. 0:1), got {text!r}")
    engine_cores, client_cores = parse_cores(engine), parse_cores(client)
    if shared := sorted(set(engine_cores) & set(client_cores)):
        raise argparse.ArgumentTypeError(f"--pin {text}: cores {shared} are both the engine's and the client's")
    return engine_cores, client_cores


def core_list(cores: list[int] | None) -> str:
    return ",".join(str(c) for c in cores or [])


def pinned(argv: list[str], cores: list[int] | None) -> list[str]:
    """``argv`` run on ``cores`` only (``taskset``; children inherit it), or as it is without cores."""
    return ["taskset", "--cpu-list", core_list(cores), *argv] if cores else list(argv)


def threads_affinity(pids: list[int]) -> list[str]:
    """The distinct ``Cpus_allowed_list`` of every thread of ``pids`` (what the kernel enforces)."""
    seen: set[str] = set()
    for pid in pids:
        for status in Path(f"/proc/{pid}/task").glob("*/status"):
            try:
                text = status.read_text()
            except OSError:  # the thread ended
                continue
            seen.update(
                line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Cpus_allowed_list")
            )
    return sorted(seen)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def vllm_records(result: dict) -> list:
    """``vllm bench serve``'s per-request outputs (its result's ``start_times``, ``ttfts``, ``itls``, ``latencies``,
    ``output_lens``, ``input_lens``, ``errors``) as servetune's records, on a clock from its first send: each
    content chunk at ``start + ttft + itl...``, the end at ``start + latency`` (vLLM's latency runs to the last
    content chunk), the tokens from the server's usage as vLLM counted them. A request with an error (or no first
    token) is a failed record."""
    from servetune.metrics import RequestRecord

    starts = result["start_times"]
    origin = min(starts) if starts else 0.0
    records = []
    rows = zip(starts, result["ttfts"], result["itls"], result["latencies"], result["output_lens"],
               result["input_lens"], result["errors"], strict=True)  # fmt: skip
    for i, (start, ttft, itl, latency, tokens, prompt, error) in enumerate(rows):
        sent = start - origin
        record = RequestRecord(index=i, sent=sent, input_tokens=prompt, max_tokens=tokens, prompt_tokens=prompt)
        if error or not ttft:
            record.end, record.error_kind, record.error = sent + (latency or 0.0), "failed", (error or "no token")[:300]
        else:
            record.chunk_times = list(itertools.accumulate([sent + ttft, *itl]))
            record.end, record.output_tokens, record.ok = sent + latency, tokens, True
        records.append(record)
    return records


def refill_gap_ms(records: list, window: tuple[float, float] | None) -> float | None:
    """The client's own pace in a closed loop: the median time from a request's end to the next send, over the
    sends while every client was busy (``window``, :func:`servetune.summary.busy_window`), where each send fills
    the slot the latest end freed. None without such a window."""
    if window is None:
        return None
    ends = sorted(r.end for r in records if r.end is not None)
    gaps = []
    for r in records:
        if window[0] < r.sent <= window[1]:
            before = [e for e in ends if e <= r.sent]
            if before:
                gaps.append((r.sent - before[-1]) * 1000.0)
    return statistics.median(gaps) if gaps else None


def common_metrics(records: list, clients: int) -> dict:
    """One definition for both clients' records (servetune's ``summarize``): the whole window's output tok/s, the
    busy window's, the seconds until every client was busy (``ramp_s``), the drain after the last send
    (``drain_s``) and the client's refill gap."""
    from servetune.summary import busy_window, measured_window, summarize

    summary = summarize(records, {"concurrency": clients})
    window, busy = measured_window(records), busy_window(records, clients)
    return {
        "window_output_throughput": summary.output_throughput, "window_s": summary.duration_s,
        "busy_output_throughput": summary.busy_output_throughput,
        "ramp_s": None if busy is None or window is None else busy[0] - window[0],
        "drain_s": None if busy is None or window is None else window[1] - busy[1],
        "refill_gap_ms": refill_gap_ms(records, busy),
    }  # fmt: skip


def wall_window(records: list, origin: float) -> list[float] | None:
    """The records' measured window (first send -> last end) in wall-clock seconds (``time.time()``), from the
    ``time.perf_counter()`` their clock starts at: what the parent reads the engine's CPU over."""
    from servetune.summary import measured_window

    window = measured_window(records)
    if window is None:
        return None
    shift = time.time() - time.perf_counter() + origin
    return [shift + window[0], shift + window[1]]


class CpuSampler:
    """The CPU seconds of a set of processes (the engine's: reaper, API server, engine core), summed, sampled
    every ``every_s`` on wall-clock time in a background thread; :meth:`between` reads the CPU spent in a window
    (linear between samples). A process that ended keeps its last reading."""

    def __init__(self, pids: list[int], every_s: float = 0.1) -> None:
        import threading

        import psutil

        self.processes = [psutil.Process(pid) for pid in pids]
        self.last: dict[int, float] = {}
        self.samples: list[tuple[float, float]] = []
        self.every_s = every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> float:
        import psutil

        for process in self.processes:
            try:
                times = process.cpu_times()
            except psutil.Error:  # it ended: keep its last reading
                continue
            self.last[process.pid] = times.user + times.system
        return sum(self.last.values())

    def _run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.time(), self.read()))
            self.done.wait(self.every_s)

    def __enter__(self) -> CpuSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=5)

    def between(self, start: float, end: float) -> float | None:
        """CPU seconds spent in [start, end] (wall clock); None unless samples cover it."""
        return cpu_between(list(self.samples), start, end)


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float | None:
    """From cumulative ``(wall time, CPU seconds)`` samples, the CPU seconds spent in [start, end], each bound read
    linearly between the samples around it; None unless the samples cover the window."""
    if len(samples) < 2 or not samples[0][0] <= start <= end <= samples[-1][0]:
        return None

    def at(moment: float) -> float:
        for (t1, c1), (t2, c2) in itertools.pairwise(samples):
            if t1 <= moment <= t2:
                return c1 if t2 == t1 else c1 + (c2 - c1) * (moment - t1) / (t2 - t1)
        return samples[-1][1]

    return at(end) - at(start)


def request_rows(records: list) -> list[list[float | int | None]]:
    """Each request as ``[sent, first chunk, end, output tokens]`` (seconds on its level's clock), for ``--json``."""
    return [
        [round(r.sent, 5), round(r.chunk_times[0], 5) if r.chunk_times else None,
         None if r.end is None else round(r.end, 5), r.output_tokens]
        for r in records
    ]  # fmt: skip


def worker_servetune(args: argparse.Namespace) -> dict:
    from servetune.load.client import StreamingClient
    from servetune.load.requests import RequestSpec
    from servetune.load.runner import Level, run_level
    from servetune.metrics import DISTRIBUTION_PERCENTILES
    from servetune.summary import send_sync_share, summarize, ttft_distribution_ms

    rows = [json.loads(line) for line in Path(args.requests).read_text().splitlines()]
    extra = VLLM_BODY if args.worker == "servetune-vllm-body" else ()
    specs = [
        RequestSpec(i, r["prompt"], r["input_tokens"], r["output_tokens"], "default", sampling=extra)
        for i, r in enumerate(rows)
    ]

    origin: list[float] = []

    async def go():
        async with StreamingClient(args.url, args.model) as client:
            level = Level("concurrency", args.concurrency)
            return await run_level(
                client, specs, level, num_requests=len(specs), stagger=args.worker == "servetune",
                on_start=origin.append,
            )  # fmt: skip

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    before = cpu_seconds()
    records = run(go())
    cpu = cpu_seconds() - before
    s = summarize(records, {"concurrency": args.concurrency})
    ttft = ttft_distribution_ms(records) or [float("nan")] * len(DISTRIBUTION_PERCENTILES)
    return {
        "output_throughput": s.output_throughput, "request_throughput": s.request_throughput,
        "ttft_ms_p10": ttft[DISTRIBUTION_PERCENTILES.index(10)],
        "ttft_ms_p50": s.ttft_ms.p50, "ttft_ms_p99": s.ttft_ms.p99, "tpot_ms_p50": s.tpot_ms.p50,
        "itl_ms_p50": s.itl_ms.p50, "e2el_ms_p50": s.e2el_ms.p50, "completed": s.completed,
        "output_tokens": s.total_output_tokens, "client_cpu_s": cpu,
        "send_sync_share": send_sync_share(records), "client_cores": sorted(os.sched_getaffinity(0)),
        "own_window_extra_ms": 0.0, **common_metrics(records, args.concurrency), "requests": request_rows(records),
        "window_wall": wall_window(records, origin[0]),
    }  # fmt: skip


def worker_vllm(args: argparse.Namespace) -> dict:
    import vllm.benchmarks.serve as vserve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spent = {}
    original = vserve.benchmark

    async def timed_benchmark(*a, **kw):  # time only the load phase
        before = cpu_seconds()
        try:
            result = await original(*a, **kw)
        finally:
            spent["cpu"] = cpu_seconds() - before
        keep = ("start_times", "ttfts", "itls", "latencies", "output_lens", "input_lens", "errors", "duration")
        spent.update({key: result[key] for key in keep})  # main() deletes the lists from result
        return result

    vserve.benchmark = timed_benchmark
    with open(args.requests) as lines:
        n = sum(1 for _ in lines)
    parser = FlexibleArgumentParser()
    vserve.add_cli_args(parser)
    vargs = parser.parse_args([
        "--backend", "openai", "--base-url", args.url, "--endpoint", "/v1/completions",
        "--model", args.model, "--tokenizer", args.model,
        "--dataset-name", "custom", "--dataset-path", args.requests, "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle",
        "--num-prompts", str(n), "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "10,50,99",
    ])  # fmt: skip
    r = vserve.main(vargs)
    from servetune.summary import send_sync_share

    sends = [SimpleNamespace(sent=t, warmup=False) for t in spent["start_times"]]
    records = vllm_records(spent)
    common = common_metrics(records, args.concurrency)
    return {
        "output_throughput": r["output_throughput"], "request_throughput": r["request_throughput"],
        "ttft_ms_p10": r["p10_ttft_ms"], "ttft_ms_p50": r["median_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"], "tpot_ms_p50": r["median_tpot_ms"],
        "itl_ms_p50": r["median_itl_ms"], "e2el_ms_p50": r["median_e2el_ms"], "completed": r["completed"],
        "output_tokens": r["total_output_tokens"], "client_cpu_s": spent["cpu"],
        "send_sync_share": send_sync_share(sends), "client_cores": sorted(os.sched_getaffinity(0)),
        "own_window_extra_ms": (spent["duration"] - common["window_s"]) * 1000.0, **common,
        "requests": request_rows(records), "window_wall": wall_window(records, min(spent["start_times"])),
    }  # fmt: skip


def fmt(value: float | None, width: int, digits: int) -> str:
    """``value`` right-aligned in ``width`` with ``digits`` decimals, or ``-`` where there is none."""
    return f"{'-':>{width}s}" if value is None else f"{value:{width}.{digits}f}"


def worker_argv(
    kind: str, url: str, model: str, requests: Path, concurrency: int, cores: list[int] | None = None
) -> list[str]:
    argv = [sys.executable, __file__, "--worker", kind, "--url", url, "--model", model,
            "--requests", str(requests), "--concurrency", str(concurrency)]  # fmt: skip
    return pinned(argv, cores)


def run_worker(
    kind: str, url: str, model: str, requests: Path, concurrency: int, cores: list[int] | None = None
) -> dict:
    argv = worker_argv(kind, url, model, requests, concurrency, cores)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} client failed:\n{done.stderr[-3000:]}")


#: The clients compared: servetune's (staggered starts), vLLM's, servetune's with every client
#: started at once (``--lockstep``), and that one sending the fields vLLM's client adds to each body
#: (``--vllm-body``).
CLIENTS = ("servetune", "vllm", "servetune-lockstep", "servetune-vllm-body")

#: What ``vllm bench serve``'s completions request adds to servetune's body (``async_request_openai_completions``
#: in vllm/benchmarks/lib/endpoint_request_func.py; its ``x-request-id`` header is not sent).
VLLM_BODY: tuple[tuple[str, object], ...] = (("repetition_penalty", 1.0), ("logprobs", None))


def clients_compared(lockstep: bool, vllm_body: bool) -> tuple[str, ...]:
    """The clients a run compares: servetune's and vLLM's, with the lock-step one and the one with vLLM's body
    where asked."""
    return CLIENTS[:2] + CLIENTS[2:3] * lockstep + CLIENTS[3:] * vllm_body


def round_order(kinds: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """The clients of round ``round_`` (from 0), rotated by one each round so none always goes first."""
    k = round_ % len(kinds)
    return kinds[k:] + kinds[:k]


def engine_env(env: dict[str, str], cores: list[int] | None) -> dict[str, str]:
    """The engine's environment: pinned, vLLM's CPU worker binds its OpenMP threads to the engine's
    cores (unless ``--env`` set the binding already)."""
    if not cores:
        return dict(env)
    return {"VLLM_CPU_OMP_THREADS_BIND": core_list(cores), **env}


def pinned_server(cores: list[int] | None, *args, **kwargs):
    """A :class:`VllmServer` whose processes (reaper, API server, engine core) run on ``cores``."""
    from servetune.engine.server import VllmServer

    class PinnedServer(VllmServer):
        def launch_argv(self) -> list[str]:
            return pinned(super().launch_argv(), cores)

    return PinnedServer(*args, **kwargs)


def engine_share(sampler: CpuSampler, result: dict) -> dict:
    """The engine's CPU seconds over a client's measured window, its share of the window (below 1 on one core:
    another process took the core, or the engine waited), and the output tokens per engine CPU second."""
    window = result.get("window_wall")
    cpu = sampler.between(*window) if window else None
    if not cpu or not window:
        return {"engine_cpu_s": None, "engine_cpu_share": None, "tokens_per_engine_cpu_s": None}
    return {
        "engine_cpu_s": cpu, "engine_cpu_share": cpu / (window[1] - window[0]),
        "tokens_per_engine_cpu_s": result["output_tokens"] / cpu,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=CLIENTS, help=argparse.SUPPRESS)
    parser.add_argument("--url")
    parser.add_argument("--requests")
    parser.add_argument("--model", help="model directory (default: the tiny model, built in a temporary directory)")
    parser.add_argument("--workload", default="cpu-tiny")
    parser.add_argument("--input-tokens", type=int, help="every prompt this many tokens (replaces the workload's)")
    parser.add_argument("--output-tokens", type=int, help="every answer this many tokens (replaces the workload's)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--env", action="append", default=["VLLM_CPU_KVCACHE_SPACE=1"])
    parser.add_argument("--engine-arg", action="append", default=["enforce_eager=true"])
    parser.add_argument("--pin", type=parse_pin, metavar="ENGINE:CLIENT",
                        help="engine on these cores, clients on those (taskset core lists, e.g. 0:1)")  # fmt: skip
    parser.add_argument("--lockstep", action="store_true",
                        help="also run servetune's client with every client started at once (no stagger) in each round")  # fmt: skip
    parser.add_argument("--vllm-body", action="store_true",
                        help="also run servetune's lock-step client with the fields vLLM's client adds to each body")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every round's numbers to OUT")
    args = parser.parse_args()
    if args.worker:
        result = (worker_vllm if args.worker == "vllm" else worker_servetune)(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    engine_cores, client_cores = args.pin or (None, None)
    if args.pin and (missing := sorted(set(engine_cores + client_cores) - os.sched_getaffinity(0))):
        parser.error(
            f"--pin: cores {missing} are not available here (allowed: {core_list(sorted(os.sched_getaffinity(0)))})"
        )
    for flag, value in (("--input-tokens", args.input_tokens), ("--output-tokens", args.output_tokens)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")

    from transformers import AutoTokenizer

    from servetune.config.workload import Fixed, load_workload
    from servetune.engine.args import load_argspecs, parse_key_values, parse_value
    from servetune.engine.server import group_members
    from servetune.load.requests import PromptFactory, iter_requests
    from servetune.models.tiny import build_tiny_model
    from servetune.secrets import redact_engine_args
    from servetune.trial.runner import write_atomic

    workload = load_workload(args.workload)
    lengths = {
        k: Fixed(dist="fixed", value=v)
        for k, v in (("input_tokens", args.input_tokens), ("output_tokens", args.output_tokens))
        if v
    }
    if lengths:
        if workload.mix:
            parser.error(f"--input-tokens/--output-tokens: workload {workload.name} is a mix of request classes")
        workload = workload.model_copy(update=lengths)
    work = Path(tempfile.mkdtemp(prefix="servetune-loadgen-"))
    model = args.model or str(build_tiny_model(work / "tiny"))
    prompts = PromptFactory(AutoTokenizer.from_pretrained(model))
    requests = work / "requests.jsonl"
    with requests.open("w") as f:
        for spec in itertools.islice(iter_requests(workload, prompts, stream=1), args.num_requests):
            f.write(
                json.dumps(
                    {"prompt": spec.prompt, "input_tokens": spec.input_tokens, "output_tokens": spec.output_tokens}
                )
                + "\n"
            )
    engine_args = {k: parse_value(v) for k, v in parse_key_values(args.engine_arg, "--engine-arg").items()}
    env = engine_env(parse_key_values(args.env, "--env"), engine_cores)
    kinds = clients_compared(args.lockstep, args.vllm_body)
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    rounds: list[dict] = []
    started = time.time()
    server = pinned_server(
        engine_cores, model, engine_args, env, log_path=work / "engine.log", argspecs=load_argspecs()
    )
    with server, contextlib.ExitStack() as stack:
        engine_affinity = threads_affinity(group_members(server.process.pid))
        print(f"vLLM up at {server.url} in {server.startup_s:.0f} s; {args.num_requests} requests of workload "
              f"{workload.name}, concurrency {args.concurrency}; engine threads on cores {engine_affinity}, "
              f"clients on {core_list(client_cores) or 'any'}", flush=True)  # fmt: skip
        sampler = stack.enter_context(CpuSampler(group_members(server.process.pid)))
        run_worker("servetune", server.url, model, requests, args.concurrency, client_cores)  # warm the server once
        print(
            f"{'round':>5s} {'client':18s} {'tok/s':>7s} {'TTFT P10':>9s} {'P50':>7s} {'P99':>7s} {'CPU s':>6s} {'in sync':>7s} {'cores':>6s}"
            f" {'busy':>7s} {'ramp s':>6s} {'drain s':>7s} {'refill':>6s} {'extra':>6s} {'eng %':>5s} {'tok/eng-s':>9s}",
            flush=True,
        )
        for round_ in range(args.repeats):
            for kind in round_order(kinds, round_):
                r = run_worker(kind, server.url, model, requests, args.concurrency, client_cores)
                r.update(engine_share(sampler, r))
                results[kind].append(r)
                rounds.append({"round": round_ + 1, "client": kind, **r})
                sync = "-" if r["send_sync_share"] is None else f"{r['send_sync_share']:.2f}"
                print(f"{round_ + 1:5d} {kind:18s} {r['output_throughput']:7.1f} {r['ttft_ms_p10']:9.1f} {r['ttft_ms_p50']:7.1f} "
                      f"{r['ttft_ms_p99']:7.1f} {r['client_cpu_s']:6.2f} {sync:>7s} {core_list(r['client_cores']):>6s} "
                      f"{fmt(r['busy_output_throughput'], 7, 1)} {fmt(r['ramp_s'], 6, 2)} {fmt(r['drain_s'], 7, 2)} "
                      f"{fmt(r['refill_gap_ms'], 6, 2)} {fmt(r['own_window_extra_ms'], 6, 1)} "
                      f"{fmt(r['engine_cpu_share'] and 100 * r['engine_cpu_share'], 5, 0)} "
                      f"{fmt(r['tokens_per_engine_cpu_s'], 9, 1)}", flush=True)  # fmt: skip

    def median(kind: str, key: str) -> float:
        values = [r[key] for r in results[kind] if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    keys = ["output_throughput", "window_output_throughput", "busy_output_throughput", "ramp_s", "drain_s",
            "refill_gap_ms", "own_window_extra_ms", "engine_cpu_share", "tokens_per_engine_cpu_s", "request_throughput", "ttft_ms_p10", "ttft_ms_p50", "ttft_ms_p99",
            "tpot_ms_p50", "itl_ms_p50", "e2el_ms_p50", "completed", "output_tokens", "client_cpu_s"]  # fmt: skip
    lockstep = "servetune-lockstep" in results
    others = [kind for kind in results if kind not in CLIENTS[:2]]
    names = {"servetune-lockstep": "lock-step", "servetune-vllm-body": "vLLM's body"}
    extra = "".join(f" {names[kind]:>12s}" for kind in others)
    print(
        f"\n{'metric (median of ' + str(args.repeats) + ')':34s} {'servetune':>12s} {'vllm bench':>12s} {'diff':>8s}{extra}"
    )
    for key in keys:
        ours, theirs = median("servetune", key), median("vllm", key)
        diff = (ours - theirs) / theirs * 100 if theirs else float("nan")
        extra = "".join(f" {median(kind, key):12.3f}" for kind in others)
        print(f"{key:34s} {ours:12.3f} {theirs:12.3f} {diff:+7.1f}%{extra}")
    per_tok = {k: median(k, "client_cpu_s") / median(k, "output_tokens") * 1e6 for k in results}
    print(f"{'client CPU µs per streamed token':34s} {per_tok['servetune']:12.1f} {per_tok['vllm']:12.1f} "
          f"{(per_tok['servetune'] / per_tok['vllm'] - 1) * 100:+7.1f}%")  # fmt: skip
    like = "servetune-lockstep" if lockstep else "servetune"  # the client that starts as vLLM's does
    tput = abs(median(like, "output_throughput") / median("vllm", "output_throughput") - 1) * 100
    ttft = abs(median(like, "ttft_ms_p50") / median("vllm", "ttft_ms_p50") - 1) * 100
    for kind in [like, *(k for k in others if k != like)]:
        pairs = [(a["output_throughput"] / b["output_throughput"] - 1) * 100
                 for a, b in zip(results[kind], results["vllm"], strict=True)]  # fmt: skip
        print(f"\n{kind} against vllm, output throughput per round: " + ", ".join(f"{p:+.1f}%" for p in pairs))
    print(
        f"targets ({like}): throughput within 3%: {tput:.1f}% {'ok' if tput <= 3 else 'MISSED'}; "
        f"TTFT P50 within 5%: {ttft:.1f}% {'ok' if ttft <= 5 else 'MISSED'}; "
        f"less CPU per token: {'ok' if per_tok['servetune'] < per_tok['vllm'] else 'MISSED'}"
    )
    if args.json:
        report = {
            "command": sys.argv, "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(time.time() - started, 1), "engine_cores": engine_cores, "client_cores": client_cores,
            "engine_threads_affinity": engine_affinity, "workload": workload.model_dump(mode="json"),
            "engine_args": redact_engine_args(engine_args), "rounds": rounds,
        }  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
