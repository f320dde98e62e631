"""What an experiment record reads from disk besides ``result.json``: the request lengths a
trial actually sent (``requests.jsonl``), a fingerprint of the model's weights, the engine
log's tail. Every reader returns "nothing known" rather than raising for a missing file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

UNKNOWN = "unknown"


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: list[int]) -> Percentiles | None:
        if not values:
            return None
        p50, p95, p99 = np.percentile(np.asarray(values, dtype=float), [50, 95, 99])
        return cls(float(p50), float(p95), float(p99))

    def __str__(self) -> str:
        return f"P50 {self.p50:g} / P95 {self.p95:g} / P99 {self.p99:g}"


@dataclass(frozen=True)
class RequestStats:
    """Token lengths of the measured (not warm-up) requests of one trial."""

    requests: int
    input_tokens: Percentiles | None  # the server's prompt_tokens where known, else what was asked
    output_tokens: Percentiles | None  # the server's usage, finished requests only


def read_request_stats(path: Path) -> RequestStats | None:
    """Lengths from a trial's ``requests.jsonl``; None when the file is missing or empty."""
    inputs: list[int] = []
    outputs: list[int] = []
    count = 0
    try:
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a killed trial
                if not isinstance(record, dict) or record.get("warmup"):
                    continue
                count += 1
                prompt = record.get("prompt_tokens")
                prompt = prompt if prompt is not None else record.get("input_tokens")
                if isinstance(prompt, int):
                    inputs.append(prompt)
                if isinstance(record.get("output_tokens"), int):
                    outputs.append(record["output_tokens"])
    except OSError:
        return None
    if not count:
        return None
    return RequestStats(count, Percentiles.of(inputs), Percentiles.of(outputs))


@dataclass(frozen=True)
class ModelFingerprint:
    weights_hash: str  # "sha256:<16 hex> (<what was hashed>)" or "unknown"
    config_dtype: str | None  # the checkpoint's own dtype (config.json), when readable


def model_fingerprint(model: str) -> ModelFingerprint:
    """Hash the weight files' names and sizes of a local model, or a hub model's cached config.json.

    Names and sizes (not contents) keep this instant for 100 GB checkpoints while still telling
    two checkpoints apart; hub ids are hashed from the config.json in the Hugging Face cache,
    if it is there (nothing is downloaded).
    """
    path = Path(model).expanduser()
    if path.is_dir():
        weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
        config = path / "config.json"
        if weights:
            listing = "".join(f"{f.name}:{f.stat().st_size}\n" for f in weights)
            digest = _sha256(
                listing.encode(),
                "safetensors names+sizes" if weights[0].suffix == ".safetensors" else "weight names+sizes",
            )
        elif config.is_file():
            digest = _sha256(config.read_bytes(), "config.json")
        else:
            digest = UNKNOWN
        return ModelFingerprint(digest, _config_dtype(config))
    cached = _hub_config(model)
    if cached is None:
        return ModelFingerprint(UNKNOWN, None)
    return ModelFingerprint(_sha256(cached.read_bytes(), "config.json"), _config_dtype(cached))


def _sha256(data: bytes, what: str) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()[:16]} ({what})"


def _config_dtype(config: Path) -> str | None:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    dtype = data.get("dtype") or data.get("torch_dtype") or (data.get("text_config") or {}).get("torch_dtype")
    return str(dtype) if dtype else None


def _hub_config(model: str) -> Path | None:
    if model.count("/") != 1:
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def log_tail(path: Path, max_bytes: int = 65536) -> str:
    """The last ``max_bytes`` of a log ('' when there is none)."""
    try:
        with path.open("rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(size - max_bytes, 0))
            return log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
