"""What one engine step reads of the KV cache, per sequence and per layer kind: :class:`KVRead`.

The one place that says how many bytes a decode step reads for a sequence, and how many tokens its attention
multiplies against (the roofline's attention FLOPs), on one rank:

    full attention (MLA too)   context tokens x the layer's KV bytes per token
    sliding window             min(context, window) tokens
    chunked local (Llama 4)    min(context, chunk) tokens (an upper bound: a chunk restarts at its boundary)
    Mamba / linear attention   the sequence's state, read and written once a step (2 x its bytes), whatever the context
    MLP-only layers            nothing

The bytes come from the memory ledger (capacity/): one attention layer's KV bytes per token is the plan's
``kv_bytes_per_token`` (the cache dtype and TP split included) over the stage's attention layers, and a Mamba
layer's state is the plan's ``mamba_state_bytes_per_sequence`` over its ``mamba_layers``; the read counts every
layer of one pipeline stage (the planner's heaviest, the whole model without PP), as the roofline counts that
stage's weights (estimate/pipeline.py). A prompt token attends, on average over the
prompt, to what :meth:`KVRead.attended_in_prompt` says (a window caps it as it caps a decode token's).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from servetune.capacity import CapacityPlan, ModelArch
from servetune.capacity.arch import ATTENTION_KINDS
from servetune.capacity.arith import cdiv
from servetune.capacity.kvgroups import layer_window


def _mean_capped(prompt: float, window: int) -> float:
    """Mean over a prompt's positions p in [0, prompt] of min(p, window)."""
    if prompt <= window:
        return prompt / 2
    return window - window * window / (2 * prompt)


@dataclass(frozen=True)
class KVRead:
    """One rank's KV layers by the tokens they attend to, and the Mamba state a sequence keeps."""

    layer_bytes: float = 0.0  # one attention layer's KV bytes per token (the cache dtype included)
    layers: tuple[tuple[int | None, int], ...] = ()  # (window in tokens, None: full context; attention layers)
    state_bytes: float = 0.0  # one sequence's Mamba / linear-attention state over every such layer

    @classmethod
    def of(cls, arch: ModelArch, plan: CapacityPlan, target_kv_bytes_per_token: float) -> KVRead:
        """The read of ``arch`` served as ``plan`` sized it; ``target_kv_bytes_per_token``: the plan's KV bytes per
        token less a drafter's (estimate/speculative.py reads the drafter's own)."""
        pp = plan.settings.pipeline_parallel_size
        stage = arch.layer_kinds[: cdiv(arch.num_layers, pp)]
        attending = sum(kind in ATTENTION_KINDS for kind in stage)
        windows = Counter(layer_window(arch, kind) for kind in stage if kind in ATTENTION_KINDS)
        state = (
            plan.mamba_state_bytes_per_sequence / plan.mamba_layers * arch.stage_kinds(pp).count("mamba")
            if plan.mamba_layers
            else 0.0
        )
        return cls(
            layer_bytes=target_kv_bytes_per_token / attending if attending else 0.0,
            layers=tuple(sorted(windows.items(), key=lambda item: (item[0] is None, item[0] or 0))),
            state_bytes=state,
        )

    def attended(self, context: float) -> float:
        """Token-layers one decoded token reads at ``context`` tokens (the attention layers summed)."""
        return sum(n * (context if w is None else min(context, w)) for w, n in self.layers)

    def attended_in_prompt(self, prompt_tokens: float) -> float:
        """Token-layers a prompt's token attends to, on average over the prompt's positions."""
        return sum(n * (prompt_tokens / 2 if w is None else _mean_capped(prompt_tokens, w)) for w, n in self.layers)

    def per_sequence(self, context: float) -> float:
        """Bytes one decode step reads and writes for one sequence at ``context`` tokens: its KV, and its state."""
        return self.layer_bytes * self.attended(context) + 2 * self.state_bytes
