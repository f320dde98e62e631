"""Reading a study directory from disk: ``study.json`` and ``trials/*/result.json``.

Nothing is skipped silently. A trial directory without ``result.json`` (a trial still
running, or killed before it wrote one) is listed as not read. A ``result.json`` that is not
valid is an error naming the file and the field, unless ``skip_unreadable`` is set, in which
case it is listed as not read with that same message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from servetune.errors import UserError
from servetune.results import RESULT_FILE, STUDY_FILE, TRIALS_DIR, StudyInfo, TrialResult

Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class NotRead:
    """A trial directory whose result could not be used, and why."""

    path: Path
    why: str


@dataclass(frozen=True)
class LoadedStudy:
    root: Path
    info: StudyInfo
    trials: tuple[TrialResult, ...]
    not_read: tuple[NotRead, ...]


def validation_message(exc: ValidationError) -> str:
    """The first problem of a pydantic error as ``field.path: message`` on one line."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        text = f"not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
    else:
        loc = ".".join(str(part) for part in first.get("loc", ())) or "(top level)"
        text = f"{loc}: {first.get('msg')}"
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more problems)"
    return " ".join(text.split())


def read_model(path: Path, model: type[Model]) -> Model:
    """Validate one JSON file; a missing, unreadable or invalid file is a one-line UserError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise UserError(f"{path}: {validation_message(exc)}") from None


def load_study(root: Path | str, skip_unreadable: bool = False) -> LoadedStudy:
    """Read a study directory (``servetune-results/<study>/``)."""
    root = Path(root)
    if not root.exists():
        raise UserError(f"{root}: no such study directory")
    if not root.is_dir():
        raise UserError(f"{root}: not a directory (give the study directory, e.g. servetune-results/<study>)")
    if not (root / STUDY_FILE).is_file():
        raise UserError(f"{root / STUDY_FILE}: no such file ({root} is not a study directory)")
    info = read_model(root / STUDY_FILE, StudyInfo)
    trials: list[TrialResult] = []
    not_read: list[NotRead] = []
    trials_dir = root / TRIALS_DIR
    for trial_dir in sorted(trials_dir.iterdir()) if trials_dir.is_dir() else []:
        if not trial_dir.is_dir() or trial_dir.name.startswith("."):
            continue
        result_file = trial_dir / RESULT_FILE
        if not result_file.is_file():
            not_read.append(NotRead(trial_dir, f"no {RESULT_FILE} (still running, or stopped before writing it)"))
            continue
        try:
            trials.append(read_model(result_file, TrialResult))
        except UserError as exc:
            if not skip_unreadable:
                raise
            not_read.append(NotRead(trial_dir, str(exc).removeprefix(f"{result_file}: ")))
    return LoadedStudy(root=root, info=info, trials=tuple(trials), not_read=tuple(not_read))
