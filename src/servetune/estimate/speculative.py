"""The speculative step: what a decode step costs and yields with a drafter (``speculative_config``).

With ``k`` draft tokens, one engine step of vLLM 0.32 for a batch of ``b`` requests:

- **drafts**: the drafter proposes k tokens per request, one forward pass per token (EAGLE, MTP and a
  draft model run k passes; n-gram and suffix matching look the tokens up in the text, on the CPU, at no
  GPU cost here). A pass reads the drafter's weights (and, for MTP and EAGLE-1, the target's lm_head,
  which they share) and its KV at the request's context, and multiplies ``b`` tokens through them;
- **verification**: the target runs ``b x (1 + k)`` tokens in one pass: the weights read once, each
  request's KV read once, the FLOPs of ``1 + k`` tokens (capacity/draft.py ``query_len``);
- **yield**: the tokens accepted, plus the target's own next token. With a per-position acceptance ``a``
  (the chance a draft token is accepted, given the ones before it were), a step yields on average
  ``1 + a + a^2 + ... + a^k`` tokens per request (:func:`accepted_length`), vLLM's "mean acceptance length".

So TPOT is the step's time over the tokens it yields. At small batches the step is bound by reading the
weights, verification costs little more than one token, and TPOT falls by about the accepted length. As
batches grow the step turns compute-bound, verification costs ``1 + k`` tokens' FLOPs, and the gain
falls and turns negative: the deployment guide's "too many draft tokens lowers the real speed", and
vLLM users' case for batch-aware speculation (vLLM #48627, #49548).

An MTP layer of an MoE target is one of its MoE layers, and vLLM builds it with the target's MoE parallel config:
its experts lie over TP x DP as the target's do (the memory ledger's ``moe_shards``; estimate/expert_parallel.py
``read_layout``, the same function the target's experts are read with), and a pass reads only the experts the DP
engines' tokens select, ``Replica.experts_touched`` (:attr:`Speculation.expert_bytes`: the held experts'
bytes a pass reads in the full case). Its FLOPs are split over TP alone, as the target's are (the rank's
``1 / (TP x DP)`` share of the experts on ``DP x`` the tokens is the same work).

The acceptance depends on the model pair and the text, not on the configuration: a trial measures it
(``spec_decode_mean_accepted_length``, engine/metrics.py). Before one is measured the estimate assumes
:data:`DEFAULT_ACCEPTANCE`, per method, and says so in :attr:`Speculation.acceptance_source`.
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.capacity import CapacityPlan, ModelArch
from servetune.capacity.arith import cdiv
from servetune.capacity.hardware import GIB
from servetune.capacity.params import MoeShards, ParamSplit, formula_bytes, mtp_params, rank_params

#: Per-position acceptance assumed before any is measured. Orders of magnitude from the methods' papers and
#: vLLM's speculative-decoding docs, on chat-like text: DeepSeek-V3's report gives 85-90% for its MTP module's
#: token; EAGLE-3 reports mean accepted lengths of 4-6 at 6-7 draft tokens (about 0.75-0.85 a position),
#: EAGLE-1 fewer; a small draft model of the same family about 0.6-0.7; n-gram and suffix matching pay on
#: text that repeats its prompt (summaries, edits, RAG) and little on open chat. Kept on the low side: a
#: measured acceptance replaces them (``acceptance=`` of :func:`speculation`).
DEFAULT_ACCEPTANCE = {
    "mtp": 0.8,
    "eagle3": 0.7,
    "eagle": 0.6,
    "draft_model": 0.6,
    "ngram": 0.3,
    "suffix": 0.35,
}
#: Methods whose drafts cost no GPU pass (looked up in the text).
TEXT_METHODS = frozenset({"ngram", "suffix"})
#: Methods that reuse the target's lm_head for every draft token (its bytes read per pass).
SHARED_HEAD = frozenset({"mtp", "eagle"})


def accepted_length(acceptance: float, k: int) -> float:
    """Tokens one verification step yields per request: ``1 + a + ... + a^k``."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance {acceptance}: must be within [0, 1]")
    return float(sum(acceptance**i for i in range(k + 1)))


def acceptance_for_length(length: float, k: int) -> float:
    """The per-position acceptance whose :func:`accepted_length` at ``k`` draft tokens is ``length`` (vLLM's measured
    mean acceptance length), clipped to [0, 1]."""
    if length <= 1:
        return 0.0
    if length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Speculation:
    """One rank's drafter as the roofline sees it, and the acceptance the estimate assumes."""

    method: str
    tokens: int  # num_speculative_tokens
    acceptance: float  # per draft position, given the earlier ones were accepted
    acceptance_source: str  # "measured" or "assumed (...)"
    pass_bytes: float = 0.0  # bytes one draft pass reads besides the KV: the drafter's weights (+ shared lm_head)
    flops_per_token: float = 0.0  # one draft token's FLOPs through the drafter (and the shared lm_head)
    kv_bytes_per_token: float = 0.0  # the drafter's KV per token of context, read by each pass
    expert_bytes: float = 0.0  # of pass_bytes, an MoE MTP layer's routed experts held (read where selected)

    @property
    def query_len(self) -> int:
        return 1 + self.tokens

    @property
    def accepted_length(self) -> float:
        return accepted_length(self.acceptance, self.tokens)

    @property
    def gpu_passes(self) -> int:
        return 0 if self.method in TEXT_METHODS else self.tokens


def speculation(
    arch: ModelArch,
    plan: CapacityPlan,
    acceptance: float | None = None,
    *,
    tp: int = 1,
    experts: MoeShards | None = None,
) -> Speculation | None:
    """The drafter of a configuration the memory ledger planned with one (None without ``speculative_config``).
    ``acceptance`` is a measured per-position acceptance; without it, :data:`DEFAULT_ACCEPTANCE`. ``experts``: the
    target's routed experts' layout over TP x DP (expert_parallel.py ``read_layout``), which an MTP layer shares."""
    draft = plan.draft
    if draft is None:
        return None
    if acceptance is None:
        assumed = DEFAULT_ACCEPTANCE.get(draft.method, 0.5)
        acceptance, source = assumed, f"assumed ({draft.method}: {assumed:g} a position, not measured)"
    else:
        if not 0 <= acceptance <= 1:
            raise ValueError(f"acceptance {acceptance}: must be within [0, 1]")
        source = "measured"
    if draft.method in TEXT_METHODS:
        return Speculation(draft.method, draft.num_speculative_tokens, acceptance, source)
    bytes_per_weight = 4 if plan.settings.dtype == "float32" else 2
    pass_bytes = draft.weights_gib * GIB
    flops = 2.0 * draft.parameters_b * 1e9 / tp
    expert_bytes = 0.0
    if draft.method == "mtp" and arch.is_moe:  # an MTP layer is one of the target's: its tokens reach top-k experts
        split = rank_params(arch, tp)
        active = split.linear + split.other + split.experts * arch.num_experts_per_tok / arch.num_experts
        flops *= active / split.total
        held = ParamSplit(linear=0, other=0, experts=mtp_params(arch, tp, shards=experts).experts)
        expert_bytes = formula_bytes(arch, held, arch.quant, bytes_per_weight)
    if draft.method in SHARED_HEAD:
        head = cdiv(arch.vocab_size, tp) * arch.hidden_size
        pass_bytes += head * bytes_per_weight
        flops += 2.0 * head
    return Speculation(draft.method, draft.num_speculative_tokens, acceptance, source, pass_bytes, flops,
                       draft.kv_bytes_per_token, expert_bytes)  # fmt: skip
