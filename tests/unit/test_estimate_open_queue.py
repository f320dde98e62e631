"""An open loop's TTFT holds the wait for a slot under random arrivals (estimate/queueing.py slot_wait_s)."""

from __future__ import annotations

import pytest

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.config.workload import Workload
from servetune.estimate import Load, estimate, load_factors, replica_from_plan
from servetune.estimate.calibrate import CalibrationPoint, predict
from servetune.estimate.model import arrival_burstiness
from servetune.estimate.queueing import slot_wait_s

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"


def _est(args=None, **load):
    """Llama-3.1-8B on an H100 with 8 slots (``args`` add to or replace them; a None value drops the argument)."""
    load.setdefault("input_tokens", 1000)
    load.setdefault("output_tokens", 200)
    engine = {k: v for k, v in {"max_model_len": 8192, "max_num_seqs": 8, **(args or {})}.items() if v is not None}
    return estimate(load_model_arch(LLAMA_8B), engine, resolve_hardware("gpu", "H100"), Load(**load))


def _capacity_rate(args=None) -> float:
    return _est(args, concurrency=10_000).request_throughput


def test_the_wait_is_erlangs_c_for_poisson_arrivals_and_kingmans_formula_on_one_slot():
    # M/M/2 at one request per service time: P(wait) = 1/3, mean wait = 1/3 x S / (2 - 1)
    assert slot_wait_s(1.0, 2, 1.0, arrival_cv2=1.0, service_cv2=1.0) == pytest.approx(1 / 3)
    # one slot: rho / (1 - rho) x S x (ca^2 + cs^2) / 2, Pollaczek-Khinchine's M/D/1 with Poisson arrivals
    for rho in (0.2, 0.7, 0.95):
        assert slot_wait_s(rho, 1, 2.0) == pytest.approx(rho / (1 - rho) * 2.0 / 2)


def test_the_wait_is_nil_at_low_load_and_grows_without_bound_as_the_slots_fill():
    assert slot_wait_s(2.0, 64, 10.0) < 1e-12
    waits = [slot_wait_s(64 * rho, 64, 10.0) for rho in (0.5, 0.9, 0.99, 0.999, 0.9999)]
    assert waits == sorted(waits) and waits[-1] > 50 * 10.0
    assert slot_wait_s(64.0, 64, 10.0) == float("inf")


def test_burstier_arrivals_wait_longer_and_evenly_spaced_ones_with_fixed_service_not_at_all():
    waits = [slot_wait_s(7.0, 8, 1.0, arrival_cv2=cv2) for cv2 in (0.0, 0.5, 1.0, 4.0)]
    assert waits[0] == 0.0 and waits == sorted(waits) and waits[-1] == pytest.approx(4 * waits[2])


def test_an_open_loop_near_capacity_waits_for_a_slot_in_its_ttft():
    cap = _capacity_rate()
    low, mid, near, nearer = (_est(rate=f * cap) for f in (0.1, 0.5, 0.9, 0.99))
    assert not nearer.saturated and nearer.tpot_ms == pytest.approx(near.tpot_ms, rel=0.2)
    # a prefill at low load is tens of ms; near capacity a request waits for one of the 8 slots to free
    assert low.ttft_ms < 60 and mid.ttft_ms < 2 * low.ttft_ms
    assert near.ttft_ms > 5 * low.ttft_ms and nearer.ttft_ms > 10 * near.ttft_ms
    assert _est(rate=1.01 * cap).saturated and _est(rate=1.01 * cap).ttft_ms is None


def test_a_bursty_workload_waits_longer_than_poisson_and_a_closed_loop_ignores_burstiness():
    rate = 0.9 * _capacity_rate()
    poisson, bursty, smooth = (_est(rate=rate, burstiness=b) for b in (1.0, 0.25, 4.0))
    assert smooth.ttft_ms < poisson.ttft_ms < bursty.ttft_ms
    assert bursty.tpot_ms == poisson.tpot_ms and bursty.output_throughput == poisson.output_throughput
    assert _est(concurrency=6, burstiness=0.25) == _est(concurrency=6)


def _workload(**arrival) -> Workload:
    return Workload.model_validate(
        {
            "name": "w",
            "input_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 50},
            "arrival": arrival,
        }
    )


def test_the_workloads_arrival_process_gives_the_burstiness():
    assert arrival_burstiness(None) == 1.0
    assert arrival_burstiness(_workload(process="poisson")) == 1.0
    assert arrival_burstiness(_workload(process="gamma", burstiness=0.5)) == 0.5
    assert arrival_burstiness(_workload(process="concurrency", burstiness=0.5)) == 1.0


@pytest.mark.parametrize(
    ("args", "clients", "ttft_ms", "tpot_ms", "output_throughput"),
    [
        ({}, 4, 46.685659700726134, 9.159205275473402, 427.95223300176303),
        ({}, 32, 6396.261074388054, 10.393305482851446, 756.0964232875214),
        ({"max_num_seqs": None}, 64, 64.36714341136974, 27.670708386144035, 2297.6794051588327),
        (
            {"max_num_seqs": None, "tensor_parallel_size": 2},
            300,
            90.27439068904108,
            66.17449469382002,
            4525.22854460976,
        ),
    ],
)
def test_closed_loop_predictions_are_unchanged(args, clients, ttft_ms, tpot_ms, output_throughput):
    """Pinned before the open loop's slot wait was added: a closed loop models its queue by Little's law."""
    est = _est(args, concurrency=clients)
    assert (est.ttft_ms, est.tpot_ms, est.output_throughput) == pytest.approx(
        (ttft_ms, tpot_ms, output_throughput), rel=1e-12
    )


def test_a_refit_point_of_a_bursty_open_loop_is_predicted_with_its_burstiness():
    arch = load_model_arch(LLAMA_8B)
    args = {"max_model_len": 8192, "max_num_seqs": 8}
    rep = replica_from_plan(arch, plan_capacity(arch, args, resolve_hardware("gpu", "H100")), args)
    eff = load_factors().for_class("H100")
    rate = 0.9 * _capacity_rate()

    def point(burstiness: float) -> CalibrationPoint:
        return CalibrationPoint(row=0, source_id="t", gpu_class="H100", model=arch.name, replica=rep, regime="open",
                                input_tokens=1000, output_tokens=200, load=rate, measured={}, held_out=False,
                                burstiness=burstiness)  # fmt: skip

    poisson, bursty = predict(point(1.0), eff)[0], predict(point(0.25), eff)[0]
    assert poisson["ttft_ms"] == pytest.approx(_est(rate=rate).ttft_ms)
    assert bursty["ttft_ms"] == pytest.approx(_est(rate=rate, burstiness=0.25).ttft_ms)
    assert bursty["ttft_ms"] > 2 * poisson["ttft_ms"]
