"""GGUF checkpoints (``--model x.gguf``): the architecture from the file's metadata, the weights from its tensors.

The test writes a tiny llama-shaped GGUF v3 file itself (the format as llama.cpp's spec gives it: header, metadata,
tensor infos, aligned tensor data), with tensors of four ggml types, and plans it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from servetune import cli
from servetune.capacity import load_model_arch, plan_capacity
from servetune.capacity.hardware import Hardware
from servetune.capacity.params import weight_bytes_per_rank
from servetune.errors import UserError

CPU = Hardware(device="cpu", name="cpu", fp8=False)
#: ggml type: (id, elements per block, bytes per block), from ggml's block structs.
TYPES = {"F32": (0, 1, 4), "F16": (1, 1, 2), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
HIDDEN, FFN, VOCAB, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 512, 2, 4, 2, 2048


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _tensors() -> list[tuple[str, list[int], str]]:
    kv = KV_HEADS * HIDDEN // HEADS
    tensors = [("token_embd.weight", [HIDDEN, VOCAB], "Q8_0"), ("output_norm.weight", [HIDDEN], "F32")]
    tensors.append(("output.weight", [HIDDEN, VOCAB], "Q6_K"))
    for i in range(LAYERS):
        tensors += [
            (f"blk.{i}.attn_norm.weight", [HIDDEN], "F32"),
            (f"blk.{i}.attn_q.weight", [HIDDEN, HIDDEN], "Q8_0"),
            (f"blk.{i}.attn_k.weight", [HIDDEN, kv], "Q8_0"),
            (f"blk.{i}.attn_v.weight", [HIDDEN, kv], "F16"),
            (f"blk.{i}.attn_output.weight", [HIDDEN, HIDDEN], "Q4_K"),
            (f"blk.{i}.ffn_norm.weight", [HIDDEN], "F32"),
            (f"blk.{i}.ffn_gate.weight", [HIDDEN, FFN], "Q4_K"),
            (f"blk.{i}.ffn_up.weight", [HIDDEN, FFN], "Q4_K"),
            (f"blk.{i}.ffn_down.weight", [FFN, HIDDEN], "Q6_K"),
        ]
    return tensors


def write_gguf(path: Path, *, context: int = CONTEXT, arch: str = "llama", splits: int = 0) -> dict[str, int]:
    """A llama-shaped GGUF v3 file (``splits``: the first shard of that many, as llama.cpp's gguf-split writes
    them); returns the bytes of its tensor data per ggml type."""
    u16, u32, i32, string, array = 2, 4, 5, 8, 9
    metadata = [
        ("general.architecture", string, _string(arch)),
        ("general.alignment", u32, struct.pack("<I", 32)),
        (f"{arch}.block_count", u32, struct.pack("<I", LAYERS)),
        (f"{arch}.context_length", u32, struct.pack("<I", context)),
        (f"{arch}.embedding_length", u32, struct.pack("<I", HIDDEN)),
        (f"{arch}.feed_forward_length", u32, struct.pack("<I", FFN)),
        (f"{arch}.attention.head_count", u32, struct.pack("<I", HEADS)),
        (f"{arch}.attention.head_count_kv", u32, struct.pack("<I", KV_HEADS)),
        (f"{arch}.rope.dimension_count", u32, struct.pack("<I", HIDDEN // HEADS)),
        ("tokenizer.ggml.tokens", array, struct.pack("<IQ", string, VOCAB) + b"".join(_string(f"t{i}") for i in range(VOCAB))),
        ("tokenizer.ggml.token_type", array, struct.pack("<IQ", i32, VOCAB) + struct.pack(f"<{VOCAB}i", *[1] * VOCAB)),
    ]  # fmt: skip
    if splits:
        metadata += [("split.no", u16, struct.pack("<H", 0)), ("split.count", u16, struct.pack("<H", splits))]
    tensors = _tensors()
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    header += b"".join(_string(key) + struct.pack("<I", kind) + value for key, kind, value in metadata)
    blobs, per_type, offset = [], dict.fromkeys(TYPES, 0), 0
    for name, dims, type_name in tensors:
        kind, block, size = TYPES[type_name]
        elements = dims[0] * (dims[1] if len(dims) > 1 else 1)
        nbytes = elements // block * size
        per_type[type_name] += nbytes
        header += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        header += struct.pack("<IQ", kind, offset)
        pad = -nbytes % 32
        blobs.append(bytes(nbytes) + bytes(pad))
        offset += nbytes + pad
    header += bytes(-len(header) % 32)
    path.write_bytes(header + b"".join(blobs))
    return per_type


def test_a_gguf_file_is_planned_from_its_metadata_and_its_tensor_bytes(tmp_path: Path) -> None:
    path = tmp_path / "tiny-llama.Q8_0.gguf"
    per_type = write_gguf(path)
    arch = load_model_arch(path)
    assert (arch.num_layers, arch.num_attention_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 64)
    assert (arch.hidden_size, arch.vocab_size, arch.max_position_embeddings) == (HIDDEN, VOCAB, CONTEXT)
    assert arch.quant.method == "gguf" and not arch.tie_word_embeddings
    # Weights: the quantized tensors as stored, the floating ones cast to the served bfloat16 (F32 norms: 2 B).
    stored = sum(per_type.values()) - per_type["F32"] // 2
    rope_cache = CONTEXT * 64 * 2
    assert weight_bytes_per_rank(arch, arch.quant, 2) == pytest.approx(stored + rope_cache, abs=1)
    # The KV cache is the engine's dtype: 2 (K, V) x 2 layers x 2 KV heads x 64 x 2 B = 1024 B a token.
    plan = plan_capacity(arch, {"quantization": "gguf"}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert plan.kv_bytes_per_token == 1024
    assert plan.kv_cache_tokens == 2**30 // 1024
    fp8 = plan_capacity(arch, {"kv_cache_dtype": "fp8"}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert fp8.kv_bytes_per_token == 512 and fp8.weights_gib == plan.weights_gib


def test_servetune_plan_reads_a_gguf_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tiny.gguf"
    write_gguf(path, context=4096)
    argv = ["plan", "--model", str(path), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--json"]
    assert cli.main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document.get("planned", True) is not False and document["kv_cache_tokens"] == 2**20
    assert document["settings"]["max_model_len"] == 4096  # the GGUF metadata's llama.context_length


@pytest.mark.parametrize("content", [b"not a gguf file", b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + b"\x05"])
def test_a_bad_gguf_file_is_one_line_naming_it(tmp_path: Path, capsys, content: bytes) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"broken\.gguf: not a readable GGUF file"):
        load_model_arch(path)
    assert cli.main(["plan", "--model", str(path), "--device", "cpu", "--cpu-kvcache-space-gib", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "broken.gguf" in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_quantization_gguf_without_a_gguf_file_is_not_planned(tmp_path: Path, capsys) -> None:
    argv = ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--quantization", "gguf"]
    assert cli.main(argv) == 0
    assert "give it as --model FILE.gguf" in capsys.readouterr().out


def test_a_gguf_architecture_the_planner_does_not_read_is_not_planned(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gemma.gguf"
    write_gguf(path, arch="gemma3")
    argv = ["plan", "--model", str(path), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--json"]
    assert cli.main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["planned"] is False and document["reason"].startswith("GGUF architecture gemma3")


def test_the_first_shard_of_a_split_gguf_is_not_planned_from_its_own_tensors(tmp_path: Path, capsys) -> None:
    """A split GGUF (gguf-split's model-00001-of-00003.gguf) holds a third of the weights in its first file:
    planning from it would under-count them, so it runs not planned, saying how to merge it."""
    path = tmp_path / "model-00001-of-00003.gguf"
    write_gguf(path, splits=3)
    argv = ["plan", "--model", str(path), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--json"]
    assert cli.main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["planned"] is False and "split GGUF" in document["reason"] and "3 files" in document["reason"]
