"""Predict before measuring: a roofline and queueing model of a vLLM replica, calibrated on public data.

:func:`estimate` takes a model (:class:`~servetune.capacity.ModelArch`), the trial's engine
arguments, the GPU and a :class:`Load`, and returns an :class:`Estimate`: TTFT, TPOT, ITL,
throughput, whether the load saturates the deployment, and the knee of its throughput curve.
GPU peaks come from the capacity catalogue; the fraction of them vLLM reaches (per GPU class and
phase) from ``data/factors.json``, fitted by :mod:`servetune.estimate.calibrate`. No Ray, no MLflow,
no vLLM: a pure function a test or a search can call.
"""

from servetune.estimate.factors import Efficiency, Factors, load_factors
from servetune.estimate.model import Estimate, Load, estimate, replica_from_plan
from servetune.estimate.roofline import Replica, decode_s, prefill_s
from servetune.estimate.specs import DeviceRates, cpu_rates, device_rates, gpu_class, measure_cpu_rates

__all__ = [
    "DeviceRates",
    "Efficiency",
    "Estimate",
    "Factors",
    "Load",
    "Replica",
    "cpu_rates",
    "decode_s",
    "device_rates",
    "estimate",
    "gpu_class",
    "load_factors",
    "measure_cpu_rates",
    "prefill_s",
    "replica_from_plan",
]
