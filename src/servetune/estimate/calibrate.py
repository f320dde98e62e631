"""Fit the efficiency factors on public vLLM measurements (``data/vllm_public_perf.csv``) and score the fit.

Each usable row of the data set becomes a :class:`CalibrationPoint`: a replica (model, GPU, TP,
weight and KV formats, the engine limits its source states or vLLM's defaults of its version) and
a regime with its measured TTFT / TPOT / output throughput:

- ``offline``: a static batch started together (``benchmark_latency`` / ``benchmark_throughput``);
- ``prefill``: the same with one output token, whose latency is the batch's TTFT;
- ``closed``: C clients (or a burst capped by the engine);
- ``open``: Poisson arrivals at R req/s.

Rows whose lengths are unknown (ShareGPT without an average), whose model has no architecture in
``data/calibration_models.yaml``, or that do not fit in memory are left out and counted, and so
are rows that measured faster than the GPU's peaks allow at the stated lengths (a decode step
shorter than reading the weights and the KV cache at full bandwidth, or a batch finished sooner
than its FLOPs at peak): their lengths, GPU or caching are not what the row says. The split
is deterministic: a row is held out when the SHA-256 of its CSV line is 0 mod 5. The fit minimises
the robust (soft-L1) sum of squared log errors, each residual weighted rows^-1/4 of its source (a
source's pull grows as the square root of its rows: the 600 offline rows of one lab count more than
two blog points, but do not drown them); one set of factors per GPU class, and a pooled
default for classes with too few points.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from servetune.capacity import ModelArch, load_catalog, plan_capacity, resolve_hardware
from servetune.errors import UserError
from servetune.estimate.encoder import encode_s
from servetune.estimate.factors import Efficiency, Factors, MetricError
from servetune.estimate.model import replica_from_plan
from servetune.estimate.queueing import capacity, closed_loop, open_loop, static_batch_s
from servetune.estimate.roofline import Replica
from servetune.estimate.specs import gpu_class

METRICS = ("tpot_ms", "ttft_ms", "output_throughput")
HELD_OUT_MODULUS = 5
MIN_POINTS_PER_CLASS = 30
# decode_bandwidth, prefill_flops, step_overhead_ms, sequence_overhead_ms, allreduce_us
FITTED = ("decode_bandwidth", "prefill_flops", "step_overhead_ms", "sequence_overhead_ms", "allreduce_us")
BOUNDS = ((0.05, 0.05, 0.0, 0.0, 0.0), (1.0, 1.0, 30.0, 2.0, 200.0))


def shipped_data() -> str:
    """The shipped data set's text (a copy of ``../shared/calibration/vllm_public_perf.csv``)."""
    data = resources.files("servetune.estimate").joinpath("data/vllm_public_perf.csv").read_bytes()
    return data.decode("utf-8")


@dataclass
class CalibrationPoint:
    row: int
    source_id: str
    gpu_class: str
    model: str
    replica: Replica
    regime: str
    input_tokens: int
    output_tokens: int
    load: float  # batch or clients (offline, prefill, closed), req/s (open)
    measured: dict[str, float]
    held_out: bool
    saturated: bool = False
    predicted: dict[str, float] = field(default_factory=dict)
    encoder_flops: float = 0.0  # the vision tower's FLOPs a request's images need (a study's own image workload)
    burstiness: float = 1.0  # an open loop's gamma shape (1: Poisson; the public points' open loops are)
    requests: float | None = None  # an open loop's level: its requests per replica (None: the long run)


# --- reading the data set ----------------------------------------------------------------------------


def _gpu_name(text: str) -> str | None:
    s = text.lower()
    if "h200" in s:
        return "H200"
    if "h100" in s:
        return "H100-PCIe" if "pcie" in s else "H100-SXM"
    if "a100" in s:
        return "A100-40GB" if "40gb" in s else "A100-80GB"
    return None


def _tokens(text: str) -> int | None:
    s = text.strip()
    if s.isdigit():
        return int(s)
    if m := re.search(r"(\d+)\s*avg", s):
        return int(m.group(1))
    if m := re.match(r"(\d+)-(\d+)", s):
        return (int(m.group(1)) + int(m.group(2))) // 2
    if m := re.match(r"(?:~|<=)\s*(\d+)", s):
        return int(m.group(1))
    return None


def _number(text: str) -> float | None:
    m = re.match(r"\s*(\d+(?:\.\d+)?)\s*$", text)
    return float(m.group(1)) if m else None


def _version(text: str) -> tuple[int, int]:
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _flag(notes: str, name: str) -> int | None:
    m = re.search(name + r"[= ](\d+)", notes)
    return int(m.group(1)) if m else None


def _load_models() -> list[tuple[list[str], ModelArch]]:
    text = resources.files("servetune.estimate").joinpath("data/calibration_models.yaml").read_text(encoding="utf-8")
    catalog = load_catalog()
    models = []
    for entry in yaml.safe_load(text):
        arch = catalog[entry["catalog"]] if "catalog" in entry else ModelArch(name=entry["match"][0], **entry["arch"])
        models.append((entry["match"], arch))
    return models


def _arch(model: str, models: Sequence[tuple[list[str], ModelArch]]) -> ModelArch | None:
    name = model.lower()
    for match, arch in models:
        if any(m in name for m in match):
            return arch
    return None


def _engine_args(row: dict[str, str], arch: ModelArch, tokens: int) -> dict[str, Any]:
    quant = row["quantization"].lower()
    notes = row["notes"]
    v1 = _version(row["vllm_version"]) >= (0, 8) or not row["vllm_version"]
    chunked = v1 or bool(re.search(r"chunked[- _]prefill(?:=TRUE| on)", notes, re.I))
    default_budget = 8192 if chunked else max(arch.max_position_embeddings, 2048)
    args: dict[str, Any] = {
        "tensor_parallel_size": int(row["tp"]),
        "dtype": "float16" if row["dtype"].startswith("fp16") else "bfloat16",
        "kv_cache_dtype": "fp8" if "kv_fp8" in quant else "auto",
        "max_model_len": min(arch.max_position_embeddings, max(2048, tokens)),
        "gpu_memory_utilization": 0.9,
        "max_num_seqs": _flag(notes, "max-num-seqs") or 256,
        "max_num_batched_tokens": _flag(notes, "max-num-batched-tokens")
        or _flag(notes, "max-batched-tokens")
        or default_budget,
        "enable_chunked_prefill": chunked,
    }
    if quant.startswith(("fp8", "w_fp8")) and arch.quant.method == "none":
        args["quantization"] = "fp8"
    return args


def _regime(row: dict[str, str]) -> tuple[str, float] | None:
    rate = row["request_rate"].lower()
    conc = _number(row["concurrency"])
    if "one wave" in row["notes"] and conc is not None:
        return "wave", conc
    if rate == "offline" and conc is not None:
        return ("prefill" if row["output_tokens"] == "1" else "offline"), conc
    if (rate.startswith("inf") or rate == "closed-loop") and conc is not None:
        return "closed", conc
    if (r := _number(rate)) is not None:
        return "open", r
    return None


def _measured(row: dict[str, str], regime: str) -> dict[str, float]:
    got: dict[str, float] = {}
    for metric, columns in (
        ("tpot_ms", ("tpot_ms_p50", "tpot_ms_mean")),
        ("ttft_ms", ("ttft_ms_p50", "ttft_ms_mean")),
        ("output_throughput", ("output_tok_s",)),
    ):
        for column in columns:
            if (value := _number(row[column])) is not None and value > 0:
                got[metric] = value
                break
    if regime in ("open", "wave"):
        # open loop: TTFT past saturation is queueing that grows with the run's length; one wave
        # (evalscope): its TTFTs of ~0.4 s for up to 100 prompts of 5-10k tokens do not fit any prefill
        got.pop("ttft_ms", None)
    return got


def read_points(text: str) -> tuple[list[CalibrationPoint], Counter[str]]:
    """The usable rows of the data set as calibration points, and why the others were left out."""
    models = _load_models()
    lines = text.splitlines(keepends=True)
    reader = csv.DictReader(io.StringIO(text))
    points: list[CalibrationPoint] = []
    skipped: Counter[str] = Counter()
    plans: dict[tuple[Any, ...], Replica | None] = {}
    for index, row in enumerate(reader):
        line = lines[reader.line_num - 1] if reader.line_num - 1 < len(lines) else str(row)
        gpu = _gpu_name(row["gpu"])
        arch = _arch(row["model"], models)
        i, o = _tokens(row["input_tokens"]), _tokens(row["output_tokens"])
        regime = _regime(row)
        if gpu is None or arch is None:
            skipped["model or GPU not described"] += 1
            continue
        if i is None or o is None or regime is None:
            skipped["lengths or load unknown"] += 1
            continue
        measured = _measured(row, regime[0])
        if not measured:
            skipped["no metric"] += 1
            continue
        args = _engine_args(row, arch, i + o)
        key = (gpu, arch.name, tuple(sorted(args.items())))
        if key not in plans:
            plans[key] = _replica(arch, args, gpu)
        replica = plans[key]
        if replica is None:
            skipped["does not fit in memory"] += 1
            continue
        if _beyond_peaks(replica, regime, i, max(o, 1), measured):
            skipped["faster than the GPU's peaks allow"] += 1
            continue
        digest = int(hashlib.sha256(line.encode("utf-8")).hexdigest(), 16)
        points.append(
            CalibrationPoint(
                row=index,
                source_id=row["source_id"],
                gpu_class=gpu_class(gpu),
                model=row["model"],
                replica=replica,
                regime=regime[0],
                input_tokens=i,
                output_tokens=max(o, 1),
                load=regime[1],
                measured=measured,
                held_out=digest % HELD_OUT_MODULUS == 0,
            )
        )
    return points, skipped


def _replica(arch: ModelArch, args: dict[str, Any], gpu: str) -> Replica | None:
    try:
        plan = plan_capacity(arch, args, resolve_hardware("gpu", gpu))
    except UserError:
        return None
    return replica_from_plan(arch, plan, args) if plan.fits else None


PEAK = Efficiency(
    decode_bandwidth=1.0, prefill_flops=1.0, step_overhead_ms=0.0, sequence_overhead_ms=0.0, allreduce_us=0.0
)


def _beyond_peaks(replica: Replica, regime: tuple[str, float], i: int, o: int, measured: dict[str, float]) -> bool:
    """Whether a row measured a TPOT below, or a throughput above, the roofline at 100 % of every peak."""
    probe = CalibrationPoint(0, "", "", "", replica, regime[0], i, o, regime[1], measured, False)
    bound, _ = predict(probe, PEAK)
    if "tpot_ms" in measured and "tpot_ms" in bound and measured["tpot_ms"] < bound["tpot_ms"]:
        return True
    got, peak = measured.get("output_throughput"), bound.get("output_throughput")
    return got is not None and peak is not None and got > peak


# --- predicting and fitting ----------------------------------------------------------------------------


def predict(point: CalibrationPoint, eff: Efficiency) -> tuple[dict[str, float], bool]:
    """The estimate of one point's measured metrics, and whether the model calls the point saturated."""
    rep, i, o = point.replica, point.input_tokens, point.output_tokens
    if point.regime in ("offline", "prefill", "wave"):
        batch = int(point.load)
        cap = capacity(rep, i, o)
        waves = math.ceil(batch / cap)
        per_wave = min(batch, cap)
        prefill, e2e = static_batch_s(rep, eff, per_wave, i, o)
        if point.regime == "prefill":
            return {"ttft_ms": prefill * 1e3}, False
        if point.regime == "wave":
            tpot = (e2e - prefill) / max(o - 1, 1)
            return {"output_throughput": batch * o / (waves * e2e), "tpot_ms": tpot * 1e3}, batch > cap
        return {"output_throughput": batch * o / (waves * e2e), "ttft_ms": prefill * 1e3}, batch > cap
    encode = encode_s(rep, eff, point.encoder_flops)
    if point.regime == "closed":
        p = closed_loop(rep, eff, point.load, i, max(o, 2), encode)
    else:
        p = open_loop(rep, eff, point.load, i, max(o, 2), encode, 1 / point.burstiness, point.requests)
    got = {"tpot_ms": p.tpot_s * 1e3, "output_throughput": p.request_rate * o}
    if p.ttft_s is not None:
        got["ttft_ms"] = p.ttft_s * 1e3
    return got, p.saturated


SOFT_L1_SCALE = 0.2  # fit_efficiency's robust loss: residuals (log ratios) past about 20% count less than squared


def _residuals(points: Sequence[CalibrationPoint], eff: Efficiency, weights: dict[str, float]) -> np.ndarray:
    out = []
    for point in points:
        predicted, _ = predict(point, eff)
        for metric, measured in point.measured.items():
            if metric in predicted:
                out.append(weights[point.source_id] * math.log(predicted[metric] / measured))
    return np.asarray(out)


def fit_efficiency(
    points: Sequence[CalibrationPoint],
    start: Efficiency | None = None,
    bounds: tuple[tuple[float, ...], tuple[float, ...]] = BOUNDS,
    extra: Sequence[tuple[str, float, float]] = (),
) -> Efficiency:
    """The factors that best predict ``points`` (deterministic: fixed start, no randomness).

    ``extra`` fits more factors than :data:`FITTED`, each ``(name, low, high)``: the CPU fit's
    ``closed_loop_waves``; the others keep ``start``'s value.
    """
    counts = Counter(p.source_id for p in points)
    weights = {source: n**-0.25 for source, n in counts.items()}
    x0 = start or Efficiency()

    base = FITTED if any(p.replica.tp > 1 for p in points) else FITTED[:-1]
    fitted = (*base, *(name for name, _, _ in extra))
    lows = (*bounds[0][: len(base)], *(lo for _, lo, _ in extra))
    highs = (*bounds[1][: len(base)], *(hi for _, _, hi in extra))

    def efficiency(x: np.ndarray) -> Efficiency:
        return x0.model_copy(update={name: round(float(v), 4) for name, v in zip(fitted, x, strict=False)})

    def residuals(x: np.ndarray) -> np.ndarray:
        return _residuals(points, efficiency(x), weights)

    from scipy.optimize import least_squares  # here, not at import: scipy.optimize costs about a second of a core

    result = least_squares(
        residuals,
        np.array([getattr(x0, name) for name in fitted]),
        bounds=(lows, highs),
        loss="soft_l1",
        f_scale=SOFT_L1_SCALE,
        diff_step=1e-3,
    )
    return efficiency(result.x)


def fit(text: str, today: str | None = None) -> tuple[Factors, list[CalibrationPoint], Counter[str]]:
    """Fit on the training rows of ``text`` (the CSV); return the factors and every point, predicted."""
    points, skipped = read_points(text)
    train = [p for p in points if not p.held_out]
    default = fit_efficiency(train)
    per_class = {}
    for cls in sorted({p.gpu_class for p in train}):
        mine = [p for p in train if p.gpu_class == cls]
        if len(mine) >= MIN_POINTS_PER_CLASS:
            per_class[cls] = fit_efficiency(mine, start=default)
    factors = Factors(
        fit_date=today or datetime.now(UTC).date().isoformat(),
        data_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        split=f"held out: SHA-256 of the CSV line = 0 mod {HELD_OUT_MODULUS}",
        default=default,
        per_gpu_class=per_class,
    )
    score(points, factors)
    held = [p for p in points if p.held_out and not p.saturated]
    errors = {m: e for m, e in ((m, error_of(held, m)) for m in METRICS) if e is not None}
    return factors.model_copy(update={"held_out_error": errors}), points, skipped


def score(points: Iterable[CalibrationPoint], factors: Factors) -> None:
    """Fill each point's prediction and saturation with ``factors``."""
    for point in points:
        point.predicted, point.saturated = predict(point, factors.for_class(point.gpu_class))


def error_of(points: Sequence[CalibrationPoint], metric: str) -> MetricError | None:
    errors = [
        abs(p.predicted[metric] / p.measured[metric] - 1)
        for p in points
        if metric in p.measured and metric in p.predicted
    ]
    if not errors:
        return None
    return MetricError(
        median=round(float(np.median(errors)), 4), p90=round(float(np.percentile(errors, 90)), 4), points=len(errors)
    )


def write_factors(factors: Factors, path: Path) -> None:
    path.write_text(factors.model_dump_json(indent=2) + "\n", encoding="utf-8")
