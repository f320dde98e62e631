"""A GPU's own efficiency factors from kernel timings: the CSV of ``calibration/gpu_kernels.py``.

That script (torch only, one GPU, Llama-3.1-8B's shapes in bf16) writes one row per case with the
columns ``kind, m, n, k, ms, tflops, gbps``: the median time of the case in **milliseconds**, and the
**TFLOP/s** and **GB/s** (10^9 bytes a second) it reached. Its kinds:

- ``copy``: a 4 GiB device-to-device copy; ``gbps`` counts read and write (the HBM ceiling);
- ``linear_qkv``, ``linear_o``, ``linear_gate_up``, ``linear_down``, ``linear_lm_head``: ``F.linear`` of ``m``
  tokens through an ``n x k`` weight; ``gbps`` counts the input, the weight and the output once;
- ``attn_decode``: one query token for each of ``m`` sequences against ``n`` tokens of KV (GQA 32/8,
  head_dim ``k``); ``gbps`` counts the K and V read;
- ``attn_prefill_causal``: causal attention over one prompt of ``n`` tokens; ``gbps`` is 0.

The roofline's factors are fractions of the catalogue's peaks (estimate/roofline.py), so a row's bytes
(``gbps`` x time) and FLOPs (``tflops`` x time) are pooled by what bounds it, as a step adds its kernels'
times:

- ``decode_bandwidth`` = bytes / time over the memory-bound rows (``attn_decode``, and ``linear_*`` whose
  FLOPs per byte are at most half the GPU's ridge, peak FLOP/s / HBM bytes/s: a decode batch's weight reads),
  over the catalogue's HBM bandwidth;
- ``prefill_flops`` = FLOPs / time over the compute-bound rows (``attn_prefill_causal``, and ``linear_*`` at
  twice the ridge or more: a prefill chunk's tokens), over the catalogue's bf16 peak.

Rows between the two (near the ridge) and the copy (reported as ``hbm_copy``, the ceiling a decode step
cannot pass) enter neither. Kernels alone leave out what a serving step adds around them (scheduling,
sampling, launches between kernels), which the fit carries in its overheads, so these are the best a
step's kernels do: an optimistic prior, which the shipped overheads complete.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from servetune.capacity import WeightQuant
from servetune.errors import UserError
from servetune.estimate.factors import Efficiency
from servetune.estimate.specs import DeviceRates, device_rates, gpu_class

#: The columns ``gpu_kernels.py`` writes, in its order.
KERNEL_COLUMNS = ("kind", "m", "n", "k", "ms", "tflops", "gbps")
#: A linear row is memory-bound at or below this share of the ridge, compute-bound at or above its inverse.
RIDGE_MARGIN = 0.5
#: Below this share of a peak a row's units are wrong (TB/s for GB/s, seconds for ms), not the GPU slow.
MIN_SHARE = 0.01


@dataclass(frozen=True)
class KernelTiming:
    """One row of the kernel CSV, in its own units (ms, TFLOP/s, GB/s)."""

    kind: str
    m: int
    n: int
    k: int
    ms: float
    tflops: float
    gbps: float

    @property
    def seconds(self) -> float:
        return self.ms / 1e3

    @property
    def flops(self) -> float:
        return self.tflops * 1e12 * self.seconds

    @property
    def bytes(self) -> float:
        return self.gbps * 1e9 * self.seconds


class KernelFactors(BaseModel):
    """What one GPU's kernel timings say its decode and prefill reach, as fractions of its catalogue peaks."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str
    gpu: str = Field(description="the catalogue GPU the kernels ran on, whose peaks the fractions are of")
    gpu_class: str
    decode_bandwidth: float = Field(description="memory-bound rows' bytes / time over the catalogue HBM bandwidth")
    decode_rows: int
    prefill_flops: float = Field(description="compute-bound rows' FLOPs / time over the catalogue bf16 peak")
    prefill_rows: int
    hbm_copy: float | None = Field(description="the copy's read + write GB/s over the catalogue HBM bandwidth")

    def efficiency(self, base: Efficiency) -> Efficiency:
        """``base`` (the class's shipped factors) with its bandwidth and FLOP/s fractions from the kernels."""
        return base.model_copy(update={"decode_bandwidth": self.decode_bandwidth, "prefill_flops": self.prefill_flops})


def read_kernel_csv(path: Path) -> list[KernelTiming]:
    """The rows of a ``gpu_kernels.py`` CSV; a missing column or a value that is not a number is one UserError
    naming the file, the line and the column."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read the kernel CSV: {exc}") from None
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in KERNEL_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(
            f"{path}: column {missing[0]} missing: a kernel CSV has the columns gpu_kernels.py writes, "
            + ",".join(KERNEL_COLUMNS)
        )
    rows = []
    for line, raw in enumerate(reader, start=2):
        values: dict[str, float] = {}
        for column in KERNEL_COLUMNS[1:]:
            cell = raw.get(column)
            try:
                value = float(cell or "")
            except ValueError:
                value = math.nan
            least = 0.0 if column != "ms" else math.ulp(0.0)
            if not math.isfinite(value) or value < least:
                what = "a positive number of milliseconds" if column == "ms" else "a number >= 0"
                raise UserError(f"{path} line {line}: column {column}: {cell!r} is not {what}")
            values[column] = value
        rows.append(
            KernelTiming(
                kind=(raw.get("kind") or "").strip(),
                m=int(values["m"]),
                n=int(values["n"]),
                k=int(values["k"]),
                ms=values["ms"],
                tflops=values["tflops"],
                gbps=values["gbps"],
            )
        )
    return rows


def gpu_kernel_factors(path: Path, gpu: str) -> KernelFactors:
    """:func:`kernel_factors` of catalogue GPU ``gpu`` at its bf16 rates, the kernels' dtype."""
    return kernel_factors(path, device_rates(gpu, WeightQuant()))


def kernel_factors(path: Path, rates: DeviceRates) -> KernelFactors:
    """The decode bandwidth and prefill FLOP/s fractions ``path``'s kernels reached on GPU ``rates``
    (its bf16 rates: the kernels run in bf16). A CSV without memory- or compute-bound rows, or whose rows pass
    the catalogue's peaks (timings of another GPU), is one UserError naming the file and column."""
    rows = read_kernel_csv(path)
    ridge = rates.flops / rates.hbm_bytes_s  # FLOPs per byte where a kernel turns compute-bound
    memory, compute = [], []
    for row in rows:
        intensity = math.inf if row.gbps == 0 else row.flops / row.bytes
        if row.kind == "attn_decode" or (row.kind.startswith("linear_") and intensity <= RIDGE_MARGIN * ridge):
            memory.append(row)
        elif row.kind == "attn_prefill_causal" or (
            row.kind.startswith("linear_") and intensity >= ridge / RIDGE_MARGIN
        ):
            compute.append(row)
    if not memory or not compute:
        which = "memory-bound (attn_decode, or linear_* at small m)" if not memory else "compute-bound"
        raise UserError(f"{path}: column kind: no {which} rows to draw the {rates.gpu}'s fractions from")
    bandwidth = sum(r.bytes for r in memory) / sum(r.seconds for r in memory)
    flops = sum(r.flops for r in compute) / sum(r.seconds for r in compute)
    copies = [r for r in rows if r.kind == "copy" and r.gbps > 0]
    copy = None if not copies else sum(r.bytes for r in copies) / sum(r.seconds for r in copies)
    for column, reached, peak, what in (
        ("gbps", max(bandwidth, copy or 0.0), rates.hbm_bytes_s, "HBM bandwidth"),
        ("tflops", flops, rates.flops, "bf16 peak"),
    ):
        if reached > peak:
            raise UserError(
                f"{path}: column {column}: its rows reach {reached / peak:.2f} x the catalogue's {what} of "
                f"{rates.gpu}: were they measured on another GPU? (--kernels-gpu)"
            )
        if reached < MIN_SHARE * peak:
            raise UserError(
                f"{path}: column {column}: its rows reach {reached / peak:.2%} of the catalogue's {what} of "
                f"{rates.gpu}: is the column in gpu_kernels.py's units (GB/s, TFLOP/s) and ms in milliseconds?"
            )
    return KernelFactors(
        file=str(path),
        gpu=rates.gpu,
        gpu_class=gpu_class(rates.gpu),
        decode_bandwidth=round(bandwidth / rates.hbm_bytes_s, 4),
        decode_rows=len(memory),
        prefill_flops=round(flops / rates.flops, 4),
        prefill_rows=len(compute),
        hbm_copy=None if copy is None else round(copy / rates.hbm_bytes_s, 4),
    )
