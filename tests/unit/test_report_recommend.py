"""The recommendation: cheapest point meeting every SLO, one notch back from the OOM boundary."""

from __future__ import annotations

import pytest

from servetune.report import ReportPoint, TrialOutline, build_report, load_study, margin_signals, recommend
from servetune.report.points import is_out_of_memory
from servetune.results import LevelRun
from tests.builders import demo_study, level, study_info, trial, write_study


def pt(trial_id: str, cost: float, params: dict, level_index: int = 0, **kwargs) -> ReportPoint:
    return ReportPoint(
        trial_id=trial_id, level_index=level_index, level={"concurrency": 8.0}, params=params,
        metrics={"cost_per_mtok_usd": cost, "ttft_ms_p99": 100.0}, **kwargs,
    )  # fmt: skip


def complete(trial_id: str, params: dict) -> TrialOutline:
    return TrialOutline(trial_id, params, "COMPLETE")


def oom(trial_id: str, params: dict, reason: str = "CUDA out of memory. Tried to allocate 1 GiB") -> TrialOutline:
    return TrialOutline(trial_id, params, "FAILED", reason, out_of_memory=is_out_of_memory(reason))


def test_cheapest_point_with_room_to_spare_is_recommended_as_is():
    points = [pt("a", 2.0, {"max_num_seqs": 16}), pt("b", 1.0, {"max_num_seqs": 32}), pt("c", 0.5, {"max_num_seqs": 64},
              slo_violations=("ttft_ms_p99 = 9000 > 2000",))]  # fmt: skip
    trials = [
        complete("a", {"max_num_seqs": 16}),
        complete("b", {"max_num_seqs": 32}),
        complete("c", {"max_num_seqs": 64}),
    ]
    rec = recommend(points, trials)
    assert rec.point is points[1] and not rec.stepped_back and rec.passed_over == ()
    assert rec.reason == (
        "the cheapest configuration meeting every SLO, with room to spare: no out-of-memory neighbour, "
        "KV-cache peak not measured, preemptions not measured"
    )


def test_the_room_names_the_kv_cache_peak_and_never_reads_a_small_one_as_none():
    for usage, said in ((0.0034, "KV cache peaked under 1%"), (0.42, "KV cache peaked at 42%")):
        point = pt("a", 1.0, {}, server_metrics={"kv_cache_usage_max": usage, "preemptions": 0.0})
        assert recommend([point], [complete("a", {})]).reason == (
            f"the cheapest configuration meeting every SLO, with room to spare: no out-of-memory neighbour, {said}, no preemptions"
        )


def test_steps_back_when_the_next_higher_max_num_seqs_ran_out_of_memory():
    points = [
        pt("s16", 1.5, {"max_num_seqs": 16, "block_size": 16}),
        pt("s32", 1.0, {"max_num_seqs": 32, "block_size": 16}),
    ]
    trials = [
        complete("s16", {"max_num_seqs": 16, "block_size": 16}),
        complete("s32", {"max_num_seqs": 32, "block_size": 16}),
        oom("s64", {"max_num_seqs": 64, "block_size": 16}),
    ]
    rec = recommend(points, trials)
    assert rec.point is points[0] and rec.stepped_back
    assert [p.point.trial_id for p in rec.passed_over] == ["s32"]
    assert rec.passed_over[0].signals == (
        "the next-higher max_num_seqs (64, trial s64) failed: CUDA out of memory. Tried to allocate 1 GiB",
    )
    assert "stepped one notch back" in rec.reason and "+50%" in rec.reason


def test_only_the_next_higher_value_with_everything_else_equal_counts():
    params = {"max_num_seqs": 16, "gpu_memory_utilization": 0.9}
    point = pt("p", 1.0, params)
    far = [
        complete("p", params),
        complete("n32", {**params, "max_num_seqs": 32}),
        oom("n64", {**params, "max_num_seqs": 64}),
    ]
    assert margin_signals(point, far) == []  # one notch of margin left: 32 ran fine
    other = [oom("o32", {"max_num_seqs": 32, "gpu_memory_utilization": 0.95})]  # differs in another knob too
    assert margin_signals(point, other) == []
    not_memory = [
        TrialOutline("f32", {**params, "max_num_seqs": 32}, "FAILED", "FP8 KV cache on CPU requires x86 with AVX-512")
    ]
    assert margin_signals(point, not_memory) == []
    util = [
        oom("u95", {**params, "gpu_memory_utilization": 0.95}),
        complete("u93", {**params, "gpu_memory_utilization": 0.93}),
    ]
    assert margin_signals(point, util) == []  # the next-higher util is 0.93, which completed
    util_edge = [oom("u93", {**params, "gpu_memory_utilization": 0.93})]
    assert margin_signals(point, util_edge)[0].startswith("the next-higher gpu_memory_utilization (0.93, trial u93)")


def test_infeasible_neighbour_that_does_not_fit_counts_as_the_boundary():
    params = {"max_num_batched_tokens": 4096}
    reason = "does not fit: activation peak leaves no KV pool"
    trials = [TrialOutline("big", {"max_num_batched_tokens": 8192}, "INFEASIBLE", reason, is_out_of_memory(reason))]
    assert "max_num_batched_tokens (8192" in margin_signals(pt("p", 1.0, params), trials)[0]


def test_kv_cache_peak_and_preemptions_make_a_margin_thin():
    assert margin_signals(pt("a", 1.0, {}, server_metrics={"kv_cache_usage_max": 0.89}), []) == []
    assert margin_signals(pt("a", 1.0, {}, server_metrics={"kv_cache_usage_max": 0.95}), []) == [
        "KV cache usage peaked at 95% (>= 90%)"
    ]
    assert margin_signals(pt("a", 1.0, {}, server_metrics={"preemptions": 3.0}), []) == [
        "the server preempted 3 requests"
    ]


def test_kv_pressure_steps_back_to_a_lower_load_level_of_the_same_trial():
    hot = pt(
        "t", 1.0, {"max_num_seqs": 32}, level_index=1, server_metrics={"kv_cache_usage_max": 0.97, "preemptions": 0}
    )
    cool = pt("t", 1.2, {"max_num_seqs": 32}, level_index=0, server_metrics={"kv_cache_usage_max": 0.6})
    rec = recommend([hot, cool], [complete("t", {"max_num_seqs": 32})])
    assert rec.point is cool and rec.stepped_back


def test_every_candidate_thin_recommends_the_cheapest_with_warnings():
    a = pt("a", 1.0, {}, server_metrics={"preemptions": 2.0})
    b = pt("b", 2.0, {}, server_metrics={"kv_cache_usage_max": 0.99})
    rec = recommend([b, a], [])
    assert rec.point is a and not rec.stepped_back
    assert rec.warnings == ("the server preempted 2 requests",)
    assert "ship it with care" in rec.reason


def test_nothing_meets_the_slo():
    failed = pt("f", 1.0, {}, outcome="FAILED")
    slow = pt("s", 1.0, {}, slo_violations=("tpot_ms_p99 = 300 > 100",))
    rec = recommend([failed, slow], [])
    assert rec.point is None and rec.reason == "no configuration met every SLO (2 operating points from 0 trials)"


def test_demo_study_steps_back_from_max_num_seqs_32_to_16(tmp_path):
    report = build_report(load_study(demo_study(tmp_path / "demo")))
    rec = report.recommendation
    assert (rec.point.trial_id, rec.point.level_index) == ("t16", 1)
    assert [(p.point.trial_id, p.point.level_index) for p in rec.passed_over] == [("t32", 1), ("t32", 0)]
    assert "next-higher max_num_seqs (64, trial t64) failed" in rec.reason
    assert "1 more cheaper point passed over" in rec.reason


@pytest.mark.parametrize(
    "reason, memory",
    [
        ("engine start: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("engine start: ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`", True),
        ("engine start: ValueError: 3.0 GiB KV cache is needed, which is larger than the available KV cache memory (1.2 GiB)", True),
        ("capacity check: no memory left for the KV cache: weights 14.00 + activations 2.00 exceed 70.00 GiB", True),
        ("capacity check: weights need 140.00 GiB per GPU but vLLM may use only 72.00 GiB (0.9 x 80 GiB)", True),
        ("capacity check: KV pool of 0.10 GiB holds 800 tokens, not enough for one request of max_model_len 8,192", True),
        ("capacity check: vLLM refuses this configuration: 7 KV heads do not split over tensor_parallel_size 2", False),
        ("engine start: RuntimeError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX", False),
        (None, False),
    ],
)  # fmt: skip
def test_out_of_memory_reasons(reason, memory):
    assert is_out_of_memory(reason) is memory


def test_a_tuned_point_inside_the_noise_of_vllms_defaults_gives_way_to_them():
    """Rule 4: 15% cheaper than the defaults, each level run once (each could be off by 10% either side, so two
    runs of one configuration by 20%): the defaults."""
    tuned, defaults = pt("t", 0.85, {"max_num_seqs": 32}), pt("d", 1.0, {})
    rec = recommend([tuned, defaults], [complete("t", {"max_num_seqs": 32}), complete("d", {})])
    assert rec.point is defaults and rec.passed_over == () and rec.warnings == ()
    assert rec.reason.startswith("vLLM's defaults: the best tuned point, trial t (max_num_seqs=32)")
    assert "only 15% cheaper than the defaults, within the two measurements' noise (±10% each)" in rec.reason


def test_a_tuned_point_cheaper_beyond_the_noise_stands_and_says_by_how_much():
    tuned, defaults = pt("t", 0.75, {"max_num_seqs": 32}), pt("d", 1.0, {})
    rec = recommend([tuned, defaults], [complete("t", {"max_num_seqs": 32}), complete("d", {})])
    assert rec.point is tuned
    assert rec.reason.endswith("; 25% cheaper than vLLM's defaults (trial d at concurrency 8, "
                               "$1 per million output tokens), beyond the two measurements' noise (±10% each)")  # fmt: skip


@pytest.mark.parametrize(
    ("tuned_noise", "defaults_noise", "winner"), [(0.05, 0.05, "t"), (0.05, 0.08, "d"), (0.08, 0.05, "d")]
)
def test_repeats_narrow_the_noise_to_what_they_measured_and_both_count(tuned_noise, defaults_noise, winner):
    """12% cheaper: a gain when both levels' repeats spread 5% (10% together), not when either spread 8%."""
    tuned, defaults = pt("t", 0.88, {"max_num_seqs": 32}, noise=tuned_noise), pt("d", 1.0, {}, noise=defaults_noise)
    rec = recommend([tuned, defaults], [complete("t", {"max_num_seqs": 32}), complete("d", {})])
    assert rec.point.trial_id == winner


def test_defaults_that_broke_the_slo_or_run_thin_do_not_take_the_recommendation():
    tuned = pt("t", 0.95, {"max_num_seqs": 16})
    slow = pt("d", 1.0, {}, slo_violations=("ttft_ms_p99 = 9000 > 2000",))
    assert recommend([tuned, slow], [complete("t", {"max_num_seqs": 16}), complete("d", {})]).point is tuned
    full = pt("d", 1.0, {}, server_metrics={"kv_cache_usage_max": 0.95})  # a thin margin of its own
    rec = recommend([tuned, full], [complete("t", {"max_num_seqs": 16}), complete("d", {})])
    assert rec.point is tuned and "vLLM's defaults" not in rec.reason


def test_the_levels_repeats_reach_the_recommendation_through_the_report(tmp_path):
    """A study whose levels ran three times each: a tuned trial 12% cheaper than the defaults wins when the repeats'
    throughput spreads 5%, and gives way when it spreads 20% (results.py throughput_noise, read into each point).
    Their P99 TTFT spreads 50% either way, as tails do between repeats on a shared host: it does not move the cost."""

    def repeated(tps: float, spread: float):
        once = level(8, tps, 400)
        runs = [
            LevelRun(summary=level(8, tps * f, ttft).summary)
            for f, ttft in ((1 - spread, 200), (1.0, 400), (1 + spread, 600))
        ]
        return once.model_copy(update={"runs": runs})

    for spread, winner in ((0.05, "tuned"), (0.2, "defaults")):
        root = write_study(tmp_path / str(spread), study_info(), [
            trial("defaults", {}, [repeated(1000, spread)]), trial("tuned", {"max_num_seqs": 32}, [repeated(1136, spread)])])  # fmt: skip
        report = build_report(load_study(root))
        assert {p.trial_id: p.noise for p in report.points} == pytest.approx({"defaults": spread, "tuned": spread})
        assert report.recommendation.point.trial_id == winner, report.recommendation.reason
        # the trial table concludes the recommended trial as recommended (as MLflow does), first
        top = report.trial_table[0]
        assert (
            top.trial_id == winner and top.recommended and str(top.conclusion).startswith("keep: recommended to ship (")
        )


def test_vllms_defaults_are_judged_at_the_values_vllm_resolved_for_them():
    """The baseline sets no parameter: its out-of-memory neighbour is the trial that set only a knob above the value
    vLLM resolved for it. With that neighbour failed the defaults run thin and the tuned point inside their noise
    stands; a cheaper point passed over for its own thin margin stays listed when the defaults are recommended."""
    resolved = {"max_num_seqs": 256, "max_num_batched_tokens": 8192}
    defaults = pt("d", 1.0, {}, resolved_engine_args=resolved)
    tuned = pt("t", 0.95, {"max_num_seqs": 128})
    trials = [complete("d", {}), complete("t", {"max_num_seqs": 128})]
    assert recommend([tuned, defaults], trials).point is defaults
    rec = recommend([tuned, defaults], [*trials, oom("o", {"max_num_seqs": 512})])
    assert rec.point is tuned
    assert margin_signals(defaults, [oom("o", {"max_num_seqs": 512})]) == [
        "the next-higher max_num_seqs (512, trial o) failed: CUDA out of memory. Tried to allocate 1 GiB"]  # fmt: skip
    full = pt("f", 0.9, {"max_num_seqs": 64}, server_metrics={"kv_cache_usage_max": 0.97})
    rec = recommend([full, tuned, defaults], [*trials, complete("f", {"max_num_seqs": 64})])
    assert rec.point is defaults and [p.point.trial_id for p in rec.passed_over] == ["f"]
