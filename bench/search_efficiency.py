"""How many trials each search algorithm needs: a recorded grid, replayed (no engines, seconds).

``record`` turns a study that ran a full grid for real into a surface file (the space, every
trial's result without its log and environment, and how it was made). ``replay`` runs the
study's own search code against it, grid, random, TPE, NSGA-II and GP, over many seeds,
answering each proposal with the recorded result, and prints how many trials each needed to
reach a configuration within 5% of the grid's best goodput under the SLO. Target: the best
Bayesian option needs at most 15% of the grid's trials on average one at a time, 25% with 4 in flight (issue 40).

    .venv/bin/python bench/search_efficiency.py record STUDY_DIR --out bench/data/cpu-tiny-grid.json --command "..."
    .venv/bin/python bench/search_efficiency.py replay bench/data/cpu-tiny-grid.json [--seeds 10] [--json out.json] \
        [--in-flight N] [--budget TRIALS] [--tolerance 0.05] [--target tolerance|noise]

Two readings of "reaching the best" are printed, each with its table and verdicts (``--target`` picks the one
listed first and given at the JSON's top level; every row holds both under ``by_target``): ``tolerance``, within
``--tolerance`` of the best's goodput; ``noise``, below it by no more than the two points' measured noise together
or ``--tolerance``, whichever is larger. A point's noise is that of the level its goodput comes from, as
servetune's results compare two measurements: half its repeats' spread in throughput, at least 5%, 10% for a
level run once (results ``throughput_noise``). A point the study could not tell from the best is as good a find.

The grid runs in its own order (one answer whatever the seed); a seed that never reaches the
target counts as the whole grid. ``--estimate-seed on`` builds each Bayesian searcher as a study with
``search.estimate.seed`` does: its first proposals are the grid points the estimate ranks best (the study's own
``estimate_seeds``, ``seed_count`` of them: min(4, a quarter of the trials)), named in the output; ``both``
replays each Bayesian algorithm without and with (rows ``tpe`` and ``tpe+estimate``), over the same seeds.
The estimate reads the surface's model as ``--pruning`` does (``--model-config``).

    .venv/bin/python bench/search_efficiency.py replay bench/data/cpu-tiny-grid-r4.json --estimate-seed both --seeds 5

``--in-flight N`` replays a cluster running N trials at once:
N proposals are outstanding whenever the searcher is asked, the oldest is told first.
``--budget`` stops each search after that many trials ("reached" then counts the seeds that got
there within the budget).

``--early-stopping`` instead searches each seed twice, with the study's dominance rule
(study/early_stop.py) off and on, the rule run on the recorded levels one at a time, and prints
per algorithm: ``lowered``, cut trials (all seeds) whose own best goodput fell because a
higher level that scored more was not run; ``best_lost_share``, the share of seeds whose best with early stopping scored
lower than without (target: under 5%), with the cut trial, level and dominator that explain
each loss; ``device_minutes_saved``, the recorded measuring time of the levels cut (times the
trial's devices, mean per seed); ``mean_trials`` against the grid size; and ``mean_trials_to_best`` ("to best"),
the trials each seed needed, early stopping on, to come within ``--tolerance`` of the grid's best (mean over the
``reached`` seeds).

    .venv/bin/python bench/search_efficiency.py replay bench/data/cpu-tiny-grid-r4.json --early-stopping --in-flight 4 \
        --seeds 10 --json out.json

``--pruning`` replays pruning by the estimate (study/replay_prune.py): each seed runs the grid one trial at a time
in an order of its own, every trial first judged by the study's prune rule against the trials measured before it.
It prints the trials pruned and the recorded device-minutes they would have taken, and the share of seeds that
lost the best (no trial measured within ``--tolerance`` of it; target: under 5%).

    .venv/bin/python bench/search_efficiency.py replay bench/data/cpu-tiny-grid-r4.json --pruning --seeds 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from servetune.config.space import ENV_PREFIX
from servetune.errors import UserError
from servetune.report.study import load_study
from servetune.study.replay import ALGORITHMS, estimate_seeds_for
from servetune.study.replay_cost import TARGETS, Efficiency, early_stopping_effect, efficiencies, reaching, score_noise
from servetune.study.surface import Surface, key, score

TARGET_SHARE = 0.25
#: Issue 40's target for a sequential search (one trial in flight); TARGET_SHARE stands for 4 in flight.
TARGET_SEQUENTIAL_SHARE = 0.15
#: Early stopping may find a worse best than a search without it in fewer than this share of seeds.
TARGET_LOST_SHARE = 0.05
BAYESIAN = ("tpe", "nsga2", "gp")


def record(args: argparse.Namespace) -> int:
    from servetune.config.loading import load_yaml_model
    from servetune.config.space import SearchSpace

    study = load_study(args.study_dir)
    space_path = Path(args.study_dir) / "space.yaml"
    space = load_yaml_model(space_path, SearchSpace)
    results, seen = [], {}
    for result in study.trials:
        # A trial kept from a grid with one more axis counts only where that axis had the value
        # this space fixes.
        for name, value in result.params.items():
            if name not in space.params and str(value) != str(fixed_value(space, name)):
                raise UserError(
                    f"{result.trial_id}: ran with {name}={value}, but {space_path} fixes it at {fixed_value(space, name)}"
                )
        params = {k: v for k, v in result.params.items() if k in space.params}
        if key(params) in seen:
            raise UserError(f"{result.trial_id} and {seen[key(params)]} ran the same grid point {params}")
        seen[key(params)] = result.trial_id
        results.append(result.model_copy(update={"params": params}))
    started = sorted(r.started_at for r in results if r.started_at)
    finished = sorted(r.finished_at for r in results if r.finished_at)
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    env = next((r.environment for r in results if r.environment), {})
    made_by = {
        "command": args.command, "study": study.info.name, "space_file": study.info.space_file,
        "measured_from": started[0] if started else None, "measured_to": finished[-1] if finished else None,
        "trials": len(results), "outcomes": outcomes, "meet_slo": sum(score(r) > 0 for r in results),
        "trial_seconds": round(sum(r.duration_s or 0 for r in results)),
        "machine": {k: env.get(k) for k in ("cpu_model", "host_cpus", "host_memory_gib", "vllm", "torch", "ray", "python", "servetune")},
        "note": args.note,
    }  # fmt: skip
    surface = Surface.from_results(space, results, made_by)
    surface.dump(args.out, space_path.read_text())
    print(f"{args.out}: {len(surface.results)} grid points, best goodput {surface.best_score:.2f} req/s under the SLO")
    return 0


def fixed_value(space, name: str):
    """What a space fixes a parameter at: its engine argument or environment variable (``env.``)."""
    if name.startswith(ENV_PREFIX):
        return space.env.get(name[len(ENV_PREFIX) :])
    return space.engine_args.get(name)


def replay(args: argparse.Namespace) -> int:
    if args.early_stopping:
        return replay_early_stopping(args)
    if args.pruning:
        return replay_pruning(args)
    surface = Surface.load(args.surface)
    seeds = range(args.seed0, args.seed0 + args.seeds)
    best = surface.best_score
    meeting = sum(score(r) > 0 for r in surface.results.values())
    near = {target: len(reaching(surface, args.tolerance, target)) for target in TARGETS}  # how big the needle is
    best_noise = score_noise(max(surface.results.values(), key=score))
    print(f"{args.surface}: {len(surface.results)} grid points, {meeting} meet the SLO; best goodput {best:.2f} req/s; "
          f"{args.seeds} seeds, {args.in_flight} in flight" + (f", at most {args.budget} trials" if args.budget else ""))  # fmt: skip
    print(f"  target 'tolerance': within {args.tolerance:.0%} of the best ({(1 - args.tolerance) * best:.2f}): "
          f"{near['tolerance']} point{'s reach' if near['tolerance'] > 1 else ' reaches'} it")  # fmt: skip
    print(f"  target 'noise': below the best by at most the two points' noise together (the best's ±{best_noise:.1%}) "
          f"or {args.tolerance:.0%}, whichever is larger: {near['noise']} point{'s reach' if near['noise'] > 1 else ' reaches'} it")  # fmt: skip
    runs = [(a, False) for a in args.algorithms if a not in BAYESIAN or args.estimate_seed != "on"]
    runs += [(a, True) for a in args.algorithms if a in BAYESIAN and args.estimate_seed != "off"]
    with surface_model(surface, args.model_config) as model:
        first = {a: estimate_seeds_for(surface, a, model, args.budget) for a, seeded in runs if seeded}
    for points in {json.dumps(p, default=str): p for p in first.values()}.values():
        print(f"the estimate's likely winners, proposed first: {'; '.join(map(label, points)) or 'none'}")
    rows = []
    for algorithm, seeded in runs:
        name = f"{algorithm}+estimate" if seeded else algorithm
        began = time.perf_counter()
        by_target = efficiencies(surface, algorithm, [0] if algorithm == "grid" else seeds, args.tolerance,
                                 args.in_flight, args.budget, proposed_first=first.get(algorithm, []) if seeded else [])  # fmt: skip
        took = time.perf_counter() - began
        row = {"algorithm": name, "estimate_seeded": seeded, "proposed_first": first.get(algorithm, []) if seeded else [],
               "seconds": took, "by_target": {target: summary(e) for target, e in by_target.items()}}  # fmt: skip
        rows.append({**row, **row["by_target"][args.target]})
    order = [args.target] + [t for t in TARGETS if t != args.target]
    reach = {"tolerance": f"within {args.tolerance:.0%} of the best", "noise": "within the noise of the best"}
    target_share = TARGET_SEQUENTIAL_SHARE if args.in_flight == 1 else TARGET_SHARE
    for target in order:
        print(f"target '{target}': trials to come {reach[target]}")
        print(
            f"{'algorithm':<14} {'mean trials':>11} {'of grid':>8} {'median':>7} {'worst':>6} {'reached':>8} {'seconds':>8}"
        )
        for row in rows:
            e = row["by_target"][target]
            print(f"{row['algorithm']:<14} {e['mean']:>11.1f} {e['share_of_grid']:>8.0%} {e['median']:>7.1f} "
                  f"{e['worst']:>6} {e['reached']:>4}/{e['seeds']:<3} {row['seconds']:>8.1f}")  # fmt: skip
        for seeded in (False, True):
            bayesian = [r for r in rows if r["algorithm"].split("+")[0] in BAYESIAN and r["estimate_seeded"] == seeded]
            if bayesian:
                top = min(bayesian, key=lambda r: r["by_target"][target]["mean"])
                share = top["by_target"][target]["share_of_grid"]
                verdict = "met" if share <= target_share else "missed"
                print(f"best Bayesian option{' seeded by the estimate' if seeded else ''}: {top['algorithm']}, "
                      f"{share:.1%} of the grid's trials on average to come {reach[target]} "
                      f"(target <= {target_share:.0%} with {args.in_flight} in flight): {verdict}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"surface": str(args.surface), "grid_size": len(surface.results), "best": best,
                                               "in_flight": args.in_flight, "budget": args.budget, "target": args.target,
                                               "tolerance": args.tolerance, "best_noise": best_noise,
                                               "points_reaching": near[args.target], "points_reaching_by_target": near,
                                               "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


def summary(e: Efficiency) -> dict:
    """One algorithm's trials to reach one target, as the table and the JSON give them."""
    needed = [n if n is not None else e.grid_size for n in e.needed]
    return {"mean": e.mean, "share_of_grid": e.share_of_grid, "median": statistics.median(needed), "worst": e.worst,
            "reached": e.reached, "seeds": e.seeds, "needed": e.needed}  # fmt: skip


@contextlib.contextmanager
def surface_model(surface: Surface, model_config: Path | None) -> Iterator[Path]:
    """The surface's model as the estimate reads it: a directory with ``model_config`` (default: the tiny model's
    config.json), or for a GPU space without one, its catalogue model by name."""
    from servetune.models.tiny import TINY_CONFIG

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        (model / "config.json").write_text(json.dumps(TINY_CONFIG) if model_config is None
                                           else Path(model_config).read_text())  # fmt: skip
        if model_config is None and surface.space.device == "gpu":
            model = Path(surface.space.model)
        yield model


def label(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def replay_early_stopping(args: argparse.Namespace) -> int:
    surface = Surface.load(args.surface)
    seeds = range(args.seed0, args.seed0 + args.seeds)
    print(f"{args.surface}: {len(surface.results)} grid points, best goodput {surface.best_score:.2f} req/s; early stopping "
          f"off and on, {args.seeds} seeds, {args.in_flight} in flight" + (f", at most {args.budget} trials" if args.budget else ""))  # fmt: skip
    print(f"{'algorithm':<10} {'mean trials':>11} {'grid':>5} {'to best':>8} {'cut/seed':>9} {'lowered':>8} {'best lost':>10} "
          f"{'device min saved':>17} {'seconds':>8}")  # fmt: skip
    rows = []
    for algorithm in args.algorithms:
        began = time.perf_counter()
        e = early_stopping_effect(surface, algorithm, [0] if algorithm == "grid" else seeds, args.in_flight, args.budget,
                                  tolerance=args.tolerance)  # fmt: skip
        took = time.perf_counter() - began
        rows.append({"algorithm": algorithm, "seeds": e.seeds, "grid_size": e.grid_size, "mean_trials": e.mean_trials,
                     "mean_cut": statistics.fmean(e.cut), "lowered": sum(e.lowered), "best_lost_share": e.best_lost_share,
                     "device_minutes_saved": e.device_minutes_saved, "losses": [vars(loss) for loss in e.losses],
                     "mean_trials_to_best": e.mean_needed, "reached": sum(n is not None for n in e.needed),
                     "seconds": took})  # fmt: skip
        to_best = "-" if e.mean_needed is None else f"{e.mean_needed:.1f}"
        print(f"{algorithm:<10} {e.mean_trials:>11.1f} {e.grid_size:>5} {to_best:>8} {statistics.fmean(e.cut):>9.1f} {sum(e.lowered):>8} "
              f"{len(e.losses):>5}/{e.seeds:<4} {e.device_minutes_saved:>17.2f} {took:>8.1f}")  # fmt: skip
        for loss in e.losses:
            why = (f"cut {loss.cut_params} after level {loss.cut_at_level}: {loss.reason}" if loss.cut_params
                   else "no cut trial reaches the best found without: the search went elsewhere")  # fmt: skip
            print(f"  seed {loss.seed}: best {loss.best_on:.2f} instead of {loss.best_off:.2f} req/s; {why}")
    worst = max(rows, key=lambda r: r["best_lost_share"], default=None)
    if worst is not None:
        verdict = "met" if worst["best_lost_share"] < TARGET_LOST_SHARE else "missed"
        print(
            f"most seeds losing the best: {worst['algorithm']}, {worst['best_lost_share']:.0%} (target < {TARGET_LOST_SHARE:.0%}): {verdict}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"surface": str(args.surface), "grid_size": len(surface.results), "best": surface.best_score,
                                               "in_flight": args.in_flight, "budget": args.budget, "early_stopping": True,
                                               "rows": rows}, indent=2, default=str) + "\n")  # fmt: skip
    return 0


def replay_pruning(args: argparse.Namespace) -> int:
    from servetune.study.replay_prune import pruning_effect

    surface = Surface.load(args.surface)
    with surface_model(surface, args.model_config) as model:
        began = time.perf_counter()
        e = pruning_effect(surface, model, range(args.seed0, args.seed0 + args.seeds), args.tolerance)
        took = time.perf_counter() - began
    total = e.device_minutes_saved[0] + e.device_minutes_spent[0] if e.pruned else e.device_minutes_spent[0]
    print(f"{args.surface}: {e.grid_size} grid points, best goodput {e.best:.2f} req/s; pruning by the estimate "
          f"(search.estimate.prune) over {args.seeds} grid orders (seed 0: the grid's own), {total:.1f} device-min "
          f"to measure every point" + (f"; not estimated: {e.unsure}" if e.unsure else ""))  # fmt: skip
    print(f"{'pruned/seed':>11} {'device min saved':>17} {'share saved':>12} {'best lost':>10} {'seconds':>8}")
    share = e.mean_saved / total if total else 0.0
    print(f"{statistics.fmean(e.pruned):>11.1f} {e.mean_saved:>17.2f} {share:>12.1%} "
          f"{sum(e.best_lost):>5}/{len(e.best_lost):<4} {took:>8.1f}")  # fmt: skip
    for t in e.trials[:10]:
        print(f"  seed {t.seed}: {t.params} (it scored {t.score:.2f}): {t.reason}")
    verdict = "met" if e.best_lost_share < TARGET_LOST_SHARE else "missed"
    print(f"seeds losing the best: {e.best_lost_share:.0%} (target < {TARGET_LOST_SHARE:.0%}): {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"surface": str(args.surface), "grid_size": e.grid_size, "best": e.best,
                                               "pruning": True, "pruned": e.pruned, "device_minutes_saved": e.device_minutes_saved,
                                               "device_minutes_spent": e.device_minutes_spent, "best_lost": e.best_lost,
                                               "trials": [vars(t) for t in e.trials]}, indent=2, default=str) + "\n")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command_name", required=True)
    rec = commands.add_parser("record", help="store a study that ran its full grid as a surface file")
    rec.add_argument("study_dir", type=Path)
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--command", required=True, help="the command that measured the study, for the record")
    rec.add_argument("--note", default="", help="anything else a reader should know about how it was measured")
    rep = commands.add_parser("replay", help="count the trials each algorithm needs on a surface")
    rep.add_argument("surface", type=Path)
    rep.add_argument("--seeds", type=int, default=10)
    rep.add_argument("--seed0", type=int, default=0)
    rep.add_argument("--tolerance", type=float, default=0.05)
    rep.add_argument("--target", choices=TARGETS, default="tolerance", help="what counts as reaching the best, for "
                     "the verdicts and the JSON's top-level figures (both are printed): 'tolerance', within --tolerance "
                     "of it; 'noise', below it by at most the two points' measured noise together (their repeats' "
                     "spread, results' MARGIN when run once) or --tolerance, whichever is larger")  # fmt: skip
    rep.add_argument("--in-flight", type=int, default=1, help="trials running at once: the searcher is asked for this many before "
                     "the first result is told, then the oldest is told whenever a slot frees")  # fmt: skip
    rep.add_argument(
        "--budget", type=int, help="trials a search may run (the baseline not counted); default: the whole grid"
    )
    rep.add_argument("--early-stopping", action="store_true", help="search each seed with early stopping off and on: "
                     "how often it loses the best, and the device-minutes it saves")  # fmt: skip
    rep.add_argument("--pruning", action="store_true", help="replay pruning by the estimate (search.estimate.prune) over "
                     "grid orders: the device-minutes it saves, and how often it loses the best")  # fmt: skip
    rep.add_argument("--estimate-seed", choices=("off", "on", "both"), default="off", help="Bayesian searchers propose "
                     "the estimate's likely winners first, as a study with search.estimate.seed does: off, on, or both "
                     "(each Bayesian algorithm replayed without and with)")  # fmt: skip
    rep.add_argument("--model-config", type=Path,
                     help="--pruning, --estimate-seed: the surface model's config.json (default: the tiny model's)")  # fmt: skip
    rep.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    rep.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command_name == "replay" and args.estimate_seed != "off" and (args.early_stopping or args.pruning):
        parser.error("--estimate-seed replays the plain search; it does not combine with --early-stopping or --pruning")
    try:
        return record(args) if args.command_name == "record" else replay(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # GP fits its model with torch, which starts a thread per core for every fit: one thread is
    # 3-5x faster on a shared 2-core host, with the same proposals. Set before torch loads (GP's
    # first fit), and only when run as a script, not in a test's process.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
