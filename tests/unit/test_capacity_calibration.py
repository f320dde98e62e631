"""The ledger against what vLLM itself reported on real GPUs (public start-up logs).

Target: KV-token capacity within 3 % of vLLM's own figure. The logs below come from vLLM ~0.11
(V1 engine, before CUDA-graph memory was charged to the KV budget), so they are checked with the
matching ``VLLM_0_11`` profile; its one fitted constant is the sampler's bytes per logit (38.5 B:
bf16 logits, an fp32 copy, a sorted copy with int64 indices and sort scratch, for top-k/top-p).
Weights and KV bytes per token are not fitted: they come from the architecture alone.

``VLLM_0_32`` (the default) differs only where vLLM 0.32's source differs: Triton top-k/top-p
without a sort (~16 B per logit), CUDA-graph memory and persistent buffers charged to the
budget. No public 0.32 log with a known GPU total was found; trials record ``compare_kv`` on
every engine start to measure it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from servetune.capacity import (
    VLLM_0_11,
    EngineProfile,
    ModelArch,
    arch_from_hf_config,
    compare_kv,
    count_parameters,
    load_model_arch,
    plan_capacity,
    resolve_hardware,
)
from servetune.capacity.compare import measured_kv_tokens
from servetune.capacity.kvgroups import kv_layout
from servetune.capacity.profile import parse_vllm_version, profile_for_version
from tests.unit.test_capacity_arch_configs import LLAMA4_SCOUT, QWEN25_VL_7B

GIB = 1 << 30

# llm-d-benchmark, "vLLM Empirical Test Results Analysis": H100 (79.18 GiB total), util 0.9,
# max-model-len 16000, vLLM defaults for H100 (max_num_seqs 1024, max_num_batched_tokens 8192).
# https://github.com/llm-d/llm-d-benchmark/blob/259334868c5075da530cc6c90b43fceb11b6e6a7/config_explorer/empirical-vllm-memory-results.md
# (model, TP, logged weights GiB, logged peak activation GiB, logged "Available KV cache memory" GiB)
LLMD_H100 = [
    ("meta-llama/Llama-3.1-8B-Instruct", 1, 14.99, 4.76, 51.38),
    ("Qwen/Qwen3-0.6B", 1, 1.12, 5.56, 64.45),
    ("Qwen/Qwen3-32B", 1, 61.03, 5.64, 4.45),
    ("RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic", 2, 33.88, 4.84, 32.0),
]


def _reported_tokens(kv_gib: float, bytes_per_token: int, block_size: int = 16) -> int:
    """The token count that a logged pool size (rounded to 0.01 GiB, <0.1 % here) gives in whole blocks."""
    return int(kv_gib * GIB // (block_size * bytes_per_token)) * block_size


@pytest.mark.parametrize("hub_id, tp, weights_gib, activation_gib, kv_gib", LLMD_H100)
def test_kv_tokens_within_3_percent_of_vllm_on_h100(
    hub_id: str, tp: int, weights_gib: float, activation_gib: float, kv_gib: float
) -> None:
    arch = load_model_arch(hub_id)
    args = {"tensor_parallel_size": tp, "max_model_len": 16000, "gpu_memory_utilization": 0.9}
    plan = plan_capacity(arch, args, resolve_hardware(memory_gib=79.18), profile=VLLM_0_11)
    assert plan.weights_gib == pytest.approx(weights_gib, rel=0.01)
    assert plan.activation_gib == pytest.approx(activation_gib, rel=0.05)
    reported = _reported_tokens(kv_gib, plan.kv_bytes_per_token)
    result = compare_kv(plan, reported)
    assert abs(result["relative_error"]) < 0.03, result


def test_activation_peak_with_256_sequences_matches_vllm_pr_10511() -> None:
    """vLLM PR 10511 (H100, Meta-Llama-3-8B, 256 sequences, 8192 batched tokens) logged
    "PyTorch activation peak memory 1.26GiB": the sampler over 256 x 128,256 logits dominates.
    https://github.com/vllm-project/vllm/pull/10511"""
    arch = load_model_arch("meta-llama/Llama-3.1-8B")
    args = {"max_model_len": 8192, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    plan = plan_capacity(arch, args, resolve_hardware(memory_gib=79.22), profile=VLLM_0_11)
    assert plan.activation_gib == pytest.approx(1.26, rel=0.1)


def test_default_profile_differs_only_in_sampler_graphs_and_buffers() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(memory_gib=79.18)
    same = {"max_model_len": 16000, "gpu_memory_utilization": 0.9}  # the defaults differ too: 0.9 in 0.11, 0.92 now
    old = plan_capacity(arch, same, h100, profile=VLLM_0_11)
    new = plan_capacity(arch, same, h100)
    assert new.weights_gib == old.weights_gib and new.kv_bytes_per_token == old.kv_bytes_per_token
    assert new.activation_gib < old.activation_gib  # no sort in the top-k/top-p kernel
    assert new.cudagraph_gib > 0 and old.cudagraph_gib == 0
    assert abs(new.kv_cache_tokens - old.kv_cache_tokens) / old.kv_cache_tokens < 0.06


# --- architectures beyond dense / Mixtral / DeepSeek (issue #39) ----------------------------------
#
# Error table (ledger vs. public vLLM log):
#   gpt-oss-120b weights, H100, vLLM 0.14.1 (MXFP4 Triton)   64.38 GiB logged, 64.49 planned  (+0.2 %)
#   gpt-oss-120b weights, H100, vLLM 0.10.1 (MXFP4 Marlin)   65.97 GiB logged, 64.49 planned  (-2.2 %, not
#       asserted: Marlin also pads the expert width 2880 -> 2944; vLLM 0.32 picks Triton for gpt-oss)
#   Qwen3-235B-A22B-FP8 KV tokens, 4 x H100 TP 4, vLLM ~0.9.2, from the logged 8.11 GiB pool:
#       178,880 logged, 180,928 planned (+1.1 %)
#   gpt-oss (H100 ~0.11, A100 0.19.0) and DeepSeek-V2-Lite (MLA, 0.8.3): KV_CASES below, bench/plan_accuracy.py
# The sliding-window / chunked-local group arithmetic is checked exactly against vLLM 0.32's own
# functions in test_capacity_kvgroups.py; no public start-up log of gemma-3, Llama 4, a Mamba / linear-attention
# hybrid or Qwen2.5-VL with the pool or the token count and its arguments was found (issue #39's search, 2026-12).

# huggingface.co/Qwen/Qwen2.5-VL-72B-Instruct/blob/main/config.json: the 7B's layout at 72B sizes (the vision tower
# projects to 8192, its MLP is 3456 wide).
QWEN25_VL_72B = {
    **QWEN25_VL_7B, "hidden_size": 8192, "intermediate_size": 29568, "num_attention_heads": 64,
    "num_hidden_layers": 80, "num_key_value_heads": 8,
    "vision_config": {**QWEN25_VL_7B["vision_config"], "out_hidden_size": 8192, "intermediate_size": 3456},
}  # fmt: skip
QWEN3_235B_FP8 = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94,
    "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}  # fmt: skip


def test_gpt_oss_120b_weights_match_vllm_on_h100() -> None:
    """vLLM 0.14.1, one H100, MXFP4 Triton backend: "Model loading took 64.38 GiB".
    https://github.com/vllm-project/vllm/issues/33155"""
    arch = load_model_arch("openai/gpt-oss-120b")
    plan = plan_capacity(arch, {"max_model_len": 8192}, resolve_hardware(gpu="H100-SXM"))
    assert plan.weights_gib == pytest.approx(64.38, rel=0.01)


def test_qwen25_vl_72b_weights_per_rank_match_vllm_on_four_a100s() -> None:
    """A vision-language model's weights, decoder and vision tower, per TP rank: vLLM ~0.8.3 (V0 worker log) on 4 x
    A100-40GB, TP 4: "model weights take 34.43GiB". The same log's 2.51 GiB of activation (V0 profiles the vision
    encoder on dummy images) and 0.04-0.13 GiB pools make no token case: the planner has no encoder profiling term
    (0.15 GiB planned), and a 0.1 GiB pool turns any small miss into a large one.
    https://github.com/vllm-project/vllm/issues/16570"""
    arch = arch_from_hf_config(QWEN25_VL_72B, "Qwen/Qwen2.5-VL-72B-Instruct")
    assert count_parameters(arch) / 1e9 == pytest.approx(73.4, rel=0.005)  # the model card's 73.4B
    plan = plan_capacity(arch, {"tensor_parallel_size": 4, "max_model_len": 4096}, resolve_hardware(memory_gib=39.38))
    assert plan.weights_gib == pytest.approx(34.43, rel=0.01)


def test_qwen3_moe_kv_tokens_from_the_logged_pool_within_3_percent() -> None:
    """Qwen3-235B-A22B-FP8 on 4 x H100, TP 4, max_model_len 40,960 (the config's):
    "Available KV cache memory: 8.11 GiB", "GPU KV cache size: 178,880 tokens".
    https://github.com/vllm-project/vllm/issues/21348"""
    from servetune.capacity import arch_from_hf_config

    arch = arch_from_hf_config(QWEN3_235B_FP8, "Qwen/Qwen3-235B-A22B-FP8")
    args = {"tensor_parallel_size": 4, "kv_cache_memory_bytes": int(8.11 * GIB)}
    plan = plan_capacity(arch, args, resolve_hardware(gpu="H100-SXM"))
    assert plan.settings.max_model_len == 40960
    result = compare_kv(plan, 178_880)
    assert abs(result["relative_error"]) < 0.03, result


# --- per release: every case with its vLLM version, planned with that release's profile (issue #39 item 4) ---
#
# ``bench/plan_accuracy.py`` prints the table (KV tokens planned vs logged, per case and release, with the
# version's profile and with 0.32's, which was applied to every version before). Targets: within 3 % for
# 0.8 and later, within 10 % on V0. A version marked "~" is inferred from the log's format, not stated.

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "torch_dtype": "float16", "tie_word_embeddings": False,
}  # fmt: skip
LLAMA2_70B = {**LLAMA2_7B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}  # fmt: skip
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}  # fmt: skip
# (meta-llama/Meta-Llama-3-8B's config.json above: vLLM's default max_model_len is its 8192.)
# kaspersiminski's comment of 2024-12-02: one RTX 3090 (total_gpu_memory 23.58 GiB), Llama-3.1-8B-Instruct, util 0.90,
# --max-model-len 20000 / 29000 (no chunked prefill below 32K on V0). "Memory profiling results: total_gpu_memory=..."
# is the 0.6.4 log format (replaced by PR 10511 in 0.6.5). Logged: non_torch_memory 0.35 GiB, peak_torch_memory 17.06 /
# 17.98 GiB over weights 14.99 GB (activation 2.07 / 2.99 GiB), kv_cache_size 3.81 / 2.89 GiB, 1952 / 1478 GPU blocks.
ISSUE_10517 = "https://github.com/vllm-project/vllm/issues/10517"
# youkaichao's sanity check of 2024-12-14 on PR 10511 (merged for 0.6.5, V0): `vllm serve meta-llama/Meta-Llama-3-8B`
# on H100 (total_gpu_memory 79.22 GiB), util 0.90: weights 14.96 GiB, non_torch_memory 1.79 GiB, activation 1.26 GiB,
# available_kv_cache_memory 53.29 GiB; with -tp 2: weights 7.48, non_torch 3.58, activation 1.26 GiB, and the pool
# line cut off in the comment: 71.29 - 7.48 - 3.58 - 1.26 = 58.97 GiB, vLLM's own sum of the logged terms.
PR_10511 = "https://github.com/vllm-project/vllm/pull/10511"
# youkaichao's PR 12126 (2025-01-16, V0 between 0.6.6 and 0.7.0): `vllm serve meta-llama/Llama-3.2-11B-Vision
# --load-format dummy --max-model-len 65536 --max-num-seqs 128 --enforce-eager` on H100 (79.22 GiB), util 0.90:
# weights 19.86 GiB, non_torch 0.16 GiB, activation 36.63 GiB, KV 14.65 GiB, 6001 CUDA blocks (160 KiB a token:
# 32 self- and 8 cross-attention layers). The config below is Llama-3.2-11B-Vision's (text and vision towers).
PR_12126 = "https://github.com/vllm-project/vllm/pull/12126"
LLAMA32_11B_VISION = {
    "architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "mllama_text_model", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
        "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38], "rope_theta": 500000.0, "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "mllama_vision_model", "hidden_size": 1280, "num_hidden_layers": 32, "num_global_layers": 8,
        "image_size": 560, "patch_size": 14, "max_num_tiles": 4, "vision_output_dim": 7680,
    },
}  # fmt: skip
LLMD = "https://github.com/llm-d/llm-d-benchmark/blob/259334868c5075da530cc6c90b43fceb11b6e6a7/config_explorer/empirical-vllm-memory-results.md"
# The same llm-d file (same H100, util 0.9, max-model-len 16000, ~0.11) also ran gpt-oss: gpt-oss-20b logged weights
# 13.47 GiB, peak activation 7.38 GiB (the sampler over 1024 x 201,088 logits), pool 50.28 GiB; gpt-oss-120b weights
# 64.38 GiB and pool 3.33 GiB. Its 120b row does not add up (64.38 + 7.38 + 0.13 GiB is over the 71.26 GiB budget,
# yet 3.33 GiB were logged) and the file has no detailed section for it.
# myoceane.fr, "[AI] vLLM 部署地端模型系統訊息記錄 A100" (2026-04-18): `vllm serve openai/gpt-oss-20b --max-model-len 131072
# --gpu-memory-utilization 0.65` on one A100 80 GB, vLLM 0.19.0 (its banner): "Model loading took 13.72 GiB",
# "Available KV cache memory: 36.56 GiB". On an A100 vLLM defaults to 256 sequences and 2048 batched tokens.
GPT_OSS_A100 = "https://myoceane.fr/index.php/ai-vllm-a100-gemma-4/"
# matheusfvesco's comment of 2025-10-31: `vllm serve openai/gpt-oss-120b --gpu-memory-utilization 0.95
# --max-num-batched-tokens 1024` on one H100 80GB HBM3 (nvidia-smi in the issue), gpu_worker.py:298 / core.py:708 lines
# of vLLM ~0.11.0: "Available KV cache memory: 1.71 GiB", too little for the 131,072-token default context.
ISSUE_27508 = "https://github.com/vllm-project/vllm/issues/27508"
# ymcki's comment of 2025-04-02, vLLM 0.8.3.dev (V1), DeepSeek-V2-Lite-Chat (MLA), --max-model-len 32768: "To serve at
# least one request with the models's max seq len (32768), (0.95 GiB KV cache is needed". One request's 32,768 tokens in
# 0.95 GiB (rounded to 0.01 GiB by vLLM, so +-0.5 %): MLA keeps one 512 + 64 latent a layer, 31,104 B a token.
ISSUE_15871 = "https://github.com/vllm-project/vllm/issues/15871"
# huggingface.co/deepseek-ai/DeepSeek-V2-Lite-Chat/blob/main/config.json (the fields the planner reads).
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 102400,
    "max_position_embeddings": 163840, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
}  # fmt: skip
PR_2031 = "https://github.com/vllm-project/vllm/pull/2031"
# fuhengwu2021/coderepo, extra/README.md and HYBRID_KV_CACHE_ANALYSIS.md: Llama-4-Scout-17B-16E-Instruct on 8 x H200,
# TP 8, vllm/vllm-openai:v0.12.0, util 0.9, "Available KV cache memory: 89.71 GiB", "GPU KV cache size: 3,919,664
# tokens" in every run; "Maximum concurrency" 0.75x at --max-model-len 5,242,880 with the hybrid manager off (vLLM's
# default for chunked attention), 2.96x with VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1, and 1.86x with it
# at 8,388,608. Before vLLM reported concurrency x max_model_len, a hybrid model's token line was blocks / groups x
# block size (3,919,664 whatever the context), so these cases compare the concurrency line, the capacity.
LLAMA4_H200 = (
    "https://github.com/fuhengwu2021/coderepo/blob/07c4f0a56b235af7f01327f7c495a5fb3c4dc75d/extra/"
    "HYBRID_KV_CACHE_ANALYSIS.md"
)


@dataclass(frozen=True)
class KvCase:
    """One public start-up log: what ran, and the KV capacity vLLM logged (tokens, or the pool in GiB)."""

    name: str
    vllm: str  # the release that logged it; "~0.11": inferred from the log's format
    source: str
    model: str | dict[str, Any]  # a hub id, or the config.json (name: ``hub_id``)
    gpu_memory_gib: float
    args: dict[str, Any] = field(default_factory=dict)
    logged_tokens: int | None = None
    logged_pool_gib: float | None = None  # "Available KV cache memory", rounded to 0.01 GiB by vLLM
    logged_concurrency: float | None = None  # "Maximum concurrency for max_model_len tokens per request", to 0.01x
    hub_id: str = ""
    asserted: bool = True  # False: a known miss the planner does not model (``note`` says why)
    note: str = ""
    gpu: str | None = None  # the catalogue's GPU name where vLLM's defaults depend on it (A100: 256 sequences)

    @property
    def release(self) -> tuple[int, int]:
        return parse_vllm_version(self.vllm.lstrip("~"))

    def arch(self) -> ModelArch:
        return (
            load_model_arch(self.model) if isinstance(self.model, str) else arch_from_hf_config(self.model, self.hub_id)
        )

    @property
    def architecture(self) -> str:
        """The model's architecture class (``GptOssForCausalLM``): the per-architecture table's key."""
        return self.arch().architecture

    def plan(self, profile: EngineProfile | None = None, args: dict[str, Any] | None = None):
        chosen = profile or profile_for_version(self.vllm.lstrip("~"))
        hardware = resolve_hardware(gpu=self.gpu, memory_gib=self.gpu_memory_gib)
        return plan_capacity(self.arch(), args if args is not None else self.args, hardware, profile=chosen)

    def logged(self) -> int:
        """The logged tokens; for a logged pool, the tokens vLLM's allocator makes of it, which the planner
        computes from that pool alone (``kv_cache_memory_bytes``): whole pages, and for a hybrid model its
        groups' pages and its window layers' shorter requests, which a pool / bytes-a-token division misses."""
        if self.logged_tokens is not None:
            return self.logged_tokens
        if self.logged_concurrency is not None:  # vLLM 0.32's token line: concurrency x max_model_len
            return int(self.logged_concurrency * self.args["max_model_len"])
        assert self.logged_pool_gib is not None
        pool = {**self.args, "kv_cache_memory_bytes": int(self.logged_pool_gib * GIB)}
        return self.plan(args=pool).kv_cache_tokens

    def error(self, profile: EngineProfile | None = None) -> float:
        """(planned - logged) / logged KV tokens with ``profile`` (default: the case's release's)."""
        return float(compare_kv(self.plan(profile), self.logged())["relative_error"])


# --- data parallelism (issue #39's search for DP start-up logs, 2026-12-06) -------------------------------------------
#
# With DP each rank is its own engine core and logs its own pool; the planner plans one rank. MoE layers shard over
# TP x DP ranks (``MoeShards``), and vLLM 0.32's profile also charges every DP rank's gathered batch to an MoE layer
# (``moe_dp_gathers_batch``). Public logs found: one dense DP start-up with the pool and token lines (below); one
# MoE DP8 x EP8 start-up with the weights line only (``test_qwen3_moe_weights_per_rank_under_dp8_ep8_match_vllm``); one
# MoE DP8 x EP8 log with concurrency lines of an architecture the planner does not model (DeepSeek-V4-Flash-0731 on
# 8 x B200, vLLM 0.25.0: 156.9x at 1M context per rank, vllm-project/vllm issue 51454 and recipes issue 762; not
# planned: the planner has no DeepSeek-V4 sparse/compressed attention model). None of them checks the MoE DP gather
# term (0.32 profile only) or a PCP x EP layout; no public start-up log with PCP was found.
# ray-project/kuberay issue 4366 (2026-01-12): `vllm serve Qwen/Qwen2.5-0.5B-Instruct --data-parallel-size 2
# --data-parallel-size-local 1 --data-parallel-backend=ray`, vLLM 0.11.0, one Tesla T4 a rank (bf16 falls back to
# fp16, default util 0.9, 32,768 context, 2048 batched tokens): both ranks "Model loading took 0.9271 GiB",
# "Available KV cache memory: 10.74 GiB", rank 1 "GPU KV cache size: 938,544 tokens". A T4 has 14.56 GiB as
# PyTorch reports it under 2025 drivers (torch's out-of-memory line in Zheng-Chong/CatVTON issue 133, GCP T4).
KUBERAY_4366 = "https://github.com/ray-project/kuberay/issues/4366"
# huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json (the fields the planner reads).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}  # fmt: skip
T4_GIB = 14.56
_DP2_T4_ARGS = {"data_parallel_size": 2, "dtype": "float16"}


_LLMD_ARGS = {"max_model_len": 16000, "gpu_memory_utilization": 0.9}
KV_CASES = [
    *(
        KvCase(f"{hub_id.split('/')[1]} TP{tp}, H100", "~0.11", LLMD, hub_id, 79.18,
               {**_LLMD_ARGS, "tensor_parallel_size": tp}, logged_pool_gib=kv_gib)
        for hub_id, tp, _, _, kv_gib in LLMD_H100
    ),
    KvCase("Qwen3-235B-A22B-FP8 TP4, H100 (logged pool)", "0.9.2", "https://github.com/vllm-project/vllm/issues/21348",
           QWEN3_235B_FP8, 79.18, {"tensor_parallel_size": 4, "kv_cache_memory_bytes": int(8.11 * GIB)},
           logged_tokens=178_880, hub_id="Qwen/Qwen3-235B-A22B-FP8"),
    KvCase("Llama-2-7B TP1, A100-80GB", "~0.2.5", PR_2031, LLAMA2_7B, 79.15, {}, logged_tokens=7351 * 16,
           hub_id="meta-llama/Llama-2-7b-hf"),
    KvCase("Llama-2-70B TP4, A100-80GB", "~0.2.5", PR_2031, LLAMA2_70B, 79.15, {"tensor_parallel_size": 4},
           logged_tokens=20865 * 16, hub_id="meta-llama/Llama-2-70b-hf", asserted=False,
           note="vLLM 0.2 with TP>1 held ~13 GiB a rank outside torch (NCCL, the PR guesses), not modelled"),
    KvCase("Llama-3.1-8B-Instruct TP1, RTX 3090, 20K context", "~0.6.4", ISSUE_10517, "meta-llama/Llama-3.1-8B-Instruct",
           23.58, {"max_model_len": 20000, "gpu_memory_utilization": 0.9}, logged_tokens=1952 * 16),
    KvCase("Llama-3.1-8B-Instruct TP1, RTX 3090, 29K context", "~0.6.4", ISSUE_10517, "meta-llama/Llama-3.1-8B-Instruct",
           23.58, {"max_model_len": 29000, "gpu_memory_utilization": 0.9}, logged_tokens=1478 * 16),
    KvCase("Meta-Llama-3-8B TP1, H100 (logged pool)", "~0.6.5", PR_10511, LLAMA3_8B, 79.22, {},
           logged_pool_gib=53.29, hub_id="meta-llama/Meta-Llama-3-8B"),
    KvCase("Meta-Llama-3-8B TP2, H100 (pool from the logged terms)", "~0.6.5", PR_10511, LLAMA3_8B, 79.22,
           {"tensor_parallel_size": 2}, logged_pool_gib=58.97, hub_id="meta-llama/Meta-Llama-3-8B"),
    KvCase("Llama-3.2-11B-Vision TP1, H100, 64K context, 128 seqs", "~0.6.6", PR_12126, LLAMA32_11B_VISION, 79.22,
           {"max_model_len": 65536, "max_num_seqs": 128, "enforce_eager": True}, logged_tokens=6001 * 16,
           hub_id="meta-llama/Llama-3.2-11B-Vision", asserted=False,
           note="V0 profiles mllama with a max-size image per sequence: 36.63 GiB of activation logged (cross-attention"
                " states of 128 sequences), 0.60 planned; weights (-2 %) and KV bytes a token (exact) match"),
    KvCase("gpt-oss-20b TP1, H100", "~0.11", LLMD, "openai/gpt-oss-20b", 79.18, _LLMD_ARGS, logged_pool_gib=50.28),
    KvCase("gpt-oss-120b TP1, H100", "~0.11", LLMD, "openai/gpt-oss-120b", 79.18, _LLMD_ARGS, logged_pool_gib=3.33,
           asserted=False, note="the source's terms for this run do not add up (64.38 + 7.38 + 0.13 GiB is over its 71.26"
                                " GiB budget); with the 20b row's sampler peak no pool is left"),
    KvCase("gpt-oss-20b TP1, A100-80GB, 128K context", "0.19.0", GPT_OSS_A100, "openai/gpt-oss-20b", 79.15,
           {"max_model_len": 131072, "gpu_memory_utilization": 0.65}, logged_pool_gib=36.56, gpu="A100-80GB"),
    KvCase("gpt-oss-120b TP1, H100, util 0.95, 1024 batched tokens", "~0.11", ISSUE_27508, "openai/gpt-oss-120b",
           79.18, {"gpu_memory_utilization": 0.95, "max_num_batched_tokens": 1024}, logged_pool_gib=1.71,
           asserted=False, note="MXFP4 ran on Marlin (expert width padded 2880 -> 2944, 65.97 GiB of weights in issue"
                                " 23278's H100 log), not modelled: vLLM picks the backend by installed kernels; with"
                                " Marlin's weights the planned pool is 1.72 GiB"),
    *(
        KvCase(f"Llama-4-Scout TP8, H200, {mml // 1024**2}M context, hybrid manager {'on' if hybrid else 'off'}",
               "0.12.0", LLAMA4_H200, LLAMA4_SCOUT, 139.81,
               {"tensor_parallel_size": 8, "max_model_len": mml, "gpu_memory_utilization": 0.9,
                "disable_hybrid_kv_cache_manager": not hybrid},
               logged_concurrency=concurrency, hub_id="meta-llama/Llama-4-Scout-17B-16E-Instruct", gpu="H200")
        for mml, hybrid, concurrency in ((5 * 1024**2, False, 0.75), (5 * 1024**2, True, 2.96), (8 * 1024**2, True, 1.86))
    ),
    # The GPU total does not enter this case: the pool is given (two 22 GB cards in the issue, with CPU offload).
    KvCase("DeepSeek-V2-Lite-Chat (MLA), one 32K request (logged pool)", "~0.8.3", ISSUE_15871, DEEPSEEK_V2_LITE, 44.0,
           {"max_model_len": 32768, "kv_cache_memory_bytes": int(0.95 * GIB)}, logged_tokens=32768,
           hub_id="deepseek-ai/DeepSeek-V2-Lite-Chat"),
    KvCase("Qwen2.5-0.5B-Instruct DP2 (dense), T4, fp16", "0.11.0", KUBERAY_4366, QWEN25_05B, T4_GIB, _DP2_T4_ARGS,
           logged_tokens=938_544, hub_id="Qwen/Qwen2.5-0.5B-Instruct"),
]  # fmt: skip


@pytest.mark.parametrize("max_model_len, logged_gib", [(20000, 2.07), (29000, 2.99)])
def test_v0_activation_of_a_long_profiling_batch_matches_issue_10517(max_model_len: int, logged_gib: float) -> None:
    """V0 without chunked prefill profiles one max_model_len-token batch: its forward peak (the down projection's
    output beside the MLP's input, residual and intermediates), not the sampler, sets the activation charge."""
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    args = {"max_model_len": max_model_len, "gpu_memory_utilization": 0.9}
    plan = plan_capacity(arch, args, resolve_hardware(memory_gib=23.58), profile=profile_for_version("0.6.4"))
    assert plan.activation_gib == pytest.approx(logged_gib, rel=0.02)


@pytest.mark.parametrize("case", [c for c in KV_CASES if c.asserted], ids=lambda c: f"{c.vllm} {c.name}")
def test_kv_tokens_per_release_within_target(case: KvCase) -> None:
    error = case.error()
    assert abs(error) < (0.03 if case.release >= (0, 8) else 0.10), (case.name, case.vllm, error)


def test_every_case_names_its_release_and_source() -> None:
    for case in KV_CASES:
        assert case.source.startswith("https://") and case.release >= (0, 0)
        assert case.asserted or case.note


def test_the_accuracy_bench_prints_a_row_per_case_and_release(capsys, monkeypatch) -> None:
    from tests.builders import bench_script

    monkeypatch.setattr("sys.argv", ["plan_accuracy.py", "--markdown"])
    bench_script("plan_accuracy").main()
    out = capsys.readouterr().out
    for case in KV_CASES:
        assert f"| {case.vllm} | {case.name} | {case.architecture} |" in out
        assert f"\n| {case.architecture} | " in out  # a row of the per-architecture table
    assert "| vllm-0.6 |" in out and "| vllm-0.11 |" in out


def test_a_logged_pool_becomes_tokens_through_the_allocators_pages() -> None:
    """gpt-oss's window layers hold only their window (and the tokens in flight), so at a 128K context its logged
    pool holds nearly twice pool / bytes a token, which charges every layer the whole context."""
    case = next(c for c in KV_CASES if c.name == "gpt-oss-20b TP1, A100-80GB, 128K context")
    plan = case.plan()
    assert case.logged_pool_gib is not None and case.logged_tokens is None
    assert case.logged() > 1.5 * _reported_tokens(case.logged_pool_gib, plan.kv_bytes_per_token)
    dense = next(c for c in KV_CASES if c.name == "Llama-3.1-8B-Instruct TP1, H100")
    assert dense.logged_pool_gib is not None
    assert dense.logged() == _reported_tokens(dense.logged_pool_gib, dense.plan().kv_bytes_per_token)


# hf-mem issue 60 (2026-05-06) quotes a vLLM log of gpt-oss-120b: "Available KV cache memory: 5.38 GiB", "GPU KV cache
# size: 78,384 tokens" (its release is not stated). vLLM PR 40384 quotes the code behind such a line before vLLM
# reported concurrency x max_model_len: num_blocks // len(kv_cache_groups) * block_size.
HF_MEM_60 = "https://github.com/alvarobartt/hf-mem/issues/60"
LEGACY_TOKEN_LINES = [
    # (model, hub id, args, logged pool GiB, groups, logged token line, source)
    (LLAMA4_SCOUT, "meta-llama/Llama-4-Scout-17B-16E-Instruct",
     {"tensor_parallel_size": 8, "disable_hybrid_kv_cache_manager": True}, 89.71, 1, 3_919_664, LLAMA4_H200),
    (LLAMA4_SCOUT, "meta-llama/Llama-4-Scout-17B-16E-Instruct",
     {"tensor_parallel_size": 8, "disable_hybrid_kv_cache_manager": False}, 89.71, 4, 3_919_664, LLAMA4_H200),
    ("openai/gpt-oss-120b", "openai/gpt-oss-120b", {}, 5.38, 2, 78_384, HF_MEM_60),
]  # fmt: skip


@pytest.mark.parametrize("model, hub_id, args, pool_gib, groups, logged, source", LEGACY_TOKEN_LINES)
def test_the_pool_gives_the_legacy_token_line_vllm_logged(
    model: str | dict[str, Any], hub_id: str, args: dict[str, Any], pool_gib: float, groups: int, logged: int,
    source: str,
) -> None:  # fmt: skip
    """Llama-4-Scout TP 8 (hybrid manager off: every block holds all 48 layers; on: four 12-layer groups share
    blocks a quarter that size) and gpt-oss-120b (two 18-layer groups): the planner's blocks for the logged pool
    give the logged token line, blocks / groups x 16, within the pool's 0.01 GiB rounding."""
    arch = load_model_arch(model) if isinstance(model, str) else arch_from_hf_config(model, hub_id)
    pool = {"max_model_len": 65536, **args, "kv_cache_memory_bytes": int(pool_gib * GIB)}
    plan = plan_capacity(arch, pool, resolve_hardware(gpu="H200"), profile=profile_for_version("0.12.0"))
    disabled = args.get("disable_hybrid_kv_cache_manager")
    assert len(kv_layout(arch, hybrid_manager=None if disabled is None else not disabled).groups) == groups, source
    assert plan.kv_cache_blocks // groups * 16 == pytest.approx(logged, rel=0.005 / pool_gib)


@pytest.mark.parametrize(
    "tokens, concurrency, max_model_len, measured",
    [
        (3_919_664, 2.96, 5 * 1024**2, int(2.96 * 5 * 1024**2)),  # Llama 4, hybrid manager on: the token line is none
        (3_919_664, 1.86, 8 * 1024**2, int(1.86 * 8 * 1024**2)),
        (3_919_664, 0.75, 5 * 1024**2, 3_919_664),  # manager off: one group, both lines agree; the exact one is kept
        (447_088, 13.64, 32_768, 447_088),  # vLLM 0.32's line is concurrency x max_model_len already
        (420_896, None, None, 420_896),  # no concurrency line
    ],
)
def test_the_measured_capacity_is_the_concurrency_line_where_the_token_line_is_none(
    tokens: int, concurrency: float | None, max_model_len: int | None, measured: int
) -> None:
    assert measured_kv_tokens(tokens, concurrency, max_model_len) == measured


def test_a_trial_on_a_hybrid_model_is_scored_against_vllms_capacity_not_its_token_line() -> None:
    """Llama-4-Scout's 5M run: the planner's tokens against 2.96 x 5,242,880, not against 3,919,664 (-75 %)."""
    from servetune.report.trials import kv_plan_check
    from servetune.results import CapacityReport, KvCapacityReport
    from tests.builders import trial

    case = next(c for c in KV_CASES if c.name == "Llama-4-Scout TP8, H200, 5M context, hybrid manager on")
    planned = case.plan().kv_cache_tokens
    result = trial("t1", {"max_model_len": 5 * 1024**2})
    result.capacity = CapacityReport(fits=True, reason="fits", kv_cache_tokens=planned, profile="vllm-0.11")
    result.kv_capacity = KvCapacityReport(
        tokens=3_919_664, max_concurrency=2.96, at_tokens_per_request=5 * 1024**2, planned_tokens=planned
    )
    check = kv_plan_check(result)
    assert check is not None and abs(check.relative_error) < 0.03


# huggingface.co/Qwen/Qwen3-30B-A3B-FP8/blob/main/config.json: Qwen3-30B-A3B's layout with block-FP8 weights.
QWEN3_30B_A3B_FP8 = {
    **QWEN3_235B_FP8, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
}  # fmt: skip
# antonai-work/vllm-deepep-v2-efa, docs/VALIDATION-WAVE11-CU12-NCCL-TEST.md (2026-05-06): `--data-parallel-size 8
# --enable-expert-parallel --all2all-backend deepep_v2` on one 8 x H100 node (a vLLM main build, 0.1.dev16220+g6d7a3fab2,
# with PR 41183), util 0.7, 2048 context, 256 batched tokens, eager: "Model loading took 5.44 GiB" a rank, then its
# first MoE dispatch crashed (no pool line). Without DP in the expert placement a rank would hold all 128 experts.
DEEPEP_V2_WAVE11 = (
    "https://github.com/antonai-work/vllm-deepep-v2-efa/blob/8073c4654ffcb6fa20d46220856c1ee113ea714e/docs/"
    "VALIDATION-WAVE11-CU12-NCCL-TEST.md"
)


def test_qwen3_moe_weights_per_rank_under_dp8_ep8_match_vllm() -> None:
    """Whole experts over TP x DP = 8 ranks under expert parallelism: 16 of 128 experts a rank, attention,
    embeddings and the untied head replicated (TP 1). ``DEEPEP_V2_WAVE11``: 5.44 GiB logged."""
    arch = arch_from_hf_config(QWEN3_30B_A3B_FP8, "Qwen/Qwen3-30B-A3B-FP8")
    args = {"data_parallel_size": 8, "enable_expert_parallel": True, "max_model_len": 2048, "enforce_eager": True,
            "gpu_memory_utilization": 0.7, "max_num_batched_tokens": 256, "max_num_seqs": 16}  # fmt: skip
    plan = plan_capacity(arch, args, resolve_hardware(gpu="H100-SXM"))
    assert plan.weights_gib == pytest.approx(5.44, rel=0.01)
    alone = plan_capacity(arch, {**args, "data_parallel_size": 1, "enable_expert_parallel": False},
                          resolve_hardware(gpu="H100-SXM"))  # fmt: skip
    assert alone.weights_gib > 5 * plan.weights_gib


def test_a_dense_model_under_dp_plans_each_rank_as_one_engine() -> None:
    """kuberay issue 4366 (vLLM 0.11.0, DP 2 on two T4s): each rank loads the whole 0.9271 GiB model and sizes its
    own pool; DP changes nothing in a dense model's plan."""
    case = next(c for c in KV_CASES if c.source == KUBERAY_4366)
    plan = case.plan()
    assert plan.settings.data_parallel_size == 2
    assert plan.weights_gib == pytest.approx(0.9271, rel=0.01)
    single = case.plan(args={**case.args, "data_parallel_size": 1})
    assert (plan.weights_gib, plan.kv_cache_tokens) == (single.weights_gib, single.kv_cache_tokens)
