"""Reading YAML into pydantic models, with one-line errors that name the file and field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from servetune.errors import UserError

M = TypeVar("M", bound=BaseModel)

#: Tags of the tagged unions in servetune's config models (workload lengths, parameter values).
UNION_TAGS = {
    "fixed", "uniform", "normal", "lognormal", "empirical", "exponential", "values", "range",
    "workload-named", "workload-inline",
}  # fmt: skip


def describe_validation_error(exc: ValidationError, source: str) -> str:
    """``chat.yaml: input_tokens.sigma: Input should be greater than 0`` (first error only)."""
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    more = len(exc.errors()) - 1
    tail = f" (and {more} more problem{'s' * (more > 1)})" if more else ""
    return f"{source}: {loc or '<top>'}: {msg}{tail}"


def _is_union_tag(part: object) -> bool:
    # pydantic puts the chosen member of a tagged union in the location ("lognormal"); the
    # user wrote no such key, so leave it out.
    return isinstance(part, str) and part in UNION_TAGS


def load_yaml_model(path: str | Path, model: type[M], **context: object) -> M:
    """Load ``path`` as YAML and validate it as ``model``; any problem is a :class:`UserError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"{path}: file not found") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys at the top level")
    try:
        return model.model_validate(data, context={"base_dir": path.parent, **context})
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, str(path))) from None
