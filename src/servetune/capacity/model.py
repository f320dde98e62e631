"""The architecture numbers the ledger reads: :class:`ModelArch`, its weight quantization and Mamba mixer.

Pure data with their consistency checks; ``hfconfig.py`` builds them from a Hugging Face ``config.json``,
``arch.py`` from the shipped catalogue.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from servetune.capacity.arith import cdiv
from servetune.capacity.checkpoint import Checkpoint

Dtype = Literal["bfloat16", "float16", "float32"]
QuantMethod = Literal["none", "awq", "gptq", "fp8", "int8", "bitsandbytes", "mxfp4", "nvfp4", "mxfp8", "gguf"]
LayerType = Literal["full_attention", "sliding_attention", "chunked_attention", "mamba", "mlp"]
#: Layer kinds that attend over tokens (a KV cache per token); "mamba" keeps a per-sequence state, "mlp" nothing.
ATTENTION_KINDS: tuple[LayerType, ...] = ("full_attention", "sliding_attention", "chunked_attention")

#: Nemotron-H's ``hybrid_override_pattern`` characters (M Mamba, * attention, - MLP, E MoE) as layer kinds.
_PATTERN_KINDS: dict[str, LayerType] = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "mlp"}


class WeightQuant(BaseModel):
    """How the decoder's linear layers are stored. Embeddings, lm_head, norms and routers never are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: QuantMethod = "none"
    bits: int = Field(16, ge=1, le=32)
    group_size: int = Field(128, ge=1)
    channelwise: bool = Field(
        False, description="one scale per output channel (GPTQ group_size -1): no groups to split"
    )

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
        if self.method == "gguf":
            return self.bits / 8  # the file's average over its quantized tensors (scales in); its bytes rule
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
    Nemotron-H, Granite-4.0-H, Falcon-H1 (plus ``n_groups``, ``num_heads``, ``head_dim``); ``gated_delta_net``:
    Qwen3-Next (``num_k_heads``, ``num_v_heads``, ``head_k_dim``, ``head_v_dim``, ``conv_kernel``);
    ``linear_attention``: MiniMax-Text-01 / M1's lightning attention (``num_heads``, ``head_dim``: one
    ``head_dim x head_dim`` state per head, no convolution).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["mamba1", "mamba2", "gated_delta_net", "linear_attention"]
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
    rms_norm: bool = Field(True, description="mamba2: the gated RMSNorm has a weight (Falcon-H1's mamba_rms_norm)")
    ssm_state_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="the SSM state's dtype when mamba_ssm_cache_dtype is auto (Nemotron-H: float32)"
    )

    @model_validator(mode="after")
    def _complete(self) -> MambaMixer:
        needed = {
            "mamba1": ("intermediate_size", "state_size"),
            "mamba2": ("intermediate_size", "state_size", "num_heads", "head_dim"),
            "gated_delta_net": ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"),
            "linear_attention": ("num_heads", "head_dim"),
        }[self.kind]
        missing = [name for name in needed if not getattr(self, name)]
        if missing:
            raise ValueError(f"a {self.kind} layer needs {', '.join(missing)}")
        return self


class VisionEncoder(BaseModel):
    """How a vision-language model turns an image into tokens (capacity/encoder.py), and its tower's widths.

    ``grid`` (Qwen2-VL, Qwen2.5-VL): an image is resized to multiples of ``patch_size`` x ``merge_size`` with its
    pixels between ``min_pixels`` and ``max_pixels`` (the checkpoint's preprocessor config), and each
    ``merge_size`` x ``merge_size`` block of patches is one token; videos too (``video``). ``fixed`` (Gemma 3):
    ``tokens_per_image`` per image, and as many again per pan-and-scan crop where the processor is asked to crop.
    The tower's depth and attention windows are what the estimate's encoder time reads (estimate/encoder.py).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["grid", "fixed"]
    patch_size: int = Field(14, ge=1)
    merge_size: int = Field(1, ge=1)
    temporal_patch_size: int = Field(1, ge=1)
    min_pixels: int = Field(56 * 56, ge=1)
    max_pixels: int = Field(28 * 28 * 16384, ge=1)
    video: bool = False
    tokens_per_image: int = Field(0, ge=0)
    image_size: int = Field(0, ge=0, description="fixed: the tower's native side in pixels")
    hidden_size: int = Field(ge=1)
    intermediate_size: int = Field(ge=1)
    gated: bool = False
    output_size: int = Field(ge=1, description="the width of an image token's embedding (the decoder's hidden size)")
    num_layers: int = Field(0, ge=0, description="the tower's blocks (0: unknown, its encoding time not estimated)")
    window_patches: int = Field(
        0, ge=0, description="windowed attention (Qwen2.5-VL): patches a window holds; 0: every block sees the image"
    )
    full_attention_layers: int = Field(0, ge=0, description="with windows: the blocks that attend over the whole image")


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
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5.2: ``index_topk`` in an MLA config): a lightning indexer
    # on ``indexer_layers`` layers keeps its own fp8 key cache beside the latent (params.kv_bytes_per_layer_token).
    index_head_dim: int = Field(0, ge=0, description="the indexer's key width (0: no indexer, dense MLA)")
    index_n_heads: int = Field(0, ge=0)
    indexer_layers: int = Field(0, ge=0, description="decoder layers that build an indexer (vLLM's skip_topk rule)")
    # Layer kinds (Gemma 2/3, gpt-oss, Llama 4, Mistral): empty means every layer is full attention.
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = Field(None, ge=1, description="tokens a sliding_attention layer sees")
    attention_chunk_size: int | None = Field(None, ge=1, description="tokens of a chunked_attention layer's chunk")
    attention_sinks: bool = Field(False, description="one learned sink logit per attention head (gpt-oss)")
    attention_output_gate: bool = Field(False, description="q_proj also emits a per-head output gate (Qwen3-Next)")
    moe_layer_step: int = Field(1, ge=1, description="every n-th layer after the dense ones is MoE (Llama 4)")
    vision_parameters: int = Field(0, ge=0, description="vision encoder and projector, kept in torch_dtype")
    vision: VisionEncoder | None = Field(None, description="how images become tokens (encoder cache planning)")
    mtp_layers: int = Field(0, ge=0, description="multi-token-prediction layers the checkpoint carries (MTP drafts)")
    draft_vocab_size: int | None = Field(None, ge=1, description="an EAGLE-3 head's own lm_head vocabulary")
    mamba: MambaMixer | None = Field(None, description="the state of the 'mamba' layers (Mamba, gated DeltaNet)")
    mixer_only_layers: bool = Field(
        False,
        description="Nemotron-H: a layer is one block (Mamba, attention, or a two-matrix squared-ReLU MLP / MoE),"
        " not attention + MLP",
    )
    parallel_mamba: bool = Field(
        False, description="Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side, then its MLP"
    )
    not_planned: str | None = Field(None, description="why the ledger cannot size this model (vLLM may serve it)")
    quant: WeightQuant = WeightQuant()
    checkpoint: Checkpoint | None = Field(None, description="safetensors parameter counts, where known")
    # (config.json as read, its source): hfconfig.with_hf_overrides merges an engine's hf_overrides into it
    _hf_config: tuple[dict[str, Any], str] | None = PrivateAttr(None)
    # config.json's rotary settings (theta, scaling) as JSON, where read (not compared, as the config is not)
    _rope_settings: str | None = PrivateAttr(None)

    def __eq__(self, other: object) -> bool:
        """Equal architecture numbers (the config.json they were read from is not compared)."""
        if not isinstance(other, BaseModel):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

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
        if ("mamba" in self.layer_types or self.parallel_mamba) and self.mamba is None:
            raise ValueError("mamba layers need the mamba mixer's numbers")
        return self

    @property
    def num_mamba_layers(self) -> int:
        return self.stage_kinds().count("mamba")

    def stage_kinds(self, pp: int = 1) -> tuple[LayerType, ...]:
        """The kinds of the cache-holding layers vLLM registers for the first pipeline stage: a layer's own kind,
        and with ``parallel_mamba`` (Falcon-H1) a Mamba layer beside each attention layer."""
        stage = self.layer_kinds[: cdiv(self.num_layers, pp)]
        mamba: tuple[LayerType, ...] = ("mamba",)
        return stage + mamba * len(stage) if self.parallel_mamba else stage

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
    def is_sparse_mla(self) -> bool:
        """DeepSeek Sparse Attention: MLA served by vLLM's sparse MLA backends (the only ones taking *_ds_mla)."""
        return self.is_mla and self.index_head_dim > 0

    @property
    def indexer_key_bytes(self) -> int:
        """One token's indexer key in one layer: fp8 values + an fp32 scale per 128 (``DeepseekV32Indexer``)."""
        return self.index_head_dim + self.index_head_dim // 128 * 4

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
    def rope_settings(self) -> str | None:
        """config.json's rotary settings as JSON (None for a catalogue entry): a drafter whose settings, head size
        and positions are the target's shares the target's cos/sin cache (capacity/draft.py)."""
        return self._rope_settings

    @property
    def rope_dim(self) -> int:
        if self.is_mla:
            return self.qk_rope_head_dim
        return self.rotary_dim or self.head_dim
