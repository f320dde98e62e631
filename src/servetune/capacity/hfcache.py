"""An on-disk cache of the configs transformers resolves, so that a model read once never imports transformers again.

Reading a ``config.json`` through transformers' own config classes (``hfconfig._library_config``) imports
transformers and torch: seconds of a core in every command and trial worker that plans a local model. The resolved
dict is kept under ``~/.cache/servetune/hf-configs`` (``$XDG_CACHE_HOME`` where set), one JSON file per key, and
read back instead. The key is a hash of everything the answer depends on: the file's content, the ``hf_overrides``
merged into it, the versions of transformers and huggingface_hub, and the source of the code that builds the answer;
change any of them and the key changes. Only answers that survive a JSON round trip unchanged are kept, and the
:data:`KEPT_CONFIGS` most recently used files stay (a read marks a file used).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any

from servetune.cache_files import cache_root, write_kept

#: How many resolved configs the cache keeps (the most recently used); each is a few kB.
KEPT_CONFIGS = 256
#: The layout of a cached file; part of the key, so a new layout never reads an old file.
CACHE_FORMAT = 1
LIBRARIES = ("transformers", "huggingface_hub")


def cache_dir() -> Path:
    return cache_root() / "hf-configs"


def config_key(config: dict[str, Any], overrides: dict[str, Any], code: Path) -> str | None:
    """The cache key of ``config`` with ``overrides`` merged, as resolved by the code in ``code`` (a module file).

    None where there is nothing to key on (values JSON cannot state, a library not installed, ``code`` unreadable):
    then nothing is cached."""
    try:
        stated = json.dumps([CACHE_FORMAT, config, overrides], sort_keys=True)
        versions = _library_versions()
        source = _code_digest(str(code))
    except (TypeError, ValueError, OSError, importlib.metadata.PackageNotFoundError):
        return None
    return hashlib.sha256("\n".join([stated, versions, source]).encode()).hexdigest()


@functools.cache
def _library_versions() -> str:  # once per process: asking the installed packages costs 1.5 ms a time
    return " ".join(f"{name}=={importlib.metadata.version(name)}" for name in LIBRARIES)


@functools.cache
def _code_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_config(key: str | None) -> dict[str, Any] | None:
    """The resolved config cached under ``key``; None where there is none (or it cannot be read)."""
    if key is None:
        return None
    path = cache_dir() / f"{key}.json"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: the cap keeps the configs in use
    return cached


def write_config(key: str | None, resolved: dict[str, Any]) -> None:
    """Keep ``resolved`` under ``key`` (atomically), if JSON states it exactly; then drop all but the
    :data:`KEPT_CONFIGS` most recently used. A cache that cannot be written is no error: the next read resolves
    the config again."""
    if key is None:
        return
    try:
        text = json.dumps(resolved)
        if json.loads(text) != resolved:  # a tuple, a NaN, ...: the read back would not be the same answer
            return
    except (TypeError, ValueError):
        return
    write_kept(cache_dir() / f"{key}.json", text, "*.json", KEPT_CONFIGS)
