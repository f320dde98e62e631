"""Where the files servetune ships beside its code live: ``trials/`` (workloads, the record template); and where
its code is, for the processes it starts (:func:`child_env`).

In a source checkout (and an editable install, and a Ray job's ``--working-dir``) they are the
repository's own ``trials/``. A wheel carries them as data files, installed under
``<prefix>/share/servetune/trials`` (pyproject.toml ``[tool.setuptools.data-files]``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CHECKOUT_TRIALS = Path(__file__).resolve().parents[2] / "trials"


def trials_dir(checkout: Path = CHECKOUT_TRIALS, prefixes: tuple[str, ...] | None = None) -> Path:
    """The checkout's ``trials/`` if there is one, else the installed copy (the checkout's path
    when neither exists, so that errors name where the files were expected)."""
    if checkout.is_dir():
        return checkout
    for prefix in prefixes if prefixes is not None else (sys.prefix, sys.base_prefix):
        installed = Path(prefix) / "share" / "servetune" / "trials"
        if installed.is_dir():
            return installed
    return checkout


def absolute_pythonpath(value: str, path: Sequence[str]) -> str:
    """``PYTHONPATH`` with each relative entry made absolute as this interpreter made it at start-up (``path``:
    ``sys.path``, whose entries from ``PYTHONPATH`` Python made absolute against its first working directory).

    A job's runtime env sets ``PYTHONPATH: src`` (cluster/runtime_env.yaml) so that the submitted source runs.
    A Ray worker starts in the job's working directory and reads it right; a trial then runs in its own Tune
    directory, and a process it starts with the relative entry finds no ``src`` there and imports whatever
    servetune the node has installed. An entry this interpreter does not hold is made absolute here."""
    entries = []
    for entry in value.split(os.pathsep):
        if entry and not os.path.isabs(entry):
            tail = Path(entry).parts
            held = [p for p in path if os.path.isabs(p) and Path(p).parts[-len(tail) :] == tail and os.path.isdir(p)]
            entry = held[0] if held else os.path.abspath(entry)
        entries.append(entry)
    return os.pathsep.join(entries)


def child_env(environ: Mapping[str, str] | None = None, path: Sequence[str] | None = None) -> dict[str, str]:
    """The environment of a process servetune starts that imports servetune (the engine's reaper, a load client
    shard): this one's, with its ``PYTHONPATH`` absolute (:func:`absolute_pythonpath`), so the child imports the
    servetune this process runs, wherever it starts."""
    env = dict(os.environ if environ is None else environ)
    if env.get("PYTHONPATH"):
        env["PYTHONPATH"] = absolute_pythonpath(env["PYTHONPATH"], sys.path if path is None else path)
    return env
