"""The CPU's flags on vLLM's CPU build: read from ``/proc/cpuinfo`` (or given), and the Mamba SSM state dtype that
vLLM 0.32's ``CpuPlatform.check_and_update_config`` settles on with and without AVX-512 BF16."""

from __future__ import annotations

import json
from typing import Any

import pytest

import servetune.cli as cli
from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.capacity.arith import cdiv
from servetune.capacity.hardware import CPU_FLAGS, host_cpu_flags, parse_cpu_flags
from servetune.capacity.mamba import cpu_ssm_dtype, state_bytes
from servetune.capacity.model import MambaMixer
from servetune.errors import UserError
from servetune.models.tinyarch import TINY_ARCHS

pytest.importorskip("transformers")  # the tiny configs are read through transformers' own config classes

BF16_CPU = resolve_hardware(device="cpu", cpu_flags=("avx512f", "avx512_bf16"))
AVX2_CPU = resolve_hardware(device="cpu", cpu_flags=())
ENGINE: dict[str, Any] = {"enforce_eager": True, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
                          "max_model_len": 4096}  # fmt: skip
KV_SPACE = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def test_the_flags_are_read_from_the_first_flags_line(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: some CPU\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile avx512_vnni\n"
        "\nprocessor\t: 1\nflags\t\t: fpu amx_bf16\n"
    )
    assert host_cpu_flags(cpuinfo) == {"avx512f", "avx512_bf16", "amx_tile"}  # only the ones vLLM checks
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # an ARM host: no x86 flags line
    assert host_cpu_flags(arm) == frozenset()
    assert host_cpu_flags(tmp_path / "absent") == frozenset()


def test_the_cpu_stand_in_has_this_hosts_flags_unless_told() -> None:
    assert resolve_hardware(device="cpu").cpu_flags == host_cpu_flags()
    assert resolve_hardware(device="cpu", cpu_flags=["amx_tile"]).cpu_flags == {"amx_tile"}
    assert BF16_CPU.avx512_bf16 and not AVX2_CPU.avx512_bf16
    assert not resolve_hardware(gpu="H100-SXM").cpu_flags


def test_cpu_flags_parse_or_fail_in_one_line() -> None:
    assert parse_cpu_flags("none") == frozenset()
    assert parse_cpu_flags(" AVX512_BF16, amx_tile ") == {"avx512_bf16", "amx_tile"}
    for bad in ("avx512bf16", "none,avx512f", ","):
        with pytest.raises(UserError, match=r"^--cpu-flags .*expected none or a comma-separated list of") as info:
            parse_cpu_flags(bad)
        assert "\n" not in str(info.value) and all(flag in str(info.value) for flag in CPU_FLAGS)


MAMBA2 = MambaMixer(kind="mamba2", conv_kernel=4, intermediate_size=512, state_size=64, n_groups=1, num_heads=8,
                    head_dim=64)  # fmt: skip
LIGHTNING = MambaMixer(kind="linear_attention", num_heads=4, head_dim=64)


@pytest.mark.parametrize(
    "asked, mixer, listed, bf16, settled",
    [
        # without AVX-512 BF16 the platform leaves it alone
        ("auto", MAMBA2, True, False, "auto"),
        ("bfloat16", MAMBA2, False, False, "bfloat16"),
        ("float16", MAMBA2, True, False, "float16"),
        # with it: float32 stays; anything else becomes float32 ...
        ("float32", MAMBA2, True, True, "float32"),
        ("auto", MAMBA2, True, True, "float32"),
        # ... except a half dtype for the accelerated GDN backend: layers listed as linear_attention, (conv, SSM)
        ("bfloat16", MAMBA2, True, True, "bfloat16"),
        ("float16", MAMBA2, True, True, "float16"),
        ("bfloat16", MAMBA2, False, True, "float32"),  # Falcon-H1's "hybrid" layers
        ("bfloat16", LIGHTNING, True, True, "float32"),  # one state, not a (conv, SSM) pair
    ],
)
def test_the_ssm_dtype_follows_the_cpu_platforms_rule(asked, mixer, listed, bf16, settled) -> None:
    assert cpu_ssm_dtype(asked, mixer, listed, bf16) == settled


def _plan(name: str, hardware, **engine: Any):
    arch = arch_from_hf_config(TINY_ARCHS[name], f"tiny-{name}")
    return arch, plan_capacity(arch, {**ENGINE, **engine}, hardware, env=KV_SPACE)


@pytest.mark.parametrize("hardware", [BF16_CPU, AVX2_CPU], ids=["avx512_bf16", "no-avx512_bf16"])
def test_a_bf16_hybrid_plans_its_state_in_the_dtype_the_cpu_keeps(hardware) -> None:
    """The tiny bfloat16 granite-4.0-h: the SSM state in float32 with AVX-512 BF16, in bfloat16 without; the
    attention block grows to the smallest 128-multiple whose bf16 page (2 layers x 2 KV heads x 64 x K and V) holds
    one layer's state."""
    arch, plan = _plan("granite-4.0-h", hardware, dtype="bfloat16")
    ssm = "float32" if hardware.avx512_bf16 else "auto"
    state = state_bytes(arch.mamba, "bfloat16", mamba_ssm_cache_dtype=ssm)  # type: ignore[arg-type]
    assert state == 3 * 640 * 2 + 8 * 64 * 64 * (4 if hardware.avx512_bf16 else 2)
    assert plan.mamba_state_bytes_per_sequence == 6 * state
    block = 128 * cdiv(state, 128 * 2 * 2 * 64 * 2)
    assert plan.settings.block_size == block
    blocks = (1 << 30) // (2 * block * 2 * 2 * 64 * 2)
    assert plan.kv_cache_tokens == int(blocks / (cdiv(4096, block) + 3 * 3) * 4096)
    kept = "float32" if hardware.avx512_bf16 else "bfloat16"
    assert any(f"AVX-512 BF16: the SSM state in {kept}" in note for note in plan.notes), plan.notes


def test_a_half_ssm_dtype_asked_is_kept_on_an_avx512_bf16_cpu() -> None:
    """granite-4.0-h's config lists its Mamba layers as linear_attention, so vLLM's CPU build takes it for the
    accelerated GDN backend and keeps a bfloat16 SSM state asked for, as on a CPU without the flag."""
    _, asked = _plan("granite-4.0-h", BF16_CPU, dtype="bfloat16", mamba_ssm_cache_dtype="bfloat16")
    _, plain = _plan("granite-4.0-h", AVX2_CPU, dtype="bfloat16")
    _, auto = _plan("granite-4.0-h", BF16_CPU, dtype="bfloat16")
    assert asked.mamba_state_bytes_per_sequence == plain.mamba_state_bytes_per_sequence
    assert asked.mamba_state_bytes_per_sequence < auto.mamba_state_bytes_per_sequence


def test_falcon_h1_s_state_is_float32_on_an_avx512_bf16_cpu_whatever_is_asked() -> None:
    """Falcon-H1's layers are "hybrid" (attention and Mamba-2 side by side), not linear_attention: its backend is
    not GDN, so a bfloat16 SSM state asked for becomes float32 there, and stays bfloat16 without the flag."""
    config = {
        "architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "hidden_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "intermediate_size": 512, "vocab_size": 258, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_n_heads": 8,
        "mamba_d_head": 64, "mamba_d_ssm": 512, "mamba_d_conv": 4, "max_position_embeddings": 4096,
    }  # fmt: skip
    arch = arch_from_hf_config(config, "tiny-falcon-h1")
    assert arch.parallel_mamba and "mamba" not in arch.layer_types
    engine = {**ENGINE, "dtype": "bfloat16", "mamba_ssm_cache_dtype": "bfloat16"}
    with_flag = plan_capacity(arch, engine, BF16_CPU, env=KV_SPACE)
    without = plan_capacity(arch, engine, AVX2_CPU, env=KV_SPACE)
    layers = arch.num_layers
    assert with_flag.mamba_state_bytes_per_sequence == layers * state_bytes(
        arch.mamba,  # type: ignore[arg-type]
        "bfloat16",
        mamba_ssm_cache_dtype="float32",
    )
    assert without.mamba_state_bytes_per_sequence == layers * state_bytes(
        arch.mamba,  # type: ignore[arg-type]
        "bfloat16",
        mamba_ssm_cache_dtype="bfloat16",
    )


def test_plan_takes_cpu_flags_on_the_cpu_build_only(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_ARCHS["granite-4.0-h"]))
    argv = ["plan", "--model", str(tmp_path), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--enforce-eager",
            "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-batched-tokens", "2048", "--json"]  # fmt: skip
    blocks = {}
    for flags in ("avx512f,avx512_bf16", "none"):
        assert cli.main([*argv, "--cpu-flags", flags]) == 0
        blocks[flags] = json.loads(capsys.readouterr().out)["settings"]["block_size"]
    assert blocks["avx512f,avx512_bf16"] > blocks["none"]  # the float32 SSM state needs the larger page
    assert cli.main([*argv, "--cpu-flags", "avx512bf16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("servetune plan: error: --cpu-flags avx512bf16: unknown avx512bf16;") and err.count("\n") == 1
    assert cli.main(["plan", "--model", str(tmp_path), "--gpu", "H100", "--cpu-flags", "none"]) == 2
    assert "--cpu-flags is read only with --device cpu" in capsys.readouterr().err
