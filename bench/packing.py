"""GPU-time utilization of a study whose trials need 1, 2 and 4 GPUs, on one node.

Starts a local Ray cluster declared with ``--gpus`` GPUs (no GPU needed: Ray hands out the ids,
``CUDA_VISIBLE_DEVICES`` carries them to each engine) and runs a real study through Ray Tune:
a grid over tensor x data parallel sizes (1, 2 and 4 GPUs per trial) and ``max_num_seqs``,
``device: gpu``, the capacity check against an H100-SXM, the fake engine in place of vLLM.
Each trial's durations are drawn from realistic ones and scaled down by ``--scale``: engine
startup (a lognormal around 90 s for one GPU, longer with more GPUs) through
``SERVETUNE_FAKE_STARTUP_DELAY_S``, and load levels of ``--level-seconds`` each; the ladder
stops early where a small ``max_num_seqs`` breaks the SLO, so trials end at different levels.

Prints the GPU-time utilization: GPU-seconds reserved by running trials (from Tune starting a
trial to Tune completing it, timed on the driver) over GPU-seconds available, from the first
trial's start to the last one's end; and whether it meets the target (90%). Also checks that
no instant had more GPUs reserved than declared and that trials running at the same time
gave their engines different GPU ids (read back from what each engine printed at startup).

    .venv/bin/python bench/packing.py [--gpus 8] [--repeats 2] [--scale 0.2] [--order packed|grid|largest] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ray.tune import Callback

from servetune.accounting import time_accounting
from servetune.study.packing import (
    Reservation,
    order_for_packing,
    overlapping,
    peak_devices,
    resolve_max_concurrent,
    utilization,
)

TARGET = 0.90
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]  # (tensor, data) parallel sizes: 1, 2, 2, 4, 4 GPUs
#: Realistic engine startup on GPUs, seconds (weights, compile, CUDA graphs): median by GPU count.
STARTUP_MEDIAN_S = {1: 90.0, 2: 120.0, 4: 150.0}
SAW = re.compile(r"engine saw CUDA_VISIBLE_DEVICES=(\S*)")

SPACE = """\
name: packing
model: {model}
device: gpu
workload: cpu-tiny
load: {{levels: [{levels}], requests_per_level: null, seconds_per_level: {level_s}, warmup_requests: 1,
        startup_timeout_s: 300, min_throughput_gain: 0.0, capacity_levels: 0}}
slo: {{ttft_ms: {{p99: 1000}}}}
hardware: {{devices_per_node: {gpus}, gpu: H100-SXM, cpus_per_trial: 1}}
price_per_device_hour: 2.5
engine_args: {{max_model_len: 2048}}
params:
  tensor_parallel_size: [1, 2, 4]
  data_parallel_size: [1, 2]
  max_num_seqs: [{max_num_seqs}]
constraints: ["tensor_parallel_size * data_parallel_size <= 4"]
search: {{algorithm: grid, baseline: false, max_concurrent: {max_concurrent}}}
"""


class Timeline(Callback):
    """When Tune started and completed each trial, on the driver's clock, by servetune trial id."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.ids: dict[str, str] = {}  # Tune's trial id -> servetune's

    def on_trial_start(self, iteration, trials, trial, **info) -> None:
        self.started[trial.trial_id] = time.time()

    def on_trial_result(self, iteration, trials, trial, result, **info) -> None:
        if "servetune_trial_id" in result:
            self.ids[trial.trial_id] = result["servetune_trial_id"]

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self.ended[trial.trial_id] = time.time()
        print(f"  {len(self.ended)} trial(s) done", file=sys.stderr, flush=True)

    on_trial_error = on_trial_complete

    def reservations(self) -> dict[str, tuple[float, float]]:
        return {self.ids.get(t, t): (self.started[t], self.ended[t]) for t in self.ended if t in self.started}


def write_engine_python(directory: Path) -> Path:
    """The fake engine's interpreter, printing the GPUs it was given before it starts."""
    from servetune.testing.fake_openai import write_fake_python

    fake = write_fake_python(directory)
    path = directory / "engine-python"
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "if sys.argv[1:2] == ['-m'] or (sys.argv[1:2] == ['-c'] and sys.argv[3:4] == ['serve']):  # the engine\n"
        "    print('engine saw CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'), flush=True)\n"
        f"os.execv({str(fake)!r}, [{str(fake)!r}, *sys.argv[1:]])\n"
    )
    path.chmod(0o755)
    return path


def draw_points(space, args: argparse.Namespace) -> list[dict]:
    """The grid, ``--repeats`` times, each point with its own startup delay and token pace."""
    rng = np.random.default_rng(args.seed)
    kept, _ = space.grid()
    points = []
    for _ in range(args.repeats):
        for params in kept:
            devices = space.devices(params)
            dp = params.get("data_parallel_size", 1)
            startup = STARTUP_MEDIAN_S[devices] * (1.1 if dp > 1 else 1.0) * float(rng.lognormal(0.0, 0.3))
            points.append({
                **params,
                "env.SERVETUNE_FAKE_STARTUP_DELAY_S": round(startup * args.scale, 2),
                "env.SERVETUNE_FAKE_ITL_MS": round(float(rng.uniform(25, 50)), 1),
                "env.SERVETUNE_FAKE_TTFT_MS": round(float(rng.uniform(30, 120)), 1),
            })  # fmt: skip
    if args.order == "packed":
        return order_for_packing(points, space.devices, args.gpus)
    if args.order == "largest":
        return sorted(points, key=lambda p: -space.devices(p))
    return points


def engine_gpus(trial_dir: Path) -> list[str] | None:
    try:
        found = SAW.search((trial_dir / "engine.log").read_text(errors="replace"))
    except OSError:
        return None
    return None if found is None else [g for g in found.group(1).split(",") if g]


def run(args: argparse.Namespace, workdir: Path) -> dict:
    from servetune.models.tiny import build_tiny_model
    from servetune.space_file import load_space
    from servetune.study.driver import prepare_study_dir
    from servetune.trial.context import StudyContext, resolve_levels

    model = build_tiny_model(workdir / "models" / "tiny")
    space_path = workdir / "space.yaml"
    space_path.write_text(SPACE.format(model=model, gpus=args.gpus, level_s=round(args.level_seconds * args.scale, 2),
                                       max_num_seqs=args.max_num_seqs, max_concurrent=args.max_concurrent or "auto", levels=args.levels))  # fmt: skip
    space = load_space(space_path)
    # "auto" is resolved by the study itself from the GPUs Ray declares; this is what it will pick.
    max_concurrent = resolve_max_concurrent(space, args.gpus)
    points = draw_points(space, args)
    study_dir = (workdir / "studies" / space.name).resolve()
    prepare_study_dir(study_dir, space_path, resume=False)
    workload = space.resolved_workload(workdir)
    engine_python = str(write_engine_python(workdir))
    context = StudyContext(
        space, workload, study_dir, str(model), resolve_levels(space, workload), python=engine_python
    )
    print(f"{len(points)} trials ({', '.join(f'{n} x {s} GPU' for s, n in sorted(_count(points, space).items(), reverse=True))}) "
          f"on {args.gpus} declared GPUs, {max_concurrent} at most in flight, {args.order} order", file=sys.stderr, flush=True)  # fmt: skip

    results, spans, wall_s = run_study(context, points, args.gpus, args.cpus or args.gpus + 2)
    trials, reservations = [], []
    for trial_id, (start, end) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        result = results.get(trial_id)
        devices = result.devices if result else 0
        reservations.append(Reservation(start, end, devices, trial_id))
        trials.append({
            "trial_id": trial_id, "devices": devices, "start": start, "end": end,
            "cuda_visible_devices": engine_gpus(study_dir / "trials" / trial_id),
            "outcome": result.outcome if result else None, "reason": result.reason if result else None,
            "levels_run": len(result.levels) if result else 0, "startup_s": result.startup_s if result else None,
            "duration_s": result.duration_s if result else None,
            "params": dict(result.params) if result else None,
        })  # fmt: skip
    by_id = {t["trial_id"]: t for t in trials}
    conflicts = []
    for a, b in overlapping(reservations):
        shared = set(by_id[a.label]["cuda_visible_devices"] or ()) & set(by_id[b.label]["cuda_visible_devices"] or ())
        if shared:
            conflicts.append({"trials": [a.label, b.label], "gpus": sorted(shared)})
    first_start = min((r.start for r in reservations), default=0.0)
    gaps = []  # from the last trial end before each later start to that start: Tune finishing one, starting the next
    for r in reservations:
        ends = [o.end for o in reservations if o.end <= r.start]
        if r.start > first_start and ends:
            gaps.append(r.start - max(ends))
    reserved = sum(r.devices * (r.end - r.start) for r in reservations)
    inside = sum((t["duration_s"] or 0.0) * t["devices"] for t in trials)
    use = utilization(reservations, args.gpus)
    return {
        "gpus": args.gpus, "order": args.order, "max_concurrent": max_concurrent, "scale": args.scale,
        "trials_proposed": len(points), "wall_s": wall_s, "utilization": use, "target": TARGET, "meets_target": use >= TARGET,
        "peak_devices": peak_devices(reservations), "gpu_id_conflicts": conflicts,
        "share_of_reservations_inside_trials": inside / reserved if reserved else 0.0,
        "mean_start_gap_s": sum(gaps) / len(gaps) if gaps else None,
        "mean_trial_s": sum(r.end - r.start for r in reservations) / len(reservations) if reservations else None,
        "time_accounting": time_accounting(results.values()), "trials": trials,
    }  # fmt: skip


def run_study(
    context, points: list[dict], gpus: int, cpus: int, max_concurrent: int | None = None
) -> tuple[dict, dict, float]:
    """Run ``points`` through Ray Tune on a local Ray cluster declaring ``gpus`` GPUs and ``cpus`` CPUs.

    Returns the finished results by servetune trial id, each trial's reservation (Tune's start
    and completion on the driver's clock) by the same id, and the wall seconds of the study.
    """
    import ray

    from servetune.local_ray import start_local_ray
    from servetune.study.driver import finished_results
    from servetune.study.mirror import ResultMirror
    from servetune.study.tuner import run_tuner

    # As `servetune run` starts its local Ray: a token of its own, none left in ~/.ray/auth_token.
    start_local_ray(num_gpus=gpus, num_cpus=cpus, logging_level="WARNING", log_to_driver=False, configure_logging=True)
    timeline = Timeline()
    began = time.monotonic()
    try:
        run_tuner(context, points, None, len(points), [ResultMirror(context), timeline], max_concurrent=max_concurrent)
    finally:
        ray.shutdown()
    wall_s = time.monotonic() - began
    return {r.trial_id: r for r in finished_results(context.study_dir)}, timeline.reservations(), wall_s


def _count(points: list[dict], space) -> dict[int, int]:
    counts: dict[int, int] = {}
    for p in points:
        counts[space.devices(p)] = counts.get(space.devices(p), 0) + 1
    return counts


def run_in_workdir(args: argparse.Namespace, run, prefix: str) -> dict:
    """``run(args, workdir)`` in ``--workdir`` (kept) or a temporary directory; the result also to ``--json``."""
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=True)
        out = run(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            out = run(args, Path(tmp))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs the local Ray cluster declares (default 8)")
    parser.add_argument("--cpus", type=int, help="CPUs it declares (default: GPUs + 2)")
    parser.add_argument(
        "--repeats", type=int, default=2, help="times the grid is run, each time with fresh durations (default 2)"
    )
    parser.add_argument(
        "--max-num-seqs", default="2, 8, 32", help="the grid's max_num_seqs values (default '2, 8, 32')"
    )
    parser.add_argument("--levels", default="1, 2, 4, 8", help="the ladder's concurrency levels (default '1, 2, 4, 8')")
    parser.add_argument(
        "--scale", type=float, default=0.2, help="real durations times this (default 0.2: 90 s -> 18 s)"
    )
    parser.add_argument(
        "--level-seconds", type=float, default=60.0, help="real seconds per load level, before scaling (default 60)"
    )
    parser.add_argument(
        "--order",
        choices=["packed", "grid", "largest"],
        default="packed",
        help="packed: study/packing.py's order (default); grid: as drawn; largest: largest trials first",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        help="trials in flight (default: the study's auto, twice what the smallest trials need to fill the GPUs, plus one)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, help="keep the study here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    args = parser.parse_args(argv)

    out = run_in_workdir(args, run, "servetune-packing-")
    acc = out["time_accounting"]
    failed = [t for t in out["trials"] if t["outcome"] != "COMPLETE"]
    print(
        f"trials: {len(out['trials'])} of {out['trials_proposed']} ran, {len(failed)} not COMPLETE; wall {out['wall_s']:.0f} s"
    )
    print(
        f"peak GPUs reserved: {out['peak_devices']} of {out['gpus']}; "
        f"GPU id conflicts between concurrent trials: {len(out['gpu_id_conflicts'])}"
    )
    if out["mean_trial_s"] is not None and out["mean_start_gap_s"] is not None:
        print(f"trials ran {out['mean_trial_s']:.1f} s on average; a trial started {out['mean_start_gap_s']:.1f} s after "
              f"the trial end before it, on average (Tune stopping one trial's actor and starting the next)")  # fmt: skip
    print(f"inside trials: {acc['measuring_share']:.0%} measuring, {acc['starting_share']:.0%} starting engines, "
          f"{acc['other_share']:.0%} warm-up, teardown and checks")  # fmt: skip
    verdict = "meets" if out["meets_target"] else "misses"
    print(f"GPU-time utilization: {out['utilization']:.1%} ({verdict} the {TARGET:.0%} target)")
    ok = (
        out["peak_devices"] <= out["gpus"]
        and not out["gpu_id_conflicts"]
        and not failed
        and not math.isnan(out["utilization"])
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
