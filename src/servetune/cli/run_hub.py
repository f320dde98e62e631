"""What ``servetune run`` asks the model hub before its first trial, and what its dry run says in its place.

The run asks the hub whether it serves each hub model of the space to the trials' token (servetune/hub.py): a
refusal ends it in one line, before anything is written or started. A dry run only plans and prints, so it asks no
hub unless told to (``--hub``): on a laptop behind a slow proxy, or in CI, it must neither wait on the network nor
depend on it. It plans from what is on this machine (servetune's model store, the Hugging Face cache, the shipped
catalogue: capacity/source.py ``hub_closed``) and says in a line each what it did not ask and how to keep a model
here that it could not plan.
"""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path

from servetune.config.space import MODEL_PARAM, SearchSpace


def hub_models(space: SearchSpace, space_dir: Path) -> dict[str, str]:
    """Each model of the space that is a hub id (no folder here), with the field that names it: ``model``, or
    ``params.model`` for a checkpoint the search varies (the field a line about it names)."""
    from servetune.models.names import is_hub_id

    listed = space.params.get(MODEL_PARAM) or []
    fields = {space.model: "model"}
    for name in listed if isinstance(listed, list) else []:
        fields.setdefault(str(name), f"params.{MODEL_PARAM}")
    return {name: field for name, field in fields.items() if is_hub_id(name, space_dir)}


def check_hub_models(space: SearchSpace, space_dir: Path) -> None:
    """Ask the hub, before anything is written or started, whether it serves each hub model of the space to the
    trials' token (servetune/hub.py): a refusal ends the run here in one line, an unreachable hub is a warning."""
    from servetune.hub import check_access
    from servetune.study.progress import stderr_console

    for name, field in hub_models(space, space_dir).items():
        warning = check_access(name, space_env(space), field)
        if warning:
            stderr_console().print(f"warning: {warning}", soft_wrap=True, highlight=False, markup=False)


def space_env(space: SearchSpace) -> dict[str, str]:
    return {k: str(v) for k, v in space.env.items()}


def unasked_lines(space: SearchSpace, space_dir: Path, refused: Set[str]) -> list[str]:
    """A dry run's lines on what it did not ask the hub: the access check the run makes (none where the user is
    offline, as the run makes none then), and each hub model it could not plan (``refused``: in no local cache),
    with how to keep it here."""
    from servetune.hub import offline

    lines = []
    models = hub_models(space, space_dir)
    off = offline(space_env(space))
    if models and not off:
        lines.append(f"hub access not asked for {', '.join(models)}: a dry run asks no hub (--hub asks it; the run "
                     "asks it before its first trial)")  # fmt: skip
    why, now = ("HF_HUB_OFFLINE is set", "") if off else ("a dry run asks no hub", ", or --hub fetches it now")
    for name in sorted(refused):
        lines.append(f"model {name}: not planned, its config.json is in no local cache and {why}; `servetune models "
                     f"add {name}` keeps its config and size here for planning where the hub can be reached (or `hf "
                     f"download {name} config.json`, or name a local directory){now}")  # fmt: skip
    return lines
