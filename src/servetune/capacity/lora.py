"""What serving LoRA adapters adds to one rank's memory, as vLLM 0.32 preallocates it (``vllm/lora/``).

With ``enable_lora`` vLLM wraps, at load time, every layer a LoRA could target (``lora_target_modules`` unset:
all of the model's linear layers, and the embeddings a model lists in ``embedding_modules``), whatever the
adapters served actually target. Each wrapped layer holds ``max_loras`` slots of A and B at ``max_lora_rank`` in
the model's dtype (``lora_dtype: auto``), zeroed, on the device (``BaseLinearLayerWithLoRA.create_lora_weights``):

- a column-parallel layer (``qkv_proj`` as three slices q, k, v; ``gate_up_proj`` as two): per slice A is
  rank x input and B is the slice's output on this rank x rank;
- a row-parallel layer (``o_proj``, ``down_proj``): A is rank x this rank's input, B is output x rank;
- ``embed_tokens`` (``VocabParallelEmbeddingWithLoRA``): A is vocab x rank, B is hidden x rank;
- the logits (``LogitsProcessorWithLoRA`` around ``lm_head``): A is rank x hidden, B is vocab x rank.

``fully_sharded_loras`` splits the rank of column-parallel A and the output of row-parallel B over TP. The
punica wrapper keeps four index vectors of ``max_num_batched_tokens`` and three of ``max_num_seqs`` (int64). All
of it is allocated before the profile run, so on a GPU it comes out of the KV pool; on the CPU build the KV
space is reserved as asked and the LoRA slots live beside it. Loaded adapters wait in host memory
(``max_cpu_loras``, default ``max_loras``), not on the GPU. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.capacity.arch import ModelArch
from servetune.capacity.arith import cdiv
from servetune.capacity.params import kv_heads_per_rank
from servetune.capacity.schema import NotPlanned

#: vLLM's defaults (``vllm/config/lora.py``).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
#: The punica wrapper's index vectors: 4 of max_num_batched_tokens, 3 of max_num_seqs, int64.
INDEX_BYTES = 8


@dataclass(frozen=True)
class LoraCost:
    """LoRA's preallocated bytes on one rank, and what they were sized for."""

    max_loras: int
    max_lora_rank: int
    slot_bytes: int  # one adapter slot over every wrapped layer (A and B)
    buffers: int  # the punica wrapper's index vectors

    @property
    def total(self) -> int:
        return self.max_loras * self.slot_bytes + self.buffers

    def describe(self) -> str:
        return (
            f"LoRA: {self.max_loras} slot(s) of rank {self.max_lora_rank} over every linear layer and the embeddings, "
            f"{self.slot_bytes / 2**20:.2f} MiB each, preallocated by vLLM whatever the adapters target"
        )


def _unsupported(arch: ModelArch) -> str | None:
    if arch.is_mla:
        return "multi-head latent attention"
    if arch.num_experts:
        return "mixture-of-experts layers"
    if arch.mamba is not None or arch.mixer_only_layers or arch.parallel_mamba:
        return "Mamba / linear-attention layers"
    return None


def lora_cost(
    arch: ModelArch,
    dtype_bytes: int,
    max_loras: int | None = None,
    max_lora_rank: int | None = None,
    tp: int = 1,
    pp: int = 1,
    max_num_batched_tokens: int = 0,
    max_num_seqs: int = 0,
    fully_sharded: bool = False,
) -> LoraCost:
    """What ``enable_lora`` preallocates on one rank of ``arch`` (the first PP stage's layers, with embeddings and
    logits counted as if one stage held both). Models with layers the ledger does not size for LoRA are
    :class:`NotPlanned`."""
    unsupported = _unsupported(arch)
    if unsupported is not None:
        raise NotPlanned(f"LoRA memory on a model with {unsupported} is not modelled")
    loras = max_loras or DEFAULT_MAX_LORAS
    rank = max_lora_rank or DEFAULT_MAX_LORA_RANK
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_out = arch.num_attention_heads * arch.head_dim // tp
    kv_out = kv_heads_per_rank(arch, tp) * arch.head_dim
    a_rank = rank // tp if fully_sharded else rank  # column-parallel A's rank
    hidden_out = hidden // tp if fully_sharded else hidden  # row-parallel B's output

    def column(out_slices: tuple[int, ...]) -> int:
        return sum(a_rank * hidden + out * rank for out in out_slices)

    def row(input_on_rank: int) -> int:
        return rank * input_on_rank + hidden_out * rank

    per_layer = column((q_out, kv_out, kv_out)) + row(q_out)
    if inter:
        per_layer += column((inter // tp, inter // tp)) + row(inter // tp)
    layers = cdiv(arch.num_layers, pp)
    vocab = arch.vocab_size
    embeddings = vocab * rank + hidden * rank  # embed_tokens
    logits = rank * hidden + vocab * rank  # lm_head, through the logits processor
    slot = (layers * per_layer + embeddings + logits) * dtype_bytes
    tokens = cdiv(max_num_batched_tokens, 8) * 8
    buffers = (4 * tokens + 3 * max_num_seqs) * INDEX_BYTES
    return LoraCost(max_loras=loras, max_lora_rank=rank, slot_bytes=slot, buffers=buffers)
