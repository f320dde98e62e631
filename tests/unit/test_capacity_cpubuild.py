"""vLLM's CPU build refuses a quantized KV cache on a CPU without AVX-512 or AMX (vLLM 0.32's
``cpu_attn._get_attn_isa``): the plan's verdict and the trial's pre-flight refuse it at once, naming the flags and the
CPU, on synthetic flag sets either side of the line (capacity/cpubuild.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import servetune.capacity as capacity
from servetune import cli
from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.capacity.cpubuild import cpu_kv_cache_problem, quantized_kv_cache
from servetune.capacity.hardware import AVX512_FLAGS, CPU_FLAGS, Hardware, host_cpu_model
from servetune.capacity.profile import VLLM_0_32, profile_for_version
from servetune.config.space import SearchSpace
from servetune.models.tinyarch import TINY_ARCHS
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import capacity_check

pytest.importorskip("transformers")  # the tiny configs are read through transformers' own config classes

ENGINE: dict[str, Any] = {"enforce_eager": True, "max_model_len": 4096}
KV_SPACE = {"VLLM_CPU_KVCACHE_SPACE": "1"}
CPU_FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # CPUAttentionBackend.supported_kv_cache_dtypes besides auto
SOME_AVX512 = ("avx512f", "avx512_bf16")  # AVX-512 F and BF16 without BW, DQ, VL: not torch's "AVX-512"


def _cpu(*flags: str, model: str = "") -> Hardware:
    return Hardware(device="cpu", name="cpu", fp8=False, cpu_flags=frozenset(flags), cpu_model=model)


def _arch(**overrides: Any):
    return arch_from_hf_config({**TINY_ARCHS["mistral-sliding"], **overrides}, "tiny-mistral")


@pytest.mark.parametrize("kv_cache_dtype", CPU_FP8_DTYPES)
@pytest.mark.parametrize(
    "flags, taken",
    [
        ((), False),  # AVX2 only, or an ARM host: no x86 flag at all
        (SOME_AVX512, False),
        (AVX512_FLAGS[:-1], False),  # one of the four missing is enough to refuse
        (AVX512_FLAGS, True),
        (("amx_tile",), True),  # AMX alone suffices
        ((*AVX512_FLAGS, "avx512_bf16", "amx_tile", "amx_bf16"), True),
    ],
)
def test_a_quantized_kv_cache_needs_avx512_or_amx(kv_cache_dtype: str, flags: tuple[str, ...], taken: bool) -> None:
    plan = plan_capacity(_arch(), {**ENGINE, "kv_cache_dtype": kv_cache_dtype}, _cpu(*flags), env=KV_SPACE)
    assert plan.fits is taken, plan.reason
    if not taken:
        assert plan.reason.startswith("vLLM refuses this configuration: kv_cache_dtype " + kv_cache_dtype)
        missing = [flag for flag in AVX512_FLAGS if flag not in flags]
        assert f"lacks {', '.join(missing)} and amx_tile" in plan.reason
        assert all(f in plan.reason for f in flags)  # the flags the CPU has are named too
        assert plan.advice and "--kv-cache-dtype auto" in plan.advice[0]


def test_an_unquantized_kv_cache_is_taken_on_any_cpu() -> None:
    for dtype in ("auto", "bfloat16", "float16"):
        assert plan_capacity(_arch(), {**ENGINE, "kv_cache_dtype": dtype}, _cpu(), env=KV_SPACE).fits
    assert [d for d in ("fp8", "fp8_inc", "int8_per_token_head", "nvfp4", "auto") if quantized_kv_cache(d)] == [
        "fp8",
        "fp8_inc",
        "int8_per_token_head",
        "nvfp4",
    ]


def test_the_reason_names_this_hosts_cpu_or_the_flags_given() -> None:
    host = _cpu("avx2", model="AMD EPYC 7B13 64-Core Processor")
    reason = cpu_kv_cache_problem(_arch(), "fp8", host, VLLM_0_32) or ""
    assert "this host's CPU, AMD EPYC 7B13 64-Core Processor" in reason and "needs AVX-512" in reason
    given = cpu_kv_cache_problem(_arch(), "fp8", _cpu(), VLLM_0_32) or ""
    assert "the CPU given (flags: none of those vLLM checks)" in given


def test_a_head_size_of_16_but_not_32_multiples_is_refused_whatever_the_cpu() -> None:
    rich = _cpu(*CPU_FLAGS)
    for head_dim, taken in ((80, False), (112, False), (64, True), (96, True)):
        arch = _arch(head_dim=head_dim)
        plan = plan_capacity(arch, {**ENGINE, "kv_cache_dtype": "fp8"}, rich, env=KV_SPACE)
        assert plan.fits is taken, (head_dim, plan.reason)
        if not taken:
            assert f"head size divisible by 32, and the model's is {head_dim}" in plan.reason
        assert plan_capacity(arch, {**ENGINE, "kv_cache_dtype": "auto"}, rich, env=KV_SPACE).fits


def test_releases_checked_and_not() -> None:
    """0.26.0 refused it on an ARM64 host in a public log (the 0.25 profile); the profiles before are not checked and
    say so in a note rather than refuse."""
    engine = {**ENGINE, "kv_cache_dtype": "fp8"}
    assert not plan_capacity(_arch(), engine, _cpu(), env=KV_SPACE, profile=profile_for_version("0.26.0")).fits
    old = plan_capacity(_arch(), engine, _cpu(), env=KV_SPACE, profile=profile_for_version("0.11.0"))
    assert old.fits and any(note.startswith("not checked for vllm-0.11") and "amx_tile" in note for note in old.notes)
    taken = plan_capacity(_arch(), engine, _cpu(*AVX512_FLAGS), env=KV_SPACE, profile=profile_for_version("0.11.0"))
    assert taken.fits and not any("not checked" in note for note in taken.notes)  # nothing 0.32 would refuse


def test_advice_offers_an_fp8_kv_cache_only_where_the_cpu_takes_it() -> None:
    """A pool too small for one request: halving the KV bytes is advice on a CPU with AVX-512, not on one without."""
    engine = {**ENGINE, "kv_cache_memory_bytes": 1 << 20}
    for flags, offered in (((), False), (AVX512_FLAGS, True)):
        plan = plan_capacity(_arch(), engine, _cpu(*flags))
        assert not plan.fits and "not enough for one request" in plan.reason
        assert any("--kv-cache-dtype fp8" in tip for tip in plan.advice) is offered, plan.advice


def test_a_gpu_is_not_asked_for_cpu_flags() -> None:
    h100 = resolve_hardware(gpu="H100-SXM")
    assert plan_capacity(_arch(), {**ENGINE, "kv_cache_dtype": "fp8"}, h100).fits


def test_the_host_cpu_model_is_read_from_cpuinfo(tmp_path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    assert host_cpu_model(cpuinfo) == "Intel(R) Xeon(R) Platinum 8480+"
    assert host_cpu_model(tmp_path / "absent")  # the machine's kind where there is no such file
    host = resolve_hardware(device="cpu")
    assert host.cpu_model == host_cpu_model() and host.cpu_model
    assert resolve_hardware(device="cpu", cpu_flags=()).cpu_model == ""  # flags given: another CPU, not this host's


def _cpu_spec(tmp_path, **env: str):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_ARCHS["mistral-sliding"]))
    space = SearchSpace.model_validate({"name": "s", "model": str(model), "device": "cpu", "workload": "chat",
                                        "env": env, "engine_args": {**ENGINE, "kv_cache_dtype": "fp8"}})  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload)).spec_for({})


@pytest.mark.parametrize("env", [{}, KV_SPACE], ids=["no-kv-space", "kv-space"])
def test_the_trials_preflight_refuses_before_an_engine_starts(tmp_path, monkeypatch, env) -> None:
    """With or without a KV space (without one the CPU build sizes its cache from host memory and nothing else is
    predicted), a CPU whose flags lack AVX-512 and AMX makes the trial's capacity check refuse it."""
    spec = _cpu_spec(tmp_path, **env)
    seen = {"vllm": "0.32.0"}
    monkeypatch.setattr(capacity, "resolve_hardware", lambda *a, **k: _cpu(*SOME_AVX512, model="Test CPU 9000"))
    refused = capacity_check(spec, dict(seen))
    assert refused is not None and not refused.fits
    assert refused.reason.startswith("vLLM refuses this configuration: kv_cache_dtype fp8")
    assert "Test CPU 9000" in refused.reason and "avx512bw" in refused.reason
    monkeypatch.setattr(capacity, "resolve_hardware", lambda *a, **k: _cpu(*AVX512_FLAGS, model="Test CPU 9000"))
    taken = capacity_check(spec, dict(seen))
    assert (taken is None) if not env else (taken is not None and taken.fits)


def test_plan_shows_the_refusal_for_the_cpu_flags_given(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_ARCHS["mistral-sliding"]))
    argv = ["plan", "--model", str(tmp_path), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--enforce-eager",
            "--max-model-len", "4096", "--kv-cache-dtype", "fp8", "--json"]  # fmt: skip
    assert cli.main([*argv, "--cpu-flags", "avx512f,avx512_bf16"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert (
        not doc["fits"] and "needs AVX-512 (avx512f, avx512bw, avx512dq, avx512vl) or AMX (amx_tile)" in doc["reason"]
    )
    assert (
        "the CPU given (flags: avx512f, avx512_bf16) lacks avx512bw, avx512dq, avx512vl and amx_tile" in doc["reason"]
    )
    assert cli.main([*argv, "--cpu-flags", ",".join(AVX512_FLAGS)]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    assert cli.main([*argv[:-1], "--cpu-flags", "none"]) == 1  # the table names it too
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit: vLLM refuses this configuration: kv_cache_dtype fp8" in out and "amx_tile" in out
