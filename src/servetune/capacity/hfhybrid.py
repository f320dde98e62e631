"""The layer kinds and the Mamba / linear-attention mixer of a hybrid model's Hugging Face config.

Read as vLLM 0.32's model classes read them (``get_mamba_state_shape_from_config`` per model type):
Qwen3-Next, Nemotron-H, Granite-4.0-H / Bamba, Jamba, Falcon-H1 (a Mamba-2 mixer beside every layer's
attention) and MiniMax-Text-01 / M1 (``attn_type_list``: 0 lightning attention, 1 softmax). What the planner
cannot size comes back as the reason why.
"""

from __future__ import annotations

from typing import Any

from servetune.capacity.arith import cdiv
from servetune.capacity.model import _PATTERN_KINDS, ATTENTION_KINDS, LayerType, MambaMixer

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
    if model_type == "minimax":  # transformers' MiniMax (MiniMax-Text-01 as layer_types): lightning attention
        heads = int(cfg["num_attention_heads"])
        return MambaMixer(
            kind="linear_attention", num_heads=heads, head_dim=int(cfg.get("head_dim") or hidden // heads)
        )
    if model_type == "jamba":  # Mamba-1
        return MambaMixer(
            kind="mamba1",
            conv_kernel=int(cfg.get("mamba_d_conv") or 4),
            intermediate_size=int(cfg.get("mamba_expand") or 2) * hidden,
            state_size=int(cfg["mamba_d_state"]),
            dt_rank=int(cfg.get("mamba_dt_rank") or cdiv(hidden, 16)),
        )
    return None


def _falcon_h1_mixer(cfg: dict[str, Any], hidden: int) -> MambaMixer:
    """Falcon-H1's ``MambaMixer2``, as vLLM 0.32's ``FalconH1ForCausalLM.get_mamba_state_shape_from_config``
    reads it: the inner width is ``mamba_d_ssm``, or ``mamba_expand x hidden_size`` when that is unset."""
    d_ssm = cfg.get("mamba_d_ssm")
    inner = int(d_ssm) if d_ssm is not None else int(float(cfg.get("mamba_expand") or 2) * hidden)
    heads = int(cfg["mamba_n_heads"])
    head_dim = cfg.get("mamba_d_head")
    return MambaMixer(
        kind="mamba2",
        conv_kernel=int(cfg.get("mamba_d_conv") or 4),
        intermediate_size=inner,
        state_size=int(cfg["mamba_d_state"]),
        n_groups=int(cfg.get("mamba_n_groups") or 1),
        num_heads=heads,
        head_dim=int(head_dim) if isinstance(head_dim, int) else inner // heads,  # "auto": inner / heads
        rms_norm=bool(cfg.get("mamba_rms_norm", False)),
    )


def _hybrid_layers(
    cfg: dict[str, Any], model_type: str, hidden: int
) -> tuple[list[LayerType], MambaMixer | None] | str:
    """Layer kinds and the mixer of a model with Mamba / linear-attention layers, ([], None) for a model without,
    or why the planner cannot size it."""
    if model_type == "falcon_h1":  # every layer: attention and a Mamba-2 mixer side by side (ModelArch.parallel_mamba)
        try:
            return ["full_attention"] * int(cfg["num_hidden_layers"]), _falcon_h1_mixer(cfg, hidden)
        except (KeyError, TypeError, ValueError) as exc:
            return f"its Mamba layers' numbers are incomplete ({exc})"
    attn_types = cfg.get("attn_type_list") or ()
    if 0 in attn_types:  # MiniMax-Text-01 / M1: 0 lightning (linear) attention, 1 softmax attention
        try:
            mixer = _mamba_mixer(cfg, "minimax", hidden)
        except (KeyError, TypeError, ValueError) as exc:
            return f"its lightning attention layers' numbers are incomplete ({exc})"
        return ["full_attention" if kind else "mamba" for kind in attn_types], mixer
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
