"""Many small or one big (checklist section 11): layouts of one device budget compared at one load.

A layout is REPLICAS x TP: ``2x1`` is two replicas of one device each, ``1x2`` one replica with
tensor parallelism over two. Every layout of a comparison uses the same devices (the budget, with
the picked point's pipeline and prefill-context parallelism kept: replicas x TP x PP x PCP, each replica
``config.space.engine_ranks`` of its engine arguments), so each costs the same per hour
and they differ in what they deliver: the cost per 1M output tokens. Every layout is offered the
same load: the picked point's level scaled from the devices it was measured on (``config.space.engine_devices``
of its engine arguments) to the budget (:func:`budget_level`: concurrency 8 on one device becomes 16 on two).

Layouts that cannot be deployed are refused before anything is (:func:`check_layouts`): a TP the
model's heads do not split into (capacity/settings.py's ``structural_problem``, as vLLM refuses it),
a layout off the budget. ``--budget D`` enumerates every replicas x TP that fills D with TP a power
of two (:func:`budget_layouts`) and leaves out, saying why, those the model does not fit.

The verdict (:func:`layout_verdict`) names the layout that meets the SLO at the lowest cost per
1M output tokens. A cheaper layout wins only beyond the noise margin (``results.noise_margin`` of
the levels compared); within it the simpler layout wins (:func:`simpler_key`: fewer replicas, then
less TP) and the verdict says the difference is inside the noise.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from servetune.capacity.arch import load_model_arch
from servetune.capacity.settings import resolve_quant, structural_problem
from servetune.config.space import engine_ranks
from servetune.errors import UserError
from servetune.load.runner import Level
from servetune.report.export import CPU_BIND, with_tp
from servetune.report.points import ReportPoint
from servetune.results import RECORD, ClaimedCores, LevelResult, noise_margin
from servetune.serve.plan import CLAIM_CORES_ENV


@dataclass(frozen=True)
class Layout:
    replicas: int
    tp: int

    def __str__(self) -> str:
        return f"{self.replicas}x{self.tp}"

    def devices(self, beside_tp: int = 1) -> int:
        """Devices of the layout where each TP group is repeated ``beside_tp`` times (PP x PCP: :func:`beside_tp`)."""
        return self.replicas * self.tp * beside_tp


def parse_layouts(text: str) -> list[Layout]:
    """``2x1,1x2`` -> [Layout(2, 1), Layout(1, 2)] in the order given, without repeats."""
    layouts: list[Layout] = []
    for part in (p.strip() for p in text.split(",")):
        match = re.fullmatch(r"(\d+)\s*[x\N{MULTIPLICATION SIGN}X]\s*(\d+)", part)
        if match is None or int(match[1]) < 1 or int(match[2]) < 1:
            raise UserError(f"--layouts '{text}': give layouts as REPLICASxTP of 1 or more, e.g. 2x1,1x2")
        layout = Layout(int(match[1]), int(match[2]))
        if layout not in layouts:
            layouts.append(layout)
    return layouts


def point_pp(point: ReportPoint) -> int:
    return int(point.engine_args.get("pipeline_parallel_size") or 1)


def beside_tp(point: ReportPoint) -> int:
    """The ranks of the picked point's engine per TP rank, which every layout keeps: PP x PCP (its
    ``config.space.engine_ranks`` with TP 1)."""
    return engine_ranks({**point.engine_args, "tensor_parallel_size": 1})


def beside_tp_label(point: ReportPoint) -> str:
    """What :func:`beside_tp` is made of, as the refusals name it: ``PP 2``, ``PP 2 x PCP 2``."""
    pcp = int(point.engine_args.get("prefill_context_parallel_size") or 1)
    return f"PP {point_pp(point)}" + (f" x PCP {pcp}" if pcp > 1 else "")


def budget_layouts(budget: int, beside: int = 1) -> list[Layout]:
    """Every replicas x TP x ``beside`` (PP x PCP, :func:`beside_tp`) = ``budget`` with TP a power of two, most
    replicas first."""
    if budget < 1:
        raise UserError(f"--budget {budget}: a device budget is 1 or more")
    if budget % beside:
        raise UserError(f"--budget {budget}: the picked point's pipeline_parallel_size x prefill_context_parallel_size "
                        f"{beside} does not divide it")  # fmt: skip
    per_tp = budget // beside
    return [Layout(per_tp // tp, tp) for tp in (2**k for k in range(per_tp.bit_length())) if per_tp % tp == 0]


def check_layouts(
    layouts: Sequence[Layout], beside: int, fits: Any, budget: int | None = None
) -> tuple[list[Layout], list[str]]:  # fmt: skip
    """The layouts to deploy and, for ``--budget`` (``budget`` given, layouts enumerated), the ones the
    model does not fit, each with why. ``beside``: PP x PCP (:func:`beside_tp`). ``fits(tp)`` is None when the model splits into ``tp`` ranks,
    else why not. Given layouts (``budget`` None) that use different devices, or one the model does
    not fit, are refused: one line, before anything is deployed."""
    skipped: list[str] = []
    kept: list[Layout] = []
    for layout in layouts:
        problem = fits(layout.tp)
        if problem is None:
            kept.append(layout)
        elif budget is None:
            raise UserError(f"--layouts {layout}: {problem}: nothing was deployed")
        else:
            skipped.append(f"{layout}: {problem}")
    if budget is None:
        used = {layout.devices(beside) for layout in kept}
        if len(used) > 1:
            each = ", ".join(f"{layout} uses {layout.devices(beside)}" for layout in kept)
            raise UserError(f"--layouts: layouts compared under one device budget use the same devices ({each}"
                            f"{', with PP x PCP ' + str(beside) if beside > 1 else ''}): nothing was deployed")  # fmt: skip
    if len(kept) < 2:
        what = f"--budget {budget}" if budget is not None else "--layouts"
        left = ", ".join(str(k) for k in kept) or "none"
        raise UserError(f"{what}: a comparison needs 2 or more layouts the model fits, got {left}"
                        + (f" ({'; '.join(skipped)})" if skipped else "") + ": nothing was deployed")  # fmt: skip
    return kept, skipped


def layout_point(point: ReportPoint, layout: Layout, cores: Sequence[int] = ()) -> ReportPoint:
    """The picked point with the layout's TP in place of its own (``report.export.with_tp``: on the CPU
    build, ranks bound to distinct cores of ``cores``), deployed at the layout's replicas
    (``plan.llm_config(point, layout.replicas)``). A layout of the point's own TP leaves its engine
    arguments and environment as they are, so it deploys the very configuration the replica counts and
    the routers deploy (the same engines, when Serve has them running). Every replica of a deployment
    gets the same binding: Serve gives them one environment. In a local Ray servetune started, each replica
    claims cores of its own instead (``serve.cores``), so the binding is left out."""
    laid = with_tp(point, layout.tp, cores)
    if laid is not point and laid.device == "cpu" and os.environ.get(CLAIM_CORES_ENV):
        laid = dataclasses.replace(laid, env={k: v for k, v in laid.env.items() if k != CPU_BIND})
    return dataclasses.replace(laid, devices=layout.replicas * engine_ranks(laid.engine_args))


def model_fits(point: ReportPoint) -> tuple[Callable[[int], str | None], str | None]:
    """``fits(tp)``: why vLLM would refuse the picked model split into ``tp`` ranks (heads that do not
    divide, as the capacity ledger checks them), None when it would not; and a note when the model's
    architecture is unknown here (neither a local directory nor in the catalogue): then every TP passes
    and a bad one fails at its deployment, with vLLM's own message."""
    try:
        arch = load_model_arch(point.model)
        quant = resolve_quant(arch, point.engine_args.get("quantization"))
    except UserError as exc:
        return (lambda tp: None), (f"{point.model}: not sized here ({exc}), so its heads are not "
                                   "known: TP is not checked before deploying")  # fmt: skip
    pp = point_pp(point)
    return (lambda tp: structural_problem(arch, tp, pp, quant)), None


def budget_level(level: Level, point_devices: int, budget: int) -> Level:
    """The picked level scaled from the devices it was measured on to the budget: the load every
    layout is offered (concurrency rounded to a whole client, at least one)."""
    value = level.value * budget / max(point_devices, 1)
    if level.kind == "concurrency":
        value = float(max(1, round(value)))
    return dataclasses.replace(level, value=value)


class LayoutRun(ClaimedCores, BaseModel):
    """One layout at the budget's load, as measured through Serve's ingress."""

    model_config = RECORD

    layout: str  # REPLICASxTP
    replicas: int
    tensor_parallel_size: int
    devices: int
    ready_s: float | None = None
    engines_reused: bool | None = None  # True: Serve kept the engines of the deployment before (same engine config)
    level: LevelResult | None = None  # None: the layout's deployment failed (``error`` says how)
    error: str | None = None
    requests_per_replica: dict[str, int] = {}
    cost_per_hour_usd: float | None = None  # devices x the price per device-hour the picked trial was costed at
    # the price x device_hours_per_mtok (layout_run); None without a price or without output
    cost_per_mtok_usd: float | None = None

    @property
    def meets_slo(self) -> bool:
        return self.level is not None and self.level.meets_slo and not self.level.summary.failed

    @property
    def device_hours_per_mtok(self) -> float | None:
        """Device-hours per 1M output tokens: the cost without a price (the verdict ranks by it)."""
        throughput = self.level.summary.steady_output_throughput if self.level is not None else 0.0
        return self.devices / (throughput * 3600.0) * 1e6 if throughput > 0 else None


def layout_run(
    layout: Layout, beside: int, level: LevelResult | None, price_per_device_hour: float | None, **measured: Any
) -> LayoutRun:  # fmt: skip
    """One layout's record (``beside``: PP x PCP, :func:`beside_tp`); ``level`` None for a layout whose deployment
    failed (``error=`` says how)."""
    devices = layout.devices(beside)
    price = price_per_device_hour if price_per_device_hour is not None and price_per_device_hour > 0 else None
    run = LayoutRun(
        layout=str(layout), replicas=layout.replicas, tensor_parallel_size=layout.tp, devices=devices, level=level,
        cost_per_hour_usd=devices * price if price is not None else None, **measured,
    )  # fmt: skip
    hours = run.device_hours_per_mtok
    if price is not None and hours is not None:  # the price of what the verdict ranks by: one formula, never two
        run.cost_per_mtok_usd = price * hours
    return run


class LayoutVerdict(BaseModel):
    model_config = RECORD

    ship: str | None  # the layout to ship (REPLICASxTP), None when none met the SLO
    reason: str
    within_noise: bool = False  # the cheapest and the shipped one differ by less than the noise margin
    margin: float | None = None  # the noise margin the costs were compared with (a share)


class LayoutResult(BaseModel):
    """``serve-check --layouts|--budget``: every layout at one offered load, and the verdict."""

    model_config = RECORD

    budget: int  # devices each layout uses
    device: str  # GPU, or CPU (the CPU build's ranks are cores)
    level: dict[str, float]  # the offered load, the same for every layout
    price_per_device_hour: float | None = None
    skipped: list[str] = []  # --budget: layouts the model does not fit, with why
    runs: list[LayoutRun] = []
    verdict: LayoutVerdict | None = None


def simpler_key(run: LayoutRun) -> tuple[int, int]:
    """What makes a layout simpler: fewer replicas (fewer engines to start, route between and keep
    warm), then less tensor parallelism (fewer ranks to keep in step)."""
    return (run.replicas, run.tensor_parallel_size)


def layout_verdict(runs: Sequence[LayoutRun]) -> LayoutVerdict | None:
    """The layout that meets the SLO (no request failed) at the lowest cost per 1M output tokens.

    Costs are compared with the noise margin of the levels measured (the largest ``noise_margin``):
    every layout within it of the cheapest counts as as cheap, and of those the simpler one is shipped
    (:func:`simpler_key`), the verdict saying the difference is inside the noise.
    """
    if len(runs) < 2:
        return None
    margin = max([noise_margin(run.level) for run in runs if run.level is not None], default=None)
    ok = [run for run in runs if run.meets_slo and run.device_hours_per_mtok is not None]
    broken = [run.layout for run in runs if run not in ok and run.level is not None]
    failed = [run.layout for run in runs if run.level is None]
    broke = f"; {', '.join(broken)} broke the SLO" if broken else ""
    broke += f"; {', '.join(failed)} failed to deploy" if failed else ""
    if not ok:
        return LayoutVerdict(ship=None, reason=f"no layout met the SLO at this load{broke}", margin=margin)
    assert margin is not None  # a layout that met the SLO has a level
    cheapest = min(ok, key=_hours)
    best = _hours(cheapest)
    tied = [run for run in ok if _hours(run) <= best * (1 + margin)]
    ship = min(tied, key=simpler_key)
    if len(ok) == 1:
        return LayoutVerdict(
            ship=ship.layout, reason=f"{ship.layout} is the only layout that met the SLO{broke}", margin=margin
        )
    if len(tied) > 1:
        names = " and ".join(run.layout for run in sorted(tied, key=simpler_key))
        return LayoutVerdict(
            ship=ship.layout, within_noise=True, margin=margin,
            reason=f"{names} cost within the noise margin ({margin:.0%}): {_costs(tied)}; "
                   f"{ship.layout} is the simpler layout (fewer replicas, then less TP){broke}",
        )  # fmt: skip
    runner_up = min((run for run in ok if run is not cheapest), key=_hours)
    return LayoutVerdict(
        ship=ship.layout, margin=margin,
        reason=f"{ship.layout} meets the SLO at the lowest cost, beyond the noise margin ({margin:.0%}): "
               f"{_costs([ship, runner_up])}{broke}",
    )  # fmt: skip


def _hours(run: LayoutRun) -> float:
    """Device-hours per 1M output tokens of a layout the verdict ranks (every one has them)."""
    hours = run.device_hours_per_mtok
    assert hours is not None
    return hours


def _costs(runs: Sequence[LayoutRun]) -> str:
    def one(run: LayoutRun) -> str:
        if run.cost_per_mtok_usd is not None:
            return f"{run.layout} ${run.cost_per_mtok_usd:,.2f}"
        return f"{run.layout} {run.device_hours_per_mtok:,.2f} device-hours"

    return ", ".join(one(run) for run in runs) + " per 1M output tokens"
