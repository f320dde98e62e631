"""Paired re-checks in the recommendation: a tie the study could not break, settled where it was measured so.

A study measures its trials minutes apart on a host that drifts, so two configurations whose capacities and costs
overlap within their noise are a tie (recommend.py, rule 5). ``servetune recheck --paired`` measures the pick (A)
against another trial (B) round by round, interleaved, and judges them from the rounds' paired differences
(verify/paired.py); it writes ``recheck-paired-<vllm>.json`` in the study directory (the latest run's on that vLLM)
and a copy of each run's in the run's own folder, ``recheck/<vllm>/<run>/recheck-paired.json``. The report reads
them all (a study-level file that is a copy of a run's counted once) and, for each tie, takes the latest comparison
of the two on the study's vLLM that measured them (by its ``created`` stamp), naming every other run of the two on
that vLLM (earlier ones, refused ones) and its verdict beside it:

- a paired comparison of the two on the study's vLLM release that told them apart settles it: the better one is
  recommended (a tie whose memory margin is thin is not switched to: rule 2 still holds), and the reason says by
  how much, over how many rounds;
- one that found them within its own noise confirms the tie;
- one run on another vLLM release is named but not taken: it measured a different engine than the study's;
- with none, the reason names the command that would settle it, and the recommendation carries it as a next
  step (``next_steps``): ``servetune run`` and ``servetune report`` print it last, the report shows it under the
  recommendation. Nothing runs it: it starts two engines for minutes.

A file that cannot be read is an error naming it and the field, as every result file is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from servetune.report.points import ReportPoint, TrialOutline
from servetune.report.recommend import Recommendation, describe, margin_signals
from servetune.results import read_model

PAIRED_GLOB = "recheck-paired-*.json"
#: Each paired run's own copy (verify/recheck.py ``PAIRED_RUN_DOC`` in ``RECHECK_DIR/<vllm>/<run>/``).
RUN_GLOB = "recheck/*/*/recheck-paired.json"
SETTLING = ("A better", "B better")  # the paired verdicts that tell two configurations apart


class PairedOutcome(BaseModel):
    """What the report reads of a paired re-check's file (verify/paired.py ``Paired``; the rest is ignored)."""

    model_config = ConfigDict(extra="ignore")

    a_trial_id: str
    b_trial_id: str
    vllm: str | None = None
    verdict: str
    reason: str
    rounds: list[dict[str, Any]] = []
    failure: str | None = None
    created: str | None = None

    def pairs(self, one: str, other: str) -> bool:
        return {self.a_trial_id, self.b_trial_id} == {one, other}

    def better(self) -> str | None:
        """The trial id the comparison found better; None for a tie or a comparison that did not run."""
        if self.failure is not None or self.verdict not in SETTLING:
            return None
        return self.a_trial_id if self.verdict == "A better" else self.b_trial_id


def read_paired_files(root: Path) -> tuple[tuple[Path, PairedOutcome], ...]:
    """Every paired run's file: each run folder's ``recheck-paired.json``, then each study-level
    ``recheck-paired-*.json`` that is not a copy of one of them (a run from before the folders, or one written
    with ``--json``); newest last (by its ``created`` stamp)."""
    runs = sorted(p for p in root.glob(RUN_GLOB) if p.is_file())
    read = [(path, read_model(path, PairedOutcome)) for path in runs]
    seen = {outcome.model_dump_json() for _, outcome in read}
    for path in sorted(p for p in root.glob(PAIRED_GLOB) if p.is_file()):
        outcome = read_model(path, PairedOutcome)
        if outcome.model_dump_json() not in seen:
            read.append((path, outcome))
    return tuple(sorted(read, key=lambda item: item[1].created or ""))


def label(path: Path) -> str:
    """A paired file as the report names it: ``recheck/<vllm>/<run>/recheck-paired.json`` for a run's copy (its
    name alone says nothing), else its name."""
    parts = path.parts
    return "/".join(parts[-4:]) if len(parts) >= 4 and parts[-4] == "recheck" else path.name


def _others(taken: int, others: Sequence[tuple[Path, PairedOutcome]], vllm: str | None) -> str:
    """What the report says of the other paired runs of the two on the study's vLLM beside the one it took, the
    ``taken``-th of those that measured them (none: '')."""
    if not others:
        return ""
    said = ", ".join(f"{label(path)}: {p.verdict}" + (f" ({p.failure})" if p.failure else "") for path, p in others)
    return f"; the latest of {taken} that measured them on vLLM {vllm}; the other runs: {said}"


def settle_ties(rec: Recommendation, points: Sequence[ReportPoint], trials: Sequence[TrialOutline],
                paired: Sequence[tuple[Path, PairedOutcome]], study_vllm: str | None,
                study_dir: str = "STUDY_DIR") -> Recommendation:  # fmt: skip
    """The recommendation with its ties (rule 5) settled, confirmed or left open by the paired re-checks."""
    if rec.point is None or not rec.ties:
        return rec
    mine = rec.point.trial_id
    notes: list[str] = []
    commands: list[str] = []
    for tie in rec.ties:
        found = [(path, p) for path, p in paired if p.pairs(mine, tie.trial_id)]
        same = [(path, p) for path, p in found if p.vllm == study_vllm and p.failure is None]
        if not same:
            elsewhere = "; ".join(f"{label(path)} compared them on vLLM {p.vllm}" + (f" and failed: {p.failure}" if
                                  p.failure else "") for path, p in found)  # fmt: skip
            commands.append(f"servetune recheck {study_dir} --paired --against {tie.trial_id}")
            hint = f"`{commands[-1]}` measures them round by round"
            notes.append(f"against trial {tie.trial_id}: no paired comparison on the study's vLLM {study_vllm}"
                         + (f" ({elsewhere}, not taken: another engine)" if elsewhere else "") + f"; {hint}")  # fmt: skip
            continue
        path, latest = same[-1]
        beside = [(p, o) for p, o in found if o.vllm == study_vllm and o is not latest]
        rounds = f"{len(latest.rounds)} rounds, {label(path)}{_others(len(same), beside, study_vllm)}"
        winner = latest.better()
        if winner is None:
            notes.append(f"against trial {tie.trial_id}: a paired comparison ({rounds}) found them within its noise "
                         f"too: {latest.reason}")  # fmt: skip
        elif winner == mine:
            notes.append(f"against trial {tie.trial_id}: settled by a paired comparison ({rounds}), trial {mine} "
                         f"better: {latest.reason}")  # fmt: skip
        elif thin := margin_signals(tie, trials):
            notes.append(f"against trial {tie.trial_id}: a paired comparison ({rounds}) found trial {tie.trial_id} "
                         f"better ({latest.reason}), but its memory margin is thin: {'; '.join(thin)}")  # fmt: skip
        else:
            others = tuple(t for t in rec.ties if t is not tie)
            why = (f"{describe(tie)}: a paired comparison ({rounds}) measured it better than trial {mine}, which "
                   f"the study's own measurements could not tell it from: {latest.reason}")  # fmt: skip
            return settle_ties(Recommendation(tie, why, ties=others), points, trials, paired, study_vllm, study_dir)
    return replace(rec, reason=f"{rec.reason}. Paired re-checks: " + "; ".join(notes), next_steps=tuple(commands))
