"""Pipeline parallelism in the roofline: a replica of ``p`` stages (``pipeline_parallel_size``), each TP GPUs.

What a stage holds. ``get_pp_indices`` (``vllm/distributed/utils.py``) gives stage ``r`` of ``p`` a run of
``L // p`` decoder layers, the ``L % p`` left over going one each to the stages before the last ("the last
partition is excluded because it often contains an additional norm layer"), or as ``VLLM_PP_LAYER_PARTITION``
says. The first stage holds the embedding (and a vision tower), the last the final norm and lm_head. The memory
planner sizes the heaviest stage, ``ceil(L / p)`` layers and the heavier end (capacity/params.py ``rank_params``,
``kv_bytes_per_token``); the roofline reads the same split (:func:`stage_layers`): a stage's step reads its
layers' weights and KV cache, multiplies its layers' FLOPs and runs its layers' all-reduces and MoE exchanges.
The lm_head's FLOPs are spread over the stages (``Replica.active_params``), so the stages' FLOPs sum to the
model's; the weight bytes are the planner's heaviest stage, so ``p`` of them count the ends' weights a little
more than once where ``p > 2`` or the embeddings are tied.

What passes between stages. A stage that is not the last returns ``IntermediateTensors`` of the hidden states
and the residual (``llama.py``; the other decoders alike), and ``Worker.execute_model``
(``v1/worker/gpu_worker.py``) sends them with ``get_pp_group().isend_tensor_dict(..., all_gather_group=
get_tp_group())``: each TP rank sends ``1 / TP`` of them, the next stage all-gathers them over its TP group
(``GroupCoordinator.send_tensor_dict``, ``distributed/parallel_state.py``). Per boundary and per rank, for ``n``
tokens of hidden size ``H`` at ``a = 2`` bytes:

    boundary = 2 x n x H x a / TP / link  +  (TP - 1) / TP x 2 x n x H x a / link  +  latency    (:func:`boundary_s`)

on the GPU link (``DeviceRates.link_bytes_s``). Stages on other nodes would cross the network instead, which the
model does not know (as for expert parallelism's exchange).

How the steps overlap. ``EngineCore.step_with_batch_queue`` (``v1/engine/core.py``) schedules up to
``VllmConfig.max_concurrent_batches`` batches (``config/vllm.py``) before it waits for the oldest. On CUDA vLLM 0.32
runs the V2 model runner by default (``VllmConfig.use_v2_model_runner``: Triton is there and no feature it lacks is
asked for, such as a suffix, Medusa or MLP speculator), with async scheduling on, and keeps ``p + 1`` batches in
flight; the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``, or such a feature) turns async scheduling off under PP and keeps
``p`` ("PP requires PP-size concurrent batches to fill the pipeline"). Either way a decoding sequence rides in one
micro-batch of every ``p`` steps: V1's scheduler (``v1/core/sched/scheduler.py``, ``schedule``) gives it no token
while its step is in flight, so its next token waits for that micro-batch to leave the last stage; V2's
``AsyncScheduler`` schedules its next step ``p`` steps after its last (``decode_stagger``), with a placeholder for the
token still on its way. The batch more is async scheduling's look-ahead, prepared while the stages run (PP 1 keeps two
for the same reason): V2 hides behind the stages the step overhead that V1 pays in each cycle of the pipeline. The
estimate counts the fitted overhead once a cycle for both runners, as at PP 1, whose fit holds what async scheduling
leaves of it; under V1 with PP it may read a TPOT short by the part async scheduling hides at PP 1, which no
calibration point tells (tests/unit/test_estimate_pipeline.py pins vLLM's side). With ``b`` sequences decoding, ``m =
min(p, b)`` micro-batches (at least one) of ``b / m`` sequences:

    stage step     s(b / m) = max(stage bytes / HBM, stage FLOPs / peak) + stage all-reduces + exchange
    token interval TPOT     = p x s(b / m) + (p - 1) x boundary(b / m) + step overhead(b / m)   (:func:`interval_s`)
    throughput              = b / TPOT: one micro-batch leaves the pipeline every stage step once it is full

So a bandwidth-bound decode's TPOT is about PP 1's (``p`` stages each reading ``1 / p`` of the weights), plus the
transfers, and at ``b >= p`` the throughput grows: each stage reads its weights for ``b / p`` sequences while the
others work. The scheduler does not balance the micro-batches (requests that arrive together go into one), so
this is the pipeline at its best; the step overhead (scheduling, sampling) is counted once per micro-batch.

A prompt's chunks are scheduled one step after another without waiting for the earlier ones (their tokens are
known), so ``k`` chunks leave the last stage after ``k + p - 1`` stage slots, and the prompt's own compute on
that path is every chunk's on one stage plus the last chunk's on the other ``p - 1`` (:func:`chunked_prompt_s`).
A whole-prompt step without chunked prefill (``prefill_s``), a wave's steps and an offline batch's steps are
each taken through all ``p`` stages, as if the next one waited: an upper bound.

At ``p = 1`` every formula is the one the roofline had without pipeline parallelism, term for term. The shipped
factors were fitted on PP 1 points alone (the calibration CSV has no pipeline column; every source ran TP only).
"""

from __future__ import annotations

import dataclasses

from servetune.capacity import ModelArch
from servetune.capacity.arith import cdiv
from servetune.estimate.expert_parallel import ExpertExchange

ACTIVATION_BYTES = 2  # hidden states and the residual cross a boundary in 16 bits
BOUNDARY_TENSORS = 2  # IntermediateTensors: hidden_states and residual


def stage_layers(arch: ModelArch, pp: int) -> int:
    """Decoder layers of the heaviest stage: ``ceil(L / p)``, the memory planner's split (capacity/params.py)."""
    return cdiv(arch.num_layers, pp)


def stage_moe_layers(arch: ModelArch, pp: int) -> int:
    """MoE layers of the heaviest stage, counted as ``rank_params`` counts them (the MoE layers first)."""
    return min(stage_layers(arch, pp), arch.num_moe_layers)


def stage_exchange(exchange: ExpertExchange | None, arch: ModelArch, pp: int) -> ExpertExchange | None:
    """The MoE layers' exchange of one stage: its MoE layers' (all of them at ``pp = 1``)."""
    if exchange is None or pp == 1:
        return exchange
    return dataclasses.replace(exchange, moe_layers=stage_moe_layers(arch, pp))


def boundary_bytes(arch: ModelArch, tokens: float) -> float:
    """Bytes of the hidden states and residual of ``tokens`` tokens that leave a stage."""
    return BOUNDARY_TENSORS * tokens * arch.hidden_size * ACTIVATION_BYTES


def boundary_s(arch: ModelArch, tp: int, pp: int, tokens: float, link_bytes_s: float, latency_us: float) -> float:
    """One stage boundary's transfer of ``tokens`` tokens on one rank: its ``1 / TP`` share sent, the rest gathered
    over TP on the receiving side. 0 without pipeline parallelism."""
    if pp == 1:
        return 0.0
    message = boundary_bytes(arch, tokens)
    return (message / tp + (tp - 1) / tp * message) / link_bytes_s + latency_us / 1e6


def micro_batches(pp: int, batch: float) -> float:
    """Micro-batches ``batch`` sequences run in: one a stage, each of at least one sequence (``batch`` below 1 is the
    queueing model's fractional load: one micro-batch)."""
    return max(1.0, min(float(pp), batch))


def interval_s(pp: int, stage_s: float, boundary: float, overhead_s: float) -> float:
    """A micro-batch's time through the ``pp`` stages: its step on each, the ``pp - 1`` boundaries between them, and
    the step's overhead once."""
    return pp * stage_s + (pp - 1) * boundary + overhead_s


def chunked_prompt_s(pp: int, steps: int, interval: float, prompt_tokens: int, chunk: float, token_s: float) -> float:
    """Time from a prompt's first chunk to its last one leaving the pipeline: ``steps + pp - 1`` stage slots of the
    running micro-batches (``interval / pp`` each) and the prompt's compute on that path (``token_s``: one prompt
    token's compute on one stage). At ``pp = 1``: ``steps x interval + prompt_tokens x token_s``."""
    slots = (steps + pp - 1) * interval / pp
    return slots + (prompt_tokens + (pp - 1) * min(chunk, prompt_tokens)) * token_s
