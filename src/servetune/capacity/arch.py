"""What the ledger needs to know about a model: its architecture numbers.

A :class:`ModelArch` comes from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2/Qwen3,
Mixtral-style MoE, DeepSeek-V3-style MLA, the tiny test model) found by ``source.py`` (a local
directory, the local caches, the hub) or, so that planning works offline, from the catalogue shipped
with servetune (``catalog/models.yaml``, the same numbers for popular hub ids). Only architecture
numbers and safetensors headers are read; never weights.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from servetune.capacity.checkpoint import Checkpoint
from servetune.capacity.source import ModelConfig, cached_model, hub_model, local_model, looks_like_hub_id
from servetune.errors import UserError

Dtype = Literal["bfloat16", "float16", "float32"]
QuantMethod = Literal["none", "awq", "gptq", "fp8", "int8", "bitsandbytes", "mxfp4", "nvfp4", "mxfp8"]
LayerType = Literal["full_attention", "sliding_attention", "chunked_attention", "mamba", "mlp"]
#: Layer kinds that attend over tokens (a KV cache per token); "mamba" keeps a per-sequence state, "mlp" nothing.
ATTENTION_KINDS: tuple[LayerType, ...] = ("full_attention", "sliding_attention", "chunked_attention")


class WeightQuant(BaseModel):
    """How the decoder's linear layers are stored. Embeddings, lm_head, norms and routers never are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: QuantMethod = "none"
    bits: int = Field(16, ge=1, le=32)
    group_size: int = Field(128, ge=1)

    def bytes_per_weight(self, dtype_bytes: int) -> float:
        """Bytes one quantized weight costs, scales and zero points included."""
        if self.method == "none":
            return float(dtype_bytes)
        if self.method in ("fp8", "int8"):
            return 1.0  # per-channel / per-tensor / 128x128-block scales are < 0.1 %
        if self.method == "bitsandbytes":
            return self.bits / 8 + 4 / 64  # nf4: fp32 absmax per 64 weights
        if self.method == "mxfp4":
            return self.bits / 8 + 1 / 32  # one e8m0 scale per 32 weights
        if self.method == "nvfp4":
            return 0.5 + 1 / 16  # fp4 e2m1, one fp8 e4m3 scale per 16 weights (+ a per-tensor fp32 scale)
        if self.method == "mxfp8":
            return 1.0 + 1 / 32  # fp8, one e8m0 scale per 32 weights
        # AWQ / GPTQ: packed ints, one fp16 scale and one packed zero point per group.
        return self.bits / 8 + (2 + self.bits / 8) / self.group_size

    @property
    def experts_only(self) -> bool:
        """vLLM's MXFP4 packs only the routed experts; attention and dense layers stay unquantized."""
        return self.method == "mxfp4"

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        if self.method in ("awq", "gptq"):
            return f"{self.method} {self.bits}-bit g{self.group_size}"
        return self.method


class MambaMixer(BaseModel):
    """A Mamba / linear-attention layer, in the numbers vLLM 0.32's ``MambaStateShapeCalculator`` reads.

    ``mamba1``: Jamba (``intermediate_size``, ``state_size``, ``conv_kernel``, ``dt_rank``); ``mamba2``:
    Nemotron-H, Granite-4.0-H (plus ``n_groups``, ``num_heads``, ``head_dim``); ``gated_delta_net``:
    Qwen3-Next (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``, ``conv_kernel``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["mamba1", "mamba2", "gated_delta_net"]
    conv_kernel: int = Field(4, ge=2)
    intermediate_size: int = Field(0, ge=0)
    state_size: int = Field(0, ge=0)
    n_groups: int = Field(1, ge=1)
    num_heads: int = Field(0, ge=0)
    head_dim: int = Field(0, ge=0)
    dt_rank: int = Field(0, ge=0)
    num_k_heads: int = Field(0, ge=0)
    num_v_heads: int = Field(0, ge=0)
    head_k_dim: int = Field(0, ge=0)
    head_v_dim: int = Field(0, ge=0)
    ssm_state_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the SSM state's dtype when mamba_ssm_cache_dtype is auto (Nemotron-H: float32)"
    )

    @model_validator(mode="after")
    def _complete(self) -> MambaMixer:
        needed = {
            "mamba1": ("intermediate_size", "state_size"),
            "mamba2": ("intermediate_size", "state_size", "num_heads", "head_dim"),
            "gated_delta_net": ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
        }[self.kind]
        missing = [name for name in needed if not getattr(self, name)]
        if missing:
            raise ValueError(f"a {self.kind} layer needs {', '.join(missing)}")
        return self


class ModelArch(BaseModel):
    """Architecture numbers of a decoder-only transformer, as vLLM sees them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    architecture: str = "LlamaForCausalLM"
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_attention_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=0, description="dense MLP width (0 when every layer is MoE)")
    vocab_size: int = Field(ge=1)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = Field(ge=1)
    torch_dtype: Dtype = "bfloat16"
    qkv_bias: bool = False
    qk_norm: bool = False
    rotary_dim: int | None = None
    # Mixture of experts (0 experts: dense model).
    num_experts: int = Field(0, ge=0)
    num_experts_per_tok: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    shared_expert_intermediate_size: int = Field(0, ge=0, description="total width of the shared expert(s)")
    first_k_dense_layers: int = Field(0, ge=0, description="leading layers with a dense MLP instead of MoE")
    # Multi-head latent attention (DeepSeek-V2/V3). kv_lora_rank set means MLA.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Layer kinds (Gemma 2/3, gpt-oss, Llama 4, Mistral): empty means every layer is full attention.
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = Field(None, ge=1, description="tokens a sliding_attention layer sees")
    attention_chunk_size: int | None = Field(None, ge=1, description="tokens of a chunked_attention layer's chunk")
    attention_sinks: bool = Field(False, description="one learned sink logit per attention head (gpt-oss)")
    attention_output_gate: bool = Field(False, description="q_proj also emits a per-head output gate (Qwen3-Next)")
    moe_layer_step: int = Field(1, ge=1, description="every n-th layer after the dense ones is MoE (Llama 4)")
    vision_parameters: int = Field(0, ge=0, description="vision encoder and projector, kept in torch_dtype")
    mtp_layers: int = Field(0, ge=0, description="multi-token-prediction layers the checkpoint carries (MTP drafts)")
    draft_vocab_size: int | None = Field(None, ge=1, description="an EAGLE-3 head's own lm_head vocabulary")
    mamba: MambaMixer | None = Field(None, description="the state of the 'mamba' layers (Mamba, gated DeltaNet)")
    mixer_only_layers: bool = Field(
        False,
        description="Nemotron-H: a layer is one block (Mamba, attention, or a two-matrix squared-ReLU MLP / MoE),"
        " not attention + MLP",
    )
    not_planned: str | None = Field(None, description="why the ledger cannot size this model (vLLM may serve it)")
    quant: WeightQuant = WeightQuant()
    checkpoint: Checkpoint | None = Field(None, description="safetensors parameter counts, where known")

    @model_validator(mode="before")
    @classmethod
    def _expand_pattern(cls, data: Any) -> Any:
        """The catalogue's shorthands: ``full_attention_every: n`` with ``local: sliding|chunked|mamba``, and
        Nemotron-H's ``hybrid_override_pattern`` (M Mamba, * attention, - MLP, E MoE)."""
        if isinstance(data, dict) and isinstance(data.get("hybrid_override_pattern"), str):
            data = dict(data)
            data["layer_types"] = [_PATTERN_KINDS.get(c, c) for c in data.pop("hybrid_override_pattern")]
        if isinstance(data, dict) and "full_attention_every" in data:
            data = dict(data)
            every, local = int(data.pop("full_attention_every")), data.pop("local", "sliding")
            kind = "mamba" if local == "mamba" else f"{local}_attention"
            data["layer_types"] = [
                "full_attention" if (i + 1) % every == 0 else kind for i in range(int(data["num_layers"]))
            ]
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ModelArch:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts and (not self.num_experts_per_tok or not self.moe_intermediate_size):
            raise ValueError("an MoE model needs num_experts_per_tok and moe_intermediate_size")
        if not self.num_experts and not self.intermediate_size:
            raise ValueError("a dense model needs intermediate_size")
        if self.is_mla and not (self.qk_rope_head_dim and self.qk_nope_head_dim and self.v_head_dim):
            raise ValueError("an MLA model needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, num_layers is {self.num_layers}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_attention layers need sliding_window")
        if "chunked_attention" in self.layer_types and self.attention_chunk_size is None:
            raise ValueError("chunked_attention layers need attention_chunk_size")
        if "mamba" in self.layer_types and self.mamba is None:
            raise ValueError("mamba layers need the mamba mixer's numbers")
        return self

    @property
    def num_mamba_layers(self) -> int:
        return self.layer_kinds.count("mamba")

    @property
    def num_attention_layers(self) -> int:
        return sum(kind in ATTENTION_KINDS for kind in self.layer_kinds)

    @property
    def layer_kinds(self) -> tuple[LayerType, ...]:
        """Every layer's attention kind (all full attention unless the config says otherwise)."""
        full: tuple[LayerType, ...] = ("full_attention",)
        return self.layer_types or full * self.num_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return (self.num_layers - self.first_k_dense_layers) // self.moe_layer_step if self.is_moe else 0

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.torch_dtype == "float32" else 2

    @property
    def rope_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return self.rotary_dim or self.head_dim


# --- reading a Hugging Face config.json -------------------------------------------------------------

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
        return WeightQuant(method="gptq", bits=int(qc.get("bits", 4)), group_size=group if group > 0 else 128)
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
            return WeightQuant(method="gptq", bits=bits, group_size=int(weights.get("group_size") or 128))
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


def _library_config(config: dict[str, Any], source: str) -> dict[str, Any]:
    """The config as transformers reads it: its own class fills every default the file leaves out.

    ``AutoConfig.for_model`` only builds the class transformers ships for ``model_type`` (offline,
    no remote code). A ``model_type`` transformers does not know is read as the file states it.
    A multimodal config yields its decoder's ``text_config``, with the vision tower kept aside.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return dict(config)
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
            return dict(config)
        raise UserError(f"{source}: {exc}") from None
    except (TypeError, KeyError) as exc:
        raise UserError(f"{source}: transformers cannot read it as {model_type!r}: {exc}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    text = library.get_text_config(decoder=True)
    merged = text.to_dict()
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
            merged["_vision"] = vision.to_dict()
        merged["_multimodal_architecture"] = (config.get("architectures") or [None])[0]
    return merged


def _vision_parameters(vision: dict[str, Any], text_hidden: int) -> int:
    """Vision encoder (a ViT: patch embedding, position table, blocks, norms) plus a projector."""
    hidden = int(vision.get("hidden_size") or 0)
    layers = int(vision.get("num_hidden_layers") or vision.get("depth") or 0)
    inter = int(vision.get("intermediate_size") or 4 * hidden)
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


# Per-layer kind names in Hugging Face configs (``layer_types``, ``layers_block_type``, Nemotron-H's
# ``hybrid_override_pattern`` as transformers expands it) and the ledger's kinds.
_HYBRID_KINDS: dict[str, LayerType] = {
    "attention": "full_attention",
    "full_attention": "full_attention",
    "mamba": "mamba",
    "linear_attention": "mamba",
    "mlp": "mlp",
    "moe": "mlp",
}
_PATTERN_KINDS: dict[str, LayerType] = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "mlp"}


def _mamba_mixer(cfg: dict[str, Any], model_type: str, hidden: int) -> MambaMixer | None:
    """The Mamba / linear-attention mixer's numbers, read as vLLM 0.32's ``get_mamba_state_shape_from_config``
    reads them for the model type; None for a model type whose mixer the planner does not know."""
    if cfg.get("linear_num_value_heads"):  # Qwen3-Next, Qwen3.5: gated DeltaNet
        return MambaMixer(
            kind="gated_delta_net",
            conv_kernel=int(cfg.get("linear_conv_kernel_dim") or 4),
            num_k_heads=int(cfg["linear_num_key_heads"]),
            num_v_heads=int(cfg["linear_num_value_heads"]),
            head_k_dim=int(cfg["linear_key_head_dim"]),
            head_v_dim=int(cfg["linear_value_head_dim"]),
        )
    if model_type == "nemotron_h":  # NemotronHForCausalLM: intermediate = mamba_num_heads x mamba_head_dim
        heads, head_dim = int(cfg["mamba_num_heads"]), int(cfg["mamba_head_dim"])
        return MambaMixer(
            kind="mamba2",
            conv_kernel=int(cfg.get("conv_kernel") or 4),
            intermediate_size=heads * head_dim,
            state_size=int(cfg["ssm_state_size"]),
            n_groups=int(cfg.get("n_groups") or 1),
            num_heads=heads,
            head_dim=head_dim,
            ssm_state_dtype=str(cfg.get("mamba_ssm_cache_dtype") or "float32"),  # vLLM's NemotronH default
        )
    if model_type in ("granitemoehybrid", "bamba"):  # intermediate = mamba_expand x hidden_size
        return MambaMixer(
            kind="mamba2",
            conv_kernel=int(cfg.get("mamba_d_conv") or 4),
            intermediate_size=int(cfg.get("mamba_expand") or 2) * hidden,
            state_size=int(cfg["mamba_d_state"]),
            n_groups=int(cfg.get("mamba_n_groups") or 1),
            num_heads=int(cfg["mamba_n_heads"]),
            head_dim=int(cfg["mamba_d_head"]),
        )
    if model_type == "jamba":  # Mamba-1
        return MambaMixer(
            kind="mamba1",
            conv_kernel=int(cfg.get("mamba_d_conv") or 4),
            intermediate_size=int(cfg.get("mamba_expand") or 2) * hidden,
            state_size=int(cfg["mamba_d_state"]),
            dt_rank=int(cfg.get("mamba_dt_rank") or _cdiv(hidden, 16)),
        )
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _hybrid_layers(
    cfg: dict[str, Any], model_type: str, hidden: int
) -> tuple[list[LayerType], MambaMixer | None] | str:
    """Layer kinds and the mixer of a model with Mamba / linear-attention layers, ([], None) for a model without,
    or why the planner cannot size it."""
    if model_type == "falcon_h1":
        return "Falcon-H1 runs attention and a Mamba-2 mixer side by side in every layer; the planner does not model it"
    if 0 in (cfg.get("attn_type_list") or ()):  # MiniMax-Text-01: 0 lightning (linear) attention, 1 softmax
        return f"{model_type or 'this model'}'s lightning (linear) attention layers (attn_type_list) are not modelled"
    raw = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(cfg.get("hybrid_override_pattern"), str) and not raw:
        raw = [_PATTERN_KINDS.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not isinstance(raw, (list, tuple)):
        return [], None
    names = [str(kind) for kind in raw]
    if not any(_HYBRID_KINDS.get(name) in ("mamba", "mlp") for name in names):
        unmodelled = sorted(set(names) - {"attention", *ATTENTION_KINDS})
        if unmodelled:  # e.g. LFM2's short convolutions: never planned as full attention
            return f"layer kinds {', '.join(unmodelled)} are not modelled"
        return [], None
    unknown = sorted({name for name in names if name not in _HYBRID_KINDS})
    if unknown:
        return f"layer kinds {', '.join(unknown)} are not modelled"
    try:
        mixer = _mamba_mixer(cfg, model_type, hidden)
    except (KeyError, TypeError, ValueError) as exc:
        return f"its Mamba layers' numbers are incomplete ({exc})"
    if mixer is None:
        return f"model_type {model_type!r}: the state of its Mamba / linear-attention layers is not modelled"
    return [_HYBRID_KINDS[name] for name in names], mixer


def arch_from_hf_config(config: dict[str, Any], name: str, source: str = "config.json") -> ModelArch:
    """Normalise a Hugging Face ``config.json`` dict; a missing field raises :class:`UserError` naming it."""
    cfg = _library_config(config, source)

    def need(*keys: str) -> Any:
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        raise UserError(f"{source}: missing field {keys[0]!r} (needed to plan KV cache and weights)")

    heads = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
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
    partial = cfg.get("partial_rotary_factor")
    if partial and not cfg.get("kv_lora_rank") and float(partial) != 1.0:
        fields["rotary_dim"] = int(fields["head_dim"] * float(partial))
    if isinstance(cfg.get("quantization_config"), dict):
        fields["quant"] = _quant_from_config(cfg["quantization_config"], source)
    try:
        return ModelArch(**fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "config"
        raise UserError(f"{source}: {where}: {first['msg']}") from None


# --- the catalogue ----------------------------------------------------------------------------------


def load_catalog() -> dict[str, ModelArch]:
    """The shipped catalogue of popular models, keyed by hub id (parsed once: a dry run asks per trial)."""
    return dict(_parsed_catalog())


@functools.cache
def _parsed_catalog() -> dict[str, ModelArch]:
    text = resources.files("servetune.capacity").joinpath("catalog/models.yaml").read_text(encoding="utf-8")
    entries = yaml.safe_load(text) or {}
    return {hub_id: ModelArch(name=hub_id, **fields) for hub_id, fields in entries.items()}


def _catalog_lookup(name: str, catalog: dict[str, ModelArch]) -> ModelArch | None:
    wanted = name.strip().lower()
    exact = [arch for key, arch in catalog.items() if key.lower() == wanted]
    if exact:
        return exact[0]
    tail = [arch for key, arch in catalog.items() if key.lower().split("/")[-1] == wanted]
    return tail[0] if len(tail) == 1 else None


def _parsed(found: ModelConfig) -> ModelArch:
    arch = arch_from_hf_config(found.config, name=found.name, source=found.source)
    if found.parameters:
        return arch.model_copy(update={"checkpoint": Checkpoint(parameters=found.parameters)})
    return arch


def load_model_arch(model: str | Path) -> ModelArch:
    """A local model directory, a hub id such as ``google/gemma-3-27b-it`` (local caches, then the catalogue,
    then the hub: see ``source.py``), or a catalogue name such as ``qwen2.5-7b-instruct``."""
    path = Path(model).expanduser()
    if path.suffix == ".json" and path.is_file():
        path = path.parent
    if path.is_dir():
        return _parsed(local_model(path))
    name = str(model)
    cached = cached_model(name) if looks_like_hub_id(name) else None
    if cached is not None:
        return _parsed(cached)
    found = _catalog_lookup(name, load_catalog())
    if found is not None:
        return found
    if looks_like_hub_id(name):
        return _parsed(hub_model(name))
    raise UserError(
        f"--model {model}: not a local model directory, not a hub id (org/name) and not in servetune's "
        f"catalogue (known: {', '.join(sorted(load_catalog()))})"
    )
