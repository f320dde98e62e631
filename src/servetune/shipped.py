"""Where the files servetune ships beside its code live: ``trials/`` (workloads, the record template).

In a source checkout (and an editable install, and a Ray job's ``--working-dir``) they are the
repository's own ``trials/``. A wheel carries them as data files, installed under
``<prefix>/share/servetune/trials`` (pyproject.toml ``[tool.setuptools.data-files]``).
"""

from __future__ import annotations

import sys
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
