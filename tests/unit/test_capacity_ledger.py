"""The memory ledger: worked examples, the CPU build's exact counts, rounding, verdicts and advice."""

from __future__ import annotations

import pytest

from servetune.capacity import (
    VLLM_DEFAULT_GPU_MEMORY_UTILIZATION,
    Hardware,
    NotPlanned,
    arch_from_hf_config,
    compare_kv,
    load_model_arch,
    plan_capacity,
    resolve_hardware,
)
from servetune.engine.server import KvCapacity
from servetune.errors import UserError
from servetune.models.tiny import TINY_CONFIG

GIB = 1 << 30
CPU = Hardware(device="cpu", name="cpu", fp8=False)


@pytest.fixture
def tiny():
    return arch_from_hf_config(TINY_CONFIG, "tiny")


# --- vLLM's CPU build: the token count it reports, exactly ------------------------------------------


def test_cpu_build_one_gib_holds_524288_tokens_of_the_tiny_model(tiny) -> None:
    plan = plan_capacity(tiny, {"enforce_eager": True}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    # 2 x 4 layers x 2 KV heads x 64 x 2 B = 2048 B/token; CPU blocks are 128 tokens: 4096 blocks.
    assert plan.kv_bytes_per_token == 2048
    assert plan.settings.block_size == 128
    assert plan.kv_cache_blocks == 4096
    assert plan.kv_cache_tokens == 524_288
    assert plan.max_concurrency == 128.0  # 524,288 / max_model_len 4,096
    assert plan.fits


def test_cpu_build_tp2_splits_kv_heads_so_one_gib_per_rank_holds_1048576_tokens(tiny) -> None:
    plan = plan_capacity(tiny, {"tensor_parallel_size": 2}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert plan.kv_bytes_per_token == 1024
    assert plan.kv_cache_tokens == 1_048_576  # as DESIGN.md measured


def test_cpu_build_rounds_down_to_whole_blocks(tiny) -> None:
    plan = plan_capacity(tiny, {"block_size": 48, "max_model_len": 1000}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    blocks = 3 * GIB // (48 * 2048)
    assert plan.kv_cache_blocks == blocks
    # vLLM: int(blocks / ceil(1000 / 48) * 1000), per-request blocks rounded up.
    assert plan.kv_cache_tokens == int(blocks / 21 * 1000)
    assert plan.max_concurrency == pytest.approx(blocks / 21, abs=0.01)


def test_cpu_build_needs_the_kv_space(tiny) -> None:
    with pytest.raises(UserError, match="VLLM_CPU_KVCACHE_SPACE"):
        plan_capacity(tiny, {}, CPU)
    with pytest.raises(UserError, match="whole number of GiB"):
        plan_capacity(tiny, {}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1.5"})


def test_cpu_defaults_scale_with_world_size(tiny) -> None:
    plan = plan_capacity(tiny, {"tensor_parallel_size": 2}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert (plan.settings.max_num_seqs, plan.settings.max_num_batched_tokens) == (256, 4096)


# --- the seed's worked example (vllm-parameters doc) --------------------------------------------------


def test_seed_example_a100_80g_awq_7b_util_090_len_8192() -> None:
    """A100-80G, AWQ 7B, util 0.90: ~72 GB for the engine, ~4 GB weights, ~65 GB KV pool,
    ~1 GB per 8K request (GQA: 32 layers x 8 KV heads), theoretical concurrency ~60."""
    arch = load_model_arch("TheBloke/Mistral-7B-Instruct-v0.2-AWQ")
    plan = plan_capacity(
        arch, {"gpu_memory_utilization": 0.9, "max_model_len": 8192}, resolve_hardware(gpu="A100-80GB")
    )
    assert plan.requested_gib == pytest.approx(71.2, abs=0.1)  # 0.9 x 79.15 GiB (~76.5 GB)
    assert plan.weights_gib == pytest.approx(4.0, abs=0.3)
    assert 60 <= plan.kv_cache_gib <= 70
    assert plan.kv_gib_per_request == pytest.approx(1.0, abs=0.01)
    assert 55 <= plan.max_concurrency <= 70
    assert plan.fits


def test_seed_command_model_qwen25_awq_needs_half_the_kv_per_request() -> None:
    """The seed's command names Qwen2.5-7B-Instruct-AWQ: 28 layers x 4 KV heads, 56 KiB per token,
    so an 8K request holds 0.44 GiB, not ~1 GB, and max_num_seqs 64 is reachable with room to spare."""
    arch = load_model_arch("Qwen/Qwen2.5-7B-Instruct-AWQ")
    args = {
        "gpu_memory_utilization": 0.9,
        "max_model_len": 8192,
        "max_num_seqs": 64,
        "quantization": "awq_marlin",
        "block_size": 16,
    }
    plan = plan_capacity(arch, args, resolve_hardware(gpu="A100-80GB"))
    assert plan.kv_gib_per_request == pytest.approx(0.4375)
    assert plan.max_concurrency > 140
    assert plan.max_num_seqs_reachable


# --- the terms of the ledger -------------------------------------------------------------------------


def test_ledger_adds_up_and_tokens_are_whole_blocks() -> None:
    plan = plan_capacity(
        load_model_arch("meta-llama/Llama-3.1-8B-Instruct"), {"max_model_len": 8192}, resolve_hardware(gpu="H100")
    )
    spent = plan.weights_gib + plan.activation_gib + plan.non_torch_gib + plan.cudagraph_gib + plan.kv_cache_gib
    assert spent == pytest.approx(plan.requested_gib, abs=0.005)
    assert plan.kv_cache_tokens == plan.kv_cache_blocks * 16
    page = 16 * 131072  # a block of 16 tokens x 128 KiB
    assert plan.kv_cache_blocks == pytest.approx(plan.kv_cache_gib * GIB / page, abs=1)  # rounded down to whole blocks


def test_fp8_kv_cache_doubles_the_tokens_and_enforce_eager_frees_graph_memory() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = resolve_hardware(gpu="H100")
    base = plan_capacity(arch, {"max_model_len": 8192}, h100)
    fp8 = plan_capacity(arch, {"max_model_len": 8192, "kv_cache_dtype": "fp8"}, h100)
    eager = plan_capacity(arch, {"max_model_len": 8192, "enforce_eager": True}, h100)
    assert fp8.kv_bytes_per_token == base.kv_bytes_per_token // 2
    assert fp8.kv_cache_tokens == pytest.approx(2 * base.kv_cache_tokens, abs=32)
    assert base.cudagraph_gib > 0 and eager.cudagraph_gib == 0
    assert eager.kv_cache_tokens > base.kv_cache_tokens


def test_activation_grows_with_batched_tokens_and_non_torch_with_tp() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-70B-Instruct")
    h100 = resolve_hardware(gpu="H100")
    small = plan_capacity(arch, {"tensor_parallel_size": 4, "max_num_batched_tokens": 2048, "max_num_seqs": 64}, h100)
    large = plan_capacity(arch, {"tensor_parallel_size": 4, "max_num_batched_tokens": 32768, "max_num_seqs": 64}, h100)
    assert large.activation_gib > small.activation_gib + 0.5
    one = plan_capacity(load_model_arch("meta-llama/Llama-3.1-8B-Instruct"), {}, h100)
    two = plan_capacity(load_model_arch("meta-llama/Llama-3.1-8B-Instruct"), {"tensor_parallel_size": 2}, h100)
    assert two.non_torch_gib > one.non_torch_gib


def test_vllm_serve_defaults_depend_on_the_gpu() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    h100 = plan_capacity(arch, {}, resolve_hardware(gpu="H100")).settings
    a100 = plan_capacity(arch, {}, resolve_hardware(gpu="A100-80GB")).settings
    b200 = plan_capacity(arch, {}, resolve_hardware(gpu="B200")).settings
    assert (h100.max_num_seqs, h100.max_num_batched_tokens, h100.block_size) == (1024, 8192, 16)
    assert (a100.max_num_seqs, a100.max_num_batched_tokens) == (256, 2048)
    assert (b200.max_num_seqs, b200.max_num_batched_tokens) == (1024, 16384)
    assert h100.max_model_len == 131072 and h100.gpu_memory_utilization == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    assert (
        plan_capacity(
            load_model_arch("deepseek-ai/DeepSeek-V3"), {"tensor_parallel_size": 8}, resolve_hardware(gpu="H200")
        ).settings.block_size
        == 64
    )


def test_kv_cache_memory_bytes_overrides_the_budget() -> None:
    plan = plan_capacity(
        load_model_arch("Qwen/Qwen2.5-7B-Instruct"),
        {"kv_cache_memory_bytes": 4 * GIB, "max_model_len": 4096},
        resolve_hardware(gpu="L4"),
    )
    assert plan.kv_cache_gib == 4.0
    assert plan.kv_cache_tokens == 4 * GIB // (16 * 57344) * 16


def test_request_length_sets_concurrency_and_max_num_seqs_reachability() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    plan = plan_capacity(arch, {"max_num_seqs": 256}, resolve_hardware(gpu="H100"), request_tokens=1000)
    assert plan.max_concurrency_at_request == pytest.approx(plan.kv_cache_blocks / 63, abs=0.01)  # ceil(1000/16) blocks
    assert plan.max_num_seqs_reachable
    full = plan_capacity(arch, {"max_num_seqs": 256}, resolve_hardware(gpu="H100"))
    assert not full.max_num_seqs_reachable and "--request-tokens" in full.advice[0]


# --- verdicts and advice -----------------------------------------------------------------------------


def test_weights_that_do_not_fit_suggest_quantization_and_tensor_parallel() -> None:
    plan = plan_capacity(
        load_model_arch("meta-llama/Llama-3.1-70B-Instruct"), {"max_model_len": 8192}, resolve_hardware(gpu="H100")
    )
    assert not plan.fits and plan.reason.startswith("weights need")
    assert plan.advice[0].startswith("quantize the weights")
    assert any(line.startswith("raise --tp to 2") and "(fits" in line for line in plan.advice)


def test_kv_pool_too_small_suggests_fp8_kv_shorter_context_and_tp_in_order() -> None:
    arch = load_model_arch("Qwen/Qwen3-32B")
    plan = plan_capacity(
        arch, {"gpu_memory_utilization": 0.9}, resolve_hardware(gpu="H100")
    )  # 61 GiB of weights, 40K context
    assert not plan.fits and "not enough for one request" in plan.reason
    levers = [line.split(" ")[0] + " " + line.split(" ")[1] for line in plan.advice]
    assert levers[:4] == ["quantize the", "--kv-cache-dtype fp8", "lower --max-model-len", "raise --tp"]
    shorter = next(line for line in plan.advice if line.startswith("lower --max-model-len"))
    length = int(shorter.split()[3].rstrip(":").replace(",", ""))
    assert plan_capacity(arch, {"max_model_len": length}, resolve_hardware(gpu="H100")).fits


def test_negative_kv_pool_is_reported() -> None:
    plan = plan_capacity(
        load_model_arch("Qwen/Qwen3-32B"), {"gpu_memory_utilization": 0.8}, resolve_hardware(gpu="H100")
    )
    assert not plan.fits and plan.kv_cache_gib < 0 and plan.kv_cache_tokens == 0
    assert plan.reason.startswith("no memory left for the KV cache")


def test_tp_that_does_not_divide_the_heads_is_infeasible_with_valid_sizes() -> None:
    plan = plan_capacity(
        load_model_arch("Qwen/Qwen2.5-7B-Instruct"), {"tensor_parallel_size": 8}, resolve_hardware(gpu="H100")
    )
    assert not plan.fits and "num_attention_heads 28" in plan.reason
    assert plan.advice == ["--tp 8 is not a valid split of this model; valid sizes: 1, 2, 4"]


def test_awq_group_size_limits_tensor_parallel() -> None:
    plan = plan_capacity(
        load_model_arch("Qwen/Qwen2.5-7B-Instruct-AWQ"),
        {"tensor_parallel_size": 4, "max_model_len": 4096},
        resolve_hardware(gpu="L4"),
    )
    assert plan.fits  # 18944 / 4 = 4736 = 37 x 128
    # Qwen2.5-72B's 29568-wide MLP split in two is 14784, not a multiple of 128: vLLM refuses it
    # (which is why Qwen's own 72B AWQ checkpoint pads the MLP to 29696).
    bad = plan_capacity(
        load_model_arch("Qwen/Qwen2.5-72B-Instruct"),
        {"tensor_parallel_size": 2, "quantization": "awq"},
        resolve_hardware(gpu="H100"),
    )
    assert not bad.fits and "not a multiple of the AWQ group size 128" in bad.reason


def test_malformed_engine_args_raise_user_error(tiny) -> None:
    hw = resolve_hardware(gpu="H100")
    with pytest.raises(UserError, match="gpu_memory_utilization"):
        plan_capacity(tiny, {"gpu_memory_utilization": 1.5}, hw)
    # What vLLM may run but the ledger does not model is no verdict (NotPlanned), not a configuration that does not fit.
    with pytest.raises(NotPlanned, match="quantization quark"):
        plan_capacity(tiny, {"quantization": "quark"}, hw)
    with pytest.raises(NotPlanned, match="quantization gguf"):
        plan_capacity(tiny, {"quantization": "gguf"}, hw)
    # A context past the model's positions is refused, as vLLM refuses it (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN).
    long = plan_capacity(tiny, {"max_model_len": tiny.max_position_embeddings + 1}, hw)
    assert not long.fits and "exceeds the model's max_position_embeddings" in long.reason
    # Keys the ledger does not read (prefix caching, ports, env of other tools) are ignored.
    assert plan_capacity(tiny, {"enable_prefix_caching": True, "port": 8000}, hw).fits


# --- predicted vs reported ---------------------------------------------------------------------------


def test_compare_kv_with_the_engine_log_line(tiny) -> None:
    plan = plan_capacity(tiny, {}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    log = (
        "INFO [kv_cache_utils.py:2329] CPU KV cache size: 524,288 tokens, "
        "Maximum concurrency for 4,096 tokens per request: 128.00x\n"
    )
    reported = KvCapacity.from_log(log).tokens
    assert reported == 524_288
    result = compare_kv(plan, reported)
    assert result["relative_error"] == 0.0 and result["predicted_tokens"] == 524_288
    assert compare_kv(plan, 500_000)["relative_error"] == pytest.approx(0.0486, abs=1e-4)


def test_cpu_pool_too_small_for_one_request_suggests_more_kv_space(tiny) -> None:
    config = {**TINY_CONFIG, "max_position_embeddings": 1_048_576}
    long = arch_from_hf_config(config, "tiny-long")
    plan = plan_capacity(long, {}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert not plan.fits and plan.kv_cache_tokens == 524_288
    assert any("VLLM_CPU_KVCACHE_SPACE" in line and "at least 2 GiB" in line for line in plan.advice)
    assert not any(line.startswith("quantize") for line in plan.advice)  # weights do not live in the KV space


def test_kv_cache_memory_bytes_must_still_fit_on_the_gpu() -> None:
    arch = load_model_arch("meta-llama/Llama-3.1-8B-Instruct")
    ok = plan_capacity(arch, {"kv_cache_memory_bytes": 60 * GIB, "max_model_len": 8192}, resolve_hardware(gpu="H100"))
    assert ok.fits  # above the 0.9 budget, but vLLM skips that budget when the KV size is given
    too_big = plan_capacity(
        arch, {"kv_cache_memory_bytes": 70 * GIB, "max_model_len": 8192}, resolve_hardware(gpu="H100")
    )
    assert not too_big.fits and "more than the GPU's 79.19 GiB" in too_big.reason


def test_one_block_is_held_back_before_the_one_request_check(tiny) -> None:
    # 1 GiB / (128 tokens x 2048 B) = 4096 blocks. vLLM needs blocks - 1 >= ceil(max_model_len / 128).
    exact = plan_capacity(tiny, {"max_model_len": 4096, "block_size": 128}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert exact.fits
    config = {**TINY_CONFIG, "max_position_embeddings": 4096 * 128}
    long = arch_from_hf_config(config, "tiny-long")
    edge = plan_capacity(long, {"max_model_len": 4096 * 128}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert edge.kv_cache_tokens == 4096 * 128 and not edge.fits  # every block, but none left for the null block
    auto = plan_capacity(long, {"max_model_len": -1}, CPU, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert auto.settings.max_model_len == 4095 * 128 and auto.fits


def test_hardware_from_nvml_names_and_the_catalogue() -> None:
    from servetune.capacity import find_gpu, gpu_hardware

    assert find_gpu("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert find_gpu("NVIDIA A100-SXM4-40GB").memory_gib == 39.39
    assert find_gpu("NVIDIA GeForce RTX 4090").name == "RTX-4090"
    seen = gpu_hardware("NVIDIA B200", 191_000_000_000)
    assert seen.name == "B200" and seen.blackwell and seen.memory_gib == pytest.approx(177.88, abs=0.01)
    unknown = gpu_hardware("NVIDIA RTX PRO 6000 Blackwell", 100 * GIB)
    assert unknown.name == "NVIDIA RTX PRO 6000 Blackwell" and unknown.memory_gib == 100
    with pytest.raises(UserError, match="known: A100-40GB, A100-80GB, H100-SXM"):
        resolve_hardware(gpu="TPU-v9")


def test_the_default_gpu_memory_utilization_is_the_installed_vllms() -> None:
    """The ledger, ``plan`` and verify's checklist assume vLLM's own default when a space sets none: the value in
    the installed vLLM's CacheConfig (read from its source, without importing vLLM and torch)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed here")
    source = (Path(spec.origin).parent / "config" / "cache.py").read_text()
    found = re.search(r"gpu_memory_utilization: float = Field\(default=([\d.]+)", source)
    assert found, "vllm/config/cache.py no longer declares gpu_memory_utilization as this test reads it"
    assert float(found.group(1)) == VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
    plan = plan_capacity(load_model_arch("meta-llama/Llama-3.1-8B-Instruct"), {}, resolve_hardware(gpu="H100"))
    assert plan.requested_gib == pytest.approx(VLLM_DEFAULT_GPU_MEMORY_UTILIZATION * 79.19, abs=0.01)
