"""A study directory on disk: ``study.json``'s record, the layout's file names, and the one reader of each JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ValidationError

from servetune.capacity.prices import Price, PriceList
from servetune.config.slo import SloBound
from servetune.errors import UserError
from servetune.results.levels import RECORD
from servetune.results.trial import TrialResult

#: The layout of ``study.json`` and ``result.json`` this servetune writes. Readers take any version:
#: a field they do not know is ignored and one they miss takes its default, so a study opens in an
#: older or a newer servetune alike; the number says which layout wrote a file. 1: before it was
#: recorded; 2: results carry ``resolved_engine_args`` and a level its ``cache_note``; 3: a level's
#: summary carries what the ladder judges saturation on (``busy_output_throughput``,
#: ``send_span_s``, ``ttft_growth``, ``ttft_growth_low``); 4: results carry ``capacity_at_slo`` and
#: their levels may go on past the ladder, in the order measured (trial/capacity.py); 5: a FAILED result
#: carries ``failure`` (whose fault: trial/failures.py) and ``retried``; 6: a level's telemetry carries the
#: energy of its measured window alone (``gpu_energy_measured_j``, ``cpu_energy_measured_j``: telemetry.py) and
#: the level its ``energy_note``, so operating points have ``energy_per_token`` and ``energy_per_request`` (a
#: result from before has neither: its energy counted the warm-up too); 7: a result carries ``price``, the price
#: of its GPU type with its source and date (capacity/prices.py); 8: a result carries ``knee``, where throughput stopped growing with load (:func:`find_knee`;
#: a result from before has none, and readers derive it from its levels with :attr:`TrialResult.knee_found`).
#: 9: a level carries its ``estimate`` (predicted TTFT, TPOT, throughput and their relative errors) and the result
#: ``estimate_factors`` or ``estimate_note``. 10: a result may be PRUNED, with ``pruned`` (the estimate that ruled it
#: out), and carry ``proposed_by`` (a point the estimate seeded the search with).
SCHEMA_VERSION = 10


class WeightsPrefetch(BaseModel):
    """One node's download of a hub model's weights before the study's first trial (servetune/prefetch.py): the time it
    took, apart from every trial's start-up (and its ``load_weights_s``); ``error`` where it failed (the trials on
    that node then download on their own, inside their start-up clock)."""

    model_config = RECORD

    model: str
    node_id: str
    host: str
    download_s: float
    bytes: int = 0  # on the node's disk once fetched (files already cached count too)
    error: str | None = None


class StudyInfo(BaseModel):
    """``study.json`` at the top of a study directory: what the study was asked to do."""

    model_config = RECORD

    schema_version: int = 1  # files from before the version was written read as 1
    name: str
    created: str
    space_file: str  # absolute (relative to the working folder before); copied beside study.json as space.yaml
    model: str
    workload: str
    device: Literal["gpu", "cpu"]
    algorithm: str
    objectives: list[tuple[str, Literal["min", "max"]]]  # e.g. [("cost_per_mtok_usd", "min"), ("ttft_ms_p99", "min")]
    slo: list[str]  # as text, for people and for older readers
    slo_bounds: list[SloBound] = []  # the same bounds, typed (empty in study.json files before schema 2)
    # the space's own price (per GPU-hour, or per core-hour on the CPU build); None where the space leaves GPU prices
    # to the price list, each trial priced at its own GPU type's (study.json files before session 43 wrote 1.0 there)
    price_per_device_hour: float | None
    # the space's price list and its own prices over it: the report prices the GPU types the study did not measure
    # from them, as the trials were priced (defaults in older study.json files)
    price_list: PriceList = "default"
    prices: dict[str, Price] = {}
    servetune_version: str
    levels: list[str] = []  # the load ladder each trial climbs, e.g. "concurrency 8" (empty in older study.json files)
    # the MLflow store the study logged to, without credentials (tracking/connection.py study_tracking_uri): verify and
    # report log there unless told otherwise (None in older study.json files)
    tracking_uri: str | None = None
    # the hub models' weights fetched on each node that runs trials before the first one (empty: none fetched, a local
    # model, ``--no-prefetch``, or a study.json from before prefetching)
    prefetch: list[WeightsPrefetch] = []


#: Layout of a study directory (``--storage``/<study name>/).
STUDY_FILE = "study.json"
SPACE_FILE = "space.yaml"
TRIALS_DIR = "trials"
RESULT_FILE = "result.json"
QUALITY_FILE = "quality.jsonl"  # the quality probe's answers, a row per prompt (quality/probe.py)
LM_EVAL_RESULTS_FILE = (
    "lm_eval_results.json"  # lm-eval's results JSON, when the probe ran lm-eval tasks (quality/lm_eval.py)
)
ENGINE_LOG = "engine.log"  # the engine's stdout and stderr (trial/runner.py)
REFIT_FILE = "estimate_factors.json"  # the estimate's factors refitted on the study's trials (study/refit.py)
REQUESTS_FILE = "requests.jsonl"  # the per-request records, a row per request (trial/runner.py)
REFERENCE_FILE = (
    Path("quality") / "reference.json"
)  # the quality reference's answers, kept by the study (study/driver.py)


def space_bases(study_dir: Path, space_file: str) -> list[Path]:
    """Where the files the kept space (``study_dir``/space.yaml) names are found, in the order to try: the folder of
    the space file the study ran (``space_file``, from study.json), where its trials found them. Studies that
    recorded a relative ``space_file`` (before it was made absolute) are tried from there, the study folder, then
    the working folder."""
    recorded = Path(space_file).parent
    bases = [recorded] if recorded.is_absolute() else [recorded, study_dir, Path.cwd()]
    return list(dict.fromkeys(bases))


Model = TypeVar("Model", bound=BaseModel)


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


def read_result(trial_dir: Path) -> TrialResult | None:
    """The one reader of ``result.json``: None when the trial has none yet (still running, or never
    finished); a file that is there but invalid is a one-line ``UserError`` naming it and the field."""
    path = trial_dir / RESULT_FILE
    if not path.is_file():
        return None
    return read_model(path, TrialResult)
