"""The capacity search against fixed ladders, on a dense recorded surface (issue #37's proof).

A **surface** is, for each of several configurations, every load of a dense closed-loop ladder (1 to 48 clients in
steps of about 10%) measured several times on one engine: ``servetune bench --concurrency ... --repeats R``, one
bench document per configuration. ``record`` makes one on vLLM's CPU build (an engine per configuration; about
10-15 minutes each on a quiet two-core host, so run it when nothing else runs)::

    .venv/bin/python bench/capacity_accuracy.py record --out bench/data/capacity-surface.json

``--num-requests 0`` leaves each level's request count to ``servetune bench`` (8 a client in flight, 32-500, as a
study's ``requests_per_level: auto``): the final drain is then about the same share of every level, so the
level's throughput curve has the steady one's knee (bench/README.md, "The measured knee at the steady rate"), at
about 70 minutes for the six configurations instead of 30.

``replay`` (seconds, no engine) then runs, for each configuration and seed, what a study's trial would do on that
engine, drawing each measured level's runs from the recorded repeats of the nearest recorded load:

- the **truth**: the highest recorded load below the lowest whose runs broke the SLO by majority, as did the next
  recorded load's (a lone break between passes is a blip, not the capacity);
- the fixed **2x ladder** (2, 4, 8, 16, 32) and **4x ladder** (2, 8, 32, the cpu-tiny study's), capacity = their
  last level meeting the SLO;
- the **capacity search** (trial/capacity.py ``CapacitySearch``) from the 4x ladder with the study's defaults
  (``load.capacity_levels`` 4, ``capacity_tolerance`` 0.10, ``knee_fraction`` 0.5).

It prints each method's capacity error against the truth (per configuration: median and worst over seeds), how
often the configuration it would recommend (the highest output throughput at its capacity, at the steady rate a
level's cost is priced at, ``LevelSummary.steady_output_throughput``: the cheapest per token
where every configuration takes the same cores) is the truth's, and the measuring time each spent::

    .venv/bin/python bench/capacity_accuracy.py replay bench/data/capacity-surface.json [--seeds 200] [--json OUT]

The SLO is the surface's (``--slo`` at record time, else ``--slo`` here): pick one under which the configurations'
capacities differ by 5-40% and lie inside the recorded loads.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from servetune.config.slo import Slo
from servetune.load.runner import Level
from servetune.results import BenchResult, LevelResult
from servetune.results.levels import MARGIN
from servetune.trial.capacity import CapacitySearch
from servetune.trial.measure import median_run

#: About 10% apart, 1 to 48 clients (the issue's range), on to 64 for the search's climb past the 4x ladder's 32.
DENSE = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 16, 18, 20, 22, 24, 27, 30, 33, 36, 40, 44, 48, 53, 58, 64)
LADDER_2X = (2, 4, 8, 16, 32)
LADDER_4X = (2, 8, 32)
#: Six configurations of the cpu-tiny space whose capacities differ (batching and token budget).
CONFIGS = (
    {"max_num_seqs": 4, "max_num_batched_tokens": 512},
    {"max_num_seqs": 8, "max_num_batched_tokens": 512},
    {"max_num_seqs": 8, "max_num_batched_tokens": 2048},
    {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
    {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
    {"max_num_seqs": 32, "max_num_batched_tokens": 4096},
)
BASE_ARGS = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"}
SLO = "ttft_ms.p95=500,tpot_ms.p95=50"


@dataclass
class Surface:
    """Per configuration name: load -> the recorded runs of that load, each a LevelResult with its own verdict."""

    slo: Slo
    runs: dict[str, dict[float, list[LevelResult]]] = field(default_factory=dict)

    def nearest(self, config: str, load: float) -> float:
        return min(self.runs[config], key=lambda recorded: abs(math.log(recorded / load)))


def load_surface(path: Path, slo_text: str | None = None) -> Surface:
    doc = json.loads(path.read_text())
    slo = Slo.parse(slo_text or doc["slo"], source=f"{path}: slo")
    surface = Surface(slo)
    for entry in doc["configs"]:
        bench = BenchResult.model_validate(entry["bench"])
        loads: dict[float, list[LevelResult]] = {}
        for level in bench.levels:
            runs = level.runs or []
            summaries = [run.summary for run in runs] or [level.summary]
            load = float(next(iter(level.summary.level.values())))
            loads[load] = [LevelResult(summary=s, slo_violations=slo.violations(s)) for s in summaries]
        surface.runs[entry["name"]] = loads
    return surface


def truth(surface: Surface, config: str) -> float | None:
    """The highest recorded load below the lowest that broke the SLO by majority, where the next recorded load broke
    it by majority too (None: the lowest two did). A lone break between passes is a blip of this host (the recorded
    surface has them at 5-6 clients, P95 TTFT over 64 requests), not the capacity; a lone pass above a sustained
    break is not the capacity either."""
    loads = sorted(surface.runs[config])

    def broken(load: float) -> bool:
        runs = surface.runs[config][load]
        return 2 * sum(not r.meets_slo for r in runs) > len(runs)

    best = None
    for i, load in enumerate(loads):
        if broken(load) and (i + 1 == len(loads) or broken(loads[i + 1])):
            return best
        if not broken(load):
            best = load
    return best


def truth_throughput(surface: Surface, config: str, load: float) -> float:
    runs = surface.runs[config][surface.nearest(config, load)]
    return statistics.median(r.summary.steady_output_throughput for r in runs)


@dataclass
class Outcome:
    capacity: float | None
    throughput: float  # steady output tok/s measured at the capacity (0 without one): what its cost is priced at
    measured_s: float  # every run of every level it measured
    levels: int


def replay(surface: Surface, config: str, ladder: Sequence[float], budget: int, repeats: int,
           rng: random.Random) -> Outcome:  # fmt: skip
    """One trial on this configuration's engine: the ladder (and the search, with a budget), each level's runs drawn
    from the nearest recorded load's (``repeats`` of them; a level measured again draws runs not drawn yet)."""
    search = CapacitySearch(
        [Level("concurrency", v) for v in ladder], surface.slo, budget=budget, min_gain=0.03, knee_fraction=0.5
    )
    steps = search.steps()
    spent, measured = 0.0, {}
    decks: dict[float, list[LevelResult]] = {}  # per recorded load, its runs not drawn yet in this trial

    def draw(load: float) -> LevelResult:
        """A run of the recorded load not drawn before in this trial (a repeat is a fresh run), reshuffled once all
        were drawn."""
        if not decks.get(load):
            decks[load] = rng.sample(surface.runs[config][load], len(surface.runs[config][load]))
        return decks[load].pop()

    try:
        level = next(steps)
        while True:
            drawn = [draw(surface.nearest(config, level.value)) for _ in range(repeats)]
            result = median_run(drawn, surface.slo) if repeats > 1 else drawn[0]
            spent += sum(r.summary.duration_s for r in drawn)
            measured[level.value] = result
            level = steps.send(result)
    except StopIteration:
        pass
    if budget:
        value = search.capacity.value if search.capacity is not None else None
    else:  # the ladder alone, as a study without the search reads it: its last level meeting the SLO by majority
        value = None
        for load, result in measured.items():
            if not result.meets_slo:
                break
            value = load
    throughput = measured[value].summary.steady_output_throughput if value in measured else 0.0
    return Outcome(value, throughput, spent, len(measured))


def spread(errors: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(errors), "worst": max(errors, key=abs)} if errors else None


METHODS = {"ladder 2x": (LADDER_2X, 0), "ladder 4x": (LADDER_4X, 0), "search": (LADDER_4X, 4)}


def evaluate(surface: Surface, seeds: int, repeats: int) -> dict:
    configs = sorted(surface.runs)
    truths = {c: truth(surface, c) for c in configs}
    true_tput = {c: truth_throughput(surface, c, t) if t is not None else 0.0 for c, t in truths.items()}
    true_best = max(configs, key=lambda c: true_tput[c])
    # as good as the best within the run-to-run noise: servetune's margin for a level run once (results MARGIN)
    near_best = sorted(c for c in configs if true_tput[c] >= (1 - MARGIN) * true_tput[true_best])
    # Each level draws ``repeats`` of its load's recorded runs, all of them where it has that many: the median of the
    # same runs whatever the order, so every seed replays the same trial and a right pick is 0% or 100%.
    alike = all(len(runs) == repeats for c in configs for runs in surface.runs[c].values())
    out: dict = {"truth": truths, "truth_best": true_best, "near_best": near_best, "seeds_alike": alike, "methods": {}}
    for name, (ladder, budget) in METHODS.items():
        errors: dict[str, list[float]] = {c: [] for c in configs}
        right, near, spent, levels = 0, 0, [], []
        for seed in range(seeds):
            rng = random.Random(seed)
            outcomes = {c: replay(surface, c, ladder, budget, repeats, rng) for c in configs}
            for c, o in outcomes.items():
                if truths[c] is not None and o.capacity is not None:
                    errors[c].append(o.capacity / truths[c] - 1)
                spent.append(o.measured_s)
                levels.append(o.levels)
            picked = max(configs, key=lambda c: outcomes[c].throughput)
            right += picked == true_best
            near += picked in near_best
        out["methods"][name] = {
            "error": {c: spread(e) for c, e in errors.items()},
            "right_pick": right / seeds,
            "near_best_pick": near / seeds,
            "measured_s": statistics.mean(spent),
            "levels": statistics.mean(levels),
        }
    return out


def show(result: dict) -> None:
    configs = sorted(result["truth"])
    print(f"{'configuration':44} {'truth':>6}  " + "  ".join(f"{m:>18}" for m in result["methods"]))
    for c in configs:
        cells = []
        for m in result["methods"].values():
            e = m["error"][c]
            cells.append(f"{'-':>18}" if e is None else f"{e['median']:+7.1%} (w {e['worst']:+6.1%})")
        t = result["truth"][c]
        print(f"{c:44} {'-' if t is None else f'{t:g}':>6}  " + "  ".join(cells))
    print(f"truth's best: {result['truth_best']}; within {MARGIN:.0%} of it: {', '.join(result['near_best'])}")
    if result.get("seeds_alike"):
        print("every level draws all the recorded runs of its load, so every seed replays the same trial: the right "
              "picks below are one trial's (0% or 100%), not a rate; --repeats 1 draws differently in each seed")  # fmt: skip
    for name, m in result["methods"].items():
        print(f"{name:10} right pick {m['right_pick']:6.1%}  within {MARGIN:.0%} of the best {m['near_best_pick']:6.1%}   measuring {m['measured_s']:7.1f} s per trial"
              f"   {m['levels']:.1f} levels")  # fmt: skip


def record(out: Path, model: str | None, loads: Sequence[int], repeats: int, num_requests: int, slo: str,
           configs_wanted: int = len(CONFIGS)) -> None:  # fmt: skip
    from servetune.models.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="capacity-surface-"))
    model = model or str(build_tiny_model(work / "tiny"))
    configs = []
    chosen = CONFIGS[:configs_wanted]
    for i, params in enumerate(chosen):
        name = " ".join(f"{k}={v}" for k, v in params.items())
        doc = work / f"config-{i}.json"
        argv = [sys.executable, "-m", "servetune", "bench", "--model", model, "--workload", "cpu-tiny",
                "--concurrency", ",".join(map(str, loads)), "--repeats", str(repeats),
                "--env", "VLLM_CPU_KVCACHE_SPACE=2", "--json", str(doc)]  # fmt: skip
        if num_requests > 0:  # else servetune bench's own count a level (8 a client)
            argv += ["--num-requests", str(num_requests)]
        for key, value in {**BASE_ARGS, **params}.items():
            argv += ["--engine-arg", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
        print(f"[{i + 1}/{len(chosen)}] {name}", flush=True)
        subprocess.run(argv, check=True)
        configs.append({"name": name, "params": params, "bench": json.loads(doc.read_text())})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"slo": slo, "loads": list(loads), "repeats": repeats, "configs": configs}) + "\n")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="measure a dense surface on vLLM's CPU build")
    rec.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "capacity-surface.json")
    rec.add_argument("--model", help="model directory (default: servetune's tiny model, built here)")
    rec.add_argument("--loads", default=",".join(map(str, DENSE)), help="clients in flight, comma-separated")
    rec.add_argument("--repeats", type=int, default=3)
    rec.add_argument(
        "--num-requests",
        type=int,
        default=64,
        help="measured requests per run of a level (0: servetune bench's own, 8 a client in flight)",
    )
    rec.add_argument("--slo", default=SLO, help="the SLO the surface is judged against (kept in the file)")
    rec.add_argument("--configs", type=int, default=len(CONFIGS), help="record only the first N configurations")
    rep = sub.add_parser("replay", help="the capacity search and the fixed ladders on a recorded surface")
    rep.add_argument("surface", type=Path)
    rep.add_argument("--seeds", type=int, default=200)
    rep.add_argument("--repeats", type=int, default=3, help="runs per measured level (load.repeats)")
    rep.add_argument("--slo", help="judge against this SLO instead of the surface's")
    rep.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        loads = [int(v) for v in args.loads.split(",")]
        record(args.out, args.model, loads, args.repeats, args.num_requests, args.slo, args.configs)
        return
    result = evaluate(load_surface(args.surface, args.slo), args.seeds, args.repeats)
    show(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
