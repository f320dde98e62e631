"""A tiny Llama-architecture model that vLLM loads offline.

Random weights from a fixed seed, a byte-level tokenizer (one token per byte, so any text
encodes and token counts are exact), a chat template, safetensors. The same files every time.

:func:`build_tiny_adapter` writes a LoRA adapter for it in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``, rank 8 on ``q_proj`` and ``v_proj``), also random from a fixed seed, that vLLM
serves with ``--enable-lora --lora-modules NAME=DIR``.

The output head only gives weight to printable ASCII bytes, so the random model streams
readable text and every generated token decodes to a character on its own (no partial UTF-8
held back by the detokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEED = 20261129
BOS, EOS = "<s>", "</s>"
BYTE_TOKENS = 256

#: The architecture of the tiny model (a Hugging Face ``LlamaConfig``).
TINY_CONFIG: dict = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": BYTE_TOKENS + 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": BYTE_TOKENS,
    "eos_token_id": BYTE_TOKENS + 1,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level tokenizers."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tiny_tokenizer_json() -> str:
    """The tiny model's ``tokenizer.json`` text, as :func:`build_tiny_model` writes it."""
    return _tokenizer_json()


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(BYTE_TOKENS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    return tok.to_str(pretty=True)


def _weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]
    std = config["initializer_range"]

    def normal(*shape: int, scale: float = std) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, scale=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, inter)
        tensors[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    # Logits of about +-5 for printable ASCII (space .. '~'), exactly 0 for every other token.
    head = np.zeros((vocab, hidden), np.float32)
    printable = np.arange(ord(" "), ord("~") + 1)
    head[printable] = normal(len(printable), hidden, scale=5.0 / np.sqrt(hidden))
    tensors["lm_head.weight"] = head
    return tensors


def parameter_count(config: dict = TINY_CONFIG) -> int:
    return sum(int(t.size) for t in _weights(config, SEED).values())


def build_tiny_model(out: Path, seed: int = SEED) -> Path:
    """Write the tiny model into ``out`` (created if missing) and return it."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BYTE_TOKENS, "eos_token_id": BYTE_TOKENS + 1}, indent=2) + "\n"
    )
    write_tokenizer(out, TINY_CONFIG["max_position_embeddings"])
    save_file(_weights(TINY_CONFIG, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_tokenizer(out: Path, model_max_length: int) -> None:
    """The byte-level tokenizer and its chat template into the model directory ``out`` (which must exist)."""
    (out / "tokenizer.json").write_text(_tokenizer_json() + "\n")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, indent=2) + "\n"
    )


#: The tiny adapter: PEFT LoRA of this rank on these modules of every layer.
TINY_LORA_RANK = 8
TINY_LORA_TARGETS = ("q_proj", "v_proj")
TINY_LORA_SEED = SEED + 1


def tiny_adapter_config(rank: int = TINY_LORA_RANK) -> dict:
    """The tiny adapter's ``adapter_config.json`` (PEFT's LoRA fields, as vLLM's ``PEFTHelper`` reads them)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "tiny",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TINY_LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def _adapter_weights(config: dict, rank: int, seed: int) -> dict[str, np.ndarray]:
    """lora_A (rank x in) and lora_B (out x rank) for each targeted module, named as PEFT saves them. B is not
    zero (a freshly initialised PEFT adapter's is), so the adapter changes what the model says."""
    rng = np.random.default_rng(seed)
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    out = {"q_proj": config["num_attention_heads"] * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    tensors: dict[str, np.ndarray] = {}
    for i in range(config["num_hidden_layers"]):
        for module in TINY_LORA_TARGETS:
            name = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) / np.sqrt(hidden)).astype(
                np.float32
            )
            tensors[f"{name}.lora_B.weight"] = (rng.standard_normal((out[module], rank)) * 0.02).astype(np.float32)
    return tensors


def build_tiny_adapter(out: Path, rank: int = TINY_LORA_RANK, seed: int = TINY_LORA_SEED) -> Path:
    """Write a LoRA adapter for the tiny model into ``out`` (created if missing) and return it."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(tiny_adapter_config(rank), indent=2, sort_keys=True) + "\n")
    save_file(
        _adapter_weights(TINY_CONFIG, rank, seed), str(out / "adapter_model.safetensors"), metadata={"format": "pt"}
    )
    return out
