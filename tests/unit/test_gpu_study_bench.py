"""bench/gpu_study.py: a scaled-down study's GPU time, unscaled back to full size."""

import pytest

from servetune.accounting import time_accounting
from tests.builders import bench_script, level, trial


@pytest.fixture(scope="module")
def bench():
    return bench_script("gpu_study")


def rate_level(rate, requests, duration_s, stopped_early=None):
    lv = level(1, 100, 300)
    summary = lv.summary.model_copy(
        update={"level": {"rate": rate}, "completed": requests, "failed": 0, "duration_s": duration_s}
    )
    return lv.model_copy(update={"summary": summary, "stopped_early": stopped_early})


def timed(devices, duration_s, startup_s, levels):
    return trial("t", {"tensor_parallel_size": devices}, levels, devices=devices).model_copy(
        update={"duration_s": duration_s, "startup_s": startup_s}
    )


def test_a_level_keeps_its_rate_and_sends_scale_times_the_requests(bench):
    assert bench.scaled_requests(256, 0.2) == 51 and bench.scaled_requests(256, 1.0) == 256
    assert bench.scaled_requests(256, 0.001) == 1  # never an empty level


def test_arrivals_and_start_up_are_unscaled_but_the_tail_and_the_rest_are_not(bench):
    # 2 GPUs; start-up 20 s; one level of 51 requests at 2 req/s: arrivals 25.5 s, tail 4.5 s; 5 s of the rest.
    result = timed(2, 55.0, 20.0, [rate_level(2.0, 51, 30.0)])
    out = bench.real_accounting([result], scale=0.2, probe_share=0.1)
    measuring, starting, other = 4.5 + 25.5 / 0.2, 20.0 / 0.2, 5.0
    quality = 0.1 * measuring
    total = measuring + starting + other + quality
    assert out["gpu_minutes"] == pytest.approx(2 * total / 60)
    assert out["measuring_share"] == pytest.approx(measuring / total)
    assert out["starting_share"] == pytest.approx(starting / total)
    assert out["quality_share"] == pytest.approx(quality / total)
    assert out["other_share"] == pytest.approx(other / total)


def test_at_full_size_without_a_probe_it_is_the_study_s_own_accounting(bench):
    results = [
        timed(1, 400.0, 90.0, [rate_level(2.0, 256, 140.0), rate_level(8.0, 256, 40.0)]),
        timed(2, 130.0, 120.0, []),
    ]
    out, own = bench.real_accounting(results, scale=1.0, probe_share=0.0), time_accounting(results)
    for share in ("measuring_share", "starting_share", "quality_share", "other_share"):
        assert out[share] == pytest.approx(own[share])
    assert out["gpu_minutes"] == pytest.approx(own["device_seconds"] / 60)


def test_a_level_cut_after_its_queue_grew_for_seconds_is_as_long_at_full_size(bench):
    saturated = "saturated: vLLM's waiting queue grew from 0 to 40 requests over 10 s: stopped early"
    cut = timed(1, 32.0, 20.0, [rate_level(32.0, 300, 12.0, stopped_early=saturated)])
    out = bench.real_accounting([cut], scale=0.2, probe_share=0.0)
    assert out["gpu_minutes"] == pytest.approx((12.0 + 20.0 / 0.2) / 60)
    slo = "ttft_ms_p99 = 4000 after 150 requests, over 2 x its bound 2000: stopped early"  # cut at half its requests: scales
    halved = bench.real_accounting([timed(1, 32.0, 20.0, [rate_level(32.0, 300, 12.0, stopped_early=slo)])], 0.2, 0.0)
    assert halved["gpu_minutes"] > out["gpu_minutes"]


def test_only_the_drawn_start_up_is_unscaled_not_the_fake_engine_s_own_process_start(bench):
    # drawn: a 10 s delay and a 3.6 s compile at scale 0.1 (136 s at full size); measured 15 s: 1.4 s is the process
    drawn = timed(1, 40.0, 15.0, []).model_copy(
        update={"params": {"env.SERVETUNE_FAKE_STARTUP_DELAY_S": "10.0"}, "startup_phases": {"compile_s": 3.6}}
    )
    out = bench.real_accounting([drawn], scale=0.1, probe_share=0.0)
    assert out["gpu_minutes"] == pytest.approx((13.6 / 0.1 + 1.4 + 25.0) / 60)
    assert bench.drawn_startup(timed(1, 40.0, 15.0, [])) is None  # a trial this script did not draw: all of it unscaled
    assert bench.real_accounting([timed(1, 40.0, 15.0, [])], 0.1, 0.0)["gpu_minutes"] == pytest.approx(
        (150.0 + 25.0) / 60
    )


def test_the_triton_what_if_saves_only_on_trials_whose_kernels_an_earlier_trial_compiled(bench):
    def t(model, seqs, devices=1):
        return {"devices": devices, "params": {"model": model, "quantization": None, "kv_cache_dtype": "auto",
                                               "tensor_parallel_size": devices, "max_num_seqs": seqs}}  # fmt: skip

    out = {
        "real": {"gpu_minutes": 10.0, "measuring_share": 0.6},
        "trials": [t("a", 16), t("a", 32), t("b", 16), t("a", 64, 2)],
    }
    # the second "a" saves 36 - 6 = 30 s, the TP=2 one is another key: 600 s total, 360 measuring
    assert bench.triton_what_if(out, 6.0) == pytest.approx(360.0 / (600.0 - 30.0))
    assert bench.triton_what_if(out, bench.COMPILE_COLD_S) == pytest.approx(0.6)  # no faster: as run


def test_the_hits_a_run_needs_for_the_target_are_the_start_up_time_that_must_go_over_what_a_hit_saves(bench):
    trials = [{"devices": 1}, {"devices": 2}]  # 1.5 devices a trial: a hit saves 33 s x 1.5
    out = {"real": {"gpu_minutes": 100.0, "measuring_share": 0.63}, "trials": trials}
    needed = bench.hits_for_target(out, 0.70)
    saved = needed * (bench.COMPILE_COLD_S - bench.COMPILE_HIT_S) * 1.5
    assert 0.63 * 6000.0 / (6000.0 - saved) == pytest.approx(0.70)  # that many hits reach the target exactly
    assert bench.hits_for_target({**out, "real": {"gpu_minutes": 100.0, "measuring_share": 0.71}}, 0.70) == 0.0


def test_with_twin_each_point_is_paced_by_the_estimate_for_its_own_configuration(bench, tmp_path):
    from types import SimpleNamespace

    from servetune.testing.twin import twin_from_env

    space = SimpleNamespace(
        hardware=SimpleNamespace(gpu="H100-SXM"),
        devices=lambda p: p["tensor_parallel_size"],
        engine_params=lambda p: ({"data_parallel_size": 1},),
    )
    points = [{"tensor_parallel_size": 1, "max_num_seqs": 16}, {"tensor_parallel_size": 2, "max_num_seqs": 64}]
    assert all("env.SERVETUNE_FAKE_TWIN" not in p for p in bench.draw_paces(points, space, 0.1, 0, tmp_path))
    paced = bench.draw_paces(points, space, 0.1, 0, tmp_path, twin=True)
    (tmp_path / "tiny").mkdir()
    model = bench.checkpoint_stand_in("meta-llama/Llama-3.1-8B-Instruct", tmp_path / "tiny", tmp_path / "llama")
    # The fake reads the rest from the engine arguments the trial launches it with.
    twins = [
        twin_from_env(p["env.SERVETUNE_FAKE_TWIN"], ["--model", str(model), "--max-num-seqs", str(p["max_num_seqs"]),
                                                     "--tensor-parallel-size", str(p["tensor_parallel_size"])])
        for p in paced
    ]  # fmt: skip
    assert [t.slots(600, 200) for t in twins] == [16, 64]
    assert [t.replica.tp for t in twins] == [1, 2]
    # The same 16 requests: TP 2 steps faster; 40 saturate the first and not the second.
    assert twins[1].pace(16, 600, 200).itl_s / twins[1].factor < twins[0].pace(16, 600, 200).itl_s / twins[0].factor
    assert twins[0].pace(40, 600, 200).saturated and not twins[1].pace(40, 600, 200).saturated
    assert twins[0].factor != twins[1].factor  # each trial its own run


def test_with_prune_the_space_prunes_by_the_estimate_and_a_pruned_trial_saves_but_measures_nothing(bench, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(
        "name: s\nmodel: meta-llama/Llama-3.1-8B-Instruct\ndevice: gpu\nworkload: chat\nload: {levels: [2, 4], requests_per_level: 256}\n"
        "slo: {ttft_ms: {p99: 2000}}\nhardware: {gpu: H100-SXM}\nsearch: {algorithm: tpe, estimate: {prune: false}}\n"
    )
    data, _ = bench.gpu_space(space, tmp_path / "tiny", 0.1, prune=True)
    assert data["search"]["estimate"] == {"prune": True} and data["search"]["algorithm"] == "random"
    assert bench.gpu_space(space, tmp_path / "tiny", 0.1)[0]["search"]["estimate"] == {"prune": False}
    space.write_text(space.read_text().replace("prune: false", "prune: true"))  # without --prune, off all the same
    assert bench.gpu_space(space, tmp_path / "tiny", 0.1)[0]["search"]["estimate"] == {"prune": False}
    # one trial ran on 1 GPU; one on 2 GPUs was pruned, its reservation 1.5 s
    ran = timed(1, 40.0, 30.0, [rate_level(2.0, 26, 10.0)])
    pruned = timed(2, 0.0, None, []).model_copy(
        update={"trial_id": "p", "outcome": "PRUNED", "params": {"env.SERVETUNE_FAKE_STARTUP_DELAY_S": "5.4"}}
    )
    real = bench.real_accounting([ran], 0.1, 0.0)
    out = bench.pruned_accounting([ran, pruned], {"t": (0.0, 40.0), "p": (1.0, 2.5)}, 0.1, real)
    assert out["trials"] == 1 and out["reserved_device_s"] == pytest.approx(3.0)
    assert out["saved_gpu_minutes_at_least"] == pytest.approx(2 * (54.0 + bench.COMPILE_COLD_S) / 60)
    assert out["saved_gpu_minutes_mean_trial"] == pytest.approx(2 * real["gpu_minutes"])
    # the pruned trial's reservation is reserved time that measured nothing: it lowers the measuring share
    honest = bench.real_accounting([ran], 0.1, 0.0, idle_device_s=out["reserved_device_s"])
    assert honest["gpu_minutes"] == pytest.approx(real["gpu_minutes"] + 3.0 / 60)
    assert honest["measuring_share"] < real["measuring_share"]


def closed_level(clients, requests, duration_s, e2e_ms):
    lv = level(clients, 100, 300)
    summary = lv.summary.model_copy(
        update={"completed": requests, "failed": 0, "duration_s": duration_s,
                "e2el_ms": lv.summary.e2el_ms.model_copy(update={"mean": e2e_ms})}
    )  # fmt: skip
    return lv.model_copy(update={"summary": summary})


def test_a_closed_loop_level_unscales_its_busy_span_by_little_s_law_and_keeps_its_drain(bench):
    # 16 clients, 64 requests of 2 s each: C clients kept busy 64 x 2 / 16 = 8 s; the level took 9.5 s, so 1.5 s
    # of drain. A quarter of the requests: at full size 32 s busy plus the same drain.
    result = timed(1, 9.5 + 20.0, 20.0, [closed_level(16, 64, 9.5, 2000.0)])
    out = bench.real_accounting([result], scale=0.1, probe_share=0.0, request_scale=0.25)
    assert out["gpu_minutes"] == pytest.approx((1.5 + 8.0 / 0.25 + 20.0 / 0.1) / 60)
    assert out["measuring_share"] == pytest.approx((1.5 + 32.0) / (1.5 + 32.0 + 200.0))
    # Not the whole level unscaled (its drain too), and not the level at its scaled length.
    whole, as_run = 9.5 / 0.25, 9.5
    assert as_run < out["gpu_minutes"] * 60 - 200.0 < whole
    # A closed level's full-size time grows with its requests and its E2E, as Little's law says.
    slower = timed(1, 29.5, 20.0, [closed_level(16, 64, 9.5, 2200.0)])
    assert bench.real_accounting([slower], 0.1, 0.0, request_scale=0.25)["gpu_minutes"] > out["gpu_minutes"]
    # An open level is unchanged: its arrivals over request_scale.
    opened = bench.real_accounting([timed(1, 50.0, 20.0, [rate_level(2.0, 51, 30.0)])], 0.2, 0.0)
    assert opened["gpu_minutes"] == pytest.approx((4.5 + 25.5 / 0.2 + 20.0 / 0.2) / 60)


def test_a_closed_ladder_sends_at_least_one_request_per_client_of_its_top_level(bench, tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(
        "name: s\nmodel: meta-llama/Llama-3.1-8B-Instruct\ndevice: gpu\nworkload: chat\n"
        "load: {kind: concurrency, levels: [16, 32, 64], requests_per_level: 256}\n"
        "slo: {ttft_ms: {p99: 2000}}\nhardware: {gpu: H100-SXM}\n"
    )
    data, changes = bench.gpu_space(space, tmp_path / "tiny", 0.1, seed=3)
    assert data["load"]["requests_per_level"] == 64 and changes["request_scale"] == pytest.approx(0.25)
    assert changes["closed_loop"] and data["search"]["seed"] == 3
    assert bench.gpu_space(space, tmp_path / "tiny", 0.5)[1]["request_scale"] == pytest.approx(128 / 256)
    assert bench.scaled_requests(256, 0.1, clients=512) == 256  # never more than the space's own
    rates = space.read_text().replace("kind: concurrency, levels: [16, 32, 64]", "levels: [2, 4]")
    space.write_text(rates)
    assert bench.gpu_space(space, tmp_path / "tiny", 0.1)[0]["load"]["requests_per_level"] == 26


def test_compare_counts_what_pruning_saved_and_whether_it_lost_the_best(bench):
    from servetune.metrics import GOODPUT

    def run(seed, outcomes, goodputs, minutes, share):
        trials = [{"params": {"max_num_seqs": seqs, "env.SERVETUNE_FAKE_TTFT_MS": 50.0}, "outcome": outcome,
                   "best": None if g is None else {"level": "16", GOODPUT: g}}
                  for seqs, outcome, g in zip((8, 16, 32), outcomes, goodputs, strict=True)]  # fmt: skip
        return {"seed": seed, "trials": trials, "real": {"gpu_minutes": minutes, "measuring_share": share}}

    off = run(0, ["COMPLETE"] * 3, [3.0, 10.0, 16.0], 100.0, 0.6)
    kept = bench.compare(off, run(0, ["PRUNED", "COMPLETE", "COMPLETE"], [None, 10.0, 16.0], 70.0, 0.72))
    assert kept["pruned"] == 1 and kept["saved_gpu_minutes"] == pytest.approx(30.0) and not kept["lost_best"]
    assert (kept["measuring_off"], kept["measuring_on"], kept["best_on"]) == (0.6, 0.72, 16.0)
    lost = bench.compare(off, run(0, ["COMPLETE", "COMPLETE", "PRUNED"], [3.0, 10.0, None], 60.0, 0.7))
    assert lost["lost_best"] and lost["best_on"] == 10.0
    # the best measured within 5% on a rerun is not lost; 10% below is
    assert not bench.compare(off, run(0, ["COMPLETE"] * 3, [3.0, 10.0, 15.5], 100.0, 0.6))["lost_best"]
    assert bench.compare(off, run(0, ["COMPLETE"] * 3, [3.0, 10.0, 14.0], 100.0, 0.6))["lost_best"]
