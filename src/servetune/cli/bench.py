"""``servetune bench``: measure one vLLM configuration under a realistic load."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from servetune import __version__
from servetune.cli.display import console as make_console
from servetune.cli.display import level_table
from servetune.config.slo import Slo
from servetune.config.space import engine_devices
from servetune.config.workload import Workload, load_workload
from servetune.engine.args import (
    STRUCTURED_BACKEND,
    cpu_build,
    load_argspecs,
    parse_key_values,
    parse_value,
    structured_backend_problems,
    validate_engine_args,
    vllm_version,
)
from servetune.engine.server import VllmServer
from servetune.errors import EngineDiedError, UserError
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level, workload_levels
from servetune.load.tokenizer import load_tokenizer
from servetune.metrics import STRUCTURED_VALID
from servetune.results import BenchResult, KvCapacityReport
from servetune.secrets import redact_engine_args, redact_env
from servetune.telemetry import TelemetrySampler, visible_gpus
from servetune.trial.measure import AUTO, LevelPlan, check_alive, client_shards, measure_rung
from servetune.trial.runner import write_atomic

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="measure one vLLM configuration under a realistic load",
        description=(
            "Start one vLLM server with the given configuration (or use --url), drive the "
            "workload at each load level in turn, and print latency and throughput per level: "
            "TTFT, TPOT, ITL and end-to-end latency (mean, P50/P90/P95/P99), tokens and requests "
            "per second, goodput under the SLO, errors by kind, and vLLM's own /metrics deltas. "
            "On vLLM's CPU build the engine is bound to a free core per rank (TP x PP x DP), as a "
            "study's trials are, unless --env VLLM_CPU_OMP_THREADS_BIND=... says where."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "example (CPU build, tiny model):\n"
            "  servetune models tiny --out models/tiny\n"
            "  servetune bench --model models/tiny --env VLLM_CPU_KVCACHE_SPACE=1 \\\n"
            "      --engine-arg enforce_eager=true --workload cpu-tiny --concurrency 1,16 --json out/bench.json"
        ),
    )
    p.add_argument("--model", help="model directory (or hub id) to serve; with --url, the tokenizer to use")
    p.add_argument("--url", help="benchmark an already running OpenAI-compatible server instead of starting one")
    p.add_argument("--served-model-name", help="model name to put in requests (default: asked from --url, or --model)")
    p.add_argument("--tokenizer", help="tokenizer directory, when it differs from --model")
    p.add_argument(
        "--engine-arg",
        action="append",
        metavar="KEY=VALUE",
        help="vLLM engine argument, snake_case (repeatable), e.g. max_num_seqs=32",
    )
    p.add_argument(
        "--env",
        action="append",
        metavar="KEY=VALUE",
        help="extra environment for vLLM (repeatable), e.g. VLLM_CPU_KVCACHE_SPACE=1",
    )
    p.add_argument(
        "--workload",
        default="chat",
        help="workload file, or the name of a shipped one under trials/workloads (default: chat)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--concurrency", help="closed-loop levels: clients in flight, e.g. 1,4,16")
    load.add_argument(
        "--rate", help="open-loop levels: requests per second, e.g. 2,8 (Poisson, or the workload's gamma burstiness)"
    )
    load.add_argument(
        "--speedup",
        help="levels of a trace replay (a workload with arrival: {process: trace}): speed-ups of the recorded times, e.g. 1,2,4",
    )
    p.add_argument("--max-concurrency", type=int, help="with --rate or --speedup: cap on requests in flight")
    p.add_argument(
        "--num-requests",
        type=int,
        help="measured requests per level (default: 8 x concurrency, or 30 s of the rate; 32..500)",
    )
    p.add_argument(
        "--duration", type=float, help="seconds per level at most (the level also ends after --num-requests)"
    )
    p.add_argument(
        "--warmup-requests",
        type=int,
        help="requests at the start of each level left out of the numbers (default: one per client, at most 32)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="runs of each level; a level reports its median run, so its SLO verdict is the majority's (default: 1)",
    )
    p.add_argument(
        "--client-processes",
        default="1",
        metavar="N|auto",
        help="client processes each level's load is split across, for more streamed tokens a second than one "
        "process reads: a number, or auto (from each level's expected token rate, at most this host's cores; "
        "default: 1)",
    )
    p.add_argument(
        "--slo",
        default="",
        help="bounds for the SLO verdict and goodput, e.g. ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001 "
        "(structured_valid.min=0.99: a floor on the share of structured answers that parsed)",
    )
    p.add_argument(
        "--json",
        type=Path,
        metavar="OUT",
        help="write the result here, per-request records and vLLM's log beside it (<stem>.requests.jsonl, <stem>.engine.log); "
        "without it vLLM's log goes to a temporary directory, removed unless vLLM fails",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds before one request counts as timed out (default: 600)",
    )
    p.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for vLLM to become healthy (default: 900)"
    )
    p.add_argument("--python", default=sys.executable, help="Python interpreter that has vLLM (default: this one)")
    p.set_defaults(run=run)


def parse_levels(args: argparse.Namespace, workload: Workload) -> list[Level]:
    arrival = workload.arrival
    kind: Literal["concurrency", "rate"] | None
    if args.rate:
        kind, text = "rate", args.rate
    elif args.concurrency:
        kind, text = "concurrency", args.concurrency
    elif args.speedup:
        if arrival.process != "trace":
            raise UserError(
                f"--speedup is for a workload that replays a trace (arrival: {{process: trace}}); {workload.name} has process {arrival.process}"
            )
        kind, text = None, args.speedup
    elif arrival.levels or arrival.process == "trace":
        kind, text = None, ""
    else:
        kind, text = "concurrency", "1,4,16"
    flag = f"--{kind or 'speedup'}"
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} '{text}' is not a comma-separated list of numbers") from None
    if text and (not values or min(values) <= 0):
        raise UserError(f"{flag} needs positive numbers, got '{text}'")
    if kind == "concurrency" and any(v != int(v) for v in values):
        raise UserError(f"{flag} levels are whole numbers of clients, got '{text}'")
    return list(workload_levels(workload, kind, tuple(values) or None, args.max_concurrency))


def level_plan(level: Level, args: argparse.Namespace) -> LevelPlan:
    if args.num_requests is not None and args.num_requests < 1:
        raise UserError("--num-requests must be at least 1")
    if not 1 <= args.repeats <= 9:
        raise UserError(f"--repeats must be 1 to 9, got {args.repeats}")
    requests: int | Literal["auto"] = args.num_requests if args.num_requests is not None else AUTO
    return LevelPlan.sized(level, requests, args.duration, args.warmup_requests)


def parse_client_processes(text: str) -> int | Literal["auto"]:
    """``--client-processes``: a whole number at least 1, or "auto" (load/shard.py ``auto_client_processes``)."""
    if text == AUTO:
        return AUTO
    try:
        processes = int(text)
    except ValueError:
        processes = 0
    if processes < 1:
        raise UserError(f"--client-processes must be a whole number of processes (at least 1) or auto, got '{text}'")
    return processes


def host_cpus() -> int:
    """The cores this process may run on: what ``--client-processes auto`` splits a level across at most."""
    return len(os.sched_getaffinity(0))


def check_model(model: str) -> None:
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {model}: the directory has no config.json (not a model directory)")
        return
    if path.exists():
        raise UserError(f"--model {model}: not a directory")
    if not _HUB_ID.match(model) or model.startswith((".", "~")):
        raise UserError(f"--model {model}: no such directory")


def served_name_from(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=10) as resp:
            models = json.load(resp).get("data", [])
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UserError(f"--url {url}: cannot reach the server ({reason})") from None
    if not models:
        raise UserError(f"--url {url}: the server lists no models")
    return models[0]["id"]


def run(args: argparse.Namespace) -> int:
    console = make_console(stderr=True)
    slo = Slo.parse(args.slo)
    workload = load_workload(args.workload)
    if any(b.metric == STRUCTURED_VALID for b in slo.bounds) and not workload.asks_structured:
        raise UserError(f"--slo structured_valid: the workload '{workload.name}' asks for no structured output, "
                        "so no level would measure it")  # fmt: skip
    levels = parse_levels(args, workload)
    plans = [level_plan(level, args) for level in levels]
    client_processes, client_cpus = parse_client_processes(args.client_processes), host_cpus()
    for plan in plans:  # a level that cannot be split says so before any engine starts
        client_shards(workload, plan, client_processes, client_cpus, setting="--client-processes")
    env = parse_key_values(args.env, "--env")
    raw_engine_args = {k: parse_value(v) for k, v in parse_key_values(args.engine_arg, "--engine-arg").items()}
    if args.url:
        if raw_engine_args or env:
            raise UserError("--engine-arg and --env configure a server servetune starts; they do not apply with --url")
        served = args.served_model_name or served_name_from(args.url)
        tokenizer_name = args.tokenizer or args.model or served
        engine_args: dict = {}
        specs = None
    else:
        if not args.model:
            raise UserError("--model is required (or --url to benchmark a running server)")
        check_model(args.model)
        specs = load_argspecs(args.python)
        if specs is None:
            raise UserError(
                f"vLLM is not installed for {args.python} (install servetune[cpu] or servetune[gpu], or pass --python)"
            )
        engine_args = validate_engine_args(raw_engine_args, specs)
        backend = engine_args.get(STRUCTURED_BACKEND)
        problem = structured_backend_problems([str(backend)], args.python).get(str(backend)) if backend else None
        if problem:  # vLLM would start, then answer every structured request with HTTP 500
            raise UserError(f"--engine-arg {STRUCTURED_BACKEND}: {backend}: {problem}")
        if args.served_model_name:
            engine_args["served_model_name"] = args.served_model_name
        served = args.served_model_name or args.model
        tokenizer_name = args.tokenizer or args.model
    with console.status(f"loading the tokenizer of {tokenizer_name}"):
        prompts = PromptFactory(load_tokenizer(tokenizer_name))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, exit_on_sigterm)

    version = None if args.url else vllm_version(args.python)
    result = BenchResult(
        servetune_version=__version__, created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        url=args.url or "", model=args.model or tokenizer_name, served_model_name=served,
        engine_args=redact_engine_args(engine_args), env=redact_env(env), command=None, vllm_version=version,
        workload_file=str(args.workload), workload=workload.model_dump(mode="json"), slo=[str(b) for b in slo.bounds],
        num_requests=args.num_requests, duration_s=args.duration, repeats=args.repeats, kv_capacity=None, startup_s=None, levels=[],
        client_processes=client_processes,
    )  # fmt: skip
    records: list[dict] = []
    died: EngineDiedError | None = None
    if args.url:
        run_levels(console, args.url, served, workload, prompts, plans, slo, args, result, records,
                   client_processes=client_processes, client_cpus=client_cpus)  # fmt: skip
    else:
        log_path = engine_log_path(args.json)
        finished = False
        try:
            if workload.adapters:  # the tiny adapter is built beside --json, else beside the temporary log (removed)
                engine_args = workload.adapter_engine_args(engine_args, log_path.parent / MODELS_DIR)
                result.engine_args = redact_engine_args(engine_args)
            server = VllmServer(
                args.model, workload.measured_engine_args(engine_args), env, log_path=log_path, python=args.python,
                startup_timeout_s=args.startup_timeout, argspecs=specs, cpu_ranks=cpu_ranks(engine_args, version),
            )  # fmt: skip
            with console.status(
                "starting vLLM (the first start imports vLLM: tens of seconds on CPU, minutes on GPUs)"
            ):
                server.__enter__()
            try:
                where = f"log: {log_path}" + ("" if args.json else ", removed at the end unless vLLM fails")
                cores = f", bound to cores {server.cpu_binding}" if server.cpu_binding else ""
                console.print(
                    f"vLLM ready at {server.url} after {server.startup_s:.1f} s{cores} ({where})", soft_wrap=True
                )
                if server.cpu_unclaimed:  # measured on cores other engines use: not comparable (cpu_unclaimed)
                    console.print(f"warning: no cores of its own: {server.cpu_unclaimed}", soft_wrap=True,
                                  highlight=False, markup=False)  # fmt: skip
                kv = server.kv_capacity()
                result.command = server.command(redacted=True)
                result.url = server.url
                result.startup_s = server.startup_s
                result.cpu_binding, result.cpu_unclaimed = server.cpu_binding, server.cpu_unclaimed
                result.kv_capacity = KvCapacityReport(**vars(kv)) if kv else None
                run_levels(console, server.url, served, workload, prompts, plans, slo, args, result, records, server,
                           client_processes=client_processes, client_cpus=client_cpus)  # fmt: skip
            except EngineDiedError as err:
                died = err  # what was measured, the level it died in included, is still written
            finally:
                with console.status("stopping vLLM"):
                    server.stop()
            finished = died is None
        finally:
            if args.json is None:
                settle_temporary_log(log_path, keep=not finished, console=console)
    if args.json is not None:
        requests_path = args.json.with_suffix(".requests.jsonl")
        result.requests_file = requests_path.name
        write_atomic(requests_path, "".join(json.dumps(r) + "\n" for r in records))
        write_atomic(args.json, result.model_dump_json(indent=2) + "\n")
        console.print(f"wrote {args.json} and {requests_path}")
    if died is not None:
        raise died
    failed_levels = [r for r in result.levels if r.summary.completed == 0]
    return 1 if failed_levels else 0


def cpu_ranks(engine_args: dict, version: str | None) -> int | None:
    """On vLLM's CPU build, the engine's ranks (TP x PP x DP), each bound to a core no other engine servetune
    started holds (as a trial's are: engine/cores.py); None on GPUs, where vLLM places its ranks."""
    if not cpu_build(version):
        return None
    return engine_devices(engine_args)


def run_levels(console, url, served, workload, prompts, plans, slo, args, result, records, server=None, *,
               client_processes: int | Literal["auto"] = 1, client_cpus: int = 1) -> None:  # fmt: skip
    """Each level in turn on one client (``client_processes`` > 1: split across that many client processes,
    load/shard.py; "auto" sized per level, at most ``client_cpus``), its table printed as it ends."""
    gpus = visible_gpus({**os.environ, **server.env}) if server is not None else []

    async def main() -> None:
        async with StreamingClient(
            url, served, api=workload.api, timeout_s=args.request_timeout,
            ignore_eos=workload.ignore_eos, temperature=workload.temperature,
        ) as client:  # fmt: skip
            for index, plan in enumerate(plans):
                total = (plan.num_requests or 0) + plan.warmup_requests
                with Progress(
                    TextColumn("[bold]{task.description}[/]"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[failed]} failed"), TimeElapsedColumn(), console=console, transient=True,
                ) as progress:  # fmt: skip
                    task = progress.add_task(str(plan.level), total=total or None, failed=0)
                    failed = 0

                    # The level's task, bound: these run while this level is measured, never after.
                    def on_done(record, task: TaskID = task) -> None:
                        nonlocal failed
                        failed += 0 if record.ok else 1
                        progress.update(task, advance=1, failed=failed)

                    def on_run(run: int, plan: LevelPlan = plan, task: TaskID = task) -> None:
                        nonlocal failed
                        if run:
                            failed = 0
                            progress.reset(task, failed=0, description=f"{plan.level}, run {run + 1} of {args.repeats}")

                    level_result = await measure_rung(
                        client, url, workload, prompts, plan, index, repeats=args.repeats, slo=slo, record=records.append,
                        engine=server, on_done=on_done, on_run=on_run, client_processes=client_processes,
                        client_cpus=client_cpus,
                        telemetry=None if server is None else lambda: TelemetrySampler(gpus, server.process.pid),
                    )  # fmt: skip
                result.levels.append(level_result)
                console.print(level_table([level_result], slo, title=str(plan.level)))
                check_alive(server, plan.level, level_result.summary.failed)

    asyncio.run(main())
    if len(result.levels) > 1:
        make_console().print(level_table(result.levels, slo, title="all levels"))


#: Where bench builds the tiny adapter a workload names: beside ``--json OUT``, else beside the temporary log.
MODELS_DIR = "models"


def engine_log_path(json_out: Path | None) -> Path:
    """vLLM's log: ``<stem>.engine.log`` beside ``--json OUT``, else in a new temporary directory."""
    if json_out is not None:
        return json_out.parent / f"{json_out.stem}.engine.log"
    return Path(tempfile.mkdtemp(prefix="servetune-bench-")) / "bench.engine.log"


def settle_temporary_log(log_path: Path, keep: bool, console) -> None:
    """Remove the temporary log's directory after a run that finished; keep it, and say where, after one that did not
    (the models built beside it, the tiny adapter, are removed either way)."""
    shutil.rmtree(log_path.parent / MODELS_DIR, ignore_errors=True)
    if keep:
        console.print(f"vLLM's log is kept at {log_path}", soft_wrap=True)  # one line: a path to copy
    else:
        shutil.rmtree(log_path.parent, ignore_errors=True)


def exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
