"""The GPU checks that need no vLLM, for a lent GPU machine: a short, prepared run (well under 2 minutes).

    PYTHONPATH=src python bench/gpu_smoke.py [--load-s 10]

1. NVML against torch's view: the GPUs each sees, their names and memory (torch counts what
   ``CUDA_VISIBLE_DEVICES`` shows it; NVML sees the whole node);
2. ``servetune doctor``'s checks of this node (doctor.py ``node_facts`` and ``evaluate``), as the node's Ray would
   declare its GPUs (torch's count): GPU names, memory, MIG, another process holding a GPU, /dev/shm, niceness;
3. servetune's telemetry (telemetry.py ``TelemetrySampler``) on every GPU while torch runs matmuls on each for
   ``--load-s`` seconds: utilization, memory, power and the energy counter, against the load's own timing; the
   counter's energy over the load against the sampled power integrated over it, within ENERGY_TOLERANCE (issue
   #43's proof: 5%).

It prints what it found, one line a check, and exits 1 on a mismatch or a doctor FAIL, 2 where there is no GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

#: How far the energy counter's joules over the load may sit from the sampled power integrated (#43: 5%).
ENERGY_TOLERANCE = 0.05


def matmuls(devices: int, seconds: float) -> float:
    """bf16 matmuls on every GPU for ``seconds``; the TFLOP/s they reached together."""
    import torch

    pairs = [(torch.randn(8192, 8192, device=f"cuda:{i}", dtype=torch.bfloat16),) * 2 for i in range(devices)]
    flops, start = 0.0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for a, b in pairs:
            a @ b
        flops += devices * 2 * 8192**3
    for i in range(devices):
        torch.cuda.synchronize(i)
    return flops / (time.perf_counter() - start) / 1e12


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-s", type=float, default=10.0, help="seconds of torch load under telemetry")
    args = parser.parse_args()
    import torch

    from servetune.doctor import evaluate, failed, node_facts
    from servetune.telemetry import TelemetrySampler

    bad = 0
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts = node_facts()
    nvml = facts.get("gpus")
    print(f"torch {torch.__version__}: {seen} GPU(s); NVML: {'none' if nvml is None else len(nvml)}")
    if not seen or not nvml:
        print("no GPU here (torch or NVML sees none): nothing to check")
        return 2
    for index in range(seen):
        props = torch.cuda.get_device_properties(index)
        gpu = nvml[index] if index < len(nvml) else None
        same = (
            gpu is not None and gpu["name"] == props.name and abs(gpu["total_gib"] - props.total_memory / 2**30) < 1.0
        )
        bad += not same
        print(f"gpu {index}: torch {props.name} {props.total_memory / 2**30:.1f} GiB; NVML "
              f"{gpu and gpu['name']} {gpu and round(gpu['total_gib'], 1)} GiB, used {gpu and round(gpu['used_gib'], 1)} GiB, "
              f"MIG {gpu and gpu['mig']}, pids {gpu and gpu['pids']}: {'same' if same else 'MISMATCH'}")  # fmt: skip
    facts = {**facts, "ray_resources": {"GPU": float(seen)}}
    checks = evaluate({"this-node": facts}, facts, device="gpu")
    for check in checks:
        print(f"doctor {check.status:4} {check.name}: {check.evidence}")
    bad += len(failed(checks))
    with TelemetrySampler(list(range(seen)), interval_s=0.5) as sampler:
        started = time.perf_counter()
        tflops = matmuls(seen, args.load_s)
        ended = time.perf_counter()
    summary = sampler.summary((started, ended))
    print(f"load: {tflops:.0f} TFLOP/s bf16 over {ended - started:.1f} s on {seen} GPU(s)")
    for key in sorted(summary):
        print(f"telemetry {key}: {summary[key]:.1f}")
    util = summary.get("gpu_util_mean")
    if util is None or util < 50:
        print(f"MISMATCH: GPU utilization under a matmul load read {util}")
        bad += 1
    energy = summary.get("gpu_energy_measured_j")
    if energy is None or energy <= 0:
        print(f"MISMATCH: no GPU energy measured over the load ({energy})")
        bad += 1
    integrated = sampler.power_window_energy(started, ended)
    if energy and integrated:  # #43's proof: the counter's energy within 5% of the sampled power integrated
        ratio = energy / integrated
        print(f"energy over the load: counter {energy:.1f} J, sampled power integrated {integrated:.1f} J, "
              f"ratio {ratio:.3f}: {'within' if abs(ratio - 1) <= ENERGY_TOLERANCE else 'MISMATCH, beyond'} "
              f"{ENERGY_TOLERANCE:.0%}")  # fmt: skip
        bad += abs(ratio - 1) > ENERGY_TOLERANCE
    print("gpu smoke: " + ("ok" if not bad else f"{bad} problem(s)"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
