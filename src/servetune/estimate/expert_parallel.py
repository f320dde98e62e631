"""The tokens an MoE layer exchanges under expert parallelism (vLLM 0.32), per engine step, on the GPU link.

Where the exchange happens. ``FusedMoEParallelConfig.make`` (``model_executor/layers/fused_moe/config.py``) turns
``enable_expert_parallel`` on when TP x DP x PCP > 1. Each rank then holds whole experts over an EP group of
``ep = TP x DP x PCP`` ranks. The layer dispatches and combines tokens only where ``use_all2all_kernels`` holds:
EP and (DP > 1 or PCP > 1 or sequence-parallel MoE). Sequence-parallel MoE (``ParallelConfig.use_sequence_parallel_moe``)
needs EP, TP > 1, DP > 1 and a backend in :data:`SEQUENCE_PARALLEL`.
- TP-only EP has no exchange. Each rank runs its own experts on every token. The MoE output's TP all-reduce
  (``MoERunner._maybe_reduce_final_output``) sums the ranks' shares as it does without EP, and the roofline's
  all-reduce already counts it.

The default backend, ``allgather_reducescatter`` (``ParallelConfig.all2all_backend``; ``naive`` and ``pplx`` were
removed and fall back to it), uses ``AgRsAll2AllManager`` (``distributed/device_communicators/all2all.py``) through
``MoEPrepareAndFinalizeNaiveDPEP*`` (``fused_moe/prepare_finalize/naive_dp_ep.py``). With ``n`` tokens in the
step on each DP engine, ``H`` the hidden size, ``k`` the top-k and ``a = 2`` bytes per 16-bit activation:
- dispatch is one grouped ``all_gatherv`` of every rank's hidden states ``[n, H]``, with the top-k weights (fp32)
  and ids (int32) ``[n, k]`` (``dispatch``; the monolithic kernels gather the router logits instead);
- combine is one ``reduce_scatterv`` of the experts' output ``[g x n, H]`` back to ``[n, H]`` (``combine``).
- Without sequence parallelism the group is the DP group (PCP's with DP 1): ``g = DP x PCP`` ranks. The MoE
  output's TP all-reduce stays.
- With it (``qwen3_moe.py``, ``deepseek_v2.py``, ``gpt_oss.py`` and ``llama4.py`` call ``sequence_parallel_chunk``):
  - each TP rank takes ``n / TP`` of the tokens, and the group is the whole EP group, ``g = ep``;
  - the model all-gathers the output over TP (``tensor_model_parallel_all_gather``);
  - the MoE output's all-reduce is skipped.

A ring all-gather or reduce-scatter over ``g`` ranks sends ``(g - 1)`` of the ``g`` equal pieces from each rank,
so one rank sends per MoE layer:

    dispatch  (g - 1) x s x (H x a + 8 k)     s = n (no sequence parallelism) or n / TP
    combine   (g - 1) x s x H x a
    gather    (TP - 1) x s x H x a            sequence-parallel only, in place of the all-reduce's 2 (TP-1)/TP x n x H x a

Each of those collectives also pays the all-reduce's latency (``Efficiency.allreduce_us``).

The all-to-all backends (DeepEP, MoRI, NIXL-EP, MoonEP, FlashInfer's NVLink kernels) send each token only to the
ranks that hold one of its top-k experts. With uniform routing over ``E`` experts, ``E / g`` of them on each rank,
a token reaches ``r = (g - 1) x (1 - C(E - E/g, k) / C(E, k))`` other ranks. Each of those gets the token's
hidden states on dispatch and returns them on combine: ``2 x s x r x H x a`` bytes. The TP split and gather
follow sequence parallelism as above. Two simplifications:
- the backends that dispatch in FP8 are counted at 16 bits;
- the two that are not sequence-parallel are taken to dispatch every token from every TP rank.

The exchange runs over the GPU link that TP's all-reduce uses (``DeviceRates.link_bytes_s``). A DP x TP group
that spans nodes would cross the network instead, and the model does not know that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from servetune.capacity import ModelArch
from servetune.errors import UserError

ACTIVATION_BYTES = 2  # dispatched and combined hidden states are 16-bit
ROUTING_BYTES = 8  # per token and top-k slot: an fp32 weight and an int32 expert id (allgather_reducescatter)
AG_RS = "allgather_reducescatter"  # vLLM 0.32's default ``all2all_backend``
REMOVED = ("naive", "pplx")  # vLLM 0.32 warns and falls back to allgather_reducescatter
#: ``ParallelConfig.use_sequence_parallel_moe``'s backends
SEQUENCE_PARALLEL = (
    AG_RS,
    "deepep_high_throughput",
    "deepep_low_latency",
    "deepep_v2",
    "flashinfer_nvlink_one_sided",
    "passthrough",
    "mori_high_throughput",
    "mori_low_latency",
    "nixl_ep",
)
#: the rest of vLLM 0.32's ``All2AllBackend`` literal (``config/parallel.py``)
ALL_TO_ALL = ("moonep", "flashinfer_all2allv", "flashinfer_nvlink_two_sided")
#: what ``--all2all-backend`` accepts (``passthrough`` is bound by the MoE backend, not selectable)
BACKENDS = (*(b for b in SEQUENCE_PARALLEL if b != "passthrough"), *ALL_TO_ALL, *REMOVED)


@dataclass(frozen=True)
class ExpertExchange:
    """The dispatch and combine of every MoE layer of one engine step, on one rank."""

    backend: str
    tp: int
    group: int  # ranks one dispatch spans
    sequence_parallel: bool  # tokens split over TP before the dispatch, gathered after; no MoE all-reduce
    moe_layers: int
    hidden_size: int
    top_k: int
    experts: int

    @classmethod
    def of(
        cls,
        arch: ModelArch,
        tp: int,
        dp: int = 1,
        pcp: int = 1,
        expert_parallel: bool = False,
        backend: str | None = None,
    ) -> ExpertExchange | None:
        """The exchange vLLM 0.32 runs for these settings, or None where there is none (a dense model, EP off,
        or TP-only EP). ``backend`` is the ``all2all_backend`` engine argument (None: vLLM's default)."""
        backend = backend or AG_RS
        if backend not in BACKENDS:
            raise UserError(f"engine argument all2all_backend={backend!r}: vLLM 0.32 offers {', '.join(BACKENDS)}")
        backend = AG_RS if backend in REMOVED else backend
        if not (arch.is_moe and expert_parallel and tp * dp * pcp > 1 and (dp > 1 or pcp > 1)):
            return None
        sequence_parallel = backend in SEQUENCE_PARALLEL and tp > 1 and dp > 1
        group = tp * dp * pcp if sequence_parallel or backend != AG_RS else dp * pcp
        return cls(backend=backend, tp=tp, group=group, sequence_parallel=sequence_parallel,
                   moe_layers=arch.num_moe_layers, hidden_size=arch.hidden_size, top_k=arch.num_experts_per_tok,
                   experts=arch.num_experts)  # fmt: skip

    @property
    def collectives(self) -> int:
        """Collectives each MoE layer launches: dispatch and combine, and the TP gather under sequence parallelism."""
        return 3 if self.sequence_parallel else 2

    @property
    def remote_ranks(self) -> float:
        """Other ranks an all-to-all backend sends a token to: those holding one of its top-k experts."""
        g, e, k = self.group, self.experts, self.top_k
        local = e / g
        missed = math.prod(max(e - local - i, 0.0) / (e - i) for i in range(k))
        return (g - 1) * (1.0 - missed)

    def layer_bytes(self, tokens: float) -> float:
        """Bytes one rank sends in one MoE layer of a step over ``tokens`` tokens (its DP engine's)."""
        h = self.hidden_size * ACTIVATION_BYTES
        s = tokens / self.tp if self.sequence_parallel else tokens
        if self.backend == AG_RS:
            sent = (self.group - 1) * s * (2 * h + ROUTING_BYTES * self.top_k)
        else:
            sent = 2 * s * self.remote_ranks * h
        return sent + ((self.tp - 1) * s * h if self.sequence_parallel else 0.0)

    def seconds(self, tokens: float, link_bytes_s: float, latency_us: float) -> float:
        """Time of every MoE layer's exchange in a step over ``tokens`` tokens, on a link of ``link_bytes_s``."""
        per_layer = self.layer_bytes(tokens) / link_bytes_s + self.collectives * latency_us / 1e6
        return self.moe_layers * per_layer

    @property
    def allreduces_replaced(self) -> int:
        """TP all-reduces a step no longer runs: one per MoE layer under sequence parallelism."""
        return self.moe_layers if self.sequence_parallel else 0
