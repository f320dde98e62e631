"""Tiny random-weight checkpoints of the architectures the capacity planner models beyond Llama.

The KV cache of these architectures is laid out differently from a Llama's (sliding-window groups, Mamba and
gated-DeltaNet state per sequence), and no public start-up log of them was found, so servetune builds each one
small enough for vLLM's CPU build and compares the planner with what vLLM allocates (``bench/arch_vllm.py``).

Each entry of :data:`TINY_ARCHS` is a ``config.json`` as published checkpoints write it, shrunk (hidden size 256,
a few layers, the byte tokenizer's 258 tokens); transformers' own config class fills every field left out, as it
does for a real checkpoint. :func:`build_tiny_arch` builds transformers' model class from it with random weights
from a fixed seed and saves it with ``save_pretrained``, beside the tiny model's byte-level tokenizer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from servetune.models.tiny import BYTE_TOKENS, SEED, write_tokenizer

#: What every tiny checkpoint shares: the byte tokenizer's vocabulary and special tokens, float32 weights.
_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": BYTE_TOKENS + 2,
    "max_position_embeddings": 8192,
    "bos_token_id": BYTE_TOKENS,
    "eos_token_id": BYTE_TOKENS + 1,
    "pad_token_id": BYTE_TOKENS + 1,
    "torch_dtype": "float32",
}

#: Name -> ``config.json`` of each tiny architecture.
TINY_ARCHS: dict[str, dict[str, Any]] = {
    # Text gemma-3: 5 sliding-window layers to 1 global (transformers' default layer_types for 12 layers).
    "gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 12,
        "head_dim": 64,
        "query_pre_attn_scalar": 64,
        "sliding_window": 512,
        "tie_word_embeddings": True,
    },
    # granite-4.0-h: Mamba-2 layers and attention layers 3:1, a dense shared MLP (no routed experts).
    "granite-4.0-h": {
        **_COMMON,
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 8,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2,
        "num_local_experts": 0,
        "shared_intermediate_size": 512,
        "position_embedding_type": "rope",
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "mamba_d_state": 64,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Jamba: Mamba-1 layers and attention layers 3:1 (attn_layer_period 4, offset 3), dense MLPs.
    "jamba": {
        **_COMMON,
        "architectures": ["JambaForCausalLM"],
        "model_type": "jamba",
        "num_hidden_layers": 8,
        "attn_layer_period": 4,
        "attn_layer_offset": 3,
        "num_experts": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "use_mamba_kernels": False,
    },
    # Qwen3-Next: gated-DeltaNet layers and gated attention 3:1 (full_attention_interval 4), routed experts.
    "qwen3-next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,  # the CPU build's GDN kernel refuses a head dim of 32
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
    },
    # gpt-oss: window layers and global layers alternating (window first), attention sinks, routed experts.
    "gpt-oss": {
        **_COMMON,
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "head_dim": 64,
        "intermediate_size": 256,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 128,
    },
    # Mistral-7B-v0.1 style: every layer attends within one sliding window.
    "mistral-sliding": {
        **_COMMON,
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "num_hidden_layers": 4,
        "head_dim": 64,
        "sliding_window": 512,
    },
}


# The tiny Qwen3-Next with one multi-token-prediction layer (``speculative_config`` method ``mtp``, vLLM's
# ``qwen3_next_mtp.py``): a gated-attention MoE decoder layer, ``fc`` (2 x hidden -> hidden) and three norms, stored
# under ``mtp.*`` as the published checkpoint stores them (transformers' model class has no MTP layers).
TINY_ARCHS["qwen3-next-mtp"] = {**TINY_ARCHS["qwen3-next"], "num_nextn_predict_layers": 1}


def _add_mtp_layers(out: Path, model: Any, layers: int, seed: int) -> None:
    """Append ``layers`` Qwen3-Next MTP layers to the saved checkpoint in ``out``: each a copy of a full-attention
    decoder layer of the same config with its own random weights (a second model from ``seed + 1``, saved as the
    first so that its experts are stored one by one, as published checkpoints store them), plus ``fc``
    and the ``norm``, ``pre_fc_norm_hidden`` and ``pre_fc_norm_embedding`` (zero-centred, as Qwen3-Next's)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    config = model.config
    full = config.layer_types.index("full_attention")
    torch.manual_seed(seed + 1)
    with tempfile.TemporaryDirectory(prefix="servetune-mtp-") as folder:  # saved as checkpoints name the experts
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        donor = load_file(Path(folder) / "model.safetensors")
    source = f"model.layers.{full}."
    tensors = load_file(out / "model.safetensors")
    for i in range(layers):
        for name, tensor in donor.items():
            if name.startswith(source):
                tensors[f"mtp.layers.{i}.{name[len(source) :]}"] = tensor.clone()
    h = config.hidden_size
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h) * config.initializer_range
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(h)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def build_tiny_arch(name: str, out: Path, seed: int = SEED) -> Path:
    """Write the tiny checkpoint ``name`` of :data:`TINY_ARCHS` into ``out`` (created if missing) and return it.

    Needs torch and transformers (the model class initialises the weights); the same files for the same seed.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name not in TINY_ARCHS:
        raise ValueError(f"no tiny architecture {name!r} (known: {', '.join(TINY_ARCHS)})")
    fields = {key: value for key, value in TINY_ARCHS[name].items() if key != "model_type"}
    config = AutoConfig.for_model(TINY_ARCHS[name]["model_type"], **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    mtp = int(TINY_ARCHS[name].get("num_nextn_predict_layers", 0))
    if mtp:
        _add_mtp_layers(out, model, mtp, seed)
    write_tokenizer(out, int(TINY_ARCHS[name]["max_position_embeddings"]))
    return out
