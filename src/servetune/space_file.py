"""A search space file, loaded and checked against everything it names before any trial runs.

The typed space is :class:`~servetune.config.space.SearchSpace`; this adds what pydantic cannot see
from the file alone: vLLM's parser for the parameters and fixed engine arguments (engine/args.py), the
quality suites and lm-eval's tasks (quality/), the names the constraints read, whether a node holds the
smallest trial, and whether the constraints leave any point. Every problem is one line naming the file
and the field. It sits above ``config/``, ``engine/`` and ``quality/`` (the layers in pyproject.toml),
which is why it is not in ``config/``: the space's models are read by rooms beneath those two.
"""

from __future__ import annotations

import difflib
import json
import math
from pathlib import Path
from typing import Any

from huggingface_hub import try_to_load_from_cache

from servetune.capacity.vocab import (
    DRAFT_MODEL,
    checkpoint_tokens,
    config_vocab_size,
    read_tokenizer,
    tokenizer_tokens,
    vocab_problem,
)
from servetune.config import speculative
from servetune.config.constraints import constraint_names
from servetune.config.loading import load_yaml_model
from servetune.config.quality import suite_name
from servetune.config.space import (
    ENGINE_DEFAULTS,
    ENV_PREFIX,
    GPU_PARAM,
    MODEL_PARAM,
    RAY_BACKENDS,
    SERVE_PREFIX,
    SERVE_REPLICAS,
    Range,
    SearchSpace,
)
from servetune.config.workload import Workload
from servetune.engine.args import mm_limits, validate_engine_args
from servetune.errors import UserError
from servetune.models.names import is_hub_id
from servetune.models.tiny import TINY_CONFIG, tiny_tokenizer_json
from servetune.quality import lm_eval
from servetune.quality.suites import load_suite
from servetune.results import SPACE_FILE, space_bases


def _check_image_limits(space: SearchSpace, images: int) -> None:
    """Every ``limit_mm_per_prompt`` the space gives lets the workload's requests carry their images (vLLM refuses
    a request with more, HTTP 400)."""
    fixed = space.engine_args.get("limit_mm_per_prompt")
    listed = space.params.get("limit_mm_per_prompt")
    candidates = [("engine_args.limit_mm_per_prompt", fixed)] if fixed is not None else []
    if isinstance(listed, list):
        candidates += [("params.limit_mm_per_prompt", value) for value in listed]
    for field, value in candidates:
        limit = mm_limits(value, field).get("image")
        if images and limit is not None and limit < images:
            raise UserError(f"{field}: image {limit} is fewer than the {images} images a request of the workload "
                            "carries: vLLM would refuse those requests")  # fmt: skip


def load_space(path: str | Path, argspecs: dict | None = None, base_dir: Path | None = None) -> SearchSpace:
    """Load and check a search space; every problem is one line naming the file and field.

    With ``argspecs`` (vLLM's options, see :func:`servetune.engine.args.load_argspecs`), the
    names of parameters and fixed engine arguments are checked against vLLM's parser. The files the
    space names (its workload, and the workload's adapters, length files, trace and text; quality
    suites) are relative to ``base_dir``, by default the space file's own folder.
    """
    path = Path(path)
    base = path.parent if base_dir is None else base_dir
    space = load_yaml_model(path, SearchSpace, base_dir=base)
    fixed = {k: v for k, v in space.engine_args.items() if not speculative.is_speculative(k)}
    if space.speculative_values({}) or any(speculative.is_speculative(n) for n in space.params):
        fixed["speculative_config"] = None  # the option the speculative.* fields become: vLLM's parser must know it
    checks: list[tuple[str, dict[str, Any]]] = [("engine_args", fixed)]
    for name, values in space.params.items():
        if (
            not name.startswith((ENV_PREFIX, SERVE_PREFIX))
            and name not in (MODEL_PARAM, GPU_PARAM)
            and not speculative.is_speculative(name)
        ):  # each listed value against vLLM's choices too
            checks += [("params", {name: v}) for v in (values if isinstance(values, list) else [None])]
    for field, args in checks:
        try:
            validate_engine_args(args, argspecs, source="engine argument")
        except UserError as exc:
            raise UserError(f"{path}: {field}: {exc}") from None
    _check_constraint_names(space, path)
    _check_gpus(space, path)
    _check_mtp(space, path, base)
    _check_draft_vocab(space, path, base)
    if space.through_serve:
        _check_serve(space, path)
    else:
        _check_executors(space, path)
    fewest = _fewest_devices(space)
    if fewest > space.hardware.devices_per_node:
        raise UserError(f"{path}: hardware.devices_per_node: a node has {space.hardware.devices_per_node}, but a trial "
                        f"needs {fewest} devices or more (tensor x pipeline x data parallel size)")  # fmt: skip
    try:
        workload = space.resolved_workload(base)
        if space.slo.structured_valid is not None and not workload.asks_structured:
            raise UserError(f"{path}: slo.structured_valid: the workload '{workload.name}' asks for no structured "
                            "output (give a request class structured:), so no level would measure it")  # fmt: skip
        _check_image_limits(space, workload.max_images)
        kept, rejected = space.grid() if _gridable(space) else ([{}], [])
    except UserError as exc:
        raise UserError(f"{path}: {exc}" if not str(exc).startswith(str(path)) else str(exc)) from None
    except ValueError as exc:
        raise UserError(f"{path}: params: {exc}") from None
    fixed_broken = speculative.violations(space.speculative_values({}))
    if not space.params and fixed_broken:  # no grid: the fixed speculation is the only choice
        raise UserError(f"{path}: engine_args: {fixed_broken[0]}")
    if space.params and not kept:
        reasons = sorted({r for _, broken in rejected for r in broken})
        raise UserError(f"{path}: constraints: they exclude every point of the space ({'; '.join(reasons)[:300]})")
    if space.quality is not None:
        _check_quality(space, path, base)
    return space


def load_study_space(study_dir: Path, space_file: str) -> tuple[SearchSpace, Workload]:
    """The space a study keeps (``study_dir``/space.yaml) and its workload, with every file they name found where
    the study's trials found it (results/files.py ``space_bases``).

    The kept copy is the user's file as it was; the files it names stay where the user keeps them (as a local
    model does), so the workload and each trial's id are the ones the study measured. A file that is gone is one
    line naming the kept space file and the field.
    """
    path = study_dir / SPACE_FILE
    if not path.is_file():
        raise UserError(f"{path}: no such file (the study keeps the space it ran there)")
    first: UserError | None = None
    for base in space_bases(study_dir, space_file):
        try:
            space = load_space(path, base_dir=base)
            return space, space.resolved_workload(base)
        except UserError as exc:
            first = first or exc
    assert first is not None
    raise first


def _check_quality(space: SearchSpace, path: Path, base: Path) -> None:
    """Every suite readable, and a reference that is a configuration of the study."""
    assert space.quality is not None
    for index, suite in enumerate(space.quality.suites):
        try:
            load_suite(suite, base)
        except UserError as exc:
            raise UserError(f"{path}: quality.suites[{index}]: {exc}") from None
    names = [suite_name(s) for s in space.quality.suites]
    if len(set(names)) != len(names):
        raise UserError(
            f"{path}: quality.suites: two suites share the name '{next(n for n in names if names.count(n) > 1)}'"
        )
    if space.quality.lm_eval is not None:  # installed, its include path, its tasks: before any engine starts
        try:
            lm_eval.check(space.quality.lm_eval, base)
        except UserError as exc:
            raise UserError(f"{path}: quality.lm_eval: {exc}") from None
    reference = space.quality.reference
    if reference == "baseline":
        return
    where = f"{path}: quality.reference"
    unknown = [name for name in reference if name not in space.params]
    if unknown:
        raise UserError(
            f"{where}: '{unknown[0]}' is not a parameter of the space ({', '.join(space.params) or 'none'})"
        )
    missing = [name for name in space.params if name not in reference]
    if missing:
        raise UserError(f"{where}: give a value for every parameter (missing: {', '.join(missing)}), or use 'baseline'")
    for name, value in reference.items():
        values = space.params[name]
        inside = (values.low <= value <= values.high) if isinstance(values, Range) and isinstance(value, (int, float)) else (
            not isinstance(values, Range) and value in values)  # fmt: skip
        if not inside:
            raise UserError(f"{where}: {name}={value!r} is not among the space's values for {name}")
    broken = space.constraint_violations(dict(reference))
    if broken:
        raise UserError(f"{where}: the reference breaks a constraint: {broken[0]}")


def _check_serve(space: SearchSpace, path: Path) -> None:
    """Serve replicas stand in for data parallelism (``export`` makes one of the other): not both."""
    dp = space.params.get("data_parallel_size", [space.engine_args.get("data_parallel_size", 1)])
    if isinstance(dp, Range) or any(int(v) != 1 for v in dp):
        raise UserError(
            f"{path}: params.{SERVE_REPLICAS}: Serve replicas replace data_parallel_size; vary one of them, not both"
        )


def _check_executors(space: SearchSpace, path: Path) -> None:
    """A bare-engine trial's engine runs its ranks as processes on the devices Ray reserved for the trial
    (``--distributed-executor-backend mp``, DESIGN). With Ray as its executor or data-parallel backend the
    engine joins the cluster as a driver of its own and places its workers with a placement group of its own:
    on devices Tune gave another trial, or after a wait of up to vLLM's placement timeout."""
    for name, ray in RAY_BACKENDS.items():
        fixed = space.engine_args.get(name)
        listed = space.params.get(name)
        values = [fixed] if listed is None else ([] if isinstance(listed, Range) else list(listed))
        if ray in values:
            field = f"engine_args.{name}" if listed is None else f"params.{name}"
            raise UserError(
                f"{path}: {field}: '{ray}' makes each trial's engine a Ray driver that places its own workers outside "
                "the devices its trial reserved; trials run their ranks as processes ('mp'), one node per engine "
                "(pipeline parallelism across nodes is not a trial servetune runs)"
            )


def _check_mtp(space: SearchSpace, path: Path, base: Path) -> None:
    """MTP drafts with heads the checkpoint itself carries: every checkpoint a space may serve with it must
    declare them (``num_nextn_predict_layers``). Read for ``tiny``, local directories and hub ids whose config is
    in the local Hugging Face cache; nothing is downloaded here (where the config is not at hand, vLLM refuses at
    start-up: a FAILED trial with its reason)."""
    listed = space.params.get(speculative.METHOD)
    methods = listed if isinstance(listed, list) else [space.engine_args.get(speculative.METHOD)]
    if "mtp" not in methods:
        return
    field = f"params.{speculative.METHOD}" if isinstance(listed, list) else f"engine_args.{speculative.METHOD}"
    models = space.params.get(MODEL_PARAM)
    for model in models if isinstance(models, list) else [space.model]:
        config = _hf_config(str(model), base)
        if config is not None and speculative.mtp_layers(config) == 0:
            raise UserError(
                f"{path}: {field}: mtp needs a checkpoint with multi-token-prediction heads; {model}'s config declares "
                f"none ({' or '.join(speculative.MTP_KEYS)})"
            )


def _listed(space: SearchSpace, name: str) -> tuple[str, list[Any]]:
    """The values a space gives ``name`` (listed in ``params``, else fixed in ``engine_args``) and that field."""
    listed = space.params.get(name)
    if isinstance(listed, list):
        return f"params.{name}", listed
    return f"engine_args.{name}", [space.engine_args.get(name)]


def _check_draft_vocab(space: SearchSpace, path: Path, base: Path) -> None:
    """A draft model must share its target's vocabulary (``capacity/vocab.py``: vLLM refuses another
    ``vocab_size``; another tokenizer of the same size drafts text the target rejects). Read where both are at
    hand (``tiny``, local directories, the local Hugging Face cache), unless every choice maps the vocabularies
    (``speculative.use_heterogeneous_vocab: true``)."""
    if DRAFT_MODEL not in _listed(space, speculative.METHOD)[1]:
        return
    if not any(v is None or v is False for v in _listed(space, speculative.PREFIX + "use_heterogeneous_vocab")[1]):
        return
    field, drafts = _listed(space, speculative.PREFIX + "model")
    models = space.params.get(MODEL_PARAM)
    for model in models if isinstance(models, list) else [space.model]:
        target = _hf_config(str(model), base)
        for draft in drafts:
            found = _hf_config(str(draft), base) if draft is not None else None
            if target is None or found is None:
                continue
            problem = vocab_problem(config_vocab_size(target), config_vocab_size(found),
                                    _tokens(str(model), base), _tokens(str(draft), base))  # fmt: skip
            if problem:
                raise UserError(f"{path}: {field}: draft model {draft} for {model}: {problem}")


def _tokens(model: str, base_dir: Path) -> dict[int, str] | None:
    """A checkpoint's tokenizer tokens where they are at hand (``capacity/vocab.py``; ``tiny``'s as it is built)."""
    if model == "tiny":
        return tokenizer_tokens(tiny_tokenizer_json())
    for directory in (Path(model).expanduser(), base_dir / model):  # where _hf_config reads the config
        if (directory / "config.json").is_file():
            return read_tokenizer(directory)
    return checkpoint_tokens(model)


def _check_gpus(space: SearchSpace, path: Path) -> None:
    """Every GPU type ``params.gpu`` lists must be a catalogue GPU: its memory sizes the capacity check, its Ray
    type places the trial and its name prices it."""
    from servetune.capacity.hardware import find_gpu, load_gpu_catalog

    listed = space.params.get(GPU_PARAM)
    for name in listed if isinstance(listed, list) else []:
        try:
            find_gpu(str(name))
        except UserError:
            raise UserError(
                f"{path}: params: {GPU_PARAM}: unknown GPU {name}; known: {', '.join(load_gpu_catalog())}"
            ) from None


def _hf_config(model: str, base_dir: Path) -> dict[str, Any] | None:
    """A checkpoint's Hugging Face config where it is at hand (``tiny``, a local directory); None elsewhere."""
    if model == "tiny":
        return TINY_CONFIG
    candidates = [Path(model).expanduser() / "config.json", base_dir / model / "config.json"]
    if is_hub_id(model, base_dir):
        cached = try_to_load_from_cache(model, "config.json")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    for path in candidates:
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        return config if isinstance(config, dict) else None
    return None


def _check_constraint_names(space: SearchSpace, path: Path) -> None:
    """Every name a constraint reads must exist, even where evaluation would never reach it."""
    known = {
        *ENGINE_DEFAULTS,
        "devices_per_node",
        MODEL_PARAM,
        GPU_PARAM,
        *space.params,
        *space.engine_args,
        *(ENV_PREFIX + k for k in space.env),
    }
    for text in space.constraints:
        for name in constraint_names(text):
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                raise UserError(
                    f"{path}: constraints: '{text}': '{name}' is neither a parameter, a fixed engine argument, nor devices_per_node{hint}"
                )


def _fewest_devices(space: SearchSpace) -> int:
    """The fewest devices a trial of this space can need: the product of the smallest parallel sizes."""
    sizes = []
    for name, default in ENGINE_DEFAULTS.items():
        values = space.params.get(name)
        if values is None:
            sizes.append(int(space.engine_args.get(name, default)))
        else:
            sizes.append(int(values.low) if isinstance(values, Range) else min(int(v) for v in values))
    return math.prod(sizes)


def _gridable(space: SearchSpace) -> bool:
    try:
        for values in space.params.values():
            if isinstance(values, Range):
                values.grid_values()
    except ValueError:
        if space.search.algorithm == "grid":
            raise
        return False
    return True
