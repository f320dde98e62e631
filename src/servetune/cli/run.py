"""``servetune run``: the study. Ray Tune searches vLLM configurations, each trial on devices reserved for it."""

from __future__ import annotations

import argparse
import atexit
import signal
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.table import Table

from servetune.cli.display import console as make_console
from servetune.cli.run_hub import check_hub_models, unasked_lines
from servetune.config.space import SearchSpace
from servetune.config.workload import mean_lengths
from servetune.engine.args import load_argspecs
from servetune.errors import UserError
from servetune.report.params import config_label
from servetune.space_file import load_space

DESCRIPTION = """\
Run a study: Ray Tune proposes vLLM configurations from the search space (grid, random, or
Optuna's TPE / NSGA-II / GP with the SLO as constraints); each trial reserves the devices its
configuration needs (TP x PP x DP GPUs on one node, or CPU cores on the CPU build), checks the
memory ledger, starts vLLM on exactly those devices, climbs the load ladder on one launch and
records its outcome. Results go to STORAGE/<study name>/trials/<hash of the config>/result.json.

With `search: {verify: {top: K}}` the study ends by running `servetune verify`'s scenarios on its
K best points, each on devices reserved through Ray as a trial's are: STORAGE/<study name>/verify/
<trial id>.json. Exit status: 0; 1 when a verified point was rejected or its verification did not finish (the
report is written either way); 2 for bad input.

On a cluster:  ray job submit --working-dir . -- servetune run search_spaces/chat-latency.yaml
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help="run a study over a search space (Ray Tune)", description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("space", type=Path, help="search-space YAML file (see search_spaces/)")
    p.add_argument("--address", help="Ray cluster to join (default: $RAY_ADDRESS, else a local cluster)")
    p.add_argument(
        "--storage",
        type=Path,
        default=Path("servetune-results"),
        help="where studies live (default: ./servetune-results)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue the study in STORAGE/<name>: finished trials are not run again"
    )
    p.add_argument(
        "--unprune",
        action="store_true",
        help="with --resume: run the trials the estimate pruned (search.estimate.prune), and only those still pruned",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list the trials a grid would run and those the constraints or capacity check reject; start nothing",
    )
    p.add_argument("--hub", action="store_true",
                   help="with --dry-run: ask the model hub as the run does (its access check; the config and size of a "
                        "hub model in no local cache, kept for later); without it a dry run plans from this machine")  # fmt: skip
    p.add_argument("--max-trials", type=int, help="run at most N trials (the baseline included)")
    p.add_argument("--no-checks", action="store_true",
                   help="on a cluster joined with --address or $RAY_ADDRESS, start without servetune doctor's checks "
                        "(for a cluster that stands in for GPUs it does not have)")  # fmt: skip
    p.add_argument("--no-prefetch", action="store_true",
                   help="do not download a hub model's weights on each node that runs trials before the first trial "
                        "(each node's first trial then downloads them inside its start-up)")  # fmt: skip
    p.add_argument(
        "--python",
        default=sys.executable,
        help="Python interpreter that has vLLM on the trial nodes (default: this one)",
    )
    p.add_argument("--tracking-uri", metavar="URI",
                   help="MLflow tracking server or store for the study's runs (default: with --resume the study's own, else "
                        "$MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here); recorded in study.json")  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from servetune.study.driver import resolve_model, resolve_models

    if args.max_trials is not None and args.max_trials < 1:
        raise UserError("--max-trials must be at least 1")
    if args.unprune and not args.resume:
        raise UserError("--unprune runs the pruned trials of a stored study: pass --resume too")
    if args.hub and not args.dry_run:
        raise UserError("--hub lets a dry run ask the hub, as the run always does: pass --dry-run too")
    argspecs = load_argspecs(args.python)
    space = load_space(args.space, argspecs)
    if argspecs is not None:  # vLLM is there to start: what it needs beside it for the space's speculation
        check_speculation(space, args.space, args.python)
        check_structured_backends(space, args.space, args.python)
    if args.hub or not args.dry_run:  # a dry run asks no hub unless told to (cli/run_hub.py)
        check_hub_models(space, args.space.parent)
    from servetune.quality.lossless import unchecked_reason

    unchecked = unchecked_reason(space)
    if unchecked:
        from servetune.study.progress import stderr_console

        stderr_console().print(f"warning: {args.space}: {unchecked}", soft_wrap=True, highlight=False, markup=False)
    if args.dry_run:
        from servetune.capacity.source import hub_closed

        # planned from this machine alone unless --hub: a hub model in no local cache is refused, not fetched
        planning = nullcontext(set[str]()) if args.hub else hub_closed()
        with tempfile.TemporaryDirectory() as tmp, planning as refused:
            model = resolve_model(space, Path(tmp), args.space.parent)
            done = dry_run(space, args, model, resolve_models(space, Path(tmp), args.space.parent), Path(tmp))
        for line in [] if args.hub else unasked_lines(space, args.space.parent, refused):
            make_console().print(line, soft_wrap=True, highlight=False, markup=False)
        return done
    return run_study(space, args)


def preflight(space: SearchSpace, model: str, console: Any) -> None:
    """``servetune doctor``'s checks on the cluster just joined, before the first trial: warnings printed, and a
    failed check ends the run in one line (``--no-checks`` skips them; a local Ray servetune started needs none)."""
    from servetune.doctor import failed, gather, space_checks

    with console.status("checking the cluster's nodes (servetune doctor)"):
        nodes = gather(model if model.startswith("/") else None)
    checks = space_checks(nodes, space)
    for check in checks:
        if check.status == "WARN":
            console.print(f"doctor: {check.node} {check.name}: {check.evidence}", soft_wrap=True, highlight=False,
                          markup=False)  # fmt: skip
    bad = failed(checks)
    if bad:
        first = bad[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise UserError(f"the cluster failed servetune doctor's checks{more}: node {first.node} {first.name}: "
                        f"{first.evidence}; `servetune doctor` lists them all, --no-checks starts anyway")  # fmt: skip


def prefetch_weights(space: SearchSpace, models: dict[str, str], console: Any) -> list:
    """servetune/prefetch.py's downloads, with a spinner while they run and a line per node as each finishes."""
    from servetune.prefetch import prefetch_study

    say = lambda line: console.print(line, soft_wrap=True, highlight=False, markup=False)  # noqa: E731
    with console.status("prefetching weights") as spinner:
        return prefetch_study(space, models, say, status=spinner.update)


def check_speculation(space: SearchSpace, path: Path, python: str) -> None:
    """Suffix decoding needs Arctic Inference beside vLLM (vLLM 0.32's SpeculativeConfig refuses to start without
    it): a space that lists it ends here in one line where the engines' interpreter has none, not in a FAILED
    trial per point after each engine's start."""
    from servetune.config.speculative import METHOD
    from servetune.engine.args import has_module

    if "suffix" in space.speculative_methods() and has_module("arctic_inference", python) is False:
        field = f"params.{METHOD}" if METHOD in space.params else f"engine_args.{METHOD}"
        raise UserError(f"{path}: {field}: suffix decoding needs Arctic Inference beside vLLM and {python} has none "
                        "(pip install arctic-inference; vLLM refuses to start without it)")  # fmt: skip


def check_structured_backends(space: SearchSpace, path: Path, python: str) -> None:
    """A structured-outputs backend whose library does not load beside the engines' vLLM (not installed, or a
    version that vLLM does not support: lm-format-enforcer 0.11.3 under vLLM 0.32) starts an engine that answers
    every structured request with HTTP 500: a space that lists one ends here in one line, before any engine starts."""
    from servetune.engine.args import STRUCTURED_BACKEND, normalize_key, structured_backend_problems

    listed: dict[str, str] = {}  # backend -> the field that lists it
    for section, values in (("engine_args", space.engine_args), ("params", space.params)):
        for key, value in values.items():
            if normalize_key(key) == STRUCTURED_BACKEND:
                for backend in value if isinstance(value, list) else [value]:
                    listed[str(backend)] = f"{section}.{key}"
    problems = structured_backend_problems(list(listed), python)
    if problems:
        backend, why = next(iter(problems.items()))
        more = f" (and {', '.join(list(problems)[1:])})" if len(problems) > 1 else ""
        raise UserError(f"{path}: {listed[backend]}: {backend}{more}: {why}")


def unchecked_note(device: str) -> str:
    """Why a dry run's trial has no capacity check (``capacity_check`` gave None)."""
    if device == "cpu":
        return "not checked (the CPU build sizes its KV cache from host memory: no VLLM_CPU_KVCACHE_SPACE)"
    return "not checked (no hardware.gpu: each trial sizes the GPU it gets)"


def estimate_cell(spec: Any, top: Any, lengths: tuple[int, int]) -> str:
    """The estimate of one point of the grid at the ladder's top level: output throughput, mean TTFT and TPOT."""
    from servetune.trial.estimated import planned_estimate
    from servetune.trial.measure import LevelPlan

    # an open loop's top level waits for a slot over its planned requests, as the study estimates it
    planned = LevelPlan.sized(top, spec.requests_per_level, spec.seconds_per_level, spec.warmup_requests)
    got = planned_estimate(spec.model, spec.device, spec.engine_args, spec.env, spec.gpu, spec.gpu_memory_gib,
                           top.kind, top.value, *lengths, workload=spec.workload,
                           requests=planned.open_loop_requests)  # fmt: skip
    if isinstance(got, str):
        return f"none: {got}"
    ttft = "unbounded" if got.ttft_ms is None else f"{got.ttft_ms:,.0f} ms"
    saturated = ", saturated" if got.saturated else ""
    return f"{got.output_throughput:,.0f} tok/s, TTFT {ttft}, TPOT {got.tpot_ms:.1f} ms{saturated}"


def estimate_note(device: str, lengths: tuple[int, int], images: bool = False, open_loop: bool = False) -> str:
    """What the estimate column assumes, and the error to expect of it (``open_loop``: the ladder's levels are
    rates, whose TTFT holds a wait for a slot)."""
    from servetune.estimate import load_factors

    factors = load_factors()
    head = f"estimate: requests of {lengths[0]} in / {lengths[1]} out tokens (the workload's means)"
    if images:
        head += ", plus their images' tokens and the vision tower's time to encode them"
    if open_loop:
        head += (", TTFT's wait for a slot over the level's planned requests sent into an empty queue (as the study "
                 "estimates the level it measures), not the long run's")  # fmt: skip
    head += ", shipped factors"
    if device == "cpu":
        return (f"{head}; the CPU build's factors were fitted on one recording host (bench/README.md): on another "
                "host expect errors of tens of percent until the study's refit (estimate_factors.json) takes over")  # fmt: skip
    expected = ", ".join(f"{m} ±{100 * e.median:.0f}%" for m, e in factors.held_out_error.items())
    return f"{head}; expected error (median on held-out public measurements, fit of {factors.fit_date}): {expected}"


def prune_summary(device: str, pruned: int, runnable: int, saved_s: float) -> str:
    """The dry run's line on ``search.estimate.prune``: how many of the runnable points the estimate prunes before
    any trial has finished, and the device time that saves."""
    from servetune.study.prune import MIN_STUDY_LEVELS

    unit = "GPU" if device == "gpu" else "core"
    line = (f"search.estimate.prune: {pruned} of {runnable} trial(s) would be pruned before any engine starts, by "
            "the SLO rule alone (a dry run has no finished trial to dominate a point; the study also prunes those)")  # fmt: skip
    if pruned:
        line += (f"; about {saved_s / 60:,.1f} {unit}-min saved by the estimate (each engine's expected start-up "
                 "and the ladder's levels until it stops at the first break; the capacity search's not counted)")  # fmt: skip
    if device == "cpu":
        line += ("; on the CPU build the estimate prunes only once the study has measured its own error "
                 f"(study/prune.py: {MIN_STUDY_LEVELS} estimated levels of a metric)")  # fmt: skip
    return line


def dry_run(
    space: SearchSpace,
    args: argparse.Namespace,
    model: str,
    models: dict[str, str] | None = None,
    build_dir: Path | None = None,
) -> int:
    from rich.markup import escape

    from servetune.config.adapters import adapter_modules
    from servetune.study.driver import proposals
    from servetune.study.prune import preview_prune, prune_reason
    from servetune.trial.context import StudyContext, resolve_levels, startup_budget_for
    from servetune.trial.runner import capacity_check

    console = make_console()
    workload = space.resolved_workload(args.space.parent)
    adapters = adapter_modules(workload.adapters, build_dir) if build_dir is not None else None
    context = StudyContext(
        space, workload, args.storage / space.name, model, resolve_levels(space, workload), models=models or {},
        adapters=adapters,
    )  # fmt: skip
    try:
        kept, rejected = space.grid()
    except ValueError:  # continuous ranges: the sampler draws from them, there is no grid to list
        kept, rejected = [], []
    table = Table(title=f"study {space.name}: {space.search.algorithm} search", title_justify="left")
    top = max(context.levels, key=lambda lv: lv.value)
    lengths = mean_lengths(workload)
    for col in ("#", "configuration", "devices", "capacity check", f"estimate at {top.kind} {top.value:g}", "verdict"):
        table.add_column(col)
    runnable = 0
    prune = space.search.estimate.prune
    would_prune, saved_s = 0, 0.0
    points = (
        proposals(space, args.max_trials)
        if space.search.algorithm in ("grid", "random")
        else ([{}] if space.search.baseline else []) + kept
    )
    for i, params in enumerate(points):
        spec = context.spec_for(params)
        cap = capacity_check(spec)
        fits = cap is None or cap.fits
        runnable += fits
        note = unchecked_note(spec.device) if cap is None else cap.reason
        est = estimate_cell(spec, top, lengths) if fits and cap is not None and cap.planned else ""
        verdict = "[green]run[/]" if fits else "[red]infeasible[/]"
        if prune and fits:
            preview = preview_prune(spec, lengths, startup_budget_for(space, params, spec.model).expected_s)
            if preview.record is not None:
                would_prune, saved_s = would_prune + 1, saved_s + preview.device_s
                verdict = (
                    f"[magenta]would be pruned[/]: {escape(prune_reason(preview.record).removeprefix('pruned: '))}"
                )
        table.add_row(str(i), config_label(params), str(spec.devices), note, est, verdict)
    for params, reasons in rejected:
        table.add_row(
            "-", config_label(params), str(space.devices(params)), "", "", "[yellow]excluded[/]: " + "; ".join(reasons)
        )
    console.print(table)
    console.print(estimate_note(space.device, lengths, workload.sends_images, top.kind == "rate"))
    levels = ", ".join(str(lv) for lv in context.levels)
    console.print(f"{runnable} trial(s) would run, {len(points) - runnable} rejected by the capacity check, "
                  f"{len(rejected)} excluded by the constraints; levels: {levels}; workload {workload.name}")  # fmt: skip
    if prune:
        console.print(prune_summary(space.device, would_prune, runnable, saved_s), soft_wrap=True)
    if space.search.algorithm not in ("grid", "random"):
        n = args.max_trials or space.search.num_trials or 20
        console.print(
            f"{space.search.algorithm} proposes up to {n} trials from these parameters; the table lists the grid they come from"
        )
    if space.search.verify is not None:
        soak = (
            f"{space.search.verify.duration_s:g} s soak" if space.search.verify.duration_s else "verify's default soak"
        )
        console.print(f"at the end: servetune verify's scenarios on the {space.search.verify.top} best point(s) ({soak}), "
                      "each on devices reserved through Ray")  # fmt: skip
    if space.quality is not None:
        console.print(f"quality probe before each ladder: {', '.join(space.quality.suites)}; the reference, "
                      f"{config_label(space.quality_reference or {})}, runs first; bounds: "
                      + (", ".join(f"{k} {v:g}" for k, v in space.quality_bounds.items()) or "none"))  # fmt: skip
    return 0


def run_study(space: SearchSpace, args: argparse.Namespace) -> int:
    from servetune.accounting import device_time_lines, prefetch_lines
    from servetune.config.adapters import adapter_modules
    from servetune.study.driver import (
        finished_results,
        prepare_study_dir,
        proposals,
        pruned_points,
        resolve_model,
        resolve_models,
        study_info,
        write_study_info,
    )
    from servetune.study.forecast import estimate_seeds, seed_count
    from servetune.study.mirror import ResultMirror
    from servetune.study.objectives import objectives_and_constraints
    from servetune.study.packing import resolve_max_concurrent
    from servetune.study.progress import LiveTable, stderr_console, summary_table
    from servetune.study.searcher import ConstrainedOptunaSearch
    from servetune.study.tuner import cluster_devices, init_ray, run_tuner
    from servetune.tracking import MlflowCallback
    from servetune.tracking.connection import recorded_tracking_uri, resolve_tracking_uri, without_credentials
    from servetune.trial.context import StudyContext, resolve_levels

    console = stderr_console()
    study_dir = args.storage / space.name
    prepare_study_dir(study_dir, args.space, args.resume)
    model = resolve_model(space, study_dir, args.space.parent)
    workload = space.resolved_workload(args.space.parent)
    levels = resolve_levels(space, workload)
    if args.resume and args.tracking_uri is None:  # a resumed study logs where it logged, wherever it runs from
        args.tracking_uri = recorded_tracking_uri(study_dir)
    args.tracking_uri = resolve_tracking_uri(args.tracking_uri)
    info = study_info(space, args.space, model, levels, without_credentials(args.tracking_uri))
    write_study_info(study_dir, info)
    context = StudyContext(space, workload, study_dir.resolve(), model, levels, python=args.python,
                           models=resolve_models(space, study_dir, args.space.parent), unprune=args.unprune,
                           adapters=adapter_modules(workload.adapters, study_dir.resolve() / "models"))  # fmt: skip
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(SystemExit(128 + signum)))
    callbacks = None
    prefetched: list = []

    def ray_started() -> list:
        nonlocal callbacks, prefetched
        if callbacks is None:
            if space.through_serve:
                from servetune.serve.cluster import start_serve
                from servetune.serve.trial import remove_study_apps
                from servetune.study.ray_cluster import local_serve_cpus

                started_here = init_ray(args.address, local_serve_cpus(space))
                if not started_here and not args.no_checks:
                    preflight(space, model, console)
                start_serve(started_here)
                left = remove_study_apps(space.name)
                if left:
                    console.print(
                        f"deleted {len(left)} Serve application(s) a stopped run of this study left deployed: {', '.join(left)}"
                    )
                atexit.register(remove_study_apps, space.name)  # a stopped driver's trials cannot delete theirs
            elif not init_ray(args.address) and not args.no_checks:  # joined a cluster: check it first
                preflight(space, model, console)
            if not args.no_prefetch:  # the weights on every node before the first trial's start-up clock runs
                prefetched = prefetch_weights(space, {space.model: model, **context.models}, console)
                if prefetched:
                    write_study_info(study_dir, info.model_copy(update={"prefetch": prefetched}))
            callbacks = [
                ResultMirror(context),
                LiveTable(space, console),
                MlflowCallback(study_dir.resolve(), args.tracking_uri),
            ]
        return callbacks

    reference = space.quality_reference
    # the quality reference runs first: every later trial is compared with its answers
    if space.quality is not None and reference is not None:  # a reference comes with a quality section
        from servetune.quality.lossless import method_of
        from servetune.quality.probe import make_plan
        from servetune.study.driver import keep_reference, read_reference

        speculation = method_of(space.engine_params(reference)[0].get("speculative_config"))
        plan = make_plan(space.quality, args.space.parent, reference, reference_speculation=speculation)
        context = replace(context, quality=plan)
        kept = read_reference(study_dir, reference, context.spec_for(reference).trial_id)
        context = replace(context, quality=plan.model_copy(update={"reference": kept}))
        if kept is None:
            console.print(
                f"quality: the reference ({config_label(reference)}) runs first; later trials are compared with its answers"
            )
            run_tuner(context, [reference], None, 1, ray_started(), 1)
            context = keep_reference(context)

    points, searcher, num_samples = None, None, 0
    if args.unprune:  # the trials still PRUNED, measured now as a grid of their own
        points = pruned_points(finished_results(study_dir), context)
        num_samples = len(points)
    elif space.search.algorithm in ("grid", "random"):
        # Only what never finished: the driver's study directory is the record (nodes share no disk).
        done = {r.trial_id for r in finished_results(study_dir) if not r.runs_again}  # a lost trial runs again
        points = [
            p for p in proposals(space, args.max_trials) if p != reference and context.spec_for(p).trial_id not in done
        ]
        num_samples = len(points)
    else:
        history = []
        for r in finished_results(study_dir):
            if r.runs_again:  # lost, or failed for the cluster's reasons: the sampler may propose it again
                continue
            values, constraints = objectives_and_constraints(
                r, space.search.objectives, space.slo_bounds, space.quality_bounds
            )
            history.append((r.params, values, constraints))
        told = len(history)
        wanted = args.max_trials or space.search.num_trials or 20
        num_samples = max(wanted - told, 0)
        baseline = space.search.baseline and not any(not params for params, _, _ in history)
        seeds = estimate_seeds(context, seed_count(space, wanted))
        if seeds:
            console.print(f"the estimate's likely winners are proposed first: {'; '.join(map(config_label, seeds))}")
        searcher = ConstrainedOptunaSearch(space, baseline=baseline, history=history, seeds=seeds)
    console.print(
        f"study {space.name}: {space.search.algorithm} search, {num_samples} trial(s) to run, results in {study_dir}"
    )
    if num_samples:
        ray_started()
        at_once = resolve_max_concurrent(space, cluster_devices(space))
        console.print(
            f"{at_once} trial(s) at once" + (" (max_concurrent: auto)" if space.search.max_concurrent == "auto" else "")
        )
        run_tuner(context, points, searcher, num_samples, ray_started(), at_once)
    results = finished_results(study_dir)
    verified = []
    if space.search.verify is not None and results:
        from servetune.study.verify_top import verify_top

        say = lambda line: console.print(line, soft_wrap=True, highlight=False, markup=False)  # noqa: E731
        verified = verify_top(study_dir, context, say, ray_started, args.tracking_uri)
    out = make_console()
    out.print(summary_table(results, space))
    for line in device_time_lines(results, space.device, len(context.levels)) + prefetch_lines(prefetched):
        out.print(line, soft_wrap=True)
    if not results:
        return 0
    from servetune.report.write import recommendation_lines, verification_line, write_report
    from servetune.tracking import sync_study

    report, files = write_report(study_dir)
    console.print(f"report: {files[0]} (and {len(files) - 1} more files in {files[0].parent})")
    for line in recommendation_lines(report, study_dir):
        console.print(line)
    synced = sync_study(study_dir, args.tracking_uri, report_dir=files[0].parent)  # the report joins the study's run
    if not synced.ok:
        console.print(synced.summary())
    if verified:
        console.print(verification_line(report), soft_wrap=True, highlight=False, markup=False)
    return (
        1 if any(not v.accepted for v in verified) else 0
    )  # as servetune verify: 1 when a verified point was rejected
