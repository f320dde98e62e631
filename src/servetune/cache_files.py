"""servetune's own cache folder, and files in it that are written whole and kept to a number.

``~/.cache/servetune`` (``$XDG_CACHE_HOME/servetune`` where set) holds what servetune works out once and reads back:
vLLM's argument table per version (engine/args.py), configs transformers resolved (capacity/hfcache.py). A file is
written to a temporary name and renamed, so a reader in another process never sees half of it, and each kind keeps
only its most recently used files (a read may mark one used by touching it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def cache_root() -> Path:
    """servetune's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "servetune"


def write_kept(path: Path, text: str, pattern: str, keep: int) -> bool:
    """Write ``text`` to ``path`` atomically, then remove all but the ``keep`` most recently used files of its folder
    matching ``pattern`` (``path`` itself always stays). False where it could not be written: a cache that cannot be
    written is no error, the answer is only worked out again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        return False
    used: list[tuple[float, Path]] = []
    for old in path.parent.glob(pattern):
        with contextlib.suppress(OSError):  # another process removed it
            used.append((old.stat().st_mtime, old))
    used.sort(reverse=True)
    for _, old in used[keep:]:
        if old != path:
            with contextlib.suppress(OSError):
                old.unlink()
    return True
