"""The GPU twin, measured: the fake engine paced by the estimate, driven by servetune's own load client.

For a few configurations of ``search_spaces/chat-latency.yaml``'s axes (Llama-3.1-8B on an H100),
starts the fake engine with ``SERVETUNE_FAKE_TWIN`` (testing/twin.py) and the configuration's
vLLM arguments, runs closed-loop levels at several concurrencies with the load runner, and prints
what the client measured (P50 TTFT, P50 ITL, output tok/s) beside the estimate's closed-loop
prediction for the same load. No Ray, no vLLM, no GPU: one fake engine process at a time.

    PYTHONPATH=src .venv/bin/python bench/twin_pace.py [--requests 48] [--input-tokens 600] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from servetune.capacity import load_model_arch, resolve_hardware
from servetune.engine.server import free_port
from servetune.estimate import Load, estimate
from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.load.runner import Level, run_level
from servetune.metrics import OUTPUT_THROUGHPUT
from servetune.summary import summarize

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
GPU = "H100-SXM"
CONFIGS = (
    {"tensor_parallel_size": 1, "max_num_seqs": 16, "max_num_batched_tokens": 2048},
    {"tensor_parallel_size": 1, "max_num_seqs": 64, "max_num_batched_tokens": 8192},
    {"tensor_parallel_size": 2, "max_num_seqs": 64, "max_num_batched_tokens": 8192},
    {"tensor_parallel_size": 1, "max_num_seqs": 64, "max_num_batched_tokens": 8192, "quantization": "fp8"},
)
CONCURRENCY = (1, 16, 48)


def argv_of(config: dict) -> list[str]:
    out = ["--model", MODEL, "--max-model-len", "8192"]
    for key, value in config.items():
        out += [f"--{key.replace('_', '-')}", str(value)]
    return out


def start_fake(config: dict, port: int) -> subprocess.Popen:
    env = {**os.environ, "SERVETUNE_FAKE_TWIN": json.dumps({"gpu": GPU, "seed": None, "spread": 0.0})}
    cmd = [sys.executable, "-m", "servetune.testing.fake_openai", "--port", str(port), *argv_of(config)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the fake engine exited ({proc.returncode}) for {config}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"the fake engine did not start for {config}")


async def measure(url: str, concurrency: int, requests: int, input_tokens: int, output_tokens: int) -> dict:
    prompt = " ".join(["word"] * input_tokens)  # the fake counts a prompt's words as its tokens
    specs = [RequestSpec(i, prompt, input_tokens, output_tokens, "default") for i in range(requests + concurrency)]
    async with StreamingClient(url, "fake") as client:
        records = await run_level(
            client, specs, Level("concurrency", concurrency), num_requests=requests, warmup_requests=concurrency
        )
    return summarize(records, {"concurrency": concurrency}).flat()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48, help="measured requests per level")
    parser.add_argument("--input-tokens", type=int, default=600)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    arch, hardware = load_model_arch(MODEL), resolve_hardware("gpu", GPU)
    rows = []
    print(
        f"{MODEL} on {GPU}, {args.input_tokens} tokens in, {args.output_tokens} out, closed loop; measured / estimate"
    )
    print(f"{'configuration':<44} {'C':>3} {'TTFT p50 ms':>17} {'ITL p50 ms':>15} {'output tok/s':>17}")
    for config in CONFIGS:
        port = free_port()
        proc = start_fake(config, port)
        try:
            for c in CONCURRENCY:
                got = asyncio.run(
                    measure(f"http://127.0.0.1:{port}", c, args.requests, args.input_tokens, args.output_tokens)
                )
                load = Load(input_tokens=args.input_tokens, output_tokens=args.output_tokens, concurrency=c)
                est = estimate(arch, {"max_model_len": 8192, **config}, hardware, load)
                row = {"config": config, "concurrency": c, "ttft_ms_p50": got["ttft_ms_p50"], "itl_ms_p50": got["itl_ms_p50"],
                       OUTPUT_THROUGHPUT: got[OUTPUT_THROUGHPUT], "estimate": est.model_dump()}  # fmt: skip
                rows.append(row)
                name = " ".join(f"{k.replace('_size', '').replace('max_num_', '')}={v}" for k, v in config.items())
                print(f"{name:<44} {c:>3} {got['ttft_ms_p50']:>8.1f} / {est.ttft_ms or float('nan'):<6.1f} "
                      f"{got['itl_ms_p50']:>6.2f} / {est.itl_ms:<6.2f} {got[OUTPUT_THROUGHPUT]:>7.0f} / {est.output_throughput:<7.0f}",
                      flush=True)  # fmt: skip
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
