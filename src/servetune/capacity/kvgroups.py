"""How vLLM 0.32 lays one rank's KV cache out when layers attend differently.

vLLM gives every attention layer a KV-cache spec: full attention keeps every token; a
sliding-window layer keeps its window; a chunked-local layer (Llama 4) its chunk. With the hybrid
KV-cache manager (on by default, ``vllm/v1/core/kv_cache_utils.py``) layers of one kind are cut
into groups of equally many layers (the smallest kind's count, or the largest's when they differ
by under 1.5x; the last group of a kind padded), every group's block holds one page per layer, and
all groups draw block ids from one pool:

    bytes per block    = layers per group x block_size x KV bytes per token per layer
    blocks per request = sum over groups of:
        full attention:   ceil(max_model_len / block_size)
        sliding window:   ceil(min(window - 1 + in-flight tokens, max_model_len) / block_size) + 1
        chunked local:    ceil(min(chunk + in-flight tokens, max_model_len) / block_size)
    KV tokens          = num_blocks / blocks per request x max_model_len

Mamba and linear-attention layers (``servetune.capacity.mamba``) form groups of their own in the
same pool: their page is padded to the attention page, and a request holds one block per Mamba
group (two or three under prefix caching's ``align`` mode) whatever its length. MLP-only layers
(Nemotron-H) hold nothing. Falcon-H1 registers an attention layer and a Mamba layer for each decoder layer.

In-flight tokens are every concurrently scheduled batch's ``max_num_batched_tokens`` (two batches
with async scheduling, vLLM's default; pipeline stages + 1 with PP; one on the CPU build, which turns
async scheduling off). When the hybrid manager is
off (``--disable-hybrid-kv-cache-manager``, and by default for chunked-local attention) every
local layer is promoted to full attention. Pure; no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.capacity.arch import LayerType, ModelArch
from servetune.capacity.arith import cdiv


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: up to ``group_size`` layers of one kind sharing a block table."""

    kind: LayerType
    layers: int
    window: int | None = None  # sliding window or chunk, in tokens
    state_blocks: int = 1  # a Mamba group: blocks one request holds (MambaSpec.max_memory_usage_bytes / page)

    def blocks_per_request(self, max_model_len: int, block_size: int, in_flight_tokens: int, dcp: int = 1) -> int:
        """``dcp``: decode context parallel ranks a full-attention layer's tokens are sharded over (vLLM's
        ``AttentionSpec.max_num_blocks_per_req``: ceil(len / (block_size x DCP)) blocks on each rank)."""
        if self.kind == "mamba":
            return self.state_blocks
        if self.kind == "sliding_attention" and self.window is not None:
            return cdiv(min(self.window - 1 + in_flight_tokens, max_model_len), block_size) + 1
        if self.kind == "chunked_attention" and self.window is not None:
            return cdiv(min(self.window + in_flight_tokens, max_model_len), block_size)
        return cdiv(max_model_len, block_size * dcp)


@dataclass(frozen=True)
class KVLayout:
    """The groups of one rank's layers and the layers every group's block holds a page for."""

    groups: tuple[KVGroup, ...]
    group_size: int

    def bytes_per_block(self, block_size: int, bytes_per_token_per_layer: float) -> int:
        return round(self.group_size * block_size * bytes_per_token_per_layer)

    def blocks_per_request(self, max_model_len: int, block_size: int, in_flight_tokens: int, dcp: int = 1) -> int:
        return sum(g.blocks_per_request(max_model_len, block_size, in_flight_tokens, dcp) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len({g.kind for g in self.groups}) > 1

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for group in self.groups:
            label = group.kind.replace("_attention", "") + (f" {group.window}" if group.window else "")
            label = "mamba state" if group.kind == "mamba" else label
            kinds[label] = kinds.get(label, 0) + 1
        parts = ", ".join(f"{n} x {label}" for label, n in kinds.items())
        return f"KV cache groups of {self.group_size} layers: {parts}"


def kv_layout(
    arch: ModelArch,
    pp: int = 1,
    hybrid_manager: bool | None = None,
    mamba_state_blocks: int = 1,
    drafter_layers: int = 0,
) -> KVLayout:
    """The KV-cache groups vLLM 0.32 forms for one pipeline stage of ``arch``.

    ``hybrid_manager`` None is vLLM's default: on, except for chunked-local attention (vLLM turns
    it off unless ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE`` is set). Mamba layers
    always keep groups of their own; ``mamba_state_blocks`` is what one request holds in each.
    ``drafter_layers``: full-attention layers of a drafter with the target's page (MTP), grouped as the
    target's own (measured: ``bench/mtp_vllm.py``, the tiny Qwen3-Next's MTP layer joins its attention group).
    """
    stage: list[LayerType] = [k for k in arch.stage_kinds(pp) if k != "mlp"]
    stage += ["full_attention"] * drafter_layers
    if hybrid_manager is None:
        hybrid_manager = "chunked_attention" not in stage
    kinds: dict[LayerType, int] = {}
    for kind in stage:
        kinds[kind] = kinds.get(kind, 0) + 1
    if len(kinds) > 1 and not hybrid_manager:
        attention = len(stage) - kinds.get("mamba", 0)
        promoted: dict[LayerType, int] = {"full_attention": attention}
        if "mamba" in kinds:
            promoted["mamba"] = kinds["mamba"]
        kinds = promoted
    if len(kinds) == 1:
        (kind, count), *_ = kinds.items()
        return KVLayout(groups=(KVGroup(kind, count, layer_window(arch, kind), mamba_state_blocks),), group_size=count)
    smallest, largest = min(kinds.values()), max(kinds.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups: list[KVGroup] = []
    for kind, count in kinds.items():
        for i in range(cdiv(count, group_size)):
            layers = min(group_size, count - i * group_size)
            groups.append(KVGroup(kind, layers, layer_window(arch, kind), mamba_state_blocks))
    return KVLayout(groups=tuple(groups), group_size=group_size)


def layer_window(arch: ModelArch, kind: LayerType) -> int | None:
    """Tokens a layer of ``kind`` attends to at most (None: the whole context)."""
    if kind == "sliding_attention":
        return arch.sliding_window
    if kind == "chunked_attention":
        return arch.attention_chunk_size
    return None
