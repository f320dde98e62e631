"""Which GPU: for each GPU type a study measured, its best configuration and what serving on it costs; for
catalogue GPUs it did not measure, the estimate's answer, marked with its expected error.

The rule, stated once:

- A trial's GPU type is its ``gpu`` parameter (``params: {gpu: [...]}``), else the type it was priced as.
- A type's best configuration is what the study's recommendation rule (report/recommend.py) picks among that
  type's points alone. Its capacity is the highest load that met the SLO on that trial (its capacity search's,
  else its best eligible level), and its request rate, cost per million output tokens and energy per token are
  measured there.
- ``--target-rps``: replicas = ceil(target / the capacity point's request rate); a replica takes the trial's
  devices, so the fleet costs replicas x devices x the type's price per hour.
- The recommended type is the measured type whose fleet costs least for the target, or, without a target, the
  lowest cost per million tokens. Estimated rows are never recommended: the sentence says where one looks
  cheaper and is worth measuring.
- Estimated rows (GPU studies only): the recommended type's best configuration at its capacity load, estimated
  on each catalogue GPU with a listed price (estimate/), scaled by measured / estimated throughput on the
  measured type (the calibration; measured at the steady rate its cost is priced at), with the estimate's held-out median error on output throughput. The load is
  the measured level's (Load.measured), and where the study's workload sends images each estimate, the measured
  type's included, encodes them in the vision tower as every estimate of the workload does (estimate/encoder.py
  ``workload_images``): the rows say so, with the tower's time a request on each GPU, or say why it is left out.
- Estimated energy per token: the measured type's power draw at that point (its measured J/token x output
  tokens/s, per device) as a share of its board power limit (the catalogue's ``tdp_w``), drawn at the same share of
  each estimated GPU's limit over that GPU's estimated output tokens/s. None where the measured point has no energy
  (no NVML counter) or either GPU no ``tdp_w``; the note says which.

Pure: no I/O beyond the catalogues (the study's workload comes read: report/study.py); the renderers draw
:class:`WhichGpu`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from servetune.capacity.prices import Price, load_price_table
from servetune.config.space import GPU_PARAM
from servetune.errors import UserError
from servetune.metrics import COST_METRIC, ENERGY_PER_TOKEN, OUTPUT_THROUGHPUT, REQUEST_THROUGHPUT
from servetune.report.params import config_label, tuned
from servetune.report.points import ReportPoint, TrialOutline
from servetune.report.recommend import recommend
from servetune.results import TrialResult
from servetune.results.files import REFIT_FILE

if TYPE_CHECKING:
    from servetune.capacity import ModelArch
    from servetune.config.workload import Workload
    from servetune.estimate import Factors, Load
    from servetune.estimate.refit import Refit


@dataclass(frozen=True)
class GpuRow:
    """One GPU type: measured (its best trial) or estimated (``expected_error`` set)."""

    gpu: str
    configuration: str
    devices: int  # per replica
    usd_per_device_hour: float | None
    capacity: str = ""  # the load at the SLO, in the level's words ("concurrency 12", "4 req/s")
    request_rate: float | None = None  # req/s a replica serves there
    cost_per_mtok: float | None = None
    joules_per_token: float | None = None
    replicas: int | None = None  # for --target-rps
    fleet_usd_per_hour: float | None = None
    trial_id: str | None = None  # None: estimated
    expected_error: float | None = None  # estimated rows: the estimate's median relative error
    note: str = ""  # why an estimated row has no numbers (does not fit), or how it was calibrated
    level_index: int | None = None  # measured rows: the trial's level at its capacity
    price_source: str = ""  # estimated rows: the shipped price used, with its source and date (Price.describe)
    encoder_ms: float | None = None  # estimated rows of an image workload: the vision tower's time a request there

    @property
    def estimated(self) -> bool:
        return self.trial_id is None


@dataclass(frozen=True)
class WhichGpu:
    rows: tuple[GpuRow, ...]
    target_rps: float | None
    choice: str | None
    why: str
    price_list: str = "default"  # the shipped list the estimated rows are priced from (the space's ``price_list``)
    calibration: Calibration | None = None  # what the estimated rows were calibrated with (None: none estimated)


@dataclass(frozen=True)
class _Images:
    """The study's workload, whose images the estimated rows encode, or why it could not be read."""

    workload: Workload | None
    unread: str | None

    def note(self, flops: float, model: str, sent: bool) -> str:
        """What the estimated rows say of the images: encoded (``flops`` a request), or left out and why; '' for a
        text workload. ``sent``: the measured level sent images (so did the workload, read or not)."""
        if flops > 0:
            return (f"each estimate includes the vision tower's time to encode a request's images ({flops / 1e9:,.0f} "
                    "GFLOP a request, as servetune estimate counts it), on the measured GPU too")  # fmt: skip
        if not sent and (self.workload is None or not self.workload.sends_images):
            return ""
        why = (
            f"the study's workload could not be read ({self.unread or 'not given'})" if self.workload is None
            else f"servetune does not model {model}'s vision tower"
        )  # fmt: skip
        return f"the vision tower's time to encode the workload's images is not in these estimates: {why}"


#: A measured type's configuration cell where none of its trials met the SLO.
NONE_MET = "none met the SLO"


def gpu_of(trial: TrialResult) -> str | None:
    """The GPU type a trial ran on: its ``gpu`` parameter, else the type its price names."""
    named = trial.params.get(GPU_PARAM)
    if named is not None:
        return str(named)
    return trial.price.gpu if trial.price is not None else None


def which_gpu(
    trials: Sequence[TrialResult],
    points: Sequence[ReportPoint],
    outlines: Sequence[TrialOutline],
    target_rps: float | None = None,
    price_override: float | None = None,
    estimate_others: bool = True,
    prices: Mapping[str, Price] | None = None,
    price_list: str = "default",
    workload: Workload | None = None,
    workload_unread: str | None = None,
    refit: Refit | None = None,
) -> WhichGpu | None:
    """The section's data, or None where no trial names a GPU type (the CPU stand-in, or older results).
    ``price_override``: ``--price-per-gpu-hour``, which the points' costs were computed with. ``prices``: what the
    estimated rows' GPU types cost, the study's price list (``price_list``) under its own prices; the shipped
    default list where not given. ``workload``: the study's (report/study.py ``read_workload``), whose images the
    estimated rows encode; ``workload_unread``: why it could not be read, said where the levels sent images.
    ``refit``: the factors the study refitted on its trials (estimate_factors.json): the estimated rows of its GPU
    class take them as they are, as ``servetune estimate --study`` does, where the others scale by the measured ratio."""
    by_id = {t.trial_id: t for t in trials}
    types: dict[str, list[str]] = {}
    for trial in trials:
        gpu = gpu_of(trial)
        if gpu is not None and trial.device == "gpu":
            types.setdefault(gpu, []).append(trial.trial_id)
    if not types:
        return None
    rows, cal = [], None
    for gpu, ids in types.items():
        mine = [p for p in points if p.trial_id in ids]
        best = recommend(mine, [o for o in outlines if o.trial_id in ids]).point
        rows.append(_measured_row(gpu, best, mine, by_id, target_rps, price_override))
    measured = [r for r in rows if r.cost_per_mtok is not None]
    choice = min(measured, key=lambda r: _rank(r, target_rps)) if measured else None
    if choice is not None and estimate_others and price_override is None:
        listed = load_price_table() if prices is None else prices
        images = _Images(workload, workload_unread)
        others, cal = _estimated_rows(choice, by_id[str(choice.trial_id)], points, set(types), target_rps, listed,
                                      images, refit)  # fmt: skip
        rows += others
    why = _why(choice, rows, target_rps)
    return WhichGpu(tuple(rows), target_rps, choice.gpu if choice else None, why, price_list, cal)


def _rank(row: GpuRow, target_rps: float | None) -> float:
    if target_rps is not None and row.fleet_usd_per_hour is not None:
        return row.fleet_usd_per_hour
    return row.cost_per_mtok if row.cost_per_mtok is not None else math.inf


def _capacity_point(best: ReportPoint, mine: Sequence[ReportPoint]) -> ReportPoint:
    """The best trial's point at its capacity: the capacity search's when eligible, else its highest eligible load."""
    own = [p for p in mine if p.trial_id == best.trial_id and p.eligible]
    at = [p for p in own if p.at_capacity]
    if at:
        return at[0]
    return max(own, key=lambda p: p.value(REQUEST_THROUGHPUT) or 0.0, default=best)


def _load_text(point: ReportPoint) -> str:
    ((kind, value),) = dict(point.level).items() if len(point.level) == 1 else (("load", 0.0),)
    return f"{kind} {value:g}" if kind == "concurrency" else f"{value:g} req/s" if kind == "rate" else str(kind)


def _replicas(target_rps: float | None, rate: float | None) -> int | None:
    if target_rps is None or not rate:
        return None
    return max(1, math.ceil(target_rps / rate - 1e-9))


def _measured_row(
    gpu: str,
    best: ReportPoint | None,
    mine: Sequence[ReportPoint],
    by_id: Mapping[str, TrialResult],
    target_rps: float | None,
    price_override: float | None = None,
) -> GpuRow:
    if best is None:
        reasons = sorted({p.why_apart for p in mine if p.why_apart}) or ["no trial completed"]
        return GpuRow(gpu, NONE_MET, 0, None, trial_id="-", note=reasons[0])
    at = _capacity_point(best, mine)
    trial = by_id[best.trial_id]
    price = trial.price.usd_per_device_hour if trial.price is not None else trial.price_per_device_hour
    price = price if price_override is None else price_override
    rate = at.value(REQUEST_THROUGHPUT)
    replicas = _replicas(target_rps, rate)
    return GpuRow(
        gpu=gpu, configuration=config_label(best.params), devices=best.devices, usd_per_device_hour=price,
        capacity=_load_text(at), request_rate=rate, cost_per_mtok=at.value(COST_METRIC),
        joules_per_token=at.value(ENERGY_PER_TOKEN), replicas=replicas,
        fleet_usd_per_hour=replicas * best.devices * price if replicas is not None else None, trial_id=best.trial_id,
        level_index=at.level_index,
    )  # fmt: skip


@dataclass(frozen=True)
class Calibration:
    """What the measured type's best point says of the estimate there: the factors that scale every estimate of it
    (output tok/s at the steady rate its cost is priced at, req/s, output tok/s over the whole level as its energy
    is counted), its draw as a share of its board power limit, and the note's words. ``servetune estimate --study``
    calibrates a space's rows with it too."""

    gpu: str  # the measured type's catalogue name
    trial_id: str
    arch: ModelArch
    load: Load
    scale_out: float
    scale_rate: float
    scale_energy: float
    power_share: float | None
    expected_error: float | None  # the estimate's held-out median error on output throughput
    note: str
    measured_output_throughput: float
    estimated_output_throughput: float


def calibration(
    choice: GpuRow, trial: TrialResult, points: Sequence[ReportPoint], images: _Images
) -> Calibration | None:
    """The chosen type's best configuration at its capacity load, estimated there and compared with what was
    measured (see the module's rule); None where the estimate cannot run (an unknown model architecture offline, a
    GPU without its performance specs) or nothing was measured there."""
    from servetune.capacity import load_model_arch, resolve_hardware
    from servetune.capacity.hardware import find_gpu
    from servetune.estimate import Load, estimate, load_factors
    from servetune.estimate.encoder import workload_images

    at = next((p for p in points if p.trial_id == trial.trial_id and p.level_index == choice.level_index), None)
    if at is None or at.level_index >= len(trial.levels):
        return None
    summary = trial.levels[at.level_index].summary
    try:
        arch = load_model_arch(trial.model)
        factors = load_factors()
        measured_name = find_gpu(choice.gpu).name
        # the images' tokens are in the prompts vLLM counted; their encoding is added, as each level's estimate adds it
        _tokens, flops = workload_images(images.workload, arch.vision, trial.engine_args)
        load = Load.measured(summary, flops)
        if load is None:
            return None
        reference = estimate(arch, trial.engine_args, resolve_hardware("gpu", measured_name), load, factors)
    except (UserError, ValueError, KeyError):
        return None
    measured_out, measured_rate = at.value(OUTPUT_THROUGHPUT), at.value(REQUEST_THROUGHPUT)
    if not measured_out or not measured_rate or not reference.output_throughput:
        return None
    # priced as the measured row is: at the level's steady rate (LevelSummary.steady_output_throughput)
    steady = summary.steady_output_throughput or measured_out
    scale_out = steady / reference.output_throughput
    scale_rate = measured_rate / reference.request_throughput if reference.request_throughput else scale_out
    # energy as the measured row's joules a token are: over the whole level's tokens (its output_throughput)
    scale_energy = measured_out / reference.output_throughput
    error = factors.held_out_error.get(OUTPUT_THROUGHPUT)
    power_share, powered = _power_share(at, measured_out, trial.devices, measured_name)
    note = (
        f"{measured_name}'s best configuration at its capacity load, estimated on each GPU (servetune estimate's "
        f"model) and calibrated on {measured_name} (measured / estimated output throughput {scale_out:.2f}); the SLO "
        "is not checked again there: measure a type before choosing it"
    )
    encoded = images.note(flops, arch.name, bool(summary.images_sent))
    note += f"; {encoded}" if encoded else ""
    note += f"; {powered}"
    return Calibration(measured_name, trial.trial_id, arch, load, scale_out, scale_rate, scale_energy, power_share,
                       error.median if error else None, note, steady, reference.output_throughput)  # fmt: skip


def _estimated_rows(
    choice: GpuRow,
    trial: TrialResult,
    points: Sequence[ReportPoint],
    measured: set[str],
    target_rps: float | None,
    prices: Mapping[str, Price],
    images: _Images,
    refit: Refit | None = None,
) -> tuple[list[GpuRow], Calibration | None]:
    """The chosen configuration estimated on each priced catalogue GPU the study did not measure, calibrated on
    the chosen type's measurement (:func:`calibration`), and that calibration; on the GPU class the study refitted
    the factors for (``refit``), estimated with those factors instead of the ratio."""
    from servetune.capacity.hardware import find_gpu
    from servetune.estimate import load_factors
    from servetune.estimate.specs import gpu_class

    cal = calibration(choice, trial, points, images)
    if cal is None:
        return [], None
    factors = load_factors()
    scales = (cal.scale_out, cal.scale_rate, cal.scale_energy)
    refitted = None if refit is None else factors.with_class(refit.gpu_class, refit.efficiency)
    rows = []
    taken = {find_gpu(g).name for g in measured if _known(g)}
    for name, price in prices.items():
        if name in taken or not _known(name):
            continue
        if refit is not None and refitted is not None and gpu_class(name) == refit.gpu_class:
            note = (f"estimated with the factors the study refitted on {refit.points} measured values of "
                    f"{len(refit.trials)} trials ({REFIT_FILE}); the SLO is not checked again there: measure a type "
                    "before choosing it")  # fmt: skip
            rows.append(_estimated_row(name, price, cal.arch, trial, cal.load, refitted, (1.0, 1.0, 1.0), choice,
                                       target_rps, cal.expected_error, note, cal.power_share))  # fmt: skip
            continue
        rows.append(_estimated_row(name, price, cal.arch, trial, cal.load, factors, scales, choice, target_rps,
                                   cal.expected_error, cal.note, cal.power_share))  # fmt: skip
    return [r for r in rows if r is not None], cal


def tdp_w(name: str) -> float | None:
    from servetune.capacity.hardware import find_gpu

    perf = find_gpu(name).perf
    return perf.tdp_w if perf is not None else None


def _power_share(at: ReportPoint, output_tps: float, devices: int, gpu: str) -> tuple[float | None, str]:
    """The measured point's power draw per device as a share of its GPU's board limit, and the note's words."""
    joules, tdp = at.value(ENERGY_PER_TOKEN), tdp_w(gpu)
    if joules is None:
        return None, f"energy not estimated: none measured on {gpu} at that point to scale (no NVML energy counter)"
    if tdp is None:
        return None, f"energy not estimated: the catalogue has no power limit (tdp_w) for {gpu}"
    watts = joules * output_tps / max(devices, 1)
    return watts / tdp, (f"energy estimated from {gpu}'s measured draw there, {watts:.0f} W a GPU ({watts / tdp:.0%} "
                         "of its board power limit), at the same share of each GPU's limit")  # fmt: skip


def _known(name: str) -> bool:
    from servetune.capacity.hardware import find_gpu

    try:
        find_gpu(name)
    except UserError:
        return False
    return True


def _estimated_row(name: str, price: Price, arch: ModelArch, trial: TrialResult, load: Load, factors: Factors,
                   scales: tuple[float, float, float], choice: GpuRow, target_rps: float | None, error: float | None,
                   calibrated: str, power_share: float | None) -> GpuRow | None:  # fmt: skip
    from servetune.capacity import resolve_hardware
    from servetune.estimate import estimate

    configuration = f"{config_label(tuned(trial.params))} ({choice.gpu}'s best)"
    base = GpuRow(name, configuration, trial.devices, price.usd_per_device_hour, f"{choice.capacity} ({choice.gpu}'s)",
                  expected_error=error, price_source=price.describe(name))  # fmt: skip
    try:
        est = estimate(arch, trial.engine_args, resolve_hardware("gpu", name), load, factors)
    except (UserError, ValueError, KeyError) as exc:
        return replace(base, note=f"not estimated: {str(exc).splitlines()[0]}")
    out, rate = est.output_throughput * scales[0], est.request_throughput * scales[1]
    if out <= 0:
        return None
    cost = price.usd_per_device_hour * trial.devices / (out * 3600) * 1e6
    replicas = _replicas(target_rps, rate)
    fleet = replicas * trial.devices * price.usd_per_device_hour if replicas is not None else None
    tdp = tdp_w(name)
    # at the whole level's rate, as the measured row's (energy over every token of the level), not the steady one
    out_all = est.output_throughput * scales[2]
    joules = power_share * tdp * trial.devices / out_all if power_share is not None and tdp is not None else None
    return replace(base, request_rate=rate, cost_per_mtok=cost, replicas=replicas, fleet_usd_per_hour=fleet,
                   note=calibrated, encoder_ms=est.encoder_ms, joules_per_token=joules)  # fmt: skip


def _why(choice: GpuRow | None, rows: Sequence[GpuRow], target_rps: float | None) -> str:
    if choice is None:
        return "no GPU type met the SLO: nothing to recommend"
    measured = [r for r in rows if not r.estimated and r.cost_per_mtok is not None]
    if target_rps is not None and choice.fleet_usd_per_hour is not None:
        why = (f"{choice.gpu}: {choice.replicas} replica(s) of {choice.devices} GPU(s) serve {target_rps:g} req/s for "
               f"${choice.fleet_usd_per_hour:,.2f}/h, the least of the {len(measured)} type(s) measured")  # fmt: skip
    else:
        why = (f"{choice.gpu}: ${choice.cost_per_mtok:.4g} per million output tokens at the SLO, the least of the "
               f"{len(measured)} type(s) measured")  # fmt: skip
    others = [r for r in measured if r is not choice]
    if others:  # each other type on the measure the choice was made by
        why += " (" + ", ".join(f"{r.gpu} {_measure(r, target_rps)}" for r in others) + ")"
    failed = [r.gpu for r in rows if not r.estimated and r.configuration == NONE_MET]
    if failed:
        why += f"; no configuration on {', '.join(failed)} met the SLO"
    cheaper = [r for r in rows if r.estimated and r.cost_per_mtok is not None and _rank(r, target_rps) < _rank(choice, target_rps)]  # fmt: skip
    if cheaper:
        best = min(cheaper, key=lambda r: _rank(r, target_rps))
        error = f" ±{best.expected_error:.0%}" if best.expected_error is not None else ""
        why += (f". The estimate puts {best.gpu} at {_measure(best, target_rps)}{error}: not measured, worth a trial "
                f"(params: {{gpu: [{choice.gpu}, {best.gpu}]}})")  # fmt: skip
    return why


def _measure(row: GpuRow, target_rps: float | None) -> str:
    """A row on the measure types are ranked by (see _rank): its fleet for the target, else its $/Mtok."""
    if target_rps is not None and row.fleet_usd_per_hour is not None:
        return f"{row.replicas} x {row.devices} GPU ${row.fleet_usd_per_hour:,.2f}/h"
    return f"${row.cost_per_mtok:.4g}/Mtok"


GPU_HEADINGS = ("GPU", "source", "best configuration", "capacity at the SLO", "req/s", "$/Mtok", "$/GPU-h", "J/token",
                "replicas", "fleet $/h")  # fmt: skip


def gpu_cells(row: GpuRow) -> list[str]:
    """A row's cells as both renderers draw them (estimated rows say so, with their expected error)."""

    def number(value: float | None, text: str) -> str:
        return "-" if value is None else text.format(value)

    source = (
        f"estimated ±{row.expected_error:.0%}" if row.estimated and row.expected_error is not None
        else "estimated" if row.estimated else f"trial {row.trial_id}"
    )  # fmt: skip
    if row.encoder_ms is not None:  # an image workload: the vision tower's time is in the estimate
        source += f", encoder {row.encoder_ms:.3g} ms a request"
    replicas = "-" if row.replicas is None else f"{row.replicas} x {row.devices} GPU"
    return [row.gpu, source, row.configuration, row.capacity or "-", number(row.request_rate, "{:.3g}"),
            number(row.cost_per_mtok, "{:.4g}"), number(row.usd_per_device_hour, "{:.2f}"),
            number(row.joules_per_token, "{:.3g}"), replicas, number(row.fleet_usd_per_hour, "{:,.2f}")]  # fmt: skip


def gpu_notes(section: WhichGpu) -> list[str]:
    """The sentences under the table: the recommendation, then what each row's note says."""
    lines = [f"Recommended: {section.why}."]
    if section.target_rps is None:
        lines.append("Replicas for a target load: `servetune report STUDY_DIR --target-rps N`.")
    listed = [r.price_source for r in section.rows if r.estimated and r.price_source]
    if listed:  # the measured rows' prices are the report's "prices:" line
        which = "" if section.price_list == "default" else f"{section.price_list} "
        lines.append(f"Estimated rows are priced from the shipped {which}list: {'; '.join(listed)}.")
    notes = sorted({r.note for r in section.rows if r.note})
    lines += [
        f"{'Estimated rows: ' if any(r.estimated and r.note == n for r in section.rows) else ''}{n}." for n in notes
    ]
    return lines
