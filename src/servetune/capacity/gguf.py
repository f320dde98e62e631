"""A GGUF checkpoint (``--model x.gguf``): its architecture from the file's metadata, its weights from its tensors.

vLLM 0.32 reads no Hugging Face ``config.json`` for a ``.gguf`` file: transformers builds the config from the
GGUF metadata (``{arch}.block_count``, ``{arch}.attention.head_count`` ...), and GGUF's quantized tensors are
loaded as stored (no dequantization). So the weights are the tensors' bytes, each tensor's from its ggml type's
block size and bytes per block; floating tensors (F32, F16, BF16) are cast to the served dtype as with
safetensors. The KV cache dtype is the engine's (GGUF quantizes weights only).

Only the header is read (metadata and tensor infos, memory-mapped), never the tensor data; no ``gguf`` package
is needed (vLLM 0.32 moved GGUF to ``vllm-gguf-plugin``, which this environment may lack).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

from servetune.capacity.checkpoint import Checkpoint
from servetune.capacity.model import ModelArch, WeightQuant
from servetune.errors import UserError

MAGIC = b"GGUF"
#: ggml type id -> (name, elements per block, bytes per block), as gguf-py's ``GGML_QUANT_SIZES``.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17),
}  # fmt: skip
#: Bytes per element of each ggml type (blocks are 32 or 256 elements: exact in binary).
GGUF_DTYPE_BYTES: dict[str, float] = {name: size / block for name, block, size in GGML_TYPES.values()}
#: Metadata value types: struct format of the scalars (8: string, 9: array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: Numeric arrays up to this long are kept (per-layer values); longer ones are only counted.
_KEPT = 1024
#: GGUF architectures whose every layer is full attention (a dense or a routed-expert MLP): what the ledger sizes.
PLANNED_ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
}


class _Header:
    """A cursor over the memory-mapped header: little-endian scalars, strings, arrays."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        raw = self.data[self.at : self.at + length]
        if len(raw) != length:
            raise ValueError("a string runs past the end of the file")
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS and count <= _KEPT:  # per-layer numbers (head_count_kv in some files)
                fmt = f"<{count}{_SCALARS[item][1]}"
                values = list(struct.unpack_from(fmt, self.data, self.at))
                self.at += struct.calcsize(fmt)
                return values
            if item in _SCALARS:  # a tokenizer's scores, token types: skipped over, only their count kept
                self.at += count * struct.calcsize(_SCALARS[item])
                return _Count(count)
            return self._skip(item, count)
        raise ValueError(f"unknown metadata value type {kind}")

    def _skip(self, item: int, count: int) -> _Count:
        for _ in range(count):
            if item == _STRING:  # a vocabulary's tokens: stepped over, not decoded
                length = self.scalar("<Q")  # read first: it moves the cursor past itself
                self.at += length
            else:
                self.value(item)
        if self.at > len(self.data):
            raise ValueError("an array runs past the end of the file")
        return _Count(count)


class _Count(int):
    """An array's length, where its items are not kept (a tokenizer's vocabulary)."""


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    """The file's metadata and, per tensor, (ggml type name, element count). One :class:`UserError` line
    naming the file where it is not a GGUF file this reader knows."""
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Header(data))
    except (OSError, ValueError, struct.error) as exc:
        raise UserError(f"{path}: not a readable GGUF file ({exc})") from None


def _parse(header: _Header) -> tuple[dict[str, Any], dict[str, tuple[str, int]]]:
    if header.data[:4] != MAGIC:
        raise ValueError("no GGUF magic")
    header.at = 4
    version = header.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; vLLM reads versions 2 and 3")
    n_tensors, n_kv = header.scalar("<Q"), header.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = header.string()
        metadata[key] = header.value(header.scalar("<I"))
    tensors: dict[str, tuple[str, int]] = {}
    for _ in range(n_tensors):
        name = header.string()
        dims = [header.scalar("<Q") for _ in range(header.scalar("<I"))]
        kind = header.scalar("<I")
        header.scalar("<Q")  # offset into the data section
        if kind not in GGML_TYPES:
            raise ValueError(f"tensor {name}: ggml type {kind} is not one the planner knows")
        elements = 1
        for dim in dims:
            elements *= dim
        type_name, block, _ = GGML_TYPES[kind]
        if elements % block:
            raise ValueError(f"tensor {name}: {elements} elements is not a whole number of {type_name} blocks")
        tensors[name] = (type_name, elements)
    return metadata, tensors


def gguf_checkpoint(tensors: dict[str, tuple[str, int]]) -> Checkpoint:
    counts: dict[str, int] = {}
    for type_name, elements in tensors.values():
        counts[type_name] = counts.get(type_name, 0) + elements
    return Checkpoint(parameters=counts, type_bytes={t: GGUF_DTYPE_BYTES[t] for t in counts})


def _field(metadata: dict[str, Any], path: Path, key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if isinstance(value, list):  # per-layer values (head_count_kv in some files): the largest layer's
        value = max(value) if value else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UserError(f"{path}: GGUF metadata {key} is missing or not a whole number")
    return int(value)


def arch_from_gguf(path: Path) -> ModelArch:
    """The architecture vLLM reads from a GGUF file's metadata, with the file's tensor bytes as its checkpoint."""
    metadata, tensors = read_gguf(path)
    name = metadata.get("general.architecture")
    if not isinstance(name, str):
        raise UserError(f"{path}: GGUF metadata general.architecture is missing")
    p = f"{name}."
    heads = _field(metadata, path, p + "attention.head_count")
    hidden = _field(metadata, path, p + "embedding_length")
    if not heads:
        raise UserError(f"{path}: GGUF metadata {p}attention.head_count is 0")
    embedding = tensors.get("token_embd.weight")
    vocab = metadata.get(p + "vocab_size") or metadata.get("tokenizer.ggml.tokens")
    if not vocab and embedding is not None:
        vocab = embedding[1] // hidden
    experts = _field(metadata, path, p + "expert_count", 0)
    dense = _field(metadata, path, p + "feed_forward_length", 0)
    quantized = {t: e for t, e in tensors.values() if t not in ("F32", "F16", "BF16", "F64")}
    bits = sum(GGUF_DTYPE_BYTES[t] * e for t, e in quantized.items()) * 8 / max(1, sum(quantized.values()))
    unplanned = (
        None
        if name in PLANNED_ARCHS
        else f"GGUF architecture {name}: the planner sizes {', '.join(PLANNED_ARCHS)} GGUF files"
    )
    splits = metadata.get("split.count")
    if isinstance(splits, int) and splits > 1:  # this file holds one shard's tensors: the weights would read short
        unplanned = (
            f"a split GGUF ({splits} files, this one shard {int(metadata.get('split.no') or 0) + 1}): the "
            "planner reads one file's tensors; merge them first (llama.cpp's gguf-split --merge)"
        )
    fields: dict[str, Any] = {
        "name": str(path),
        "architecture": PLANNED_ARCHS.get(name, name),
        "num_layers": _field(metadata, path, p + "block_count"),
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": _field(metadata, path, p + "attention.head_count_kv", heads),
        "head_dim": _field(metadata, path, p + "attention.key_length", hidden // heads),
        "intermediate_size": 0 if experts else dense,
        "vocab_size": int(vocab) if vocab else _field(metadata, path, p + "vocab_size"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "max_position_embeddings": _field(metadata, path, p + "context_length"),
        "rotary_dim": metadata.get(p + "rope.dimension_count") or None,
        "qk_norm": "blk.0.attn_q_norm.weight" in tensors,
        "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "quant": WeightQuant(method="gguf", bits=max(1, min(32, round(bits))) if quantized else 16),
        "checkpoint": gguf_checkpoint(tensors),
        "not_planned": unplanned,
    }
    if experts:
        fields["num_experts"] = experts
        fields["num_experts_per_tok"] = _field(metadata, path, p + "expert_used_count")
        fields["moe_intermediate_size"] = _field(metadata, path, p + "expert_feed_forward_length", dense)
        fields["shared_expert_intermediate_size"] = _field(metadata, path, p + "expert_shared_feed_forward_length", 0)
    try:
        return ModelArch(**fields)
    except ValueError as exc:
        first = str(exc).splitlines()
        raise UserError(f"{path}: GGUF metadata is not a model the planner reads ({first[-1].strip()})") from None
