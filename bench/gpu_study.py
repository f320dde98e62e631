"""How much of a GPU-sized study's reserved GPU time goes to measuring: target >= 70%.

Runs a study shaped like ``--space`` (default ``search_spaces/chat-latency.yaml``) through Ray
Tune on a local Ray cluster declaring ``--gpus`` GPUs (no GPU needed; see packing.py), with the
fake engine in place of vLLM. What is the space's: its workload, its ladder (Poisson rates), its
SLO, its trial count and trials in flight, its capacity check against its GPU, and early stopping
as the study does it (the SLO, saturation, and dominance by finished trials for the Bayesian
searchers). What is changed:

- The points are the baseline and random draws from the space (Optuna's seeded sampler, as
  ``random`` search proposes them), not NSGA-II's: the fake engine's answers do not depend on the
  configuration beyond ``max_num_seqs``, so a Bayesian searcher would have nothing to learn.
- Each trial's engine start-up is drawn around realistic GPU medians (packing.py's
  ``STARTUP_MEDIAN_S``, by GPU count) and its token pace around an 8B model on an H100: TTFT
  40-100 ms (tens of ms plus a ~600-token prefill; the fake's TTFT does not grow with the
  prompt), ITL 10-20 ms. ``max_num_seqs`` bounds the requests the fake generates at once, so
  small ones queue and break the SLO at high rates, as on a GPU.
- ``--twin`` paces each trial's fake engine by the estimate instead (testing/twin.py,
  ``SERVETUNE_FAKE_TWIN``): the model (its stand-in's architecture), the space's GPU and the
  trial's engine arguments give TTFT from the prefill and queueing, ITL from the batch in flight,
  saturation past ``max_num_seqs`` or the planned KV pool, times one seeded run factor drawn from
  the measured run-to-run spread. Answers then depend on the configuration, as on a GPU; each
  trial's best level is printed.
- ``--prune`` turns on pruning by the estimate (``search.estimate: {prune: true}``, study/prune.py): a trial the
  estimate rules out beyond its error is recorded PRUNED before its engine starts. Its reservation (Tune's start
  to its end: the verdict, Ray's gaps) counts as reserved time that measured nothing; the device-minutes it
  saved are printed as a lower bound (its drawn start-up at full size) and as the mean trial's full-size cost
  per device. Meaningful with ``--twin``, where the paces are the estimate's too.
- Durations are scaled by ``--scale``: start-ups through ``SERVETUNE_FAKE_STARTUP_DELAY_S``, and
  each level's request count (256 -> 256 x scale), so a level's arrivals span scale x its real
  span. A closed loop (``load.kind: concurrency``) sends at least one request per client of its top
  level, so its levels still run that many at once; its busy span is n x mean E2E / clients (Little's
  law), unscaled by the counts' own ratio. What does not scale is counted once: a level's tail (the
  last requests finishing after the last arrival, a closed loop's drain), warm-up, teardown and Ray's
  gaps. :func:`real_accounting` unscales each part accordingly.
- ``--seed`` draws the points (``search.seed``) as well as the start-ups and paces, so one seed run
  with and without ``--prune`` measures the same configurations; ``--compare OFF ON`` reads the two
  runs' ``--json`` and prints what pruning saved and whether it lost the best.
- The quality probe is not run: it needs greedy completions and ``prompt_logprobs``, and the fake
  engine answers neither (every token is ``x``, no logprobs). Its cost is counted from
  bench/README.md's quality_probe numbers instead: ``PROBE_SHARE_OF_MEASURING`` of each trial's
  real measuring time.

    PYTHONPATH=src .venv/bin/python bench/gpu_study.py [--space search_spaces/chat-latency.yaml] [--scale 0.2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packing import STARTUP_MEDIAN_S, run_in_workdir, run_study, write_engine_python

from servetune.accounting import stop_cause, time_accounting
from servetune.metrics import GOODPUT, OUTPUT_THROUGHPUT, TPOT_P99, TTFT_P99
from servetune.results import TrialResult
from servetune.study.packing import Reservation, utilization

TARGET = 0.70
ROOT = Path(__file__).resolve().parent.parent
#: The probe's cost against a trial's measuring time: bench/README.md, quality_probe.py, the
#: median cpu-tiny trial (6.6%; 8.7% of the shortest). Measured on the CPU stand-in.
PROBE_SHARE_OF_MEASURING = 0.066
#: ``torch.compile``'s part of a GPU start, and what loading it from the compile cache takes
#: instead: vLLM 0.28 with torch 2.11 on a B200, 4 engines sharing one VLLM_CACHE_ROOT, started
#: in 63.9 s cold and 30.5 s warm (SkyRL pull request #2138): 33 s of a start is compiling.
COMPILE_COLD_S = 36.0
COMPILE_HIT_S = 3.0
#: A new graph whose kernels an earlier trial of the node compiled (the shared Triton cache), against a cold compile:
#: ``triton_cache.py`` on an H200 (torch 2.11, Triton 3.6, a Llama-3.1-8B-shaped stack of 32 layers, issue #40):
#: 27.7 s against 32.0 s cold. At 4 layers it saved more (7.3 of 13.2 s), but an 8B model has 32.
TRITON_WARM_SHARE = 27.7 / 32.0
TTFT_MS = (40.0, 100.0)  # an 8B model on one H100: tens of ms plus a ~600-token prefill
ITL_MS = (10.0, 20.0)


def scaled_requests(requests_per_level: int, scale: float, clients: int = 1) -> int:
    """A level's request count at ``scale``: its arrivals then span ``scale`` times as long. A closed
    loop's (``clients``: its ladder's top concurrency) sends at least one request per client, so its top
    level still runs that many at once; its :func:`real_accounting` then unscales by the counts' ratio."""
    return min(requests_per_level, max(1, clients, round(requests_per_level * scale)))


def level_span(summary: Any) -> float:
    """The part of a level's time its request count sets, which ``--scale`` shrinks with it.

    An open loop's arrivals: its requests over its rate. A closed loop's, by Little's law: its requests
    times their mean E2E over its clients (``n x E2E / C``, the time C clients keep busy with n requests);
    what the level took beyond that (its drain, the last requests finishing with fewer in flight) does
    not scale. Without either figure: the whole level."""
    sent = summary.completed + summary.failed
    rate = summary.level.get("rate")
    if rate:
        return sent / rate
    clients, e2e_ms = summary.level.get("concurrency"), summary.e2el_ms.mean
    if clients and e2e_ms is not None:
        return sent * e2e_ms / 1000.0 / clients
    return summary.duration_s


def gpu_space(
    path: Path, model: Path, scale: float, prune: bool = False, seed: int = 0
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The space to run (as YAML data) and what was changed from ``path``, for the printout."""
    data = yaml.safe_load(path.read_text())
    load = data.setdefault("load", {})
    real_requests = load.get("requests_per_level", 256)
    if not isinstance(real_requests, int):
        raise SystemExit(
            f"{path}: load.requests_per_level must be a number of requests to scale, not {real_requests!r}"
        )
    from servetune.config.space import SearchSpace

    original = SearchSpace.model_validate({**data, "model": str(model)})
    closed = original.load.kind == "concurrency"
    clients = int(max(original.load.levels)) if closed and original.load.levels else 1
    load["requests_per_level"] = scaled_requests(real_requests, scale, clients)
    load["stop_when_dominated"] = original.stops_when_dominated  # as the space's own searcher does it
    quality = data.pop("quality", None)
    served, data["model"] = data["model"], str(model)  # trials load stand-ins (checkpoint_stand_in)
    data["search"] = {**data.get("search", {}), "algorithm": "random", "seed": seed}  # --seed draws the points too
    data["search"].pop("objectives", None)
    # --prune decides, whatever the space says (bench/data/gpu-twin-closed.yaml prunes), so off and on compare
    data["search"]["estimate"] = {**data["search"].get("estimate", {}), "prune": prune}
    changes = {"real_requests_per_level": real_requests, "requests_per_level": load["requests_per_level"],
               "request_scale": load["requests_per_level"] / real_requests, "closed_loop": closed,
               "algorithm": original.search.algorithm, "stop_when_dominated": original.stops_when_dominated,
               "quality_suites": (quality or {}).get("suites"), "model": served}  # fmt: skip
    return data, changes


def checkpoint_stand_in(name: str, tiny: Path, out: Path) -> Path:
    """A directory the trial loads as checkpoint ``name``: the tiny model's tokenizer (the fake
    engine serves any text) with ``name``'s architecture from servetune's catalogue as its
    ``config.json``, so the capacity check weighs the real model on the space's GPU."""
    import shutil

    from servetune.capacity.arch import load_catalog, load_model_arch

    arch = load_catalog()[name]
    out.mkdir(parents=True, exist_ok=True)
    for file in tiny.iterdir():
        if file.name.startswith("tokenizer") or file.name == "special_tokens_map.json":
            shutil.copy(file, out / file.name)
    config = {"architectures": [arch.architecture], "model_type": "llama", "num_hidden_layers": arch.num_layers,
              "hidden_size": arch.hidden_size, "num_attention_heads": arch.num_attention_heads,
              "num_key_value_heads": arch.num_kv_heads, "head_dim": arch.head_dim, "intermediate_size": arch.intermediate_size,
              "vocab_size": arch.vocab_size, "tie_word_embeddings": arch.tie_word_embeddings,
              "max_position_embeddings": arch.max_position_embeddings, "torch_dtype": arch.torch_dtype}  # fmt: skip
    if arch.quant.method != "none":
        config["quantization_config"] = {
            "quant_method": arch.quant.method,
            "bits": arch.quant.bits,
            "group_size": arch.quant.group_size,
        }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    read = load_model_arch(out)
    if read.model_dump(exclude={"name", "source"}) != arch.model_dump(exclude={"name", "source"}):
        raise SystemExit(f"{out}: reads back as another architecture than {name}'s")
    return out


def draw_paces(points: list[dict], space, scale: float, seed: int, cache_root: Path, twin: bool = False) -> list[dict]:
    """Each point with its own start-up delay (scaled) and token pace. The start-up's compiling
    part is the fake engine's: cold, or loaded from the node's compile cache (``cache_root``, as
    the trials of one node share it) when an earlier trial built the same graph. With ``twin``
    the pace is the estimate's for the point (``SERVETUNE_FAKE_TWIN``, its own noise seed)."""
    rng = np.random.default_rng(seed)
    out = []
    for i, params in enumerate(points):
        devices = space.devices(params)
        dp = space.engine_params(params)[0].get("data_parallel_size", 1)
        startup = STARTUP_MEDIAN_S[devices] * (1.1 if dp > 1 else 1.0) * float(rng.lognormal(0.0, 0.3))
        out.append({
            **params,
            "env.SERVETUNE_FAKE_STARTUP_DELAY_S": round(max(startup - COMPILE_COLD_S, 0.0) * scale, 2),
            "env.SERVETUNE_FAKE_COMPILE_S": round(COMPILE_COLD_S * scale, 2),
            "env.SERVETUNE_FAKE_COMPILE_HIT_S": round(COMPILE_HIT_S * scale, 2),
            "env.VLLM_CACHE_ROOT": str(cache_root),
            "env.SERVETUNE_FAKE_TTFT_MS": round(float(rng.uniform(*TTFT_MS)), 1),
            "env.SERVETUNE_FAKE_ITL_MS": round(float(rng.uniform(*ITL_MS)), 1),
        })  # fmt: skip
        if twin:
            out[-1]["env.SERVETUNE_FAKE_TWIN"] = json.dumps({"gpu": space.hardware.gpu, "seed": seed * 1000 + i})
    return out


def drawn_startup(result: TrialResult) -> float | None:
    """The part of a trial's start-up that ``--scale`` shrank: the delay drawn for it and the fake
    engine's compile, cold or loaded, as its log says (None: not a point of this script)."""
    delay = result.params.get("env.SERVETUNE_FAKE_STARTUP_DELAY_S")
    if delay is None:
        return None
    return float(delay) + result.startup_phases.get("compile_s", 0.0)


def real_accounting(
    results: list[TrialResult],
    scale: float,
    probe_share: float = PROBE_SHARE_OF_MEASURING,
    idle_device_s: float = 0.0,
    request_scale: float | None = None,
) -> dict[str, Any]:
    """The study's GPU time as it would be at full size: what ``--scale`` shrank, divided by it.

    Per trial: the drawn start-up / scale, and the rest of the start-up (the fake engine's own
    process start, the health check seeing it up) as measured, since it does not shrink; each level's span
    (:func:`level_span`: an open loop's arrivals, a closed loop's n x E2E / C) / ``request_scale`` (the
    requests sent over the space's; default ``scale``), plus its tail (duration less that span) as measured,
    but a level cut for saturation (a queue that grew for ``QUEUE_WINDOW_S``, trial/measure.py) as measured;
    warm-up, teardown, checks and the rest as measured. The quality probe, not run, is ``probe_share`` of the trial's real measuring
    time. Device-seconds are those times the trial's devices, as in ``time_accounting``. ``idle_device_s``:
    device-seconds reserved without a trial's own time (a PRUNED trial's reservation), counted in the rest.
    """
    measuring = starting = quality = 0.0
    other = idle_device_s
    per_request = request_scale or scale
    for result in results:
        duration = result.duration_s or 0.0
        measured = spans = 0.0
        for level in result.levels:
            span = level_span(level.summary)
            if stop_cause(level.stopped_early) == "saturated":
                span = 0.0  # cut after a queue grew for a set number of seconds: as long at any size
            span = min(span, level.measured_s)
            spans += span
            measured += level.measured_s
        startup = min(result.startup_s or 0.0, max(duration - measured, 0.0))
        drawn = min(drawn_startup(result) or startup, startup)
        real_measuring = (measured - spans) + spans / per_request
        measuring += real_measuring * result.devices
        starting += (drawn / scale + startup - drawn) * result.devices
        quality += probe_share * real_measuring * result.devices
        other += max(duration - measured - startup, 0.0) * result.devices
    total = measuring + starting + quality + other

    def share(x: float) -> float:
        return x / total if total > 0 else 0.0

    return {"gpu_minutes": total / 60.0, "measuring_share": share(measuring), "starting_share": share(starting),
            "quality_share": share(quality), "other_share": share(other), "probe_share_of_measuring": probe_share}  # fmt: skip


#: What Triton's kernels depend on among a point's parameters (not max_num_seqs,
#: max_num_batched_tokens or max_model_len): trials alike here share kernels through the node's
#: Triton cache (engine/compile_cache.py).
TRITON_KEY = ("model", "quantization", "kv_cache_dtype", "tensor_parallel_size")


def triton_what_if(out: dict[str, Any], warm_compile_s: float) -> float:
    """The measuring share at full size had every trial whose Triton key an earlier trial (in the
    order they started) compiled taken ``warm_compile_s`` instead of ``COMPILE_COLD_S`` to compile:
    an upper bound, since a trial in flight can start before the one it would reuse has finished."""
    total = out["real"]["gpu_minutes"] * 60.0
    measuring = out["real"]["measuring_share"] * total
    seen: set[tuple] = set()
    saved = 0.0
    for t in out["trials"]:
        key = tuple(t["params"].get(name) for name in TRITON_KEY)
        if key in seen:
            saved += max(COMPILE_COLD_S - warm_compile_s, 0.0) * t["devices"]
        seen.add(key)
    return measuring / (total - saved) if total > saved else 0.0


def hits_for_target(out: dict[str, Any], target: float = TARGET) -> float:
    """How many more compile-cache hits (each ``COMPILE_COLD_S - COMPILE_HIT_S`` of a start, on the mean trial's
    devices) a run (its ``--json``) would need for its measuring share at full size to reach ``target``: the
    start-up time that must go, over what one hit saves. 0 where it already does."""
    total = out["real"]["gpu_minutes"] * 60.0
    measuring = out["real"]["measuring_share"] * total
    devices = sum(t["devices"] for t in out["trials"]) / max(len(out["trials"]), 1)
    return max(total - measuring / target, 0.0) / ((COMPILE_COLD_S - COMPILE_HIT_S) * devices)


def pruned_accounting(
    results: list[TrialResult], spans: dict[str, tuple[float, float]], scale: float, real: dict[str, Any]
) -> dict[str, Any]:
    """The PRUNED trials: their reservations' device-seconds (as run: nothing of them was scaled), and the
    device-minutes they saved at full size, at least their drawn start-ups (delay and cold compile, unscaled) and
    about the mean trial's full-size cost per device (``real``: the accounting of the trials that ran)."""
    pruned = [r for r in results if r.outcome == "PRUNED"]
    ran = [r for r in results if r.outcome != "PRUNED"]
    reserved = sum((spans[r.trial_id][1] - spans[r.trial_id][0]) * r.devices for r in pruned if r.trial_id in spans)
    startups = sum(
        (float(r.params.get("env.SERVETUNE_FAKE_STARTUP_DELAY_S", 0.0)) / scale + COMPILE_COLD_S) * r.devices
        for r in pruned
    )
    per_device = real["gpu_minutes"] / max(sum(r.devices for r in ran), 1)
    return {"trials": len(pruned), "reserved_device_s": reserved, "saved_gpu_minutes_at_least": startups / 60.0,
            "saved_gpu_minutes_mean_trial": per_device * sum(r.devices for r in pruned)}  # fmt: skip


def best_of(result: TrialResult) -> dict[str, Any] | None:
    """The trial's best level (servetune's rule): its load, goodput and latencies; None if none met the SLO."""
    point = result.best
    if point is None:
        return None
    wanted = (GOODPUT, TTFT_P99, TPOT_P99, OUTPUT_THROUGHPUT)
    return {"level": point.level, **{k: v for k, v in point.metrics.items() if k in wanted}}


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from servetune.models.tiny import build_tiny_model
    from servetune.space_file import load_space
    from servetune.study.driver import prepare_study_dir, proposals
    from servetune.trial.context import StudyContext, resolve_levels

    model = build_tiny_model(workdir / "models" / "tiny").resolve()
    data, changes = gpu_space(args.space, model, args.scale, args.prune, args.seed)
    space_path = workdir / "space.yaml"
    space_path.write_text(yaml.safe_dump(data, sort_keys=False))
    space = load_space(space_path)
    points = draw_paces(
        proposals(space, None), space, args.scale, args.seed, (workdir / "vllm-cache").resolve(), args.twin
    )
    study_dir = (workdir / "studies" / space.name).resolve()
    prepare_study_dir(study_dir, space_path, resume=False)
    workload = space.resolved_workload(ROOT)
    served = changes["model"]
    models = {name: str(checkpoint_stand_in(name, model, workdir / "models" / name.replace("/", "--")))
              for name in dict.fromkeys([served, *(space.params.get("model") or ())])}  # fmt: skip
    context = StudyContext(space, workload, study_dir, models[served], resolve_levels(space, workload),
                           python=str(write_engine_python(workdir)), models=models)  # fmt: skip
    cpus = args.cpus or space.hardware.cpus_per_trial * args.gpus + 2
    print(f"{len(points)} trials of {args.space.name} on {args.gpus} declared GPUs, {space.search.max_concurrent} at most in flight, "
          f"{space.load.requests_per_level} requests per level (real {changes['real_requests_per_level']})", file=sys.stderr, flush=True)  # fmt: skip
    results, spans, wall_s = run_study(context, points, args.gpus, cpus)
    reservations = [Reservation(s, e, results[t].devices if t in results else 0, t) for t, (s, e) in spans.items()]
    done = [results[t] for t in spans if t in results]
    ran = [r for r in done if r.outcome != "PRUNED"]
    per_request = changes["request_scale"]
    real = real_accounting(ran, args.scale, request_scale=per_request)
    pruned = pruned_accounting(done, spans, args.scale, real)
    if pruned["trials"]:
        real = real_accounting(ran, args.scale, idle_device_s=pruned["reserved_device_s"], request_scale=per_request)
    return {
        "space": str(args.space), "twin": args.twin, "prune": args.prune, "pruned": pruned, "scale": args.scale, "gpus": args.gpus, "seed": args.seed, "wall_s": wall_s,
        "changes": changes, "trials_proposed": len(points), "target": TARGET,
        "utilization": utilization(reservations, args.gpus),
        "scaled": time_accounting(ran), "real": real,
        "compile_cache_hits": sum(r.startup_phases.get("compile_cache_hit", 0.0) > 0 for r in done),
        "graphs": len({space.graph_key(p) for p in points}), "graph_steps": space.search.graph_steps,
        "trials": [{"trial_id": r.trial_id, "devices": r.devices, "outcome": r.outcome, "reason": r.reason,
                    "stopped_because": r.stopped_because, "levels_run": len(r.levels), "startup_s": r.startup_s,
                    "duration_s": r.duration_s, "params": dict(r.params), "best": best_of(r)} for r in done],
    }  # fmt: skip


def best_trial(out: dict[str, Any]) -> dict[str, Any] | None:
    """A run's (its ``--json``) trial whose best level had the highest goodput; None if none met the SLO."""
    met = [t for t in out["trials"] if t["best"] and t["best"].get(GOODPUT) is not None]
    return max(met, key=lambda t: t["best"][GOODPUT]) if met else None


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """One seed run with pruning off and on (the same points and paces): the measuring shares, the GPU-minutes
    at full size each reserved (the difference is what pruning saved, as run), and whether pruning lost the best:
    the off run's best configuration pruned, or the on run's best goodput more than 5% below the off run's."""

    def config(t: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in t["params"].items() if not k.startswith("env.")}

    best_off, best_on = best_trial(off), best_trial(on)
    pruned = [config(t) for t in on["trials"] if t["outcome"] == "PRUNED"]
    lost = best_off is not None and (
        config(best_off) in pruned or best_on is None or best_on["best"][GOODPUT] < 0.95 * best_off["best"][GOODPUT]
    )
    return {"seed": on["seed"], "measuring_off": off["real"]["measuring_share"], "measuring_on": on["real"]["measuring_share"],
            "gpu_minutes_off": off["real"]["gpu_minutes"], "gpu_minutes_on": on["real"]["gpu_minutes"],
            "saved_gpu_minutes": off["real"]["gpu_minutes"] - on["real"]["gpu_minutes"], "pruned": len(pruned),
            "trials": len(on["trials"]), "best_off": best_off and best_off["best"][GOODPUT],
            "best_on": best_on and best_on["best"][GOODPUT], "lost_best": lost}  # fmt: skip


def print_bests(trials: list[dict[str, Any]]) -> None:
    """Per trial: the varied parameters that shape the pace and what its best level measured."""
    shown = (
        "model",
        "tensor_parallel_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "quantization",
        "kv_cache_dtype",
    )
    for t in sorted(trials, key=lambda t: -(t["best"] or {}).get(GOODPUT, 0.0)):
        config = " ".join(f"{k}={t['params'][k]}" for k in shown if k in t["params"])
        best = t["best"]
        if best is None:
            print(
                f"  {t['trial_id']} {config}: no level met the SLO ({t['outcome']}, {t['stopped_because'] or 'ladder run'})"
            )
            continue
        figures = " ".join(f"{k} {v:.1f}" for k, v in best.items() if k != "level")
        print(f"  {t['trial_id']} {config}: best at {best['level']}: {figures}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", type=Path, default=ROOT / "search_spaces" / "chat-latency.yaml")
    parser.add_argument(
        "--gpus", type=int, help="GPUs the local Ray cluster declares (default: the space's devices_per_node)"
    )
    parser.add_argument("--cpus", type=int, help="CPUs it declares (default: the space's cpus_per_trial x GPUs + 2)")
    parser.add_argument(
        "--scale", type=float, default=0.2, help="real durations times this (default 0.2: 256 requests a level -> 51)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the start-ups and token paces drawn")
    parser.add_argument(
        "--twin", action="store_true", help="pace each fake engine by the estimate for its configuration"
    )
    parser.add_argument(
        "--prune", action="store_true", help="prune by the estimate (search.estimate: {prune: true}); with --twin"
    )
    parser.add_argument("--workdir", type=Path, help="keep the study here (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the measurements here")
    parser.add_argument(
        "--what-if",
        type=Path,
        metavar="JSON",
        help="run nothing: read an earlier run's --json and print its share with a shared Triton cache",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        nargs=2,
        metavar=("OFF", "ON"),
        help="run nothing: read one seed's --json without and with --prune and print what pruning saved and lost",
    )
    args = parser.parse_args(argv)
    if args.compare:
        c = compare(*(json.loads(path.read_text()) for path in args.compare))
        print(
            f"seed {c['seed']}: {c['pruned']} of {c['trials']} pruned; measuring {c['measuring_off']:.1%} off, "
            f"{c['measuring_on']:.1%} on; {c['gpu_minutes_off']:.1f} -> {c['gpu_minutes_on']:.1f} GPU-min at full size "
            f"({c['saved_gpu_minutes']:+.1f} saved); best goodput {c['best_off']} off, {c['best_on']} on: "
            + ("pruning LOST the best" if c["lost_best"] else "best kept")
        )
        return 0
    if args.what_if:
        out = json.loads(args.what_if.read_text())
        measured = COMPILE_COLD_S * TRITON_WARM_SHARE
        print(
            f"a Triton-warm compile as measured on an H200 ({measured:.1f} s of a {COMPILE_COLD_S:.0f} s cold one): "
            f"measuring share at most {triton_what_if(out, measured):.1%} (as run: {out['real']['measuring_share']:.1%})"
        )
        for warm in (3.0, 10.0, 15.0, 20.0, 25.0):
            print(
                f"a Triton-warm compile of {warm:.0f} s (cold {COMPILE_COLD_S:.0f} s): measuring share at most "
                f"{triton_what_if(out, warm):.1%} (as run: {out['real']['measuring_share']:.1%})"
            )
        print(
            f"the {TARGET:.0%} target needs about {hits_for_target(out):.1f} more compile-cache hits "
            f"({COMPILE_COLD_S - COMPILE_HIT_S:.0f} s of a start each) than the {out['compile_cache_hits']} "
            f"of {len(out['trials'])} starts as run"
        )
        return 0
    if args.gpus is None:
        args.gpus = yaml.safe_load(args.space.read_text()).get("hardware", {}).get("devices_per_node", 8)

    out = run_in_workdir(args, run, "servetune-gpu-study-")
    scaled, real = out["scaled"], out["real"]
    stopped = sum(1 for t in out["trials"] if t["stopped_because"])
    failed = [t for t in out["trials"] if t["outcome"] == "FAILED"]
    print(
        f"trials: {len(out['trials'])} of {out['trials_proposed']} ran, {len(failed)} FAILED, "
        f"{stopped} stopped their ladder early; wall {out['wall_s']:.0f} s; GPU-time utilization {out['utilization']:.0%}; "
        f"compile cache hit in {out['compile_cache_hits']} of {len(out['trials'])} starts "
        f"({out['graphs']} distinct graphs among {out['trials_proposed']} points; graph_steps {out['graph_steps']})"
    )
    print(
        f"as run (scale {out['scale']}): {scaled['device_seconds'] / 60:.1f} GPU-min, {scaled['measuring_share']:.0%} measuring, "
        f"{scaled['starting_share']:.0%} starting engines, {scaled['other_share']:.0%} the rest"
    )
    print(
        f"at full size: {real['gpu_minutes']:.1f} GPU-min reserved; {real['measuring_share']:.1%} measuring, "
        f"{real['starting_share']:.1%} starting engines, {real['quality_share']:.1%} quality probe (estimated: "
        f"{real['probe_share_of_measuring']:.1%} of measuring, bench/README.md), {real['other_share']:.1%} warm-up, teardown and the rest"
    )
    if out.get("prune"):
        p = out["pruned"]
        print(
            f"pruned by the estimate: {p['trials']} of {out['trials_proposed']} trials, their reservations "
            f"{p['reserved_device_s'] / 60:.2f} GPU-min (counted in the rest); saved at full size at least "
            f"{p['saved_gpu_minutes_at_least']:.1f} GPU-min (their start-ups), about {p['saved_gpu_minutes_mean_trial']:.1f} "
            "at the mean trial's cost"
        )
    if out.get("twin"):
        print_bests(out["trials"])
    verdict = "meets" if real["measuring_share"] >= TARGET else "misses"
    print(f"measuring share {real['measuring_share']:.1%}: {verdict} the {TARGET:.0%} target")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
