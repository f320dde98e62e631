"""servetune's load client against vLLM's own benchmark client, on the same server and requests.

Starts one vLLM server (the CPU build and the tiny model by default), makes one list of
requests from a workload, and runs both clients on it one after the other (alternating, for
``--repeats`` rounds), each in its own process. Prints both sets of metrics side by side and the
client CPU seconds each spent driving the load (measured inside the client process around the
load phase only, so interpreter start-up, imports and tokenizer loading are not counted).

Targets: output throughput within 3% and TTFT P50 within 5% of vLLM's client; less client CPU
per streamed token.

    .venv/bin/python bench/loadgen_vs_vllm.py [--concurrency 16] [--num-requests 400] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def worker_servetune(args: argparse.Namespace) -> dict:
    from servetune.load.client import StreamingClient
    from servetune.load.requests import RequestSpec
    from servetune.load.runner import Level, run_level
    from servetune.metrics import summarize

    rows = [json.loads(line) for line in Path(args.requests).read_text().splitlines()]
    specs = [RequestSpec(i, r["prompt"], r["input_tokens"], r["output_tokens"], "default") for i, r in enumerate(rows)]

    async def go():
        async with StreamingClient(args.url, args.model) as client:
            return await run_level(client, specs, Level("concurrency", args.concurrency), num_requests=len(specs))

    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    before = cpu_seconds()
    records = run(go())
    cpu = cpu_seconds() - before
    s = summarize(records, {"concurrency": args.concurrency})
    return {
        "output_throughput": s.output_throughput, "request_throughput": s.request_throughput,
        "ttft_ms_p50": s.ttft_ms.p50, "ttft_ms_p99": s.ttft_ms.p99, "tpot_ms_p50": s.tpot_ms.p50,
        "itl_ms_p50": s.itl_ms.p50, "e2el_ms_p50": s.e2el_ms.p50, "completed": s.completed,
        "output_tokens": s.total_output_tokens, "client_cpu_s": cpu,
    }  # fmt: skip


def worker_vllm(args: argparse.Namespace) -> dict:
    import vllm.benchmarks.serve as vserve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spent = {}
    original = vserve.benchmark

    async def timed_benchmark(*a, **kw):  # time only the load phase
        before = cpu_seconds()
        try:
            return await original(*a, **kw)
        finally:
            spent["cpu"] = cpu_seconds() - before

    vserve.benchmark = timed_benchmark
    n = sum(1 for _ in open(args.requests))
    parser = FlexibleArgumentParser()
    vserve.add_cli_args(parser)
    vargs = parser.parse_args([
        "--backend", "openai", "--base-url", args.url, "--endpoint", "/v1/completions",
        "--model", args.model, "--tokenizer", args.model,
        "--dataset-name", "custom", "--dataset-path", args.requests, "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle",
        "--num-prompts", str(n), "--max-concurrency", str(args.concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--ready-check-timeout-sec", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
    ])  # fmt: skip
    r = vserve.main(vargs)
    return {
        "output_throughput": r["output_throughput"], "request_throughput": r["request_throughput"],
        "ttft_ms_p50": r["median_ttft_ms"], "ttft_ms_p99": r["p99_ttft_ms"], "tpot_ms_p50": r["median_tpot_ms"],
        "itl_ms_p50": r["median_itl_ms"], "e2el_ms_p50": r["median_e2el_ms"], "completed": r["completed"],
        "output_tokens": r["total_output_tokens"], "client_cpu_s": spent["cpu"],
    }  # fmt: skip


def run_worker(kind: str, url: str, model: str, requests: Path, concurrency: int) -> dict:
    argv = [sys.executable, __file__, "--worker", kind, "--url", url, "--model", model,
            "--requests", str(requests), "--concurrency", str(concurrency)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{kind} client failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["servetune", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--url")
    parser.add_argument("--requests")
    parser.add_argument("--model", help="model directory (default: the tiny model, built in a temporary directory)")
    parser.add_argument("--workload", default="cpu-tiny")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--env", action="append", default=["VLLM_CPU_KVCACHE_SPACE=1"])
    parser.add_argument("--engine-arg", action="append", default=["enforce_eager=true"])
    args = parser.parse_args()
    if args.worker:
        result = (worker_servetune if args.worker == "servetune" else worker_vllm)(args)
        print("RESULT " + json.dumps(result), flush=True)
        return

    from transformers import AutoTokenizer

    from servetune.config.workload import load_workload
    from servetune.engine.args import load_argspecs, parse_key_values, parse_value
    from servetune.engine.server import VllmServer
    from servetune.load.requests import PromptFactory, iter_requests
    from servetune.models.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="servetune-loadgen-"))
    model = args.model or str(build_tiny_model(work / "tiny"))
    workload = load_workload(args.workload)
    prompts = PromptFactory(AutoTokenizer.from_pretrained(model))
    requests = work / "requests.jsonl"
    with requests.open("w") as f:
        for spec in itertools.islice(iter_requests(workload, prompts, stream=1), args.num_requests):
            f.write(json.dumps({"prompt": spec.prompt, "input_tokens": spec.input_tokens, "output_tokens": spec.output_tokens}) + "\n")
    engine_args = {k: parse_value(v) for k, v in parse_key_values(args.engine_arg, "--engine-arg").items()}
    env = parse_key_values(args.env, "--env")
    results: dict[str, list[dict]] = {"servetune": [], "vllm": []}
    with VllmServer(model, engine_args, env, log_path=work / "engine.log", argspecs=load_argspecs()) as server:
        print(f"vLLM up at {server.url}; {args.num_requests} requests of workload {workload.name}, concurrency {args.concurrency}", flush=True)
        run_worker("servetune", server.url, model, requests, args.concurrency)  # warm the server once
        for round_ in range(args.repeats):
            order = ("servetune", "vllm") if round_ % 2 == 0 else ("vllm", "servetune")
            for kind in order:
                results[kind].append(run_worker(kind, server.url, model, requests, args.concurrency))
                print(f"  round {round_ + 1}: {kind:9s} {results[kind][-1]['output_throughput']:8.1f} tok/s", flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    keys = ["output_throughput", "request_throughput", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50",
            "itl_ms_p50", "e2el_ms_p50", "completed", "output_tokens", "client_cpu_s"]  # fmt: skip
    print(f"\n{'metric (median of ' + str(args.repeats) + ')':34s} {'servetune':>12s} {'vllm bench':>12s} {'diff':>8s}")
    for key in keys:
        ours, theirs = median("servetune", key), median("vllm", key)
        diff = (ours - theirs) / theirs * 100 if theirs else float("nan")
        print(f"{key:34s} {ours:12.3f} {theirs:12.3f} {diff:+7.1f}%")
    per_tok = {k: median(k, "client_cpu_s") / median(k, "output_tokens") * 1e6 for k in results}
    print(f"{'client CPU µs per streamed token':34s} {per_tok['servetune']:12.1f} {per_tok['vllm']:12.1f} "
          f"{(per_tok['servetune'] / per_tok['vllm'] - 1) * 100:+7.1f}%")  # fmt: skip
    tput = abs(median("servetune", "output_throughput") / median("vllm", "output_throughput") - 1) * 100
    ttft = abs(median("servetune", "ttft_ms_p50") / median("vllm", "ttft_ms_p50") - 1) * 100
    print(f"\ntargets: throughput within 3%: {tput:.1f}% {'ok' if tput <= 3 else 'MISSED'}; "
          f"TTFT P50 within 5%: {ttft:.1f}% {'ok' if ttft <= 5 else 'MISSED'}; "
          f"less CPU per token: {'ok' if per_tok['servetune'] < per_tok['vllm'] else 'MISSED'}")


if __name__ == "__main__":
    main()
