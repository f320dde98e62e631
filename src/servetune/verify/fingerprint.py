"""Content hashes of a model's weight and tokenizer files: what "weights pinned" means on disk.

The experiment record (tracking/inputs.py) fingerprints weights by file names and sizes, which
is instant but cannot tell two uploads of the same size apart. Acceptance pins the content:
every file is read in 1 MiB chunks through sha256 (a 16 GB checkpoint takes about a minute).

A model is found where the study served it from: a local directory; the study's own copy
(``STUDY_DIR/models/<name>``, where the tiny model is built, or a directory recorded on another
machine); or, for a hub id, the snapshot in the Hugging Face cache. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from servetune.models.names import is_hub_id

CHUNK_BYTES = 1 << 20
#: Weight files, by preference: safetensors, else PyTorch or GGUF checkpoints.
WEIGHT_PATTERNS = (("*.safetensors",), ("*.bin", "*.pt", "*.pth", "*.gguf"))
#: Files a Hugging Face tokenizer is loaded from (any that are present are hashed).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
)  # fmt: skip
#: Hex digits of a digest shown in evidence (the full digest is 64).
SHOWN_HEX = 16


@dataclass(frozen=True)
class FileHash:
    name: str
    size: int
    sha256: str  # full hex digest

    def __str__(self) -> str:
        return f"{self.name} ({_size(self.size)}) sha256:{self.sha256[:SHOWN_HEX]}"


@dataclass(frozen=True)
class ModelFiles:
    """A model directory found on this machine, and how."""

    path: Path
    source: str  # "local directory", "the study's copy", "Hugging Face cache"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(paths: list[Path]) -> list[FileHash]:
    return [FileHash(p.name, p.stat().st_size, sha256_file(p)) for p in sorted(paths)]


def combined_sha256(hashes: list[FileHash]) -> str:
    """One digest for a set of files: sha256 of their ``name digest`` lines, in name order."""
    lines = "".join(f"{h.name} {h.sha256}\n" for h in sorted(hashes, key=lambda h: h.name))
    return hashlib.sha256(lines.encode()).hexdigest()


def describe(hashes: list[FileHash], limit: int = 3) -> str:
    """Each file with its digest, or for many shards their count, total size and combined digest."""
    if len(hashes) <= limit:
        return ", ".join(str(h) for h in hashes)
    total = sum(h.size for h in hashes)
    return f"{len(hashes)} files ({_size(total)}), combined sha256:{combined_sha256(hashes)[:SHOWN_HEX]}"


def weight_files(directory: Path) -> list[Path]:
    for patterns in WEIGHT_PATTERNS:
        found = sorted(p for pattern in patterns for p in directory.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def tokenizer_files(directory: Path) -> list[Path]:
    return [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]


def locate(model: str, study_dir: Path, revision: str | None = None) -> ModelFiles | None:
    """Where the model's files are on this machine (None: a hub id that is not in the cache)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return ModelFiles(path, "local directory")
    copy = study_dir / "models" / path.name
    if not is_hub_id(model) and path.name and copy.is_dir():
        return ModelFiles(copy, "the study's copy")
    if is_hub_id(model):
        snapshot = _hub_snapshot(model, revision)
        if snapshot is not None:
            return ModelFiles(snapshot, "Hugging Face cache")
    return None


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json", revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return Path(found).parent if isinstance(found, str) else None


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
