"""``servetune estimate SPACE.yaml``: what each configuration of a space should measure, before measuring."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from servetune.capacity import ModelArch, arch_from_hf_config, find_gpu, load_model_arch, resolve_hardware
from servetune.config.workload import mean_lengths
from servetune.errors import UserError
from servetune.estimate import Estimate, Load, estimate, load_factors
from servetune.estimate.calibrate_cpu import RECORDED_HOST
from servetune.estimate.encoder import workload_images
from servetune.estimate.factors import Efficiency
from servetune.estimate.kernels import KernelFactors, gpu_kernel_factors
from servetune.estimate.model import arrival_burstiness
from servetune.estimate.refit import Refit
from servetune.estimate.slo import broken_bounds, judged_bounds
from servetune.estimate.specs import gpu_class
from servetune.metrics import cost_per_mtok_usd
from servetune.models.tiny import TINY_CONFIG
from servetune.report.gpus import Calibration, tdp_w
from servetune.report.study import read_refit
from servetune.results.files import REFIT_FILE
from servetune.space_file import load_space
from servetune.trial.context import resolve_levels
from servetune.trial.measure import LevelPlan

DESCRIPTION = """\
Predict TTFT, TPOT, throughput, saturation and the knee of every configuration of a search space's
grid at every level of its load ladder, before starting any engine.

The estimate is a roofline of each engine step (prefill bound by the GPU's FLOP/s, decode by its
memory bandwidth: weights plus the KV cache read, tensor-parallel all-reduces on NVLink or PCIe)
and a queueing model of the load (closed loop by Little's law, open loop at the level's rate, its wait
for a slot over the requests the level will measure sent into an empty queue; KV capacity from the
memory ledger of `servetune plan`). The fraction of each peak vLLM reaches was
fitted on public vLLM measurements (A100, H100, H200); the expected error printed above the table
is the fit's median error on held-out measurements. Requests take the workload's mean input and
output lengths; prefix caching is not modelled. A vision-language workload's requests add their images'
tokens to the prompt and the vision tower's time to encode them to TTFT. Each row's cost per million
output tokens is at its GPU type's price as a trial of it would be costed (the space's price list, its
`prices:`, or its `price_per_device_hour`; on the CPU build, its price per core-hour). Where the space's SLO bounds
TTFT, TPOT or ITL (mean, P90, P95 or P99), each row lists the bounds its estimated mean already breaks, so
the first level of a configuration that lists a bound is where that bound is predicted to break.

Each row's energy per output token (J/token) is the GPUs' board power limit (the catalogue's tdp_w) x the
engine's devices over the estimated output tok/s: an upper bound, since a GPU draws at most its limit, and
marked so (<=). With --study DIR the estimate is calibrated on a measured study first, as the report's "Which
GPU" table is: its recommended type's best configuration at its capacity load, estimated and measured there,
scales every row's output tok/s, req/s and $/Mtok (TTFT, TPOT and the SLO column stay the model's), and where
that point measured its GPUs' energy (NVML), J/token is drawn at the same share of each GPU's power limit as the
measured GPU drew of its own, an estimate within the expected error printed. Where the study wrote the factors
it refitted on its trials (estimate_factors.json), the rows on its GPU class are estimated with them instead,
TTFT and TPOT included, and not scaled by the ratio.

On vLLM's CPU build (device: cpu) the same model runs with the cores' rates of the host the CPU factors
were fitted on (estimate/calibrate_cpu.py RECORDED_HOST), as a study's trials and its dry run estimate
them: on another host its error is not known until a study refits the factors on its own trials.
"""

#: What the CPU build's expected error is: its factors hold on the host whose surfaces they were fitted on.
CPU_ERROR = (
    "not known on this host: the CPU factors were fitted on one recording host's study surfaces (bench/README.md, "
    "the CPU stand-in), with that host's rates; a study refits them on its own trials"
)

CPU_HOST = "vLLM's CPU build (the recording host's rates)"

#: How an open-loop level's TTFT counts the wait for a slot: the line above the table and the JSON's ``slot_wait``.
SLOT_WAIT = (
    "each rate level's TTFT holds the wait for a slot of a level of the requests it will measure (n=, "
    "load.requests_per_level or its rate over load.seconds_per_level, less the warm-up) sent into an empty queue, "
    "as a study estimates the level it measures; near capacity that is less than the long run's wait"
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="predict each configuration's latency and throughput at each load level, before measuring",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("space", type=Path, metavar="SPACE.yaml", help="the search space (search_spaces/*.yaml)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--study",
        type=Path,
        metavar="DIR",
        help="a study directory (servetune-results/<study>) whose measured trials calibrate the estimate first",
    )
    p.add_argument(
        "--kernels",
        type=Path,
        metavar="CSV",
        help="one GPU's kernel timings (the CSV of calibration/gpu_kernels.py): the rows on its GPU class take their "
        "decode bandwidth and prefill FLOP/s fractions from it",
    )
    p.add_argument(
        "--kernels-gpu",
        metavar="GPU",
        help="the catalogue GPU the --kernels CSV was measured on (default: the space's GPU type, where it has one)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    cpu = space.device == "cpu"
    if not cpu and not space.gpu_types():
        raise UserError(
            f"{args.space}: hardware.gpu: the estimate covers catalogue GPUs (gpu: NAME) and vLLM's CPU build "
            "(device: cpu)"
        )
    workload = space.resolved_workload(args.space.parent)
    levels = resolve_levels(space, workload)
    input_tokens, output_tokens = mean_lengths(workload)
    burstiness = arrival_burstiness(workload)
    # an open loop's level waits for a slot over the requests it will measure, sent into an empty queue
    sized = [LevelPlan.sized(lv, space.load.requests_per_level, space.load.seconds_per_level,
                             space.load.warmup_requests) for lv in levels]  # fmt: skip
    level_requests = {plan.level: plan.open_loop_requests for plan in sized}
    if cpu:
        hardware_of = {"cpu": resolve_hardware("cpu")}
    else:
        hardware_of = {g: resolve_hardware("gpu", g, space.hardware.gpu_memory_gib) for g in space.gpu_types()}
    prices = {key: space.pricing.resolve(None if cpu else key) for key in hardware_of}  # as a trial is costed
    configs, _ = space.grid()
    factors = load_factors()
    kernels = _kernels(args, [h.name for h in hardware_of.values()], cpu)
    if kernels is not None:  # its class's bandwidth and FLOP/s fractions measured; the overheads stay the shipped
        shipped = factors.for_class(kernels.gpu_class)
        factors = factors.with_class(kernels.gpu_class, kernels.efficiency(shipped))
    cal = _calibration(args.study, args.space, cpu)
    refit = read_refit(args.study) if cal is not None and args.study is not None else None
    refit_factors = None if refit is None else factors.with_class(refit.gpu_class, refit.efficiency)
    slo = space.slo_bounds
    judged = judged_bounds(slo)
    rows: list[dict[str, Any]] = []
    for params in configs:
        engine, env = space.engine_params(params)
        arch = _arch(space.model_for(params))
        key = "cpu" if cpu else str(space.gpu_for(params))
        hardware, price = hardware_of[key], prices[key].usd_per_device_hour  # its own type where types compare
        # the study's own GPU class: estimated with the factors refitted on its trials, which the ratio would re-scale
        by_refit = refit is not None and not cpu and gpu_class(hardware.name) == refit.gpu_class
        row_factors = refit_factors if by_refit and refit_factors is not None else factors
        # a vision-language workload's prompts hold its images' tokens too, encoded by the vision tower first
        image_tokens, flops = workload_images(workload, arch.vision, engine)
        prompt_tokens = input_tokens + image_tokens
        for level in levels:
            load = Load.at_level(level.kind, level.value, prompt_tokens, output_tokens, flops, burstiness,
                                 level_requests[level])  # fmt: skip
            row: dict[str, Any] = {"params": params, "level": {level.kind: level.value}}
            if prompt_tokens > input_tokens:
                row["image_tokens"] = prompt_tokens - input_tokens
            try:
                est = estimate(arch, engine, hardware, load, row_factors, env=env, rates=RECORDED_HOST if cpu else None)
            except UserError as exc:
                row["infeasible"] = str(exc)
            else:
                row["estimate"] = est.model_dump(mode="json")
                row["usd_per_device_hour"] = price
                devices, tokens = space.replica_devices(params), est.output_throughput
                scales = (
                    (1.0, 1.0, 1.0) if cal is None or by_refit else (cal.scale_out, cal.scale_rate, cal.scale_energy)
                )
                if cal is not None:  # the measured point's error, applied as the report's estimated rows apply it
                    tokens = est.output_throughput * scales[0]
                    row["calibrated"] = {"by": "refit" if by_refit else "measured_ratio", "output_throughput": tokens,
                                         "request_throughput": est.request_throughput * scales[1]}  # fmt: skip
                row["cost_per_mtok_usd"] = cost_per_mtok_usd(price, devices, tokens) if tokens > 0 else None
                row.update(_energy(est.output_throughput * scales[2], None if cpu else hardware.name, devices, cal))
                if judged:  # where along the ladder each bound breaks: the first level that lists it
                    row["slo_broken"] = broken_bounds(est, slo)
            rows.append(row)
    # the held-out errors are the GPU fit's; the CPU factors belong to the host they were fitted on
    expected = {} if cpu else {metric: err.median for metric, err in factors.held_out_error.items()}
    if args.json:
        report = {
            "space": str(args.space),
            "gpu": ", ".join(h.name for h in hardware_of.values()),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
            "expected_error": expected,
            **({"expected_error_note": CPU_ERROR} if cpu else {}),
            "factors_fit_date": factors.fit_date,
            "prices": {key: price.describe() for key, price in prices.items()},
            "energy": _energy_line(cpu, cal),
            **({"calibration": _calibration_json(args.study, cal)} if cal is not None else {}),
            **({"refit": _refit_json(args.study, refit)} if refit is not None else {}),
            **({"kernels": _kernels_json(kernels, shipped)} if kernels is not None else {}),
            "slo_judged": [str(b) for b in judged],
            **({"slot_wait": SLOT_WAIT} if any(lv.kind == "rate" for lv in levels) else {}),
            "rows": rows,
        }
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"{space.name}: {len(configs)} configurations x {len(levels)} levels on "
        f"{CPU_HOST if cpu else ', '.join(h.name for h in hardware_of.values())}, "
        f"requests of {input_tokens} in / {output_tokens} out tokens (the workload's means)"
    )
    if cpu:
        print(f"expected error: {CPU_ERROR}")
    else:
        print(
            "expected error (median on held-out public measurements, fit of "
            f"{factors.fit_date}): " + ", ".join(f"{metric} ±{100 * value:.0f}%" for metric, value in expected.items())
        )
    print("prices: " + "; ".join(price.describe() for price in prices.values()))
    if cal is not None:
        scaled = "" if refit is None else f" except on {refit.gpu_class} GPUs"
        print(f"calibrated on {args.study}: {cal.note}; output tok/s, req/s and $/Mtok below are scaled by it{scaled}")
    if refit is not None:
        print(f"refit: {refit.gpu_class} GPUs' rows use the factors the study refitted on its trials "
              f"({args.study / REFIT_FILE}: {refit.points} measured values of {len(refit.trials)} trials), "
              "TTFT and TPOT included, and are not scaled by the ratio")  # fmt: skip
    if kernels is not None:
        print(_kernels_line(kernels, shipped))
    print(f"energy: {_energy_line(cpu, cal)}")
    if any(lv.kind == "rate" for lv in levels):
        print(f"open loop: {SLOT_WAIT}")
    if judged:
        print(
            "SLO judged by the estimated means (a mean over a bound breaks it; within it, the tail may not be): "
            + ", ".join(map(str, judged))
        )
    print(_table(rows, slo_column=bool(judged)))
    return 0


def _calibration(study: Path | None, space: Path, cpu: bool) -> Calibration | None:
    """The report's calibration of the estimate on ``study``'s measured trials (report/gpus.py), or None."""
    if study is None:
        return None
    from servetune.report import build_report, load_study

    if cpu:
        raise UserError(
            f"--study {study}: the calibration is on a GPU study's measurements; {space} is on the CPU build"
        )
    section = build_report(load_study(study)).which_gpu
    if section is None:
        raise UserError(f"--study {study}: no trial there ran on a GPU type to calibrate the estimate on")
    if section.calibration is None:
        why = section.why if section.choice is None else f"{section.choice}'s best point could not be estimated"
        raise UserError(f"--study {study}: nothing to calibrate the estimate on: {why}")
    return section.calibration


def _kernels(args: argparse.Namespace, gpus: list[str], cpu: bool) -> KernelFactors | None:
    """The fractions ``--kernels``' timings reached on ``--kernels-gpu`` (default: the space's one GPU type)."""
    if args.kernels is None:
        if args.kernels_gpu is not None:
            raise UserError(f"--kernels-gpu {args.kernels_gpu}: give the --kernels CSV measured on it")
        return None
    if cpu:
        raise UserError(f"--kernels {args.kernels}: kernel timings are a GPU's; {args.space} is on the CPU build")
    name = args.kernels_gpu
    if name is None and len(gpus) != 1:
        raise UserError(
            f"--kernels {args.kernels}: {args.space} compares {', '.join(gpus)}: name the GPU the kernels ran on "
            "with --kernels-gpu"
        )
    try:
        gpu = find_gpu(name).name if name is not None else gpus[0]
    except UserError:
        raise UserError(f"--kernels-gpu {name}: not a catalogue GPU (capacity/catalog/gpus.yaml)") from None
    kernels = gpu_kernel_factors(args.kernels, gpu)
    if kernels.gpu_class not in {gpu_class(g) for g in gpus}:
        raise UserError(
            f"--kernels-gpu {name}: no GPU type of {args.space} ({', '.join(gpus)}) is an {kernels.gpu_class}"
        )
    return kernels


def _kernels_line(kernels: KernelFactors, shipped: Efficiency) -> str:
    copy = "" if kernels.hbm_copy is None else f"; a copy reached {kernels.hbm_copy:.0%} of its HBM bandwidth"
    return (
        f"kernels: {kernels.gpu_class} GPUs' rows use the fractions {kernels.file}'s kernels reached on {kernels.gpu}: "
        f"decode {kernels.decode_bandwidth:.0%} of its HBM bandwidth ({kernels.decode_rows} memory-bound rows), "
        f"prefill {kernels.prefill_flops:.0%} of its bf16 peak ({kernels.prefill_rows} compute-bound rows){copy}; "
        f"the shipped factors had {shipped.decode_bandwidth:.0%} and {shipped.prefill_flops:.0%}. Kernels leave out "
        "a serving step's overheads (the shipped ones stay): expect the rows to be optimistic, and the expected "
        "error above is the shipped fit's"
    )


def _kernels_json(kernels: KernelFactors, shipped: Efficiency) -> dict[str, Any]:
    return {**kernels.model_dump(mode="json"), "shipped": {"decode_bandwidth": shipped.decode_bandwidth,
                                                           "prefill_flops": shipped.prefill_flops}}  # fmt: skip


def _refit_json(study: Path, refit: Refit) -> dict[str, Any]:
    return {"file": str(study / REFIT_FILE), "gpu_class": refit.gpu_class, "points": refit.points,
            "trials": refit.trials, "efficiency": refit.efficiency.model_dump(mode="json")}  # fmt: skip


def _calibration_json(study: Path, cal: Calibration) -> dict[str, Any]:
    return {
        "study": str(study),
        "trial": cal.trial_id,
        "gpu": cal.gpu,
        "model": cal.arch.name,
        "measured_output_throughput": cal.measured_output_throughput,
        "estimated_output_throughput": cal.estimated_output_throughput,
        "scale_output_throughput": cal.scale_out,
        "scale_request_throughput": cal.scale_rate,
        "power_share": cal.power_share,
        "note": cal.note,
    }


def _energy(tokens: float, gpu: str | None, devices: int, cal: Calibration | None) -> dict[str, Any]:
    """A row's ``joules_per_token`` and its basis: the measured GPU's share of its power limit on this GPU's limit
    (``measured_power_share``, an estimate), else this GPU's limit (``board_power_limit``, an upper bound); or
    ``energy_note``, why there is none. ``tokens``: its output tok/s over the whole level, as energy is counted."""
    limit = None if gpu is None else tdp_w(gpu)
    if limit is None:
        return {"energy_note": "no board power limit to draw on" + ("" if gpu is None else f" (no tdp_w for {gpu})")}
    if tokens <= 0:
        return {"energy_note": "no output tokens estimated"}
    measured = cal is not None and cal.power_share is not None
    share = cal.power_share if cal is not None and cal.power_share is not None else 1.0
    return {
        "joules_per_token": share * limit * devices / tokens,
        "joules_per_token_basis": "measured_power_share" if measured else "board_power_limit",
    }


def _energy_line(cpu: bool, cal: Calibration | None) -> str:
    """What the rows' J/token are: the energy: line above the table and the JSON's ``energy``."""
    if cpu:
        return ("not estimated on the CPU build (no board power limit to draw on); a study on a host with RAPL "
                "measures it")  # fmt: skip
    if cal is not None and cal.power_share is not None:
        error = f" ±{cal.expected_error:.0%}" if cal.expected_error is not None else ""
        return (f"J/token estimated{error} (the output throughput's expected error) at {cal.gpu}'s measured share "
                f"of its board power limit, {cal.power_share:.0%}, of each GPU's limit (tdp_w)")  # fmt: skip
    why = "" if cal is None else f"; the study measured no GPU energy on {cal.gpu} to draw a share from"
    return (f"J/token at each GPU's board power limit (tdp_w), marked <=: an upper bound, as a GPU draws at most "
            f"that{why}")  # fmt: skip


def _arch(model: str) -> ModelArch:
    """The model's architecture; ``tiny`` is servetune's test model, which a study builds (models/tiny.py)."""
    return arch_from_hf_config(TINY_CONFIG, name="tiny") if model == "tiny" else load_model_arch(model)


SHORT = {
    "tensor_parallel_size": "tp",
    "data_parallel_size": "dp",
    "pipeline_parallel_size": "pp",
    "max_model_len": "len",
    "gpu_memory_utilization": "util",
    "max_num_seqs": "seqs",
    "max_num_batched_tokens": "batched",
    "quantization": "quant",
    "kv_cache_dtype": "kv",
}


def _params_text(params: dict[str, Any]) -> str:
    """``tp=1 len=8192 ... model=Llama-3.1-8B-Instruct``: the table's short form (JSON keeps the full names)."""
    parts = []
    for name, value in params.items():
        shown = str(value).rsplit("/", 1)[-1] if name == "model" else value
        parts.append(f"{SHORT.get(name, name)}={shown}")
    return " ".join(parts)


def _slo_cell(row: dict[str, Any]) -> str:
    """``met``, or ``breaks ttft_ms_p95, ttft_ms_p99``: the bounds the row's estimate breaks, by name."""
    broken = row.get("slo_broken", [])
    return "breaks " + ", ".join(text.split(" ", 1)[0] for text in broken) if broken else "met"


def _row_cells(row: dict[str, Any], slo_column: bool = False) -> list[str]:
    ((kind, value),) = row["level"].items()
    level = f"{'c' if kind == 'concurrency' else 'r'}={value:g}"
    requests = row.get("estimate", {}).get("level_requests")
    if requests is not None:  # the open loop's level: the requests it waits for a slot over
        level += f" n={requests}"
    if "infeasible" in row:
        return [_params_text(row["params"]), level, row["infeasible"], "", "", "", "", "", "", ""] + [""] * slo_column
    est = Estimate(**row["estimate"])
    tokens, requests = est.output_throughput, est.request_throughput
    if "calibrated" in row:
        tokens, requests = row["calibrated"]["output_throughput"], row["calibrated"]["request_throughput"]
    return [
        _params_text(row["params"]),
        level,
        "-" if est.ttft_ms is None else f"{est.ttft_ms:,.0f}",
        f"{est.tpot_ms:.1f}",
        f"{tokens:,.0f}",
        f"{requests:.2f}",
        "-" if row["cost_per_mtok_usd"] is None else f"{row['cost_per_mtok_usd']:.2f}",
        _joules_cell(row),
        "yes" if est.saturated else "",
        str(est.knee),
    ] + [_slo_cell(row)] * slo_column


def _joules_cell(row: dict[str, Any]) -> str:
    """``0.31`` (an estimate from a measured share), ``<=0.52`` (the board power limit's bound) or ``-``."""
    joules = row.get("joules_per_token")
    if joules is None:
        return "-"
    return f"{'<=' if row['joules_per_token_basis'] == 'board_power_limit' else ''}{joules:.3g}"


def _table(rows: list[dict[str, Any]], slo_column: bool = False) -> str:
    """One line per row; with ``slo_column``, a last column naming the SLO bounds the row's estimate breaks."""
    header = ["configuration", "level", "ttft_ms", "tpot_ms", "output tok/s", "req/s", "$/Mtok", "J/token", "saturated",
              "knee"]  # fmt: skip
    header += ["SLO"] * slo_column
    cells = [_row_cells(r, slo_column) for r in rows]
    feasible = [header, *(c for r, c in zip(rows, cells, strict=True) if "infeasible" not in r)]
    widths = [max(len(c[i]) for c in [header, *cells] if i < 2 or c in feasible) for i in range(len(header))]
    lines = []
    for row, r in zip([{}, *rows], [header, *cells], strict=True):
        first = f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}"
        if "infeasible" in row:  # its reason runs to the end of the line
            lines.append(f"{first}  {r[2]}")
            continue
        numbers = r[2:10]  # right-aligned; the SLO's words after them
        line = "  ".join([first] + [f"{c:>{w}}" for c, w in zip(numbers, widths[2:10], strict=True)])
        lines.append(f"{line}  {r[10]}" if slo_column else line)
    return "\n".join(lines)
