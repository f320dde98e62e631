"""vLLM's admission bounds sized from a trial's measurements (report/admission.py) and shipped by export."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from servetune.cli import main
from servetune.engine.args import load_argspecs, validate_engine_args
from servetune.report import build_report, load_study
from servetune.report.admission import derive_admission, size_admission

STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"
BASELINE = "e57a166985b8"  # met the SLO at concurrency 2 and 8, broke it at 32 (ttft_ms.p99 <= 300)


@pytest.mark.parametrize(("rate", "in_flight", "wait_s", "ttft_s"),
                         [(10.0, 8.0, 0.3, 0.0), (29.31, 8.0, 2.0, 0.5), (0.5, 1.5, 0.3, 0.1), (29.31, 8.0, 0.3, 0.0887)])  # fmt: skip
def test_the_queue_is_what_drains_within_the_ttft_bound_on_top_of_what_runs(rate, in_flight, wait_s, ttft_s):
    reqs, tokens, queue = size_admission(rate, in_flight, wait_s, input_throughput=1000.0, ttft_s=ttft_s)
    # the last request admitted leaves the queue in time to have its first token, after its own TTFT, by the bound...
    assert queue >= 1 and (queue - 1) / rate + ttft_s < wait_s
    assert queue == 1 or queue / rate + ttft_s >= wait_s - 1e-9  # ...and the queue is no shorter than that
    assert reqs == math.ceil(in_flight) + queue  # vLLM counts running and waiting requests together
    assert tokens == math.ceil(1000.0 * (wait_s - ttft_s) - 1e-9)


def test_the_last_request_admitted_at_the_bound_still_meets_the_ttft_bound():
    """The stored study's trial at 8 clients: 29.31 req/s, TTFT P99 88.7 ms, bound 300 ms. A queue of ceil(X x W) = 9
    would start its last request 273 ms after it arrived, its first token at about 362 ms: past the bound. The
    wait left after its own TTFT, 211 ms, holds 7."""
    report = build_report(load_study(STUDY))
    points = [p for p in report.points if p.trial_id == BASELINE]
    at = next(p for p in points if p.level == {"concurrency": 8.0})
    bounds = derive_admission(points, [str(s) for s in report.slo])
    ttft_s, rate = at.metrics["ttft_ms_p99"] / 1000, at.metrics["request_throughput"]
    assert ttft_s + (bounds.queue_depth - 1) / rate <= 0.3  # the last one admitted: its first token in time
    assert bounds.queue_depth == 7 and bounds.max_num_queued_reqs == 15


def test_a_tighter_ttft_bound_and_a_slower_engine_admit_fewer():
    assert size_admission(10.0, 8, 0.2)[0] < size_admission(10.0, 8, 1.0)[0]
    assert size_admission(10.0, 8, 1.0, ttft_s=0.5)[0] < size_admission(10.0, 8, 1.0)[0]  # a slower first token too
    assert size_admission(5.0, 8, 1.0)[0] < size_admission(10.0, 8, 1.0)[0]
    assert size_admission(10.0, 8, 1.0)[1] is None  # no prompt-token throughput recorded: no token bound


def test_the_bounds_rest_on_the_highest_level_meeting_the_slo_and_export_ships_them(capsys):
    report = build_report(load_study(STUDY))
    points = [p for p in report.points if p.trial_id == BASELINE]
    at = next(p for p in points if p.level == {"concurrency": 8.0})
    bounds = derive_admission(points, [str(s) for s in report.slo])
    rate, left = at.metrics["request_throughput"], 0.3 - at.metrics["ttft_ms_p99"] / 1000  # ttft_ms_p99 <= 300
    assert bounds.queue_depth == math.ceil(rate * left) and bounds.max_num_queued_reqs == 8 + bounds.queue_depth
    assert bounds.max_num_queued_tokens == math.ceil(at.metrics["input_throughput"] * left)
    assert "ceil(29.31 req/s x (0.3 s - 0.089 s ttft_ms_p99 measured there))" in bounds.reasons["max_num_queued_reqs"]
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "vllm"]) == 0
    text = capsys.readouterr().out
    assert f"--max-num-queued-reqs {bounds.max_num_queued_reqs}" in text
    assert f"--max-num-queued-tokens {bounds.max_num_queued_tokens}" in text
    assert "#   max_num_queued_reqs: " in text and "vLLM answers 503 past it" in text
    specs = load_argspecs()  # vLLM's own parser's options (cached per vLLM version)
    if specs is not None:
        assert validate_engine_args(bounds.engine_args(), specs) == bounds.engine_args()


def test_a_trial_that_met_no_slo_ships_no_bounds_and_says_why(capsys):
    assert main(["export", str(STUDY), "--pick", "18ae6e731937", "--format", "vllm"]) == 0
    text = capsys.readouterr().out
    assert "# No admission bounds derived: trial 18ae6e731937 met the SLO at no load level" in text
    assert "--max-num-queued-reqs" not in text


@pytest.mark.parametrize("fmt", ["kubernetes", "kserve", "llm-d"])
def test_a_pods_vllm_serve_carries_the_bounds_the_vllm_export_prints(fmt, capsys):
    """The pod exports run `vllm serve` with the flags `--format vllm` prints (report/deploy.py), the admission bounds
    included: a pod's vLLM is the only queue in front of its engine there (no Serve queue cap)."""
    from servetune.report import deploy

    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", "vllm"]) == 0
    shipped = capsys.readouterr().out
    assert main(["export", str(STUDY), "--pick", BASELINE, "--format", fmt]) == 0
    text = capsys.readouterr().out
    docs = deploy.documents(text)
    containers = {
        "kubernetes": lambda: docs[0]["spec"]["template"]["spec"]["containers"],
        "kserve": lambda: docs[0]["spec"]["predictor"]["containers"],
        "llm-d": lambda: docs[0]["decode"]["containers"],
    }[fmt]()
    (args,) = [c["args"] for c in containers]
    for flag in ("--max-num-queued-reqs", "--max-num-queued-tokens"):
        value = args[args.index(flag) + 1]
        assert f"{flag} {value}" in shipped  # the very bound the vllm command ships
    assert "#   max_num_queued_reqs: " in text and "vLLM answers 503 past it" in text  # and why, as comments


def test_a_pod_export_of_a_trial_without_bounds_says_why(capsys):
    assert main(["export", str(STUDY), "--pick", "18ae6e731937", "--format", "kubernetes"]) == 0
    text = capsys.readouterr().out
    assert "# No admission bounds derived: trial 18ae6e731937 met the SLO at no load level" in text
    assert "--max-num-queued-reqs" not in text


def test_the_bounds_rest_on_the_capacity_not_on_a_higher_load_that_met_the_slo_above_a_break(tmp_path):
    """The search met the SLO at 12 clients and broke it at 16; 32 met it once above that break, a load the capacity
    does not trust (trial/capacity.py ``bracket``). The bounds are sized at 12, the capacity."""
    from servetune.results import Capacity
    from tests.builders import level, study_info, trial, write_study

    slow = ("ttft_ms_p99 = 2500 > 2000",)
    levels = [level(2, 200, 300), level(8, 800, 600), level(32, 1000, 1500), level(16, 950, 2500, violations=slow),
              level(12, 900, 1500)]  # fmt: skip
    searched = trial("t1", {"max_num_seqs": 8}, levels)
    searched.capacity_at_slo = Capacity(value=12, unit="concurrency", bracket=(12, 16), bound="exact", tolerance=0.1)
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), [searched])))
    points = [p for p in report.points if p.trial_id == "t1"]
    at12 = next(p for p in points if p.level == {"concurrency": 12.0})
    bounds = derive_admission(points, [str(s) for s in report.slo])
    assert bounds.in_flight == 12 and bounds.request_throughput == at12.metrics["request_throughput"]
    assert bounds.max_num_queued_reqs == 12 + bounds.queue_depth
    assert "(at concurrency 12, its capacity at the SLO)" in bounds.reasons["max_num_queued_reqs"]


def test_a_trial_measured_through_serve_sizes_each_replicas_vllm_on_its_share(tmp_path):
    """Measured behind two Serve replicas, 32 clients were 16 per replica, each its own vLLM: the bounds one vLLM
    ships with are sized on its share of the clients, the request rate and the prompt rate."""
    from servetune.config.space import SERVE_REPLICAS
    from tests.builders import level, study_info, trial, write_study

    one = trial("t1", {"max_num_seqs": 8}, [level(32, 1000, 150)])
    two = trial("t2", {"max_num_seqs": 8, SERVE_REPLICAS: 2}, [level(32, 1000, 150)])
    report = build_report(load_study(write_study(tmp_path / "s", study_info(), [one, two])))
    slo = [str(s) for s in report.slo]
    alone, split = (derive_admission([p for p in report.points if p.trial_id == t], slo) for t in ("t1", "t2"))
    assert alone.in_flight == 32 and split.in_flight == 16
    assert split.request_throughput == pytest.approx(alone.request_throughput / 2)
    assert split.max_num_queued_reqs < alone.max_num_queued_reqs
    assert "its 32 clients / 2 Serve replicas" in split.reasons["max_num_queued_reqs"]


def test_a_level_whose_ttft_spends_the_bound_gets_the_short_queue_serve_and_the_policy_get():
    """One rule for the wait the SLO leaves (report/autoscale_policy.wait_left): where the TTFT measured there takes
    the whole bound, a tenth of it, as Serve's queue cap and the predictive policy use, not a queue of one."""
    from servetune.report.autoscale_policy import wait_left

    assert size_admission(10.0, 8, 1.0, ttft_s=1.0)[2] == math.ceil(10.0 * wait_left(1.0, "", 1000.0)[0]) == 1
    assert size_admission(100.0, 8, 1.0, ttft_s=1.2)[2] == 10  # ceil(100 req/s x 0.1 s)
    assert size_admission(100.0, 8, 1.0, ttft_s=0.5)[2] == 50  # what is left of the bound
