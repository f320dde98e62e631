"""The front end's CPU per level (engine/frontend.py): the share of a core vLLM's API server used over each level of a
trial, beside the engine's running and waiting peaks and the load client's own share, on real vLLM or the fake engine.

A trial (trial/runner.py ``run_trial``, the path every study takes) on the tiny model at 1, 16 and 64 in flight;
what ``diagnosis.FRONTEND_BUSY`` is judged against. ``--fake`` runs the fake engine answering at once instead (its
front end does the HTTP and streaming, not vLLM's tokenizing). Run under the heavy lock.

    .venv/bin/python bench/frontend_cpu.py [--fake] [--levels 1,16,64] [--requests 96]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from servetune.config.slo import Slo
from servetune.config.workload import load_workload
from servetune.load.requests import PromptFactory
from servetune.load.runner import Level
from servetune.models.tiny import build_tiny_model
from servetune.testing.fake_openai import write_fake_python
from servetune.trial.runner import TrialSpec, run_trial, vllm_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fake", action="store_true", help="the fake engine answering at once, not vLLM")
    parser.add_argument("--levels", default="1,16,64", help="concurrencies, comma-separated")
    parser.add_argument("--requests", type=int, default=96, help="measured requests per level")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="frontend-cpu-"))
    model = build_tiny_model(scratch / "tiny")
    python = str(write_fake_python(scratch)) if args.fake else sys.executable
    env = (
        {"SERVETUNE_FAKE_TTFT_MS": "0", "SERVETUNE_FAKE_ITL_MS": "0"} if args.fake else {"VLLM_CPU_KVCACHE_SPACE": "1"}
    )
    spec = TrialSpec(
        study="frontend-cpu", trials_dir=scratch / "trials", params={}, engine_args={"enforce_eager": True}, env=env,
        model=str(model), device="cpu", devices=1, price_per_device_hour=0.05, workload=load_workload("cpu-tiny"),
        levels=tuple(Level("concurrency", float(c)) for c in args.levels.split(",")), requests_per_level=args.requests,
        seconds_per_level=None, warmup_requests=1, request_timeout_s=120, startup_timeout_s=300,
        stop_on_slo_break=False, min_throughput_gain=0.0, slo=Slo.parse("ttft_ms.p99=100000"), python=python,
        capacity_levels=0,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model)
    result = run_trial(spec, lambda report: None, lambda: PromptFactory(tokenizer), engine=vllm_engine)
    print(f"{'fake engine' if args.fake else 'vLLM'}: {result.outcome} {result.reason or ''}")
    print("| in flight | req/s | front end CPU share | client CPU share | running max | waiting max | host CPU % |")
    print("|---|---|---|---|---|---|---|")
    for level in result.levels:
        server, fmt = level.server_metrics, lambda v: "-" if v is None else f"{v:.2f}"
        print(f"| {level.summary.level['concurrency']:g} | {level.summary.request_throughput:.1f} | "
              f"{fmt(level.frontend_cpu_share)} | {fmt(level.client_cpu_share)} | "
              f"{fmt(server.get('requests_running_max'))} | {fmt(server.get('requests_waiting_max'))} | "
              f"{fmt(level.telemetry.get('host_cpu_percent_mean'))} |")  # fmt: skip


if __name__ == "__main__":
    main()
