"""Ray Serve's router overhead and replica scaling, against the bare engine measured just before.

Builds the tiny model, measures the bare vLLM CPU engine with ``servetune bench`` at one load
level, writes a one-trial study from that measurement (the same engine arguments, environment,
workload and level), and runs ``servetune serve-check`` on it at 1 and 2 replicas. Prints TTFT
P50 through Serve against the bare engine at the same load (target: within 5 ms or 5%, whichever
is larger) and the scaling efficiency at 2 replicas (throughput at 2 / (2 x throughput at 1)).

A shared host drifts by a few ms between runs, as much as the target. So the bare engine and
Serve are measured in turn, ``--rounds`` times (bare, Serve, bare, Serve, ..., bare), each run once the
host's CPUs are quiet (a Ray just shut down still exits for a while). Each round's overhead is its Serve
run against the mean of the bare runs on either side, leaving out one over 1.5x their median (disturbed). The verdict is the
median round's (one disturbed run moves it less than a mean), and it says when the bare engine's
own drift (the median step between consecutive bare runs) reaches from the overhead to the target.

    .venv/bin/python bench/serve_overhead.py [--concurrency 8] [--num-requests 64] [--stream-batching-ms MS] [--rounds 3]

``--stream-batching-ms`` deploys with Ray Serve LLM's stream batching at that interval (default: Ray's,
50 ms, which holds each replica's tokens, the first included, until its next send).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import statistics
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
        name="serve-overhead", created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        space_file="space.yaml", model=str(model), workload="cpu-tiny", device="cpu", algorithm="grid",
        objectives=[("goodput", "max")], slo=[], price_per_device_hour=0.05, servetune_version="bench",
    )  # fmt: skip
    trial = TrialResult(
        trial_id="bare", study=info.name, params={}, engine_args=ENGINE_ARGS, env=ENV, model=str(model), device="cpu",
        devices=1, price_per_device_hour=0.05, slo=[], outcome="COMPLETE", levels=bench["levels"],
    )  # fmt: skip
    (root / "study.json").write_text(info.model_dump_json(indent=2))
    (root / "trials" / "bare" / "result.json").write_text(trial.model_dump_json(indent=2))
    (root / "space.yaml").write_text(
        json.dumps(
            {
                "name": info.name,
                "model": str(model),
                "device": "cpu",
                "workload": "cpu-tiny",
                "load": {"levels": [concurrency], "requests_per_level": requests, "startup_timeout_s": 600},
                "engine_args": ENGINE_ARGS,
                "env": ENV,
            }
        )
    )  # fmt: skip  (JSON is YAML)
    return root


def bare_run(model: Path, work: Path, concurrency: int, requests: int, index: int) -> dict:
    """One ``servetune bench`` of the bare engine at the level (its own engine start)."""
    out = work / f"bare-{index}.json"
    servetune(
        "bench", "--model", model, *[a for k, v in ENV.items() for a in ("--env", f"{k}={v}")],
        *[a for k, v in ENGINE_ARGS.items() for a in ("--engine-arg", f"{k}={str(v).lower() if isinstance(v, bool) else v}")],
        "--workload", "cpu-tiny", "--concurrency", concurrency, "--num-requests", requests, "--json", out,
    )  # fmt: skip
    return json.loads(out.read_text())


def wait_quiet(limit_s: float = 120.0, busy: float = 25.0, calm_s: int = 3) -> float:
    """Wait until the host's CPUs are less than ``busy`` percent used for ``calm_s`` seconds in a row (a Ray
    that was just shut down still exits for a while: a bare run started beside it measured 100 ms streaks);
    at most ``limit_s``. Returns the seconds waited."""
    import psutil

    start, calm = time.monotonic(), 0
    while calm < calm_s and time.monotonic() - start < limit_s:
        calm = calm + 1 if psutil.cpu_percent(interval=1.0) < busy else 0
    return time.monotonic() - start


def neighbours(bare_p50: list[float], index: int) -> float:
    """The bare engine around Serve run ``index``: the mean of the bare runs before and after it. A bare run
    over 1.5x the median of them all was disturbed, and only its other neighbour counts (both disturbed: both)."""
    median = statistics.median(bare_p50)
    pair = [bare_p50[index], bare_p50[index + 1]]
    kept = [v for v in pair if v <= 1.5 * median] or pair
    return sum(kept) / len(kept)


def ttft_p50(bench: dict) -> float:
    return float(bench["levels"][0]["summary"]["ttft_ms"]["p50"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--stream-batching-ms",
        type=float,
        default=None,
        help="Ray Serve LLM's stream batching interval (default: Ray's)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="Serve runs, each between two bare runs (bare, Serve, bare, ...): "
        "a round's overhead is its Serve run against the mean of the bare runs on either side",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        sys.exit("--rounds: at least 1")
    from servetune.models.tiny import build_tiny_model

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="serve-overhead-"))
    model = build_tiny_model(work / "tiny")
    bare = [bare_run(model, work, args.concurrency, args.num_requests, 0)]
    study = one_trial_study(work / "study", model, bare[0], args.concurrency, args.num_requests)
    batching = ["--stream-batching-ms", args.stream_batching_ms] if args.stream_batching_ms is not None else []
    served: list[dict] = []  # serve-check's row at 1 replica, per round
    two: dict | None = None
    first: dict | None = None
    waited = 0.0
    for index in range(args.rounds):
        replicas = "1,2" if index == 0 else "1"  # scaling is measured once, in the first round
        waited += wait_quiet()
        servetune("serve-check", study, "--pick", "bare", "--replicas", replicas, *batching)
        result = json.loads((study / "serve-check.json").read_text())
        rows = {row["replicas"]: row for row in result["rows"]}
        served.append(rows[1])
        if index == 0:
            two, first = rows[2], result
        waited += wait_quiet()
        bare.append(bare_run(model, work, args.concurrency, args.num_requests, index + 1))
    bare_p50 = [ttft_p50(b) for b in bare]
    serve_p50 = [row["ttft_ms_p50"] for row in served]
    overheads = [s - neighbours(bare_p50, i) for i, s in enumerate(serve_p50)]
    overhead = statistics.median(overheads)
    reference = statistics.median(bare_p50)
    allowed = max(5.0, 0.05 * reference)
    # How far the bare engine alone moves from one run to the next (the median step: one disturbed run does not set it).
    noise = statistics.median(abs(b - a) for a, b in itertools.pairwise(bare_p50))
    verdict = "met" if abs(overhead) <= allowed else "NOT met"
    if abs(abs(overhead) - allowed) <= noise:
        verdict += f", within the bare engine's own run-to-run drift ({noise:.1f} ms) of the target"
    interval = "Ray's default" if args.stream_batching_ms is None else f"{args.stream_batching_ms:g} ms"
    print(f"concurrency {args.concurrency}, {args.num_requests} requests per level, tiny model on vLLM's CPU build, "
          f"stream batching {interval}, {args.rounds} round(s)")  # fmt: skip
    print("bare engine TTFT P50 (ms), in order:  " + ", ".join(f"{v:.1f}" for v in bare_p50))
    print("Serve, 1 replica, TTFT P50 (ms):      " + ", ".join(f"{v:.1f}" for v in serve_p50))
    print("overhead per round (ms):              " + ", ".join(f"{v:+.1f}" for v in overheads))
    print(f"router TTFT P50 overhead: {overhead:+.1f} ms, the median round ({overhead / reference:+.0%} of the bare "
          f"engine's median {reference:.1f} ms); target within {allowed:.1f} ms: {verdict}")  # fmt: skip
    one_tps = served[0]["output_throughput"]
    print(f"output tok/s, first round: bare {bare[0]['levels'][0]['summary']['output_throughput']:.0f}, Serve 1 replica "
          f"{one_tps:.0f}, 2 replicas {two['output_throughput']:.0f}; scaling efficiency {two['scaling_efficiency']:.0%}; "
          f"requests per replica {[run['requests_per_replica'] for run in first['runs']]}")  # fmt: skip
    disturbed = [f"{v:.1f}" for v in bare_p50 if v > 1.5 * reference]
    if disturbed:
        print(
            f"disturbed bare runs (over 1.5x the median), left out of the rounds beside them: {', '.join(disturbed)} ms"
        )
    print(f"took {time.monotonic() - started:.0f} s ({waited:.0f} s waiting for a quiet host); files in {work}")


if __name__ == "__main__":
    main()
