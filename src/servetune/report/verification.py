"""The report's "Verification" section as plain data: the verdict of ``servetune verify``, its
stability numbers, a row per scenario and a row per acceptance-checklist item; one such set per
verified point, and what the verdicts mean together (:func:`conclusion`).

``servetune verify STUDY_DIR`` writes ``STUDY_DIR/verify.json``; a study with ``search.verify:
{top: K}`` writes ``STUDY_DIR/verify/<trial id>.json`` for each of its K best points (with
``settings.rank``, the point's place: 0 is the recommendation). :func:`read_verify_file` and
:func:`read_verify_files` read them (the only I/O here, called by ``report/study.py``) and
:func:`verification` turns each into rows the renderers draw. The keys read, all optional (a missing one shows as "-", never an error):

- ``accepted`` (bool) and ``reason`` (text): the verdict and why;
- ``trial_id`` and ``level`` (an index into the trial's levels, or a load such as
  ``{"concurrency": 8}``): what was verified;
- ``stability``: ``cancellation_success_rate``, ``p99_jitter``, ``oom``, ``error_rate_5xx``;
- ``limited_by``: what limited the configuration in the verification (verify/diagnosis.py);
- ``scenarios``: name -> numbers plus ``passed`` (bool), ``reason`` and (the steady ones) ``limited_by``;
- ``checklist``: a list of ``{id, text, status, evidence}`` (``verify/checklist.py``).

The report does not evaluate the checklist itself: it shows what verify recorded.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERIFY_FILE = "verify.json"
#: ``search.verify: {top: K}`` writes one file per verified point: ``STUDY/verify/<trial id>.json``.
VERIFY_DIR = "verify"
#: Checklist statuses in the order a reader looks for them.
STATUSES = ("FAIL", "NOT CHECKED", "PASS")
#: Stability numbers (section 16's record), in order: key -> label.
STABILITY = {
    "oom": "out of memory",
    "error_rate_5xx": "5xx error rate",
    "cancellation_success_rate": "cancellation success rate",
    "p99_jitter": "P99 jitter (max over min of the windowed P99)",
}
#: Scenarios in the order verify runs them; any others follow by name.
SCENARIO_ORDER = ("soak", "peak", "burst", "mix", "long_output", "disconnects", "headroom", "repeats")
#: Numbers that are shares (shown as percentages).
_SHARES = {
    "error_rate_5xx",
    "cancellation_success_rate",
    "kv_usage_peak",
    "memory_peak_fraction",
    "long_share",
    "error_rate",
    "refused_share",  # the 503s an admission bound made (burst, overload)
    "admitted_error_rate",
}


@dataclass(frozen=True)
class JsonFile:
    """A JSON document the report reads (``verify.json``, ``serve-check.json``): its content, or why it could not be used."""

    path: Path
    content: Mapping[str, Any] | None
    problem: str = ""


VerifyFile = JsonFile


@dataclass(frozen=True)
class ScenarioRow:
    name: str
    result: str  # "passed", "failed", "no verdict"
    numbers: str  # ``requests_waiting_max 7, error_rate 0.1%``
    reason: str


@dataclass(frozen=True)
class ChecklistRow:
    id: str
    text: str
    status: str  # PASS, FAIL, NOT CHECKED (or what the file said)
    evidence: str

    @property
    def css_class(self) -> str:
        return self.status.lower().replace(" ", "-")


@dataclass(frozen=True)
class Verification:
    """What the section shows; ``found`` False: verify has not run (``command`` says how)."""

    path: Path
    found: bool
    command: str  # ``servetune verify STUDY_DIR``
    problem: str = ""  # verify.json is there but could not be read
    accepted: bool | None = None
    reason: str = ""
    subject: str = ""  # ``trial t32 at concurrency 16``
    stability: tuple[tuple[str, str], ...] = ()
    scenarios: tuple[ScenarioRow, ...] = ()
    checklist: tuple[ChecklistRow, ...] = ()
    trial_id: str = ""
    rank: int | None = None  # the point's place in the study's verify order (0: the recommendation); None: verify.json
    limited_by: str = ""  # what limited the configuration in the verification ('' where verify.json has no such line)

    @property
    def verdict(self) -> str:
        """``accepted``, ``rejected`` or ``no verdict recorded``."""
        return "no verdict recorded" if self.accepted is None else "accepted" if self.accepted else "rejected"

    def counts(self) -> dict[str, int]:
        """Checklist items by status (every status of :data:`STATUSES`, then any other the file used)."""
        out = dict.fromkeys(STATUSES, 0)
        for row in self.checklist:
            out[row.status] = out.get(row.status, 0) + 1
        return out

    @property
    def counts_line(self) -> str:
        return ", ".join(f"{n} {status}" for status, n in self.counts().items())


def read_verify_file(study_dir: Path) -> VerifyFile | None:
    """``STUDY_DIR/verify.json``: None when absent; one that cannot be read or parsed says why."""
    path = Path(study_dir) / VERIFY_FILE
    return read_json_file(path) if path.is_file() else None


def read_verify_files(study_dir: Path) -> tuple[VerifyFile, ...]:
    """``STUDY_DIR/verify/*.json``, one per point the study verified (``search.verify``), by name."""
    folder = Path(study_dir) / VERIFY_DIR
    paths = sorted(p for p in folder.glob("*.json") if p.is_file()) if folder.is_dir() else []
    return tuple(read_json_file(path) for path in paths)


def read_json_file(path: Path) -> JsonFile:
    """``path`` as a JSON object; one that cannot be read or parsed, or is not an object, says why."""
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return VerifyFile(path, None, f"cannot read: {exc}")
    except ValueError as exc:
        return VerifyFile(path, None, f"not valid JSON: {exc}")
    if not isinstance(content, dict):
        return VerifyFile(path, None, "not a JSON object")
    return VerifyFile(path, content)


def verifications(
    study_dir: Path, single: VerifyFile | None, per_point: Sequence[VerifyFile]
) -> tuple[Verification, ...]:
    """Every verification of the study, as the report lists them: the study's points in their
    verify order (the recommendation first), then ``verify.json`` (``servetune verify``'s own)."""
    points = [verification(study_dir, file) for file in per_point]
    points.sort(key=lambda v: (v.rank is None, v.rank if v.rank is not None else 0, v.trial_id, str(v.path)))
    if single is not None:
        points.append(verification(study_dir, single))
    return tuple(points)


def primary(all_verified: Sequence[Verification], recommended_trial: str | None, study_dir: Path) -> Verification:
    """The verification the recommendation's summary line states: the recommended trial's (the
    ``servetune verify``'s own ``verify.json`` before the study's file), else the first listed, else how to run verify."""
    mine = [v for v in all_verified if recommended_trial and v.trial_id == recommended_trial and not v.problem]
    if mine:
        return next((v for v in mine if v.rank is None), mine[0])
    if all_verified:
        return next((v for v in all_verified if v.rank is None), all_verified[0])
    return verification(study_dir, None)


def conclusion(all_verified: Sequence[Verification], recommended_trial: str | None, study_dir: Path) -> str:
    """What the verdicts mean for the choice to ship, in one sentence ('' with one verification or none).

    The recommendation accepted: ship it. Rejected while another verified point was accepted: that
    one is the configuration to ship, with the command that exports it. None accepted: none is ready.
    """
    judged = [v for v in all_verified if v.accepted is not None]
    if len(judged) < 2:
        return ""
    accepted = [v for v in judged if v.accepted]
    mine = next((v for v in judged if recommended_trial and v.trial_id == recommended_trial), None)
    if mine is not None and mine.accepted:
        return f"The recommendation (trial {mine.trial_id}) passed verification: ship it."
    if not accepted:
        return f"Every verified point was rejected ({len(judged)}): none is ready to ship as measured."
    first = accepted[0]
    said = (
        f"the recommendation (trial {recommended_trial}) was rejected by verification"
        if mine is not None
        else "the recommendation was not verified"
    )
    return (
        f"{said[0].upper()}{said[1:]}; trial {first.trial_id}, verified next, was accepted: "
        f"ship it instead (servetune export {study_dir} --pick {first.trial_id})."
    )


def verification(study_dir: Path, file: VerifyFile | None) -> Verification:
    """The section's data (pure)."""
    path = Path(study_dir) / VERIFY_FILE
    command = f"servetune verify {study_dir}"
    if file is None:
        return Verification(path, False, command)
    if file.content is None:
        return Verification(file.path, True, command, problem=file.problem)
    data = file.content
    accepted = data.get("accepted")
    reason = data.get("reason")
    reasons = data.get("reasons")
    if not isinstance(reason, str) and isinstance(reasons, list):  # verify writes ``reasons``, a list
        reason = "; ".join(str(r) for r in reasons)
    trial = data.get("trial_id")
    settings = data.get("settings")
    rank = settings.get("rank") if isinstance(settings, Mapping) else None
    return Verification(
        path=file.path, found=True, command=command,
        accepted=accepted if isinstance(accepted, bool) and not data.get("stopped") else None,  # stopped: no verdict
        reason=reason if isinstance(reason, str) else "",
        subject=_subject(data),
        stability=tuple(_stability(data.get("stability"))),
        scenarios=tuple(_scenarios(data.get("scenarios"))),
        checklist=tuple(_checklist(data.get("checklist"))),
        trial_id=trial if isinstance(trial, str) else "",
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        limited_by=limited if isinstance(limited := data.get("limited_by"), str) else "",
    )  # fmt: skip


def _subject(data: Mapping[str, Any]) -> str:
    trial = data.get("trial_id")
    level = data.get("level")
    text = f"trial {trial}" if isinstance(trial, str) and trial else "trial -"
    if isinstance(level, Mapping) and level:
        text += " at " + ", ".join(f"{k} {_value(k, v)}" for k, v in level.items())
    elif isinstance(level, int) and not isinstance(level, bool):
        text += f", level #{level}"
    return text


def _stability(values: Any) -> list[tuple[str, str]]:
    values = values if isinstance(values, Mapping) else {}
    rows = [(label, _value(key, values.get(key))) for key, label in STABILITY.items()]
    rows += [(str(key), _value(str(key), value)) for key, value in values.items() if key not in STABILITY]
    return rows


def _scenarios(values: Any) -> list[ScenarioRow]:
    if not isinstance(values, Mapping):
        return []
    names = [n for n in SCENARIO_ORDER if n in values] + sorted(str(n) for n in values if n not in SCENARIO_ORDER)
    rows = []
    for name in names:
        numbers = values[name]
        if not isinstance(numbers, Mapping):
            rows.append(ScenarioRow(name, "no verdict", "-", "not a set of numbers in verify.json"))
            continue
        passed = numbers.get("passed")
        result = "passed" if passed is True else "failed" if passed is False else "no verdict"
        shown = [
            f"{key} {_value(str(key), value)}"
            for key, value in numbers.items()
            if key not in ("passed", "reason", "limited_by")
        ]
        reason = numbers.get("reason")
        reason = reason if isinstance(reason, str) else ""
        if isinstance(limited := numbers.get("limited_by"), str):
            reason += ("; " if reason else "") + f"what limited it: {limited}"
        rows.append(ScenarioRow(name, result, ", ".join(shown) or "-", reason))
    return rows


def _checklist(values: Any) -> list[ChecklistRow]:
    if not isinstance(values, Sequence) or isinstance(values, str):
        return []
    rows = []
    for item in values:
        if isinstance(item, Mapping):
            rows.append(ChecklistRow(*(str(item.get(key, "") or "-") for key in ("id", "text", "status", "evidence"))))
    return rows


def _value(key: str, value: Any) -> str:
    """A number as a reader wants it: shares as percentages, lists as their range, booleans as yes/no."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if key in _SHARES:
            return f"{value:.2%}" if value < 0.01 and value > 0 else f"{value:.0%}"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if numbers and len(numbers) == len(value):
            if len(numbers) > 4:
                return f"{len(numbers)} values, {_value(key, min(numbers))} to {_value(key, max(numbers))}"
            return "[" + ", ".join(_value(key, v) for v in numbers) + "]"
        return f"{len(value)} entries"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} {_value(str(k), v)}" for k, v in value.items()) + "}"
    return str(value)
