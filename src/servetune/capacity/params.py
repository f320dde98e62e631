"""Parameters from architecture numbers, and the weight bytes one GPU holds.

Counted the way vLLM shards them: attention heads and MLP / expert widths split by tensor
parallelism (KV heads replicated once TP exceeds them; MLA's low-rank down-projections replicated
on every rank), vocabulary-parallel embedding and lm_head (vocabulary padded to a multiple of 64),
norms and MoE routers replicated, layers split by pipeline parallelism. MoE layers shard over TP x DP ranks
(:class:`MoeShards`): experts' widths without expert parallelism, whole experts with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from servetune.capacity.arch import ModelArch, WeightQuant
from servetune.capacity.arith import cdiv

VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of 64
# MXFP4 experts on Hopper (Triton and Marlin layouts) are stored with the hidden dimension padded to
# a multiple of 256: gpt-oss-120b loads 64.38 GiB on an H100 under vLLM 0.14.1 (issue #33155),
# 60.7 GiB unpadded. See tests/unit/test_capacity_calibration.py.
MXFP4_HIDDEN_ALIGNMENT = 256


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts on one rank: linear weights a quantization method may pack (routed experts
    apart: MXFP4 packs only those), and the rest."""

    linear: int
    other: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.other + self.experts

    def __add__(self, other: ParamSplit) -> ParamSplit:
        return ParamSplit(self.linear + other.linear, self.other + other.other, self.experts + other.experts)

    def times(self, n: int) -> ParamSplit:
        return ParamSplit(self.linear * n, self.other * n, self.experts * n)


#: Architectures whose shared experts vLLM 0.32 replicates under sequence-parallel MoE (``disable_tp``).
SEQUENCE_PARALLEL_SHARED_EXPERTS = ("Deepseek", "Llama4", "Qwen3Next", "NemotronH")


@dataclass(frozen=True)
class MoeShards:
    """How vLLM 0.32's FusedMoE lays the routed experts over the GPUs (``FusedMoEParallelConfig.make``).

    Its group is every rank of TP x DP x PCP (``flatten_tp_across_dp_and_pcp``: attention and dense layers
    split by TP only, replicated over DP and prefill context parallelism). Without expert parallelism every
    rank holds every expert, its width split over the group (``FusedMoEConfig`` asserts it divides); with it
    (``enable_expert_parallel`` and a group above 1) ``ep_size`` = TP x DP x PCP and each rank holds whole experts,
    ``ceil(experts / ep_size)`` on the heaviest (``determine_expert_map``: the first ``experts % ep_size``
    ranks take one more). The router gate is replicated. Shared experts split by TP, but DeepSeek-V2/V3,
    Llama 4, Qwen3-Next and Nemotron-H replicate them when the MoE runs sequence parallel
    (``use_sequence_parallel_moe``: EP, TP > 1 and DP > 1 with the default all2all backend; Qwen2/3-MoE do not).
    """

    group: int = 1  # TP x DP x PCP
    expert_parallel: bool = False
    replicate_shared: bool = False
    layout: str = ""  # how the group is made, for messages: "TP 2 x DP 2 (4 ranks)" (of() fills it)
    gathered: int = 1  # DP ranks whose scheduled tokens each MoE layer gathers (activation_bytes_per_token)
    eplb: bool = False  # expert-parallel load balancing: a transfer buffer of one MoE layer's experts (weight_bytes)
    redundant: int = 0  # EPLB's redundant experts, placed with the routed ones (determine_expert_counts)

    @classmethod
    def of(
        cls,
        arch: ModelArch,
        tp: int,
        dp: int = 1,
        expert_parallel: bool = False,
        pcp: int = 1,
        eplb: bool = False,
        redundant: int = 0,
    ) -> MoeShards:
        ep = expert_parallel and tp * dp * pcp > 1
        sequence_parallel = ep and tp > 1 and dp > 1  # vLLM 0.32 use_sequence_parallel_moe: PCP plays no part
        family = arch.architecture.startswith(SEQUENCE_PARALLEL_SHARED_EXPERTS)
        sizes = [f"TP {tp}"] + [f"{name} {n}" for name, n in (("DP", dp), ("PCP", pcp)) if n > 1]
        layout = f"{' x '.join(sizes)} ({tp * dp * pcp} ranks)"
        replicate = sequence_parallel and family
        eplb = eplb and ep and arch.is_moe
        return cls(group=tp * dp * pcp, expert_parallel=ep, replicate_shared=replicate, layout=layout, gathered=dp,
                   eplb=eplb, redundant=redundant if eplb else 0)  # fmt: skip

    @property
    def expert_split(self) -> int:
        """How many ways one expert's intermediate width is split: the group without EP, 1 with it."""
        return 1 if self.expert_parallel else self.group

    def experts_per_rank(self, experts: int) -> int:
        """Experts on the heaviest rank: all of them without EP; with it, E + R physical experts over the group."""
        return cdiv(experts + self.redundant, self.group) if self.expert_parallel else experts

    def expert_width(self, width: int) -> int:
        """One expert's intermediate width on a rank."""
        return width if self.expert_parallel else cdiv(width, self.group)


def kv_heads_per_rank(arch: ModelArch, tp: int) -> int:
    """KV heads one rank stores: split while TP <= KV heads, one (replicated) beyond."""
    return max(1, arch.num_kv_heads // tp)


def _attention(arch: ModelArch, tp: int) -> ParamSplit:
    h = arch.hidden_size
    heads = arch.num_attention_heads // tp
    if arch.is_mla:
        qk = arch.qk_nope_head_dim + arch.qk_rope_head_dim
        latent = arch.kv_lora_rank or 0
        if arch.q_lora_rank:
            q = h * arch.q_lora_rank + arch.q_lora_rank * heads * qk
            q_norm = arch.q_lora_rank
        else:
            q, q_norm = h * heads * qk, 0
        kv = h * (latent + arch.qk_rope_head_dim) + latent * heads * (arch.qk_nope_head_dim + arch.v_head_dim)
        o = heads * arch.v_head_dim * h
        return ParamSplit(linear=q + kv + o, other=q_norm + latent)
    kv = kv_heads_per_rank(arch, tp)
    d = arch.head_dim
    linear = h * heads * d * (2 if arch.attention_output_gate else 1) + 2 * h * kv * d + heads * d * h
    other = (heads + 2 * kv) * d if arch.qkv_bias else 0
    if arch.qk_norm:
        other += 2 * d
    if arch.attention_sinks:
        other += heads
    return ParamSplit(linear=linear, other=other)


def _dense_mlp(arch: ModelArch, tp: int) -> ParamSplit:
    return ParamSplit(linear=3 * arch.hidden_size * cdiv(arch.intermediate_size, tp), other=0)


def _moe_mlp(arch: ModelArch, tp: int, shards: MoeShards | None = None) -> ParamSplit:
    h, moe = arch.hidden_size, shards or MoeShards(group=tp)
    experts = moe.experts_per_rank(arch.num_experts) * 3 * h * moe.expert_width(arch.moe_intermediate_size)
    shared = 3 * h * cdiv(arch.shared_expert_intermediate_size, 1 if moe.replicate_shared else tp)
    router = h * arch.num_experts + arch.num_experts  # gate weight (+ DeepSeek's correction bias)
    if arch.architecture.startswith("Qwen3Next") and arch.shared_expert_intermediate_size:
        # no correction bias; a sigmoid gate on the shared expert (shared_expert_gate, hidden -> 1), replicated.
        # Measured: bench/mtp_vllm.py, the MTP layer of the tiny Qwen3-Next
        router += h - arch.num_experts
    return ParamSplit(linear=shared, other=router, experts=experts)


def _mixer(arch: ModelArch, tp: int) -> ParamSplit:
    """A Mamba / gated-DeltaNet mixer, as vLLM's MambaMixer, MambaMixer2 and Qwen3-Next's GatedDeltaNet hold it."""
    m, h = arch.mamba, arch.hidden_size
    if m is None:
        return ParamSplit(linear=0, other=0)
    if m.kind == "linear_attention":  # MiniMax lightning attention: qkv_proj, output_gate, out_proj, norm
        inner = m.num_heads * m.head_dim
        return ParamSplit(linear=h * cdiv(3 * inner, tp) + h * cdiv(inner, tp) + cdiv(inner, tp) * h, other=inner)
    if m.kind == "gated_delta_net":  # in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj
        k, v = m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim
        linear = h * cdiv(2 * k + 2 * v, tp) + h * cdiv(2 * m.num_v_heads, tp) + cdiv(v, tp) * h
        other = cdiv(2 * k + v, tp) * m.conv_kernel + 2 * cdiv(m.num_v_heads, tp) + m.head_v_dim
        return ParamSplit(linear=linear, other=other)
    inner = cdiv(m.intermediate_size, tp)
    if m.kind == "mamba2":  # in_proj (z, x, B, C, dt), conv1d (+ bias), A, D, dt_bias, gated norm, out_proj
        groups = 2 * m.n_groups * m.state_size
        linear = h * cdiv(2 * m.intermediate_size + groups + m.num_heads, tp) + inner * h
        other = cdiv(m.intermediate_size + groups, tp) * (m.conv_kernel + 1) + 3 * cdiv(m.num_heads, tp)
        other += inner if m.rms_norm else 0
        return ParamSplit(linear=linear, other=other)
    # mamba1: in_proj, conv1d (+ bias), x_proj, dt_proj (+ bias), A_log, D, out_proj
    linear = h * 2 * inner + inner * (m.dt_rank + 2 * m.state_size) + m.dt_rank * inner + inner * h
    other = inner * (m.conv_kernel + 1) + inner + inner * m.state_size + inner
    return ParamSplit(linear=linear, other=other)


def _mixer_only_body(arch: ModelArch, tp: int, stage: tuple[str, ...], shards: MoeShards | None) -> ParamSplit:
    """Nemotron-H: every layer is one block (Mamba-2, attention, or a squared-ReLU MLP / MoE of two matrices)."""
    mamba, mlp = stage.count("mamba"), stage.count("mlp")
    feed = _moe_mlp(arch, tp, shards) if arch.is_moe else _dense_mlp(arch, tp)
    feed = ParamSplit(linear=feed.linear * 2 // 3, other=feed.other, experts=feed.experts * 2 // 3)
    body = _attention(arch, tp).times(len(stage) - mamba - mlp) + _mixer(arch, tp).times(mamba) + feed.times(mlp)
    return body + ParamSplit(linear=0, other=arch.hidden_size * len(stage))


def _indexer(arch: ModelArch) -> ParamSplit:
    """One DeepSeek Sparse Attention indexer, replicated on every rank (``DeepseekV32Indexer``): ``wq_b``
    (quantized like the model), ``wk_weights_proj`` (unquantized) and ``k_norm``."""
    d, n = arch.index_head_dim, arch.index_n_heads
    return ParamSplit(linear=(arch.q_lora_rank or 0) * n * d, other=arch.hidden_size * (d + n) + 2 * d)


def layer_params(arch: ModelArch, tp: int, moe: bool, shards: MoeShards | None = None) -> ParamSplit:
    """One decoder layer on one rank; ``shards``: how its experts lie (default: split by TP alone)."""
    norms = ParamSplit(linear=0, other=2 * arch.hidden_size)
    return _attention(arch, tp) + (_moe_mlp(arch, tp, shards) if moe else _dense_mlp(arch, tp)) + norms


def _vocab(arch: ModelArch, tp: int, padded: bool) -> int:
    vocab = cdiv(arch.vocab_size, VOCAB_PADDING) * VOCAB_PADDING if padded else arch.vocab_size
    return cdiv(vocab, tp) * arch.hidden_size


def mtp_params(arch: ModelArch, tp: int = 1, shards: MoeShards | None = None) -> ParamSplit:
    """One rank's share of the checkpoint's MTP layers (``arch.mtp_layers``; none for most models): a decoder
    layer of the target's kind each (MoE where the target's last layers are), ``eh_proj`` (2 x hidden -> hidden,
    replicated), and enorm, hnorm and the shared head's norm; embeddings and lm_head are the target's."""
    h = arch.hidden_size
    layer = layer_params(arch, tp, moe=arch.is_moe, shards=shards) + ParamSplit(linear=0, other=2 * h * h + 3 * h)
    if arch.indexer_layers:  # vLLM builds an indexer on every MTP layer
        layer = layer + _indexer(arch)
    return layer.times(arch.mtp_layers)


def count_parameters(arch: ModelArch) -> int:
    """Total parameters of the model as published (unsharded, unpadded vocabulary)."""
    return rank_params(arch, tp=1, pp=1, padded_vocab=False).total


def rank_params(
    arch: ModelArch, tp: int = 1, pp: int = 1, padded_vocab: bool = True, shards: MoeShards | None = None
) -> ParamSplit:
    """Parameters on the heaviest rank for tensor parallel ``tp`` and pipeline parallel ``pp`` (``shards``: the
    experts' layout over TP x DP, default TP alone).

    With PP > 1 the heaviest stage is taken: ceil(layers / PP) layers (MoE layers first, they are
    the larger ones) plus the larger of the embedding (first stage) and the lm_head (last stage).
    """
    layers = cdiv(arch.num_layers, pp)
    stage = arch.layer_kinds[:layers]
    if arch.mixer_only_layers:
        body = _mixer_only_body(arch, tp, stage, shards)
    else:
        moe_layers = min(layers, arch.num_moe_layers)
        dense_layers = layers - moe_layers
        body = layer_params(arch, tp, moe=False).times(dense_layers)
        if moe_layers:
            body = body + layer_params(arch, tp, moe=True, shards=shards).times(moe_layers)
        mamba = stage.count("mamba")  # a Mamba layer has its mixer where another has attention
        if mamba:
            body = body + _mixer(arch, tp).times(mamba) + _attention(arch, tp).times(-mamba)
        if arch.parallel_mamba:  # Falcon-H1: the mixer beside every layer's attention
            body = body + _mixer(arch, tp).times(layers)
    if arch.indexer_layers:  # the heaviest stage's share of the indexers (every layer's, for DeepSeek-V3.2)
        body = body + _indexer(arch).times(cdiv(arch.indexer_layers * layers, arch.num_layers))
    embed = _vocab(arch, tp, padded_vocab)
    vision = cdiv(arch.vision_parameters, tp)  # the vision tower shards like the decoder, on the first stage
    if pp == 1:
        ends = embed + vision + (0 if arch.tie_word_embeddings else embed) + arch.hidden_size
    else:  # the heavier end: the first stage's embedding and vision tower or the last's lm_head + final norm
        ends = embed + max(vision, arch.hidden_size)
    return body + ParamSplit(linear=0, other=ends)


def formula_bytes(arch: ModelArch, params: ParamSplit, quant: WeightQuant, dtype_bytes: int) -> float:
    packed = quant.bytes_per_weight(dtype_bytes)
    linear = float(dtype_bytes) if quant.experts_only else packed
    experts = float(params.experts)
    if quant.method == "mxfp4":
        experts *= cdiv(arch.hidden_size, MXFP4_HIDDEN_ALIGNMENT) * MXFP4_HIDDEN_ALIGNMENT / arch.hidden_size
    return params.linear * linear + experts * packed + params.other * dtype_bytes


def weight_bytes_per_rank(
    arch: ModelArch, quant: WeightQuant, dtype_bytes: int, tp: int = 1, pp: int = 1, shards: MoeShards | None = None
) -> int:
    """Bytes of weights (plus the rotary cos/sin cache) one GPU loads (``shards``: :class:`MoeShards`).

    Where the checkpoint's safetensors headers are known (``arch.checkpoint``) and it is served as stored
    (its own quantization), the whole is the checkpoint's bytes, split across ranks in the proportions the
    parameter-count formula gives; otherwise the formula alone.
    """
    weights = formula_bytes(arch, rank_params(arch, tp, pp, shards=shards), quant, dtype_bytes)
    if shards is not None and shards.eplb:  # EplbState.add_model, inside the load: empty_like one MoE layer's experts
        one_layer = ParamSplit(linear=0, other=0, experts=_moe_mlp(arch, tp, shards).experts)
        weights += formula_bytes(arch, one_layer, quant, dtype_bytes)
    stored = arch.checkpoint.bytes_served(dtype_bytes) if arch.checkpoint and quant == arch.quant else None
    if stored:
        # The checkpoint also stores its MTP layers, which vLLM loads only to draft with (capacity/draft.py).
        whole = rank_params(arch, padded_vocab=False) + mtp_params(arch, 1)
        weights *= stored / formula_bytes(arch, whole, quant, dtype_bytes)
    rope_cache = arch.max_position_embeddings * arch.rope_dim * dtype_bytes
    return int(weights) + rope_cache


def kv_bytes_per_layer_token(arch: ModelArch, kv_dtype_bytes: float, tp: int = 1) -> float:
    """KV cache bytes one layer keeps per token on one rank.

    Standard attention: 2 (K and V) x KV heads on this rank x head_dim x bytes.
    MLA: one latent (kv_lora_rank + qk_rope_head_dim) per token, on every TP rank; DeepSeek Sparse Attention
    adds its indexer's key (``ModelArch.indexer_key_bytes``), averaged over the layers.
    """
    if arch.is_mla:
        latent = ((arch.kv_lora_rank or 0) + arch.qk_rope_head_dim) * kv_dtype_bytes
        # DeepSeek Sparse Attention: each indexer layer's own key cache, in one KV-cache group with the latents
        # (UniformTypeKVCacheSpecs: the block's page is the sum of every layer's), whatever the kv_cache_dtype.
        return latent + arch.indexer_key_bytes * arch.indexer_layers / arch.num_layers
    return 2 * kv_heads_per_rank(arch, tp) * arch.head_dim * kv_dtype_bytes


def kv_bytes_per_token(arch: ModelArch, kv_dtype_bytes: float, tp: int = 1, pp: int = 1) -> int:
    """KV cache bytes per token on one rank if every attention layer of its stage kept every token."""
    stage = arch.layer_kinds[: cdiv(arch.num_layers, pp)]
    attention = len(stage) - stage.count("mamba") - stage.count("mlp")
    return round(attention * kv_bytes_per_layer_token(arch, kv_dtype_bytes, tp))


def activation_bytes_per_token(
    arch: ModelArch, act_bytes: int, tp: int = 1, hidden_states: int = 2, shards: MoeShards | None = None
) -> int:
    """Peak transient bytes per scheduled token in a forward pass (one layer is live at a time).

    ``hidden_states`` hidden-size tensors (the hidden state and the residual; in V0's eager forward also the
    down projection's output, written while the MLP's input is still held: 3), plus the larger of the MLP
    intermediates (gate_up output and the activated product, or the fused-MoE caches for top-k experts) and
    the attention projections. Three are checked on vLLM 0.6.4's V0 profiling run of Llama-3.1-8B at 20K and
    29K tokens (issue 10517: 2.07 and 2.99 GiB logged, 2.06 and 2.99 planned; two give 1.91 and 2.77).

    Under data parallelism an MoE layer works on every DP rank's tokens: vLLM 0.32 picks the naive DP
    prepare/finalize whenever ``dp_size > 1`` (``fused_moe/all2all_utils.py`` ``maybe_make_prepare_finalize``),
    whose dispatch all-gathers the hidden states (``AgRsAll2AllManager.dispatch``, the default
    ``allgather_reducescatter`` backend: ``all_gatherv`` over the DP group, or the EP group under sequence-parallel
    MoE, sized by ``DPMetadata``'s per-rank token counts, unchunked) and whose combine reduce-scatters the experts'
    output back. The profiling run gives every DP rank ``max_num_batched_tokens``, so a rank's fused-MoE caches
    hold DP x that many tokens' top-k rows, beside the gathered input and the output to scatter
    (``MoeShards.gathered``: DP hidden states each, per scheduled token). The shared experts see the rank's own.
    """
    h = arch.hidden_size
    if arch.is_moe:
        moe = shards or MoeShards(group=tp)  # the fused-MoE caches hold top-k rows of one expert's width on a rank
        inter = moe.expert_width(arch.moe_intermediate_size)
        shared = cdiv(arch.shared_expert_intermediate_size, 1 if moe.replicate_shared else tp)
        routed = arch.num_experts_per_tok * (3 * inter + h)
        if moe.gathered > 1:  # every DP rank's tokens gathered in, and the output to reduce-scatter back
            routed = moe.gathered * (routed + 2 * h)
        mlp = routed + 3 * shared
        mlp = max(mlp, 3 * cdiv(arch.intermediate_size, tp))
    else:
        mlp = 3 * cdiv(arch.intermediate_size, tp)
    heads = arch.num_attention_heads // tp
    if arch.is_mla:
        attn = heads * (2 * (arch.qk_nope_head_dim + arch.qk_rope_head_dim) + 2 * arch.v_head_dim)
    else:
        attn = (2 * heads + 2 * kv_heads_per_rank(arch, tp)) * arch.head_dim
    return act_bytes * (hidden_states * h + max(mlp, attn))
