"""Where the model runs: a GPU from the catalogue (or an explicit memory size), or vLLM's CPU build."""

from __future__ import annotations

import functools
import platform
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from servetune.errors import UserError

GIB = 1 << 30

#: The x86 features vLLM 0.32's CPU build checks, as ``/proc/cpuinfo`` names them: AVX-512 (which kernel library it
#: loads; with AMX, whether it takes an FP8 KV cache), AVX-512 BF16 (``torch.cpu._is_avx512_bf16_supported``: the Mamba
#: SSM state's dtype, the conv-state layout) and AMX tiles (its attention, MLA and MoE kernels).
CPU_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "amx_tile", "amx_bf16")
#: What ``torch.cpu._is_avx512_supported()`` asks of the CPU (ATen's ``is_avx512_supported``: cpuinfo's AVX-512 F, BW,
#: DQ and VL), the test vLLM's CPU build makes for "AVX-512".
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512dq", "avx512vl")


class GpuPerf(BaseModel):
    """A GPU's peak rates for the performance estimate (dense tensor-core math, per GPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bf16_tflops: float = Field(gt=0, description="16-bit tensor-core peak (fp16 is the same)")
    fp8_tflops: float | None = Field(None, gt=0, description="absent: no FP8 tensor cores")
    hbm_gbps: float = Field(gt=0, description="memory bandwidth, GB/s")
    link: Literal["nvlink", "pcie"]
    link_gbps: float = Field(gt=0, description="GPU-to-GPU bandwidth per direction, GB/s")
    tdp_w: float | None = Field(None, gt=0, description="the board's power limit (datasheet max TDP), W")
    source: str


class GpuSpec(BaseModel):
    """One catalogue entry (``catalog/gpus.yaml``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    aliases: list[str] = []
    memory_gib: float = Field(gt=0)
    nvidia_smi_mib: int | None = None
    compute_capability: str | None = Field(None, pattern=r"^\d+\.\d+$", description="CUDA's major.minor, e.g. 10.0")
    fp8: bool = False
    blackwell: bool = False
    ray_type: str | None = None  # Ray's accelerator type for it: nodes of it have resource accelerator_type:<ray_type>
    perf: GpuPerf | None = None

    @model_validator(mode="after")
    def _blackwell_is_sm100(self) -> GpuSpec:
        """``blackwell`` is vLLM's SM100 family (compute capability 10.x: ``is_device_capability_family(100)``)."""
        if self.compute_capability is not None and self.blackwell != self.compute_capability.startswith("10."):
            raise ValueError(f"blackwell: {self.blackwell} but compute_capability {self.compute_capability}")
        return self


class Hardware(BaseModel):
    """One device of a replica. On a GPU, ``memory_gib`` is the total the CUDA runtime reports."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: Literal["gpu", "cpu"] = "gpu"
    name: str = "custom"
    memory_gib: float | None = Field(None, gt=0)
    fp8: bool = True
    blackwell: bool = False
    cpu_flags: frozenset[str] = Field(
        frozenset(), description="on the CPU build: which of CPU_FLAGS the host has (none: a CPU without them)"
    )
    cpu_model: str = Field("", description="on the CPU build: the host CPU's model name; empty where flags were given")

    @property
    def avx512_bf16(self) -> bool:
        """Does vLLM's CPU build see AVX-512 BF16 here (``torch.cpu._is_avx512_bf16_supported()``)?"""
        return "avx512_bf16" in self.cpu_flags

    @property
    def avx512(self) -> bool:
        """Does vLLM's CPU build see AVX-512 here (``torch.cpu._is_avx512_supported()``: every one of AVX512_FLAGS)?"""
        return set(AVX512_FLAGS) <= self.cpu_flags

    @property
    def amx(self) -> bool:
        """Does vLLM's CPU build see AMX tiles here (``torch.cpu._is_amx_tile_supported()``)?"""
        return "amx_tile" in self.cpu_flags

    def describe_cpu(self) -> str:
        """The CPU in a sentence: this host's by its model name, or the one whose flags were given, with its flags."""
        flags = ", ".join(f for f in CPU_FLAGS if f in self.cpu_flags) or "none of those vLLM checks"
        return (
            f"this host's CPU, {self.cpu_model} (flags: {flags})"
            if self.cpu_model
            else f"the CPU given (flags: {flags})"
        )

    @property
    def memory_bytes(self) -> int:
        if self.memory_gib is None:
            raise UserError(f"{self.name}: GPU memory unknown; pass --gpu NAME or --gpu-memory-gib X")
        return round(self.memory_gib * GIB)


def load_gpu_catalog() -> dict[str, GpuSpec]:
    """The shipped GPU catalogue by name (parsed once: a dry run asks per trial)."""
    return dict(_parsed_gpu_catalog())


@functools.cache
def _parsed_gpu_catalog() -> dict[str, GpuSpec]:
    text = resources.files("servetune.capacity").joinpath("catalog/gpus.yaml").read_text(encoding="utf-8")
    entries = yaml.safe_load(text) or {}
    return {name: GpuSpec(name=name, **fields) for name, fields in entries.items()}


def _norm(name: str) -> str:
    name = re.sub(r"^nvidia[\s_-]*", "", name.strip().lower())
    return re.sub(r"[\s_]+", "-", name)


def find_gpu(name: str) -> GpuSpec:
    """A catalogue GPU by name or alias (case, spaces and a leading "NVIDIA" do not matter)."""
    catalog = load_gpu_catalog()
    wanted = _norm(name)
    for spec in catalog.values():
        if wanted == _norm(spec.name) or wanted in (_norm(a) for a in spec.aliases):
            return spec
    raise UserError(
        f"--gpu {name}: unknown GPU; known: {', '.join(catalog)} (or give its memory with --gpu-memory-gib X)"
    )


@functools.cache
def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The flags of :data:`CPU_FLAGS` this host's CPU has (its first ``flags`` line); none where there is no such
    file or line (an ARM or macOS host: vLLM's x86 checks are false there too)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    line = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(line.group(1).split()) & frozenset(CPU_FLAGS) if line else frozenset()


@functools.cache
def host_cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This host's CPU model name (the first ``model name`` line of ``/proc/cpuinfo``), else the machine's kind."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    line = re.search(r"^model name\s*:(.*)$", text, re.MULTILINE)
    return line.group(1).strip() if line and line.group(1).strip() else (platform.machine() or "unknown CPU")


def parse_cpu_flags(text: str, what: str = "--cpu-flags") -> frozenset[str]:
    """``avx512f,avx512_bf16`` (names of :data:`CPU_FLAGS`, comma-separated) or ``none``; a wrong name is one line."""
    names = {name.strip().lower() for name in text.split(",") if name.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = sorted(names - set(CPU_FLAGS))
    if unknown or not names:
        bad = f"unknown {', '.join(unknown)}; " if unknown else ""
        raise UserError(f"{what} {text}: {bad}expected none or a comma-separated list of {', '.join(CPU_FLAGS)}")
    return frozenset(names)


def resolve_hardware(
    device: str = "gpu",
    gpu: str | None = None,
    memory_gib: float | None = None,
    cpu_flags: Iterable[str] | None = None,
) -> Hardware:
    """Hardware from the command line: ``--device``, ``--gpu NAME`` and/or ``--gpu-memory-gib X``.

    On the CPU build, ``cpu_flags`` (names of :data:`CPU_FLAGS`) says what the CPU that runs vLLM has; None: this
    host's, from ``/proc/cpuinfo``."""
    if device == "cpu":
        if cpu_flags is None:
            return Hardware(device="cpu", name="cpu", fp8=False, cpu_flags=host_cpu_flags(), cpu_model=host_cpu_model())
        return Hardware(device="cpu", name="cpu", memory_gib=None, fp8=False, cpu_flags=frozenset(cpu_flags))
    if device != "gpu":
        raise UserError(f"--device {device}: expected gpu or cpu")
    if memory_gib is not None and memory_gib <= 0:
        raise UserError(f"--gpu-memory-gib {memory_gib:g}: must be > 0")
    if gpu is None:
        if memory_gib is None:
            known = ", ".join(load_gpu_catalog())
            raise UserError(f"say which GPU: --gpu NAME (known: {known}) or --gpu-memory-gib X")
        return Hardware(device="gpu", name="custom", memory_gib=memory_gib)
    spec = find_gpu(gpu)
    return Hardware(
        device="gpu",
        name=spec.name,
        memory_gib=memory_gib if memory_gib is not None else spec.memory_gib,
        fp8=spec.fp8,
        blackwell=spec.blackwell,
    )


#: Ray gives every GPU node the resource ``accelerator_type:T`` (T from NVML's GPU name, e.g. ``H100``).
ACCELERATOR = "accelerator_type:"


def gpu_types(nodes: Iterable[Mapping[str, float]]) -> list[str]:
    """The GPU types Ray nodes declare (their ``accelerator_type:T`` resources), sorted."""
    return sorted(
        {k[len(ACCELERATOR) :] for node in nodes for k, v in node.items() if k.startswith(ACCELERATOR) and v > 0}
    )


def ray_accelerator_type(gpu: str) -> str | None:
    """The accelerator type Ray gives nodes of the catalogue GPU ``gpu`` (None: not in the catalogue, or unknown)."""
    try:
        return find_gpu(gpu).ray_type
    except UserError:
        return None


def gpu_hardware(device_name: str, memory_bytes: int) -> Hardware:
    """A GPU as the trial sees it (NVML's name and total memory); never fails on an unknown name.

    A known name (e.g. "NVIDIA H100 80GB HBM3") brings the catalogue's FP8 / Blackwell flags; the
    measured memory always wins over the catalogue's.
    """
    try:
        spec = find_gpu(device_name)
    except UserError:
        return Hardware(device="gpu", name=device_name, memory_gib=memory_bytes / GIB)
    return Hardware(device="gpu", name=spec.name, memory_gib=memory_bytes / GIB, fp8=spec.fp8, blackwell=spec.blackwell)
