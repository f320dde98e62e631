"""Ray Serve's router overhead and replica scaling, against the bare engine measured just before.

Builds the tiny model, measures the bare vLLM CPU engine with ``servetune bench`` at one load
level, writes a one-trial study from that measurement (the same engine arguments, environment,
workload and level), and runs ``servetune serve-check`` on it at 1 and 2 replicas. Prints TTFT
P50 through Serve against the bare engine at the same load (target: within 5 ms or 5%, whichever
is larger) and the scaling efficiency at 2 replicas (throughput at 2 / (2 x throughput at 1)).

    .venv/bin/python bench/serve_overhead.py [--concurrency 8] [--num-requests 64] [--stream-batching-ms MS]

``--stream-batching-ms`` deploys with Ray Serve LLM's stream batching at that interval (default: Ray's,
50 ms, which holds each replica's tokens, the first included, until its next send).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def servetune(*argv: object) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "servetune", *map(str, argv)], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"servetune {argv[0]} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done


def one_trial_study(root: Path, model: Path, bench: dict, concurrency: int, requests: int) -> Path:
    from servetune.results import StudyInfo, TrialResult

    (root / "trials" / "bare").mkdir(parents=True)
    info = StudyInfo(
        name="serve-overhead", created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        space_file="space.yaml", model=str(model), workload="cpu-tiny", device="cpu", algorithm="grid",
        objectives=[("goodput", "max")], slo=[], price_per_device_hour=0.05, servetune_version="bench",
    )  # fmt: skip
    trial = TrialResult(
        trial_id="bare", study=info.name, params={}, engine_args=ENGINE_ARGS, env=ENV, model=str(model), device="cpu",
        devices=1, price_per_device_hour=0.05, slo=[], outcome="COMPLETE", levels=bench["levels"],
    )  # fmt: skip
    (root / "study.json").write_text(info.model_dump_json(indent=2))
    (root / "trials" / "bare" / "result.json").write_text(trial.model_dump_json(indent=2))
    (root / "space.yaml").write_text(json.dumps({
        "name": info.name, "model": str(model), "device": "cpu", "workload": "cpu-tiny",
        "load": {"levels": [concurrency], "requests_per_level": requests, "startup_timeout_s": 600},
        "engine_args": ENGINE_ARGS, "env": ENV,
    }))  # fmt: skip  (JSON is YAML)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--stream-batching-ms", type=float, default=None, help="Ray Serve LLM's stream batching interval (default: Ray's)")
    args = parser.parse_args()
    from servetune.models.tiny import build_tiny_model

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    model = build_tiny_model(work / "tiny")
    bench_json = work / "bare.json"
    servetune(
        "bench", "--model", model, *[a for k, v in ENV.items() for a in ("--env", f"{k}={v}")],
        *[a for k, v in ENGINE_ARGS.items() for a in ("--engine-arg", f"{k}={str(v).lower() if isinstance(v, bool) else v}")],
        "--workload", "cpu-tiny", "--concurrency", args.concurrency, "--num-requests", args.num_requests, "--json", bench_json,
    )  # fmt: skip
    study = one_trial_study(work / "study", model, json.loads(bench_json.read_text()), args.concurrency, args.num_requests)
    batching = ["--stream-batching-ms", args.stream_batching_ms] if args.stream_batching_ms is not None else []
    servetune("serve-check", study, "--pick", "bare", "--replicas", "1,2", *batching)
    result = json.loads((study / "serve-check.json").read_text())
    rows = {row["replicas"]: row for row in result["rows"]}
    one, two = rows[1], rows[2]
    overhead = one["ttft_p50_overhead_ms"]
    allowed = max(5.0, 0.05 * one["bare_ttft_ms_p50"])
    interval = "Ray's default" if args.stream_batching_ms is None else f"{args.stream_batching_ms:g} ms"
    print(f"concurrency {args.concurrency}, {args.num_requests} requests per level, tiny model on vLLM's CPU build, "
          f"stream batching {interval}")  # fmt: skip
    print(f"bare engine:      TTFT P50 {one['bare_ttft_ms_p50']:.1f} ms, {one['bare_output_throughput']:.0f} output tok/s")
    print(f"Serve, 1 replica: TTFT P50 {one['ttft_ms_p50']:.1f} ms, {one['output_throughput']:.0f} output tok/s")
    print(f"router TTFT P50 overhead: {overhead:+.1f} ms ({overhead / one['bare_ttft_ms_p50']:+.0%}); "
          f"target within {allowed:.1f} ms: {'met' if abs(overhead) <= allowed else 'NOT met'}")  # fmt: skip
    print(f"Serve, 2 replicas: {two['output_throughput']:.0f} output tok/s; scaling efficiency {two['scaling_efficiency']:.0%}; "
          f"requests per replica {[run['requests_per_replica'] for run in result['runs']]}")  # fmt: skip
    print(f"took {time.monotonic() - started:.0f} s; files in {work}")


if __name__ == "__main__":
    main()
