"""Speculative decoding's gain, load by load, against the same configuration without it (issue #41 item 2).

A speculative trial (``speculative.method`` other than ``none``) is paired with the trial whose parameters are
the same but for the ``speculative.*`` ones and that ran without a drafter. At every load both measured, the
gain is the speculative trial's output throughput over the other's, less one, with the TPOT ratio beside it. A
gain counts only beyond the two levels' throughput noise added (results ``throughput_noise``: their repeats'
spread, 10% for a level run once): within it the load is "within the noise". The lowest load from which every
measured load loses is where the gain turns negative: the deployment guide's warning that too many draft
tokens lower the real speed, as a number.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from servetune.config.speculative import METHOD, is_speculative
from servetune.results import LevelResult, TrialResult, by_load, throughput_noise


@dataclass(frozen=True)
class LoadGain:
    load: float
    gain: float  # output throughput, speculative over without, less one
    noise: float  # the two levels' throughput noise added
    tpot_ratio: float | None  # mean TPOT, speculative over without

    @property
    def verdict(self) -> str:
        if self.gain > self.noise:
            return "gain"
        return "loss" if self.gain < -self.noise else "within the noise"


@dataclass(frozen=True)
class SpeculativePair:
    trial_id: str
    baseline_id: str
    method: str
    label: str  # the speculative parameters, as the report names them
    kind: str  # concurrency or rate
    loads: tuple[LoadGain, ...]

    @property
    def turns_negative_at(self) -> float | None:
        """The lowest load from which every measured load loses beyond the noise (None: none does)."""
        at = None
        for row in reversed(self.loads):
            if row.verdict != "loss":
                break
            at = row.load
        return at


def _drafting(trial: TrialResult) -> bool:
    method = trial.params.get(METHOD)
    return method is not None and method != "none"


def _rest(trial: TrialResult) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, repr(v)) for k, v in trial.params.items() if not is_speculative(k)))


def _completed(trial: TrialResult) -> dict[float, LevelResult]:
    return by_load([level for level in trial.levels if level.summary.completed and level.summary.level])


def speculative_pairs(trials: Sequence[TrialResult]) -> list[SpeculativePair]:
    """Each speculative trial beside the trial of the same other parameters without a drafter, where both measured
    at least one load in common."""
    baselines: dict[tuple[tuple[str, str], ...], TrialResult] = {}
    for t in trials:
        if t.levels and not _drafting(t):
            baselines.setdefault(_rest(t), t)
    pairs = []
    for trial in trials:
        base = baselines.get(_rest(trial)) if _drafting(trial) else None
        if base is None:
            continue
        mine, theirs = _completed(trial), _completed(base)
        rows = []
        for load in sorted(mine.keys() & theirs.keys()):
            spec, plain = mine[load], theirs[load]
            if plain.summary.output_throughput <= 0:
                continue
            tpots = spec.summary.tpot_ms.mean, plain.summary.tpot_ms.mean
            rows.append(LoadGain(
                load, spec.summary.output_throughput / plain.summary.output_throughput - 1,
                throughput_noise(spec) + throughput_noise(plain),
                tpots[0] / tpots[1] if tpots[0] is not None and tpots[1] else None,
            ))  # fmt: skip
        if rows:
            label = ", ".join(
                f"{k.removeprefix('speculative.')}={v}" for k, v in trial.params.items() if is_speculative(k)
            )
            kind = next(iter(mine[min(mine)].summary.level))
            pairs.append(SpeculativePair(trial.trial_id, base.trial_id, str(trial.params[METHOD]), label, kind,
                                         tuple(rows)))  # fmt: skip
    return pairs


def gain_lines(trials: Sequence[TrialResult]) -> list[str]:
    """One line per speculative trial with a baseline: its gain at each load, and where it turns negative."""
    lines = []
    for pair in speculative_pairs(trials):
        unit = "clients" if pair.kind == "concurrency" else "req/s"
        cells = []
        for row in pair.loads:
            tpot = f", TPOT x{row.tpot_ratio:.2f}" if row.tpot_ratio is not None else ""
            cells.append(f"{row.load:g} {unit}: {row.gain:+.0%} ({row.verdict}, noise ±{row.noise:.0%}{tpot})")
        negative = pair.turns_negative_at
        end = (
            f"the gain turns negative from {negative:g} {unit}"
            if negative is not None
            else "no load measured loses beyond the noise"
        )
        lines.append(
            f"trial {pair.trial_id} ({pair.label}) against {pair.baseline_id} without a drafter: "
            + "; ".join(cells)
            + f"; {end}"
        )
    return lines
