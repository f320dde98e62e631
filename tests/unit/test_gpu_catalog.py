"""The GPU catalogue (``capacity/catalog/gpus.yaml``): every entry's shape, the names NVML and Ray give its GPUs,
and the newest data-centre GPUs (GB200, B300, GB300, H20) planned as vLLM 0.32 runs them.

vLLM 0.32 tests the SM100 family (compute capability 10.x: ``is_device_capability_family(100)``) for its 1024-token
CUDA-graph ceiling (``VllmConfig._set_cudagraph_sizes``) and ``capability.major == 10`` for FLASHMLA_SPARSE's
``nvfp4_ds_mla`` (``flashmla_sparse.py`` ``supports_combination``): B200 and GB200 are 10.0, B300 and GB300 10.3.
"""

from __future__ import annotations

import json

import pytest

from servetune import cli
from servetune.capacity import (
    arch_from_hf_config,
    find_gpu,
    gpu_hardware,
    plan_capacity,
    resolve_hardware,
)
from servetune.capacity.hardware import GpuSpec, load_gpu_catalog, ray_accelerator_type
from servetune.capacity.profile import cudagraph_capture_sizes
from tests.unit.test_capacity_sparse_mla import V32

SM100 = ("B200", "GB200", "B300", "GB300")

#: The name NVML gives each GPU (``nvmlDeviceGetName``, as nvidia-smi prints it), and the catalogue entry it is.
NVML_NAMES = {
    "NVIDIA A100-SXM4-80GB": "A100-80GB",
    "NVIDIA H100 80GB HBM3": "H100-SXM",
    "NVIDIA H200": "H200",
    "NVIDIA B200": "B200",
    "NVIDIA GB200": "GB200",
    "NVIDIA B300 SXM6 AC": "B300",
    "NVIDIA GB300": "GB300",
    "NVIDIA H20": "H20",
    "NVIDIA L40S": "L40S",
}


def test_every_entry_says_its_compute_capability_and_blackwell_means_sm100() -> None:
    catalog = load_gpu_catalog()
    for name, spec in catalog.items():
        assert spec.compute_capability is not None, name
        assert spec.blackwell == spec.compute_capability.startswith("10."), name
        major, minor = (int(part) for part in spec.compute_capability.split("."))
        assert spec.fp8 == ((major, minor) >= (8, 9)), name  # FP8 tensor cores: Ada (8.9), Hopper, Blackwell
    assert sorted(name for name, spec in catalog.items() if spec.blackwell) == sorted(SM100)


def test_a_blackwell_flag_that_contradicts_the_compute_capability_is_refused() -> None:
    with pytest.raises(ValueError, match=r"blackwell: False but compute_capability 10\.3"):
        GpuSpec(name="X", memory_gib=1, compute_capability="10.3", blackwell=False)
    with pytest.raises(ValueError, match=r"blackwell: True but compute_capability 12\.0"):
        GpuSpec(name="X", memory_gib=1, compute_capability="12.0", blackwell=True)  # RTX PRO 6000 is not SM100


def test_no_alias_names_two_gpus_and_every_perf_cites_its_source() -> None:
    seen: dict[str, str] = {}
    for name, spec in load_gpu_catalog().items():
        for alias in (name, *spec.aliases):
            assert find_gpu(alias).name == name, alias
            assert seen.setdefault(alias.lower(), name) == name, alias
        if spec.perf is not None:
            assert spec.perf.source and spec.perf.tdp_w is not None, name
    for name in ("GB200", "B300", "GB300", "H20"):  # added 2026-12-07: each says where and when it was read
        perf = load_gpu_catalog()[name].perf
        assert perf is not None and "read 2026-12-07" in perf.source and "secondary" in perf.source, name


def test_nvml_names_find_their_entry_and_ray_types_match_rays_own_mapping() -> None:
    from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager

    for nvml, name in NVML_NAMES.items():
        assert find_gpu(nvml).name == name, nvml
        ray_type = NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(nvml)
        assert ray_accelerator_type(name) == ray_type, nvml
    seen = gpu_hardware("NVIDIA B300 SXM6 AC", 288_000_000_000)
    assert seen.name == "B300" and seen.blackwell and seen.memory_gib == pytest.approx(268.22, abs=0.01)
    assert not gpu_hardware("NVIDIA H20", 100_000_000_000).blackwell


@pytest.mark.parametrize("gpu", SM100)
def test_sm100_gpus_take_nvfp4_ds_mla_and_keep_plain_fp8_on_sparse_mla(gpu: str) -> None:
    v32 = arch_from_hf_config(V32, "deepseek-ai/DeepSeek-V3.2-Exp")
    args = {"tensor_parallel_size": 8, "max_model_len": 32768}
    nvfp4 = plan_capacity(v32, {**args, "kv_cache_dtype": "nvfp4_ds_mla"}, resolve_hardware(gpu=gpu))
    assert nvfp4.fits and nvfp4.kv_bytes_per_token == 61 * (352 + 132)
    fp8 = plan_capacity(v32, {**args, "kv_cache_dtype": "fp8"}, resolve_hardware(gpu=gpu))
    assert fp8.settings.kv_cache_dtype == "fp8"  # FLASHINFER_MLA_SPARSE on SM100, not fp8_ds_mla
    assert max(cudagraph_capture_sizes(1024, 16384, resolve_hardware(gpu=gpu).blackwell)) == 1024


@pytest.mark.parametrize("gpu", ["H200", "H20"])
def test_hopper_gpus_refuse_nvfp4_ds_mla(gpu: str) -> None:
    v32 = arch_from_hf_config(V32, "deepseek-ai/DeepSeek-V3.2-Exp")
    args = {"tensor_parallel_size": 8, "max_model_len": 32768, "kv_cache_dtype": "nvfp4_ds_mla"}
    plan = plan_capacity(v32, args, resolve_hardware(gpu=gpu))
    assert not plan.fits and "SM100 (compute capability 10.x: B200, GB200, B300, GB300) only" in plan.reason
    assert max(cudagraph_capture_sizes(1024, 16384, resolve_hardware(gpu=gpu).blackwell)) == 512


def test_plan_gpu_gb200_plans_a_70b_model_on_one_gpu(capsys) -> None:
    argv = ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--max-model-len", "32768", "--json"]
    assert cli.main([*argv, "--gpu", "GB200"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fits"] and doc["settings"]["max_num_seqs"] == 1024  # vLLM's default above 160 GiB
    assert doc["requested_gib"] == pytest.approx(0.92 * 184.32, abs=0.01)  # the catalogue's GB200 memory
    assert cli.main([*argv, "--gpu", "NVIDIA GB200"]) == 0  # NVML's name finds it too
    assert json.loads(capsys.readouterr().out)["fits"]
    assert cli.main([*argv, "--gpu", "H100-SXM"]) == 1  # 131 GiB of bf16 weights: not on one H100
    assert not json.loads(capsys.readouterr().out)["fits"]


def test_trials_on_b300_are_priced_from_the_table_and_gb200_says_it_has_no_price() -> None:
    from servetune.capacity.prices import Pricing, load_price_table

    pricing = Pricing(table=load_price_table())
    b300 = pricing.resolve("NVIDIA B300 SXM6 AC")  # NVML's name, as a trial records it
    assert b300.usd_per_device_hour == 7.89 and b300.gpu == "B300"
    gb200 = pricing.resolve("NVIDIA GB200")
    assert gb200.gpu == "GB200" and "no price listed for GB200" in gb200.source
