"""What a model's name says it is: a Hugging Face hub repository (``org/name``) or a folder on this machine.

One answer for every room that asks: the space's loader and the driver's hub check (is there a repository to
ask?), the planner (is there a config to fetch?), verify's fingerprint (are the files in the hub's cache?) and the
trial's failure classes (could its weights have been downloading?).
"""

from __future__ import annotations

from pathlib import Path


def looks_like_hub_id(name: str) -> bool:
    """``org/name``: the form the hub (and vLLM's ``--model``) accepts as a repository id, whatever is on disk."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~")) and all(name.split("/"))


def is_hub_id(name: str, base: Path | None = None) -> bool:
    """``org/name`` that is no folder on this machine: not as given (``~`` expanded), nor under ``base`` (the
    space file's folder, against which a space's relative paths are read)."""
    if not looks_like_hub_id(name) or Path(name).expanduser().exists():
        return False
    return base is None or not (base / name).exists()
