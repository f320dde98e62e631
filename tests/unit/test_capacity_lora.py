"""LoRA in the memory ledger (capacity/lora.py): the adapter slots vLLM preallocates, sized as its LoRA layers
allocate their stacked A and B tensors, taken out of a GPU's KV pool, beside the CPU build's KV space."""

from __future__ import annotations

import pytest

from servetune.capacity import Hardware, NotPlanned, arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.capacity.lora import DEFAULT_MAX_LORA_RANK, lora_cost
from servetune.models.tiny import TINY_CONFIG

CPU = Hardware(device="cpu", name="cpu", fp8=False)
ONE_GIB = {"VLLM_CPU_KVCACHE_SPACE": "1"}
C = TINY_CONFIG


@pytest.fixture
def tiny():
    return arch_from_hf_config(TINY_CONFIG, "tiny")


def stacked(max_loras: int, rank: int, tp: int = 1) -> int:
    """Elements vLLM's LoRA layers allocate for the tiny model, written out as their tensors' shapes:
    (max_loras, 1, rank, in) for A and (max_loras, 1, out, rank) for B, per slice of a merged layer."""
    hidden, inter, vocab = C["hidden_size"], C["intermediate_size"], C["vocab_size"]
    q, kv = C["num_attention_heads"] * C["head_dim"] // tp, max(1, C["num_key_value_heads"] // tp) * C["head_dim"]
    shapes = []
    for _ in range(C["num_hidden_layers"]):
        shapes += [(rank, hidden), (q, rank), (rank, hidden), (kv, rank), (rank, hidden), (kv, rank)]  # qkv_proj
        shapes += [(rank, q), (hidden, rank)]  # o_proj (row-parallel: this rank's input)
        shapes += [(rank, hidden), (inter // tp, rank)] * 2  # gate_up_proj
        shapes += [(rank, inter // tp), (hidden, rank)]  # down_proj
    shapes += [(vocab, rank), (hidden, rank)]  # embed_tokens
    shapes += [(rank, hidden), (vocab, rank)]  # the logits processor around lm_head
    return max_loras * sum(a * b for a, b in shapes)


@pytest.mark.parametrize(("loras", "rank", "tp"), [(1, 16, 1), (2, 16, 1), (4, 64, 1), (1, 8, 2)])
def test_the_slots_are_the_stacked_tensors_vllm_allocates(tiny, loras, rank, tp):
    cost = lora_cost(tiny, 4, loras, rank, tp=tp)
    assert cost.max_loras * cost.slot_bytes == stacked(loras, rank, tp) * 4 and cost.buffers == 0
    with_buffers = lora_cost(tiny, 4, loras, rank, tp=tp, max_num_batched_tokens=2049, max_num_seqs=256)
    assert with_buffers.total - cost.total == (4 * 2056 + 3 * 256) * 8  # int64 index vectors, tokens rounded up to 8


def test_vllms_defaults_are_one_slot_of_rank_16(tiny):
    assert lora_cost(tiny, 2).total == stacked(1, DEFAULT_MAX_LORA_RANK) * 2


def test_on_a_gpu_the_slots_come_out_of_the_kv_pool(tiny):
    gpu = resolve_hardware("gpu", "L4", None)
    args = {"max_model_len": 2048, "enforce_eager": True}
    base = plan_capacity(tiny, args, gpu)
    lora_args = {**args, "enable_lora": True, "max_loras": 8, "max_lora_rank": 64}
    plan = plan_capacity(tiny, lora_args, gpu)
    expected = lora_cost(tiny, 2, 8, 64, max_num_batched_tokens=plan.settings.max_num_batched_tokens,
                         max_num_seqs=plan.settings.max_num_seqs).total  # fmt: skip
    assert plan.lora_gib == pytest.approx(expected / 2**30, abs=1e-4) and base.lora_gib == 0
    assert (base.kv_cache_gib - plan.kv_cache_gib) == pytest.approx(expected / 2**30, abs=2e-3)
    assert plan.kv_cache_blocks < base.kv_cache_blocks
    assert any("LoRA: 8 slot(s) of rank 64" in note for note in plan.notes)
    # more slots, less KV
    more = plan_capacity(tiny, {**lora_args, "max_loras": 16}, gpu)
    assert more.kv_cache_blocks < plan.kv_cache_blocks


def test_on_the_cpu_build_the_kv_space_is_what_was_asked(tiny):
    args = {"max_model_len": 1024, "dtype": "float32"}
    base = plan_capacity(tiny, args, CPU, env=ONE_GIB)
    plan = plan_capacity(tiny, {**args, "enable_lora": True, "max_loras": 2}, CPU, env=ONE_GIB)
    assert plan.kv_cache_tokens == base.kv_cache_tokens and plan.lora_gib > 0
    assert any("outside the CPU build's KV space" in note for note in plan.notes)


def test_slots_that_do_not_fit_are_named_in_the_refusal(tiny):
    gpu = Hardware(device="gpu", name="small", memory_gib=0.5, fp8=False)
    args = {"max_model_len": 256, "enforce_eager": True, "enable_lora": True, "max_loras": 64, "max_lora_rank": 512}
    plan = plan_capacity(tiny, args, gpu)
    assert not plan.fits and "LoRA slots" in plan.reason, plan.reason


def test_models_the_ledger_does_not_size_for_lora_are_not_planned():
    moe = arch_from_hf_config({**TINY_CONFIG, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "moe")  # fmt: skip
    with pytest.raises(NotPlanned, match="LoRA memory on a model with mixture-of-experts layers"):
        plan_capacity(moe, {"enable_lora": True, "max_model_len": 1024}, CPU, env=ONE_GIB)


#: Measured on vLLM 0.32.0 (CPU build), tiny model, float32, enable_lora with max_loras 2 and max_lora_rank 16:
#: the stacked A and B tensors of the 18 layers vLLM wrapped, summed in its worker (bench/lora_vllm.py), and the
#: KV tokens its log reported ("CPU KV cache size: 262,144 tokens", the same without LoRA) at 1 GiB.
VLLM_TINY_LORA_BYTES = 2_228_736
VLLM_TINY_KV_TOKENS = 262_144


def test_the_plan_matches_what_vllm_allocated_on_the_tiny_model(tiny):
    cost = lora_cost(tiny, 4, 2, 16)
    assert cost.max_loras * cost.slot_bytes == VLLM_TINY_LORA_BYTES
    args = {"max_model_len": 1024, "dtype": "float32", "enforce_eager": True}
    for lora in ({}, {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}):
        assert plan_capacity(tiny, {**args, **lora}, CPU, env=ONE_GIB).kv_cache_tokens == VLLM_TINY_KV_TOKENS
