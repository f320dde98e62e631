"""Reading a study directory from disk: ``study.json``, ``trials/*/result.json`` and, when
``servetune verify`` ran, ``verify.json``, and ``verify/*.json`` when the study verified its best points, and
``serve-check.json`` when ``servetune serve-check`` ran, ``recheck-paired-*.json`` for each
``servetune recheck --paired``, and the workload of the space the study keeps (``space.yaml``), whose images the
report's estimates encode.

Nothing is skipped silently. A trial directory without ``result.json`` (a trial still
running, or killed before it wrote one) is listed as not read. A ``result.json`` that is not
valid is an error naming the file and the field, unless ``skip_unreadable`` is set, in which
case it is listed as not read with that same message. The workload is read for the estimates alone: a kept space
that cannot be read (a study from before it was kept, a workload file since moved) leaves it unread, with why,
and the report says where its estimates lack the images for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from servetune.config.loading import load_yaml_model
from servetune.config.space import SearchSpace
from servetune.config.workload import Workload
from servetune.errors import UserError
from servetune.estimate.refit import Refit
from servetune.report.paired import PairedOutcome, read_paired_files
from servetune.report.serving import ServeCheckFile, read_serve_check_file
from servetune.report.verification import VerifyFile, read_verify_file, read_verify_files
from servetune.results import (
    RESULT_FILE,
    SPACE_FILE,
    STUDY_FILE,
    TRIALS_DIR,
    StudyInfo,
    TrialResult,
    read_model,
    read_result,
    space_bases,
)
from servetune.results.files import REFIT_FILE


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
    verify: VerifyFile | None = None  # verify.json (report/verification.py); None when verify has not run
    verified: tuple[VerifyFile, ...] = ()  # verify/<trial id>.json, one per point the study verified (search.verify)
    serve_check: ServeCheckFile | None = None  # serve-check.json (report/serving.py); None when serve-check has not run
    paired: tuple[tuple[Path, PairedOutcome], ...] = ()  # recheck-paired-*.json (report/paired.py), oldest first
    workload: Workload | None = None  # the kept space's workload (read_workload); None where it could not be read
    workload_unread: str | None = None  # why not, in one line
    refit: Refit | None = None  # estimate_factors.json: the estimate's factors refitted on the trials (read_refit)


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
        try:
            result = read_result(trial_dir)
        except UserError as exc:
            if not skip_unreadable:
                raise
            not_read.append(NotRead(trial_dir, str(exc).removeprefix(f"{trial_dir / RESULT_FILE}: ")))
            continue
        if result is None:
            not_read.append(NotRead(trial_dir, f"no {RESULT_FILE} (still running, or stopped before writing it)"))
        else:
            trials.append(result)
    workload, unread = read_workload(root, info)
    return LoadedStudy(
        root=root,
        info=info,
        trials=tuple(trials),
        not_read=tuple(not_read),
        verify=read_verify_file(root),
        verified=read_verify_files(root),
        serve_check=read_serve_check_file(root),
        paired=read_paired_files(root),
        workload=workload,
        workload_unread=unread,
        refit=read_refit(root),
    )


def read_refit(root: Path) -> Refit | None:
    """The factors the study refitted on its trials (study/refit.py), or None where it wrote none."""
    path = root / REFIT_FILE
    return read_model(path, Refit) if path.is_file() else None


def read_workload(root: Path, info: StudyInfo) -> tuple[Workload | None, str | None]:
    """The workload of the space the study keeps, with the files it names found where its trials found them
    (results/files.py ``space_bases``); else None and why. Only the space's own fields are read, not the checks
    ``servetune run`` makes against vLLM's parser: the report estimates from the workload, it runs nothing."""
    path = root / SPACE_FILE
    if not path.is_file():
        return None, f"{path}: no such file"
    first = ""
    for base in space_bases(root, info.space_file):
        try:
            return load_yaml_model(path, SearchSpace, base_dir=base).resolved_workload(base), None
        except (UserError, ValueError) as exc:
            first = first or (str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    return None, first
