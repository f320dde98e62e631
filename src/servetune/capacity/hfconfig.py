"""A :class:`ModelArch` from a Hugging Face ``config.json``, read through transformers' own config classes.

Llama, Mistral, Qwen2/Qwen3, Mixtral-style MoE, DeepSeek-V3-style MLA, Gemma 3, gpt-oss, Llama 4,
vision-language models (their ``text_config`` and vision tower) and the hybrid Mamba / linear-attention
families of ``hfhybrid.py``. Only architecture numbers are read; never weights.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from servetune.capacity import hfcache
from servetune.capacity.hfhybrid import _hybrid_layers
from servetune.capacity.model import MambaMixer, ModelArch, VisionEncoder, WeightQuant
from servetune.capacity.schema import NotPlanned
from servetune.errors import UserError

_TORCH_DTYPES = {
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "float32": "float32",
    "float": "float32",
}


def _quant_from_config(qc: dict[str, Any], source: str) -> WeightQuant:
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return WeightQuant(
            method="awq",
            bits=int(qc.get("bits", qc.get("w_bit", 4))),
            group_size=int(qc.get("group_size", qc.get("q_group_size", 128))),
        )
    if method == "gptq":
        group = int(qc.get("group_size", 128))
        bits = int(qc.get("bits", 4))
        return WeightQuant(method="gptq", bits=bits, group_size=group if group > 0 else 128, channelwise=group <= 0)
    if method in ("fp8", "fbgemm_fp8"):
        return WeightQuant(method="fp8", bits=8)
    if method == "bitsandbytes":
        return WeightQuant(method="bitsandbytes", bits=8 if qc.get("load_in_8bit") else 4, group_size=64)
    if method == "mxfp4":
        return WeightQuant(method="mxfp4", bits=4, group_size=32)
    if method in ("modelopt", "modelopt_fp4", "modelopt_mxfp8"):
        algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
        if method == "modelopt_fp4" or "NVFP4" in algo:
            return WeightQuant(method="nvfp4", bits=4, group_size=16)
        if method == "modelopt_mxfp8" or "MXFP8" in algo:
            return WeightQuant(method="mxfp8", bits=8, group_size=32)
        if algo.startswith("FP8"):
            return WeightQuant(method="fp8", bits=8)
        raise UserError(
            f"{source}: quantization_config.quant_algo {algo!r} is not one the planner knows (FP8, NVFP4, MXFP8)"
        )
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            bits, kind = int(weights.get("num_bits", 8)), weights.get("type", "int")
            if kind == "float" and bits == 4:
                return WeightQuant(method="nvfp4", bits=4, group_size=int(weights.get("group_size") or 16))
            if kind == "float":
                return WeightQuant(method="fp8", bits=8)
            if bits == 8:
                return WeightQuant(method="int8", bits=8)
            group = int(weights.get("group_size") or 0)  # strategy "channel": none
            return WeightQuant(method="gptq", bits=bits, group_size=group if group > 0 else 128, channelwise=group <= 0)
        raise UserError(f"{source}: quantization_config.config_groups has no weights entry")
    raise UserError(
        f"{source}: quantization_config.quant_method {method!r} is not one the planner knows "
        "(awq, gptq, fp8, compressed-tensors, bitsandbytes, mxfp4, modelopt, modelopt_fp4, modelopt_mxfp8)"
    )


#: Where a Hugging Face config states its multi-token-prediction layers (the names vLLM reads).
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")

# rope types whose ``factor`` stretches the context beyond max_position_embeddings (vLLM 0.32
# ``_get_and_verify_max_len``: YaRN and Llama-3 style configs already state the stretched length).
_ROPE_TYPES_NOT_SCALED = ("default", "su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def _json_float(value: Any) -> Any:
    """transformers writes a non-finite float as ``{"__float__": "Infinity"}`` (Mamba's ``time_step_limit``)."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return [_json_float(item) for item in value]
    return value


def _merge_nested(target: Any, updates: dict[str, Any]) -> None:
    """vLLM 0.32 ``ModelConfig._update_nested``: a dict into an existing dict or config merges key by key."""
    for key, value in updates.items():
        nested = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, dict) and nested is not None and (isinstance(nested, dict) or hasattr(nested, "__dict__")):
            _merge_nested(nested, value)
        elif isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def apply_hf_overrides(config: Any, overrides: dict[str, Any]) -> None:
    """Merge ``hf_overrides`` into a config in place, as vLLM 0.32's ``ModelConfig`` does.

    A value that is not a dict replaces the top-level field (``config.update``: a multimodal model's decoder
    fields are reached through ``{"text_config": {...}}``). A dict merges recursively into a nested config
    (``text_config``, ``vision_config``), and replaces any other field whole (``rope_scaling``: not merged).
    ``config`` is a transformers config, or a raw ``config.json`` dict where transformers does not know the
    model type (its nested configs: the dict fields named ``*_config``, ``quantization_config`` apart).
    """
    for key, value in overrides.items():
        if isinstance(config, dict):
            nested = config.get(key)
            sub_config = key.endswith("_config") and key != "quantization_config" and isinstance(nested, dict)
        else:
            from transformers import PreTrainedConfig

            nested = getattr(config, key, None)
            sub_config = isinstance(nested, PreTrainedConfig)
        if isinstance(value, dict) and sub_config:
            _merge_nested(nested, value)
        elif isinstance(config, dict):
            config[key] = value
        else:
            setattr(config, key, value)


def _library_config(config: dict[str, Any], source: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config as transformers reads it: its own class fills every default the file leaves out.

    ``AutoConfig.for_model`` only builds the class transformers ships for ``model_type`` (offline,
    no remote code). A ``model_type`` transformers does not know is read as the file states it.
    A multimodal config yields its decoder's ``text_config``, with the vision tower kept aside.
    A config read before is read from ``hfcache`` without transformers (keyed on all the answer depends on).
    """
    model_type = config.get("model_type")
    overrides = overrides or {}
    if isinstance(overrides.get("model_type"), str):
        model_type = overrides["model_type"]  # vLLM reads the overridden model_type before building the config
    if not isinstance(model_type, str) or not model_type:
        return _raw_overridden(config, overrides)
    key = hfcache.config_key(config, overrides, Path(__file__))
    cached = hfcache.read_config(key)
    if cached is not None:
        return cached
    merged = _transformers_config(config, source, model_type, overrides)
    hfcache.write_config(key, merged)
    return merged


def _transformers_config(
    config: dict[str, Any], source: str, model_type: str, overrides: dict[str, Any]
) -> dict[str, Any]:
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig  # slow import: only when a config is read
    from transformers.utils import logging as hf_logging

    fields = {key: _json_float(value) for key, value in config.items() if key != "model_type"}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # deprecation chatter about torch_dtype and the like
    try:
        library = AutoConfig.for_model(model_type, **fields)
    except StrictDataclassError as exc:  # "Validation error for field 'x': TypeError: ..."
        raise UserError(f"{source}: {' '.join(str(exc).split())}") from None
    except ValueError as exc:
        if "Unrecognized model identifier" in str(exc):
            return _raw_overridden(config, overrides)
        raise UserError(f"{source}: {exc}") from None
    except (TypeError, KeyError) as exc:
        raise UserError(f"{source}: transformers cannot read it as {model_type!r}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if overrides:
        apply_hf_overrides(library, overrides)
    text = library.get_text_config(decoder=True)
    merged = _fields(text)
    if not merged.get("layer_types") and not merged.get("layers_block_type"):
        block_types = getattr(text, "layers_block_type", None)  # Jamba: a property over attn_layer_period/offset
        if isinstance(block_types, (list, tuple)):
            merged["layers_block_type"] = list(block_types)
    for key in ("architectures", "quantization_config", "torch_dtype", "dtype", "tie_word_embeddings"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    if text is not library:
        vision = getattr(library, "vision_config", None)
        if vision is not None:
            merged["_vision"] = _fields(vision)
        merged["_multimodal_architecture"] = (config.get("architectures") or [None])[0]
        merged["_multimodal_type"] = model_type
        if isinstance(getattr(library, "mm_tokens_per_image", None), int):  # Gemma 3: tokens per image
            merged["_mm_tokens_per_image"] = library.mm_tokens_per_image
    return merged


def _fields(config: Any) -> dict[str, Any]:
    """A transformers config as a dict, less a classifier's labels: keyed by int, which JSON gives back as str, so
    the answer would never be cached (``hfcache.write_config``); nothing reads them. Vision towers carry them too."""
    fields: dict[str, Any] = config.to_dict()
    fields.pop("id2label", None)
    return fields


def _raw_overridden(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(config)
    apply_hf_overrides(merged, overrides)
    return merged


def _tower_widths(vision: dict[str, Any]) -> tuple[int, int]:
    """(hidden, MLP) widths of a vision tower's blocks. Qwen2-VL names its blocks' width ``embed_dim`` (1280) and
    its merger's output ``hidden_size`` (3584), with an MLP ``mlp_ratio`` times as wide; the others ``hidden_size``
    and ``intermediate_size``."""
    hidden = int(vision.get("embed_dim") or vision.get("hidden_size") or 0)
    return hidden, int(vision.get("intermediate_size") or int(vision.get("mlp_ratio") or 4) * hidden)


def _vision_parameters(vision: dict[str, Any], text_hidden: int) -> int:
    """Vision encoder (a ViT: patch embedding, position table, blocks, norms) plus a projector."""
    hidden, inter = _tower_widths(vision)
    layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    if not hidden or not layers:
        return 0
    channels = int(vision.get("num_channels") or vision.get("in_channels") or 3)
    patch = int(vision.get("patch_size") or 14)
    temporal = int(vision.get("temporal_patch_size") or 1)
    image = int(vision.get("image_size") or 0)
    positions = (image // patch) ** 2 if image else 0
    gated = str(vision.get("hidden_act", "")).lower() == "silu"  # Qwen2.5-VL: SwiGLU MLP
    mlp = (3 if gated else 2) * hidden * inter + inter + hidden
    block = 4 * hidden * hidden + 4 * hidden + mlp + 4 * hidden
    embed = channels * temporal * patch * patch * hidden + hidden + positions * hidden
    out = int(vision.get("out_hidden_size") or vision.get("projector_output_dim") or text_hidden)
    merge = int(vision.get("spatial_merge_size") or 1) ** 2
    projector = hidden * merge * out + (hidden * merge) ** 2 if merge > 1 else hidden * out
    return layers * block + embed + projector


#: Multimodal model types whose images become a grid of merged patches (vLLM's Qwen2VLProcessingInfo), with the
#: pixel bounds of their published preprocessor configs (Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2.5-VL-7B-Instruct:
#: min_pixels 3136, max_pixels 12845056), which vLLM reads from the checkpoint.
GRID_VISION_TYPES = ("qwen2_vl", "qwen2_5_vl")
#: ... and those with a fixed number of tokens per image (vLLM's Gemma3ProcessingInfo).
FIXED_VISION_TYPES = ("gemma3",)


def _vision_encoder(cfg: dict[str, Any], text_hidden: int) -> VisionEncoder | None:
    """How the model's images become tokens, where servetune knows its processor (None elsewhere)."""
    vision, model_type = cfg["_vision"], cfg.get("_multimodal_type")
    hidden, inter = _tower_widths(vision)
    if not hidden or model_type not in GRID_VISION_TYPES + FIXED_VISION_TYPES:
        return None
    patch = int(vision.get("patch_size") or 14)
    common = {
        "hidden_size": hidden,
        "intermediate_size": inter,
        "gated": str(vision.get("hidden_act", "")).lower() == "silu",
        "output_size": int(vision.get("out_hidden_size") or text_hidden),
        "patch_size": patch,
        "num_layers": int(vision.get("num_hidden_layers") or vision.get("depth") or 0),
    }
    if model_type in GRID_VISION_TYPES:
        merge = int(vision.get("spatial_merge_size") or 2)
        full = vision.get("fullatt_block_indexes")
        if vision.get("window_size") and isinstance(full, (list, tuple)):  # Qwen2.5-VL: windows of merged tokens
            side = int(vision["window_size"]) // (merge * patch) * merge  # vLLM's window_size // merge // patch
            common.update(window_patches=side * side, full_attention_layers=len(full))
        return VisionEncoder(kind="grid", merge_size=merge,
                             temporal_patch_size=int(vision.get("temporal_patch_size") or 2), min_pixels=3136,
                             max_pixels=12845056, video=True, **common)  # fmt: skip
    return VisionEncoder(kind="fixed", tokens_per_image=int(cfg.get("_mm_tokens_per_image") or 256),
                         image_size=int(vision.get("image_size") or 896), **common)  # fmt: skip


def _layer_types(cfg: dict[str, Any], layers: int) -> tuple[list[str], int | None, int | None]:
    """(layer_types, sliding_window, attention_chunk_size) as vLLM 0.32 builds its attention layers."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) is not False else None
    chunk = cfg.get("attention_chunk_size")
    kinds = [str(k) for k in cfg.get("layer_types") or []]
    if chunk and cfg.get("no_rope_layers"):  # Llama 4: RoPE layers attend in chunks, NoPE layers globally
        kinds = ["chunked_attention" if use_rope else "full_attention" for use_rope in cfg["no_rope_layers"]]
    known = {"full_attention", "sliding_attention", "chunked_attention"}
    if kinds and (len(kinds) != layers or not set(kinds) <= known):
        kinds = []  # a list of another length: every layer full attention (unknown kinds: _hybrid_layers)
    if not kinds and window:
        kinds = ["sliding_attention"] * layers  # Mistral-7B-v0.1 style: every layer has the window
    if "sliding_attention" not in kinds:
        window = None
    if "chunked_attention" not in kinds:
        chunk = None
    if set(kinds) == {"full_attention"}:
        kinds = []
    return kinds, int(window) if window else None, int(chunk) if chunk else None


def arch_from_hf_config(
    config: dict[str, Any], name: str, source: str = "config.json", hf_overrides: dict[str, Any] | None = None
) -> ModelArch:
    """Normalise a Hugging Face ``config.json`` dict; a missing field raises :class:`UserError` naming it.

    ``hf_overrides`` (vLLM's ``--hf-overrides``) is merged in first, as vLLM merges it (:func:`apply_hf_overrides`);
    the arch keeps the file's own config so that :func:`with_hf_overrides` can merge another."""
    arch = _arch(config, name, source, hf_overrides)
    arch._hf_config = (config, source)
    return arch


def with_hf_overrides(arch: ModelArch, hf_overrides: dict[str, Any] | None) -> ModelArch:
    """``arch`` with the engine's ``hf_overrides`` merged into its config.json and read again (the checkpoint's
    parameter counts kept). A catalogue model has no config.json to merge into: not planned."""
    if not hf_overrides:
        return arch
    if arch._hf_config is None:
        raise NotPlanned(
            f"hf_overrides: {arch.name} comes from servetune's catalogue, without its config.json to merge them "
            "into; give a local model directory (or cache the model's config) to plan it"
        )
    config, source = arch._hf_config
    merged = _arch(config, arch.name, f"{source} with hf_overrides", hf_overrides)
    merged._hf_config = arch._hf_config
    return merged.model_copy(update={"checkpoint": arch.checkpoint}) if arch.checkpoint else merged


def _indexer_fields(cfg: dict[str, Any], layers: int) -> dict[str, int]:
    """DeepSeek Sparse Attention's indexer, as vLLM 0.32's ``DeepseekV32Attention`` builds it: layer i has one
    unless ``skip_topk`` (``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq != 0``, or an ``S`` in
    ``index_topk_pattern``); DeepSeek-V3.2 (freq 1) has one on every layer."""
    freq, offset, pattern = int(cfg.get("index_topk_freq") or 1), int(cfg.get("index_skip_topk_offset", 2)), None
    if isinstance(cfg.get("index_topk_pattern"), (str, list)):
        pattern = cfg["index_topk_pattern"]
    skipped = [
        (max(i - offset + 1, 0) % freq != 0) if pattern is None else (i < len(pattern) and pattern[i] == "S")
        for i in range(layers)
    ]
    return {
        "index_head_dim": int(cfg.get("index_head_dim") or 128),
        "index_n_heads": int(cfg.get("index_n_heads") or 64),
        "indexer_layers": skipped.count(False),
    }


def _arch(config: dict[str, Any], name: str, source: str, hf_overrides: dict[str, Any] | None) -> ModelArch:
    cfg = _library_config(config, source, hf_overrides)

    def need(*keys: str) -> Any:
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise UserError(f"{source}: missing field {keys[0]!r} (needed to plan KV cache and weights)")

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    sparse_mla = cfg.get("kv_lora_rank") is not None and cfg.get("index_topk") is not None
    if sparse_mla and set(cfg.get("layer_types") or ()) <= {"indexed_attention", "full_attention"}:
        cfg = {**cfg, "layer_types": None}  # transformers' DeepSeek-V3.2 / GLM-5.2: MLA + indexer on every layer
    hybrid = _hybrid_layers(cfg, model_type, hidden)
    if cfg.get("num_hidden_layers") is None and isinstance(hybrid, tuple) and hybrid[0]:
        cfg["num_hidden_layers"] = len(hybrid[0])  # Nemotron-H: one layer per pattern character
    layers = int(need("num_hidden_layers"))
    experts = int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    if model_type == "nemotron_h" and "moe" not in (cfg.get("layers_block_type") or ()):
        experts = 0  # transformers' NemotronHConfig carries MoE defaults for dense models too
    positions = int(cfg.get("max_position_embeddings") or 2048)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if isinstance(rope, dict) and "gemma3" not in model_type:
        ropes = [r for r in rope.values() if isinstance(r, dict)] or [rope]
        factors = [
            float(r.get("factor") or 1.0)
            for r in ropes
            if str(r.get("rope_type") or r.get("type") or "default") not in _ROPE_TYPES_NOT_SCALED
        ]
        positions = int(positions * (factors[-1] if factors else 1.0))
    not_planned: str | None = None
    mixer: MambaMixer | None = None
    kinds: list[str]
    if isinstance(hybrid, str):
        not_planned, kinds, window, chunk = hybrid, [], None, None
    elif hybrid[0]:
        kinds, mixer, window, chunk = list(hybrid[0]), hybrid[1], None, None
    else:
        kinds, window, chunk = _layer_types(cfg, layers)
    architecture = cfg.get("_multimodal_architecture") or (cfg.get("architectures") or ["unknown"])[0]
    fields: dict[str, Any] = {
        "name": name,
        "architecture": architecture,
        "num_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or hidden // heads),
        "vocab_size": int(need("vocab_size")),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "max_position_embeddings": positions,
        "torch_dtype": _TORCH_DTYPES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), "bfloat16"),
        "qkv_bias": bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe", "qwen2_5_vl_text"))),
        "qk_norm": model_type.startswith(("qwen3", "gemma3")),
        "layer_types": kinds,
        "sliding_window": window,
        "attention_chunk_size": chunk,
        "attention_sinks": model_type == "gpt_oss",
        "attention_output_gate": model_type.startswith("qwen3_next"),
        "mamba": mixer,
        "mixer_only_layers": model_type == "nemotron_h",
        "parallel_mamba": model_type == "falcon_h1" and mixer is not None,
        "not_planned": not_planned,
    }
    mtp = [cfg.get(key) for key in MTP_KEYS if isinstance(cfg.get(key), int) and cfg[key] > 0]
    if mtp:
        fields["mtp_layers"] = mtp[0]
    if isinstance(cfg.get("draft_vocab_size"), int):
        fields["draft_vocab_size"] = cfg["draft_vocab_size"]
    if mixer is not None and len(kinds) != layers:
        raise UserError(f"{source}: {len(kinds)} layer kinds for num_hidden_layers {layers}")
    if isinstance(cfg.get("_vision"), dict):
        fields["vision_parameters"] = _vision_parameters(cfg["_vision"], hidden)
        fields["vision"] = _vision_encoder(cfg, hidden)
    if experts:
        fields["num_experts"] = experts
        fields["num_experts_per_tok"] = int(need("num_experts_per_tok"))
        # Mixtral keeps the expert width in intermediate_size; DeepSeek and Qwen-MoE in moe_intermediate_size.
        fields["moe_intermediate_size"] = int(cfg.get("moe_intermediate_size") or need("intermediate_size"))
        fields["intermediate_size"] = int(cfg.get("intermediate_size") or 0) if cfg.get("moe_intermediate_size") else 0
        shared = int(cfg.get("n_shared_experts") or 0) * fields["moe_intermediate_size"]
        shared = shared or int(cfg.get("moe_shared_expert_intermediate_size") or 0)  # Nemotron-H MoE
        shared = shared or int(cfg.get("shared_intermediate_size") or 0)  # Granite-4.0-H
        fields["shared_expert_intermediate_size"] = shared or int(cfg.get("shared_expert_intermediate_size") or 0)
        fields["first_k_dense_layers"] = int(cfg.get("first_k_dense_replace") or 0)
        if model_type.startswith("llama4"):  # one shared expert as wide as a routed one; dense layers between
            fields["shared_expert_intermediate_size"] = fields["moe_intermediate_size"]
            fields["moe_layer_step"] = int(cfg.get("interleave_moe_layer_step") or 1)
            fields["intermediate_size"] = int(cfg.get("intermediate_size_mlp") or 0)
        if model_type == "jamba":  # MoE on every expert_layer_period-th layer, dense MLPs between
            fields["moe_layer_step"] = int(cfg.get("expert_layer_period") or 1)
            fields["intermediate_size"] = int(cfg.get("intermediate_size") or 0)
    else:
        fields["intermediate_size"] = int(need("intermediate_size"))
    if cfg.get("kv_lora_rank") is not None:
        fields["kv_lora_rank"] = int(cfg["kv_lora_rank"])
        fields["q_lora_rank"] = int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None
        fields["qk_nope_head_dim"] = int(need("qk_nope_head_dim"))
        fields["qk_rope_head_dim"] = int(need("qk_rope_head_dim"))
        fields["v_head_dim"] = int(need("v_head_dim"))
        fields["num_kv_heads"] = heads  # MLA: vLLM stores one latent per token; heads only shard q/o.
        fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        if sparse_mla:
            fields.update(_indexer_fields(cfg, layers))
    partial = cfg.get("partial_rotary_factor")
    if partial and not cfg.get("kv_lora_rank") and float(partial) != 1.0:
        fields["rotary_dim"] = int(fields["head_dim"] * float(partial))
    if isinstance(cfg.get("quantization_config"), dict):
        fields["quant"] = _quant_from_config(cfg["quantization_config"], source)
    try:
        arch = ModelArch(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise UserError(f"{source}: {where}: {first['msg']}") from None
    rope_keys = ("rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor")
    arch._rope_settings = json.dumps({key: cfg.get(key) for key in rope_keys}, sort_keys=True, default=str)
    return arch
