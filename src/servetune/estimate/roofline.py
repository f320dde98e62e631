"""Time of one vLLM engine step on one GPU of a replica, from a roofline.

Per rank (tensor parallelism splits weights, heads and FLOPs; all-reduces join them):

    prefill of n tokens   = max(weight bytes / (HBM x e_bw), n x FLOPs per token / (peak x e_flops))
    decode of b sequences = max((weights touched + b x KV read per sequence) / (HBM x e_bw),
                                b x FLOPs per token / (peak x e_flops))
    FLOPs per token       = 2 x active parameters (MoE: the top-k experts only, lm_head included)
                            + 2 x heads x (d_qk + d_v) x tokens attended, over the attention layers
    all-reduce            = 2 per layer, ring: 2 (TP-1)/TP x tokens x hidden x 2 bytes / link + latency
    expert parallelism    = each MoE layer's dispatch and combine on the same link, where vLLM runs them, and
                            the experts a rank holds (its share over TP x DP) read for the DP group's tokens
                            (:mod:`servetune.estimate.expert_parallel`)

With speculative decoding (:mod:`servetune.estimate.speculative`) a decode step verifies 1 + k tokens per
sequence (the weights and KV read once, the FLOPs of every token) after k draft passes, and yields the
accepted length of tokens per sequence (:func:`tokens_per_step`).

With pipeline parallelism (:mod:`servetune.estimate.pipeline`) each of the ``p`` stages holds the planner's
heaviest stage (``ceil(layers / p)`` layers): a step above is one stage's, of one micro-batch, and what
:func:`decode_s` and :func:`prefill_s` return is a micro-batch's time through all ``p`` stages, the boundary
transfers between them included (``pipeline.interval_s``).

Every step adds a fixed overhead (scheduling, kernel launches) and a cost per sequence (sampling,
bookkeeping). What a step reads of the KV cache per layer kind (full, sliding window, MLA, Mamba state)
and the tokens its attention multiplies against come from :class:`~servetune.estimate.kvread.KVRead`.
The efficiencies, the overheads and the all-reduce latency come from :mod:`servetune.estimate.factors`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from servetune.capacity import ModelArch, WeightQuant
from servetune.capacity.arith import cdiv
from servetune.capacity.params import MoeShards, rank_params, weight_bytes_per_rank
from servetune.estimate.expert_parallel import ExpertExchange
from servetune.estimate.factors import Efficiency
from servetune.estimate.kvread import KVRead
from servetune.estimate.pipeline import boundary_s, interval_s, micro_batches, stage_layers
from servetune.estimate.specs import DeviceRates
from servetune.estimate.speculative import Speculation

ACTIVATION_BYTES = 2  # all-reduced hidden states are 16-bit


@dataclass(frozen=True)
class Replica:
    """One vLLM replica (one engine: TP GPUs) as the roofline sees it; data parallel replicas are copies (an MoE
    model's run in lock-step, its MoE layers over every replica's tokens: estimate/expert_parallel.py)."""

    arch: ModelArch
    rates: DeviceRates
    quant: WeightQuant
    tp: int = 1
    pp: int = 1  # pipeline stages: the fields below are one stage's (estimate/pipeline.py)
    dtype_bytes: int = 2
    # what a step reads of the KV cache per layer kind, on one rank (the target's alone)
    kv: KVRead = field(default_factory=KVRead)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    kv_cache_tokens: int | None = None  # per replica; None: unlimited
    speculation: Speculation | None = None  # the drafter (it reads its own KV: Speculation.kv_bytes_per_token)
    exchange: ExpertExchange | None = None  # the MoE layers' token exchange over DP (and EP)
    experts: MoeShards | None = None  # the routed experts' layout over TP x DP (expert_parallel.read_layout)

    @property
    def layers(self) -> int:
        """Decoder layers on one stage (all of them without pipeline parallelism)."""
        return stage_layers(self.arch, self.pp)

    @functools.cached_property
    def expert_bytes(self) -> float:
        """Bytes of routed-expert weights on one rank (read only for the experts a step touches)."""
        experts = rank_params(self.arch, self.tp, self.pp, shards=self.experts).experts
        return experts * self.quant.bytes_per_weight(self.dtype_bytes)

    @functools.cached_property
    def weight_bytes(self) -> float:
        return float(
            weight_bytes_per_rank(self.arch, self.quant, self.dtype_bytes, self.tp, self.pp, shards=self.experts)
        )

    @functools.cached_property
    def active_params(self) -> float:
        """Parameters one token multiplies through on one rank: routed experts at top-k / experts. Split over TP
        alone whatever the experts' layout: a rank's share over TP x DP times the DP engines' tokens it runs
        them on is the same FLOPs (estimate/expert_parallel.py). Under PP one stage's: its layers, and the last
        stage's lm_head spread over the stages (estimate/pipeline.py)."""
        a = self.arch
        p = rank_params(a, self.tp, self.pp)  # routed experts apart from the linear weights (capacity/params.py)
        share = a.num_experts_per_tok / a.num_experts if a.is_moe else 0.0
        lm_head = cdiv(a.vocab_size, self.tp) * a.hidden_size
        return p.linear + p.experts * share + lm_head / self.pp

    def attention_flops(self, context: float, prompt: bool = False) -> float:
        """Attention FLOPs of one token against ``context`` earlier tokens, on one rank (``prompt``: of a prompt's
        token on average, ``context`` its prompt's length), each layer against the tokens its kind attends to."""
        a = self.arch
        heads = max(1, a.num_attention_heads // self.tp)
        if a.is_mla:  # absorbed MLA: scores and values against the latent
            d_qk = (a.kv_lora_rank or 0) + a.qk_rope_head_dim
            d_v = a.kv_lora_rank or 0
        else:
            d_qk = d_v = a.head_dim
        attended = self.kv.attended_in_prompt(context) if prompt else self.kv.attended(context)
        return 2.0 * heads * (d_qk + d_v) * attended

    def experts_touched(self, tokens: float) -> float:
        """Expected fraction of routed experts that a step of ``tokens`` tokens on each DP engine selects (uniform
        routing): the MoE layers see every DP engine's tokens (``MoeShards.gathered``)."""
        a = self.arch
        if not a.is_moe:
            return 0.0
        gathered = tokens * (self.experts.gathered if self.experts is not None else 1)
        return 1.0 - (1.0 - a.num_experts_per_tok / a.num_experts) ** max(gathered, 1.0)

    def allreduce_s(self, tokens: float, latency_us: float) -> float:
        """Two all-reduces per layer (of a stage) of ``tokens`` hidden states (ring algorithm), on the GPU link."""
        if self.tp == 1:
            return 0.0
        message = tokens * self.arch.hidden_size * ACTIVATION_BYTES
        ring = 2 * (self.tp - 1) / self.tp * message / self.rates.link_bytes_s
        return 2 * self.layers * (ring + latency_us / 1e6)

    def link_s(self, tokens: float, latency_us: float) -> float:
        """A step's traffic on the GPU link: TP's all-reduces and, under expert parallelism, the MoE layers'
        exchange, which takes the place of their all-reduce where the MoE runs sequence parallel."""
        allreduce = self.allreduce_s(tokens, latency_us)
        x = self.exchange
        if x is None:
            return allreduce
        replaced = allreduce * x.allreduces_replaced / (2 * self.layers)
        return allreduce - replaced + x.seconds(tokens, self.rates.link_bytes_s, latency_us)

    def weights_read(self, tokens: float) -> float:
        return self.weight_bytes - self.expert_bytes * (1.0 - self.experts_touched(tokens))

    def boundary_s(self, tokens: float, latency_us: float) -> float:
        """One stage boundary's transfer of ``tokens`` tokens (0 without PP)."""
        return boundary_s(self.arch, self.tp, self.pp, tokens, self.rates.link_bytes_s, latency_us)


def prefill_token_s(rep: Replica, eff: Efficiency, prompt_tokens: float) -> float:
    """Compute time of one prompt token (attention over half the prompt on average), its link traffic included;
    under PP on one stage, with its share of the boundaries' transfer."""
    flops = 2 * rep.active_params + rep.attention_flops(prompt_tokens, prompt=True)
    boundary = (rep.pp - 1) / rep.pp * rep.boundary_s(1, 0.0)
    return flops / (rep.rates.flops * eff.prefill_flops) + rep.link_s(1, 0.0) + boundary


def prefill_s(rep: Replica, eff: Efficiency, tokens: float, prompt_tokens: float) -> float:
    """One step that prefills ``tokens`` tokens of prompts ``prompt_tokens`` long (through every stage under PP)."""
    flops = tokens * (2 * rep.active_params + rep.attention_flops(prompt_tokens, prompt=True))
    compute = flops / (rep.rates.flops * eff.prefill_flops)
    memory = rep.weights_read(tokens) / (rep.rates.hbm_bytes_s * eff.decode_bandwidth)
    stage = max(compute, memory) + rep.link_s(tokens, eff.allreduce_us)
    return interval_s(rep.pp, stage, rep.boundary_s(tokens, eff.allreduce_us), eff.step_overhead_ms / 1e3)


def decode_s(rep: Replica, eff: Efficiency, batch: float, context: float) -> float:
    """One step that decodes one token for each of ``batch`` sequences at mean ``context`` tokens; with a drafter,
    its draft passes and the verification of ``1 + k`` tokens per sequence (yielding :func:`tokens_per_step`).

    Under PP the interval between a sequence's steps: the ``batch`` sequences run as micro-batches, one a stage, and
    one micro-batch's time through every stage is returned (estimate/pipeline.py); the drafter runs once in it."""
    if batch <= 0:
        return eff.step_overhead_ms / 1e3
    spec = rep.speculation
    micro = batch / micro_batches(rep.pp, batch)  # sequences a micro-batch: all of them without PP
    tokens = micro * (spec.query_len if spec is not None else 1)
    read = rep.weights_read(tokens) + micro * rep.kv.per_sequence(context)
    memory = read / (rep.rates.hbm_bytes_s * eff.decode_bandwidth)
    flops = tokens * (2 * rep.active_params + rep.attention_flops(context))
    compute = flops / (rep.rates.flops * eff.prefill_flops)
    overhead = (eff.step_overhead_ms + micro * eff.sequence_overhead_ms) / 1e3
    stage = max(memory, compute) + rep.link_s(tokens, eff.allreduce_us)
    step = interval_s(rep.pp, stage, rep.boundary_s(tokens, eff.allreduce_us), overhead)
    return step + (draft_s(rep, eff, micro, context) if spec is not None else 0.0)


def draft_s(rep: Replica, eff: Efficiency, batch: float, context: float) -> float:
    """The drafter's k passes of one step: each reads its weights (an MoE MTP layer's experts as the target's are
    read, for every DP engine's tokens) and its KV and multiplies ``batch`` tokens."""
    spec = rep.speculation
    if spec is None or not spec.gpu_passes:
        return 0.0
    unread = spec.expert_bytes * (1.0 - rep.experts_touched(batch))  # an MoE MTP layer: the experts none selects
    read = spec.pass_bytes - unread + batch * context * spec.kv_bytes_per_token
    memory = read / (rep.rates.hbm_bytes_s * eff.decode_bandwidth)
    compute = batch * spec.flops_per_token / (rep.rates.flops * eff.prefill_flops)
    return spec.gpu_passes * max(memory, compute)


def tokens_per_step(rep: Replica) -> float:
    """Tokens one decode step yields per sequence: 1, or the drafter's expected accepted length."""
    return rep.speculation.accepted_length if rep.speculation is not None else 1.0
