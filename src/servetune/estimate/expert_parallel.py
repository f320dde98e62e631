"""An MoE model over TP x DP ranks as vLLM 0.32 runs it: the experts one rank holds and reads in a step, and the
tokens each MoE layer exchanges over the GPU link.

What a rank holds (:func:`read_layout`: the memory ledger's ``MoeShards``, capacity/params.py). ``FusedMoEParallelConfig
.make`` (``model_executor/layers/fused_moe/config.py``) flattens TP across DP and PCP
(``flatten_tp_across_dp_and_pcp``): the MoE layers' group is all ``G = TP x DP x PCP`` ranks.
- Without expert parallelism every rank holds all ``E`` experts at ``1 / G`` of their width.
- With it (``enable_expert_parallel``, ``G > 1``), ``ep_size = G`` and a rank holds whole experts:
  ``ceil((E + R) / G)`` on the heaviest (``determine_expert_map`` in ``fused_moe/expert_map_manager.py``; ``R``
  EPLB's redundant experts).
- The EPLB transfer buffer (one MoE layer's experts) is memory, not read by a step: :func:`read_layout` drops it.

What a rank reads. An MoE model's DP engines are not independent. ``run_engine_core`` (``v1/engine/core.py``) starts
each one as a ``DPEngineCoreProc`` when ``data_parallel_size > 1`` and ``model_config.is_moe``. Those run in
lock-step: an engine with nothing to run executes a dummy batch (``execute_dummy_batch``) so that every rank enters
each step's MoE collectives. With EP off, ``maybe_make_prepare_finalize`` (``fused_moe/all2all_utils.py``) logs
"Detected DP deployment with no --enable-expert-parallel. Falling back to AllGather+ReduceScatter" and gathers over
DP as the default backend does with EP. So with ``n`` tokens on each of the DP engines, each rank's MoE layers run
on ``N = DP x n`` tokens, with or without EP, and sequence parallel or not: ``n / TP`` over ``TP x DP`` ranks is
``N`` as well. With top-k routing spread evenly over ``E`` experts, a given expert is picked by one of them with
probability ``p(N) = 1 - (1 - k / E) ^ N``. One step reads of the routed experts:

    expert bytes read = p(N) x (bytes of the experts the rank holds)      (Replica.expert_bytes, .experts_touched)

- without EP: ``E x 3 x H x ceil(I / G)`` weights a layer (``I`` an expert's intermediate width);
- with EP: ``ceil((E + R) / G) x 3 x H x I``.

Either way that is about ``1 / (TP x DP)`` of a TP-alone replica's expert bytes, read with ``p(DP x n)`` in place of
``p(n)``. One engine's rank reads ``p(n) x E x 3H x I / TP`` bytes; a rank of DP engines reads
``p(DP x n) / (DP x p(n))`` of that: ``1 / DP`` once every expert is picked, nearly all of it at one token (at DP 2,
top-8 of 128: 0.97 at n = 1, 0.68 at 16, 0.5 from about 100).
- A TP-only replica (DP 1, EP on or off) reads what it read before. EP over TP alone holds ``E / TP`` whole experts
  in place of every expert at ``1 / TP`` of its width: the same bytes.
- The FLOPs do not change. A rank runs ``1 / (TP x DP)`` of the experts' weights on ``DP x n`` tokens: the
  ``1 / TP`` share on ``n`` tokens that ``Replica.active_params`` counts.
- An EPLB replica of an expert shares its tokens with the others and is taken as read whenever its expert is, a
  slight overcount.
- PCP splits a prompt's tokens over its ranks, which the estimate does not model: a PCP rank's experts are read at
  ``p(n)`` of the engine's ``n`` tokens, which the MoE gathers over PCP.

The lock-step's other cost is not modelled. The step runs at the slowest engine's batch, padded to the largest
with CUDA graphs (``coordinate_batch_across_dp``, ``v1/worker/dp_utils.py``). The queueing model splits the load
evenly over the replicas and keeps one mean batch a replica, not its spread, so under it every engine runs the same
batch. Uneven arrivals (an open loop's Poisson bursts, clients not divisible by DP) make vLLM slower than
estimated. The dummy batches an idle engine runs cost GPU time but no request's latency.

Where the exchange happens. ``FusedMoEParallelConfig.make`` (``model_executor/layers/fused_moe/config.py``) turns
``enable_expert_parallel`` on when TP x DP x PCP > 1. Each rank then holds whole experts over an EP group of
``ep = TP x DP x PCP`` ranks. The layer dispatches and combines tokens only where ``use_all2all_kernels`` holds:
EP and (DP > 1 or PCP > 1 or sequence-parallel MoE). Sequence-parallel MoE (``ParallelConfig.use_sequence_parallel_moe``)
needs EP, TP > 1, DP > 1 and a backend in :data:`SEQUENCE_PARALLEL`.
- DP > 1 without EP: the same ``allgather_reducescatter`` exchange over the DP group (``AgRsAll2AllManager
  ._get_comm_group``), never sequence parallel (``use_sequence_parallel_moe`` needs EP), whatever the backend argument.
  The experts' partial outputs, reduce-scattered over DP, then take the TP all-reduce. PCP without DP gathers over
  PCP (``MoERunner._maybe_dispatch``) and is left out, as PCP is.
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

import dataclasses
import math
from dataclasses import dataclass

from servetune.capacity import ModelArch, Settings
from servetune.capacity.params import MoeShards
from servetune.capacity.settings import moe_shards
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
        """The exchange vLLM 0.32 runs for these settings, or None where there is none (a dense model, one DP
        engine without EP, or TP-only EP). ``backend`` is the ``all2all_backend`` engine argument (None: vLLM's
        default; without EP the gather over DP is always ``allgather_reducescatter``'s)."""
        backend = backend or AG_RS
        if backend not in BACKENDS:
            raise UserError(f"engine argument all2all_backend={backend!r}: vLLM 0.32 offers {', '.join(BACKENDS)}")
        backend = AG_RS if backend in REMOVED or not expert_parallel else backend
        if not arch.is_moe or (dp == 1 and not (expert_parallel and pcp > 1)):
            return None
        sequence_parallel = expert_parallel and backend in SEQUENCE_PARALLEL and tp > 1 and dp > 1
        group = tp * dp * pcp if sequence_parallel or backend != AG_RS else dp * pcp if expert_parallel else dp
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


def read_layout(arch: ModelArch, settings: Settings) -> MoeShards | None:
    """The routed experts a step reads on one rank, laid out as the memory ledger lays them (capacity/settings.py
    ``moe_shards``) less EPLB's transfer buffer, which only a rearrangement touches. None for a dense model."""
    return dataclasses.replace(moe_shards(arch, settings), eplb=False) if arch.is_moe else None
